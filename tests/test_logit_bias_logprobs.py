"""``logit_bias`` and ``n_probs`` in the speculative loop: the same answer and the same numbers
in every drafting mode (tiny random models; the server's shapes are in test_server.py)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from flashdraft.drafters.dflash import DFlashDrafter, random_dflash_model
from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.generate import SpeculativeGenerator, Step
from flashdraft.sampling import SamplingParams
from tiny import tiny_target

GREEDY = SamplingParams()
PROMPT = [5, 9, 17, 3, 22, 41, 5, 9, 17]


def _drafters(target):
    return {"none": None, "ngram": NgramDrafter(),
            "dflash": DFlashDrafter(random_dflash_model(target.model, num_layers=1, block_size=6),
                                    target.embed_tokens, target.lm_head)}


def _run(gen, n=20, params=GREEDY, **kw) -> tuple[list[int], list]:
    ids, lps = [], []
    for step in gen.generate(PROMPT, n, params, ignore_eos=True, **kw):
        assert isinstance(step, Step)
        ids += step.token_ids
        lps += step.logprobs or []
    return ids, lps


def test_logit_bias_changes_the_answer_identically_in_every_mode():
    target = tiny_target("llama", seed=5)
    base, _ = _run(SpeculativeGenerator(target))
    banned = {base[0]: -math.inf, base[3]: -math.inf}
    boost = {7: 4.0}
    outs = {}
    for name, drafter in _drafters(target).items():
        gen = SpeculativeGenerator(target, drafter, n_draft=4)
        outs[name], _ = _run(gen, logit_bias={**banned, **boost})
        assert not set(banned) & set(outs[name]), name
    assert outs["none"] != base
    assert outs["ngram"] == outs["none"] == outs["dflash"]


def test_logprobs_are_the_targets_whatever_drafts():
    target = tiny_target("qwen3", seed=6)
    ref_ids, ref = _run(SpeculativeGenerator(target), n_probs=3)
    assert len(ref) == len(ref_ids) == 20
    for r, tok in zip(ref, ref_ids):
        assert r.token_id == tok and r.logprob <= 0
        assert r.top[0][0] == tok  # greedy: the chosen token is the most likely
        assert [v for _, v in r.top] == sorted((v for _, v in r.top), reverse=True) and len(r.top) == 3
    for name, drafter in _drafters(target).items():
        ids, lps = _run(SpeculativeGenerator(target, drafter, n_draft=4), n_probs=3)
        assert ids == ref_ids, name
        for a, b in zip(lps, ref):
            assert [i for i, _ in a.top] == [i for i, _ in b.top], name
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4), name
    # the log-probabilities are the softmax of the target's own next-token logits
    with torch.inference_mode():
        logits = target.model(torch.tensor([PROMPT])).logits[0, -1].float()
    assert ref[0].logprob == pytest.approx(torch.log_softmax(logits, -1)[ref_ids[0]].item(), abs=1e-4)


def test_sampling_with_a_ban_keeps_the_biased_distribution():
    """T=1 with a banned token: the first token (from the prefill) follows the biased softmax
    (chi-square), the second (accepted or rejected by verification in the drafting modes)
    has the same distribution in every mode (two-sample chi-square against plain decoding),
    and the banned token never appears."""
    target = tiny_target("llama", seed=7)
    with torch.inference_mode():
        logits = target.model(torch.tensor([PROMPT])).logits[0, -1].float()
    banned = int(torch.argmax(logits))
    p = torch.softmax(logits.index_fill(0, torch.tensor([banned]), -math.inf), -1)
    keep = p > 0.02
    second = {}
    for name, drafter in _drafters(target).items():
        gen = SpeculativeGenerator(target, drafter, n_draft=4)
        first, second[name] = torch.zeros_like(p), torch.zeros_like(p)
        for seed in range(300):
            ids, _ = _run(gen, n=2, params=SamplingParams(temperature=1.0, seed=seed), logit_bias={banned: -math.inf})
            assert banned not in ids, name
            first[ids[0]] += 1
            second[name][ids[1]] += 1
        observed = torch.cat([first[keep], first[~keep].sum()[None]])
        expected = torch.cat([p[keep], p[~keep].sum()[None]]) * 300
        assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3, name
    for name in ("ngram", "dflash"):
        table = torch.stack([second["none"], second[name]])
        table = table[:, table.sum(0) >= 10]  # cells with enough counts for the test
        assert chi2_contingency(table.numpy()).pvalue > 1e-3, name
