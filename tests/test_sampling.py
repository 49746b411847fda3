"""Sampling filters, verify rules, and the distribution of speculative sampling (T > 0)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from flashdraft.drafters.ar import ARDrafter
from flashdraft.drafters.ar_model import ar_from_target
from flashdraft.drafters.dflash import DFlashDrafter, random_dflash_model
from flashdraft.drafters.draft_model import DraftModelDrafter
from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams, filtered_probs, verify_greedy, verify_sampling
from tiny import VOCAB, tiny_model, tiny_target


def test_filters():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))  # 0.5 + 0.25 reaches 0.7
    torch.testing.assert_close(p, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))  # floor 0.15 keeps 0.15
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.25, 0.15, 0.0]]) / 0.9)
    hot = filtered_probs(logits, SamplingParams(temperature=100.0))
    assert float(hot.max() - hot.min()) < 0.01


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=math.nan), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(top_k=-1), dict(min_p=2.0), dict(temperature=math.inf)])
def test_invalid_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_verify_greedy_prefix_and_bonus():
    logits = torch.full((4, 10), -1.0)
    for row, tok in enumerate([3, 4, 9, 1]):
        logits[row, tok] = 1.0
    assert verify_greedy(torch.tensor([3, 4, 9]), logits) == (3, 1)
    assert verify_greedy(torch.tensor([3, 5, 9]), logits) == (1, 4)
    assert verify_greedy(torch.tensor([0, 4, 9]), logits) == (0, 3)
    assert verify_greedy(torch.empty(0, dtype=torch.long), logits[:1]) == (0, 3)


def test_verify_sampling_rejects_impossible_and_keeps_certain():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert verify_sampling(torch.tensor([1]), None, p, g) == (1, 2)  # p(x)=1: always accepted
    assert verify_sampling(torch.tensor([0]), None, p, g) == (0, 1)  # p(x)=0: resampled from p


def _exact_marginals(target, prompt, params):
    """Exact P(x1), P(x2), P(x3) of plain sampling, by enumeration on the tiny vocabulary."""
    with torch.no_grad():
        m = target.model
        p1 = filtered_probs(m(torch.tensor([prompt])).logits[0, -1:], params)[0]  # [V]
        seqs = torch.tensor([prompt + [a] for a in range(VOCAB)])
        p2_given = filtered_probs(m(seqs).logits[:, -1], params)  # [V, V]
        joint12 = p1[:, None] * p2_given
        seqs3 = torch.tensor([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
        p3_given = filtered_probs(m(seqs3).logits[:, -1], params).view(VOCAB, VOCAB, VOCAB)
        p3 = (joint12[:, :, None] * p3_given).sum((0, 1))
    return p1, joint12.sum(0), p3


def _chi2_pvalue(samples: list[int], expected_probs: torch.Tensor) -> float:
    n = len(samples)
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).double()
    exp = expected_probs.double() * n
    big = exp >= 5  # pool rare outcomes into one bin so the chi-square approximation holds
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    ex = torch.cat([exp[big], exp[~big].sum()[None]])
    if ex[-1] < 1e-9:
        obs, ex = obs[:-1], ex[:-1]
    ex = ex * obs.sum() / ex.sum()
    return float(chisquare(obs.numpy(), ex.numpy()).pvalue)


@pytest.mark.parametrize("kind", ["dflash", "draft", "ngram", "ar"])
def test_speculative_sampling_matches_target_distribution(kind):
    target = tiny_target("llama", seed=1, layers=2, hidden=32)
    params = SamplingParams(temperature=1.0, top_k=20)
    prompt = [3, 14, 15, 3, 14]  # repeated n-gram so prompt lookup drafts too
    drafter = {
        "dflash": lambda: DFlashDrafter(random_dflash_model(target.model, 1, 4), target.embed_tokens, target.lm_head),
        "draft": lambda: DraftModelDrafter(tiny_model("llama", seed=9, layers=2, hidden=32), VOCAB),
        "ngram": lambda: NgramDrafter(),
        # an AR drafter from the target's first layer, EAGLE features on, a draft vocabulary of
        # every other id: q is 0 outside it, and the residual still restores the target's p
        "ar": lambda: ARDrafter(ar_from_target(target.model, 1, use_features=True, d2t=torch.arange(0, VOCAB, 2)),
                                target.embed_tokens.weight, VOCAB),
    }[kind]()
    # sampled drafts (Leviathan's rule), then a seed's argmax drafts (plain decoding's tokens)
    for reproducible in (False, True):
        gen = SpeculativeGenerator(target, drafter, n_draft=3, reproducible_seeds=reproducible)
        torch.manual_seed(0)
        # a drafter that is sometimes right and sometimes wrong exercises both paths
        assert_sampled_marginals(gen, target, prompt, params, mixed_acceptance=kind != "ngram")


def assert_sampled_marginals(gen, target, prompt: list[int], params: SamplingParams,
                             mixed_acceptance: bool = True, n: int = 1500) -> None:
    """Three tokens sampled ``n`` times (seeds 0..n-1) through ``gen`` follow plain sampling's
    exact marginals (chi-square, p > 1e-3 per position); with ``mixed_acceptance`` some
    drafts are accepted and some rejected, so both branches of the residual are tested."""
    exact = _exact_marginals(target, prompt, params)
    runs = [generate_text(gen, prompt, 3, SamplingParams(temperature=params.temperature, top_k=params.top_k, seed=s),
                          ignore_eos=True) for s in range(n)]
    assert sum(r[3].draft_n for r in runs) > 0
    if mixed_acceptance:
        acc = sum(r[3].draft_n_accepted for r in runs) / sum(r[3].draft_n for r in runs)
        assert 0.0 < acc < 1.0
    for pos in range(3):
        pval = _chi2_pvalue([r[1][pos] for r in runs], exact[pos])
        assert pval > 1e-3, f"position {pos + 1}: p-value {pval:.2g}"


def test_top_k_fast_path_gives_the_full_paths_distribution(monkeypatch):
    """With top-k, top-p and min-p work on the k survivors only: the same support and the same
    probabilities (to float rounding) as filtering the whole vocabulary; a tie at the k-th
    score (more than k survivors) takes the full path."""
    import flashdraft.sampling as S

    torch.manual_seed(0)
    logits = torch.randn(6, 5000) * 3
    logits[5, :10] = 50.0  # ten tokens tied at the top: top-k 4 keeps all ten
    for p in (SamplingParams(temperature=0.7, top_k=40), SamplingParams(temperature=1.3, top_k=64, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=4, top_p=0.5, min_p=0.1)):
        fast = S.filtered_probs(logits, p)
        monkeypatch.setattr(S, "_filtered_top_k", lambda scores, params: None)
        full = S.filtered_probs(logits, p)
        monkeypatch.undo()
        # rows 0-4 (no ties; in row 5 which of ten equal tokens a top-p cut drops is arbitrary on both paths)
        assert torch.equal(fast[:5] > 0, full[:5] > 0) and torch.allclose(fast[:5], full[:5], atol=1e-6), p
    assert S._filtered_top_k(logits[5:] / 1.0, SamplingParams(temperature=1.0, top_k=4)) is None
    assert (S.filtered_probs(logits[5:], SamplingParams(temperature=1.0, top_k=4)) > 0).sum() == 10


def test_a_seed_gives_the_same_tokens_with_drafting_on_and_off():
    """llama-server's ``test_with_and_without_draft`` (T 0.2, top-k 5, seed 4242), here at
    hotter T too so drafts are rejected as well: a deterministic draft (prompt lookup, what
    ``make serve`` runs) is checked with one target sample per emitted token, so the random
    stream does not depend on drafting. (DFlash and AR drafters sample their drafts at T > 0
    and keep Leviathan's rule: the same distribution, not the same tokens.) A sampling drafter
    (DFlash, a draft model) proposes its argmax for a seeded request, so it gives plain
    decoding's tokens too."""
    target = tiny_target("llama", seed=1, layers=2, hidden=32)
    plain = SpeculativeGenerator(target, None, n_draft=0)
    prompt = [3, 14, 15, 3, 14, 15, 3, 14]
    for drafter in (NgramDrafter(), DFlashDrafter(random_dflash_model(target.model, 1, 4), target.embed_tokens,
                                                  target.lm_head),
                    DraftModelDrafter(tiny_model("llama", seed=9, layers=2, hidden=32), VOCAB)):
        spec = SpeculativeGenerator(target, drafter, n_draft=4, reproducible_seeds=True)  # the server's rule
        drafted = accepted = 0
        for seed, temperature in [(4242, 0.2), (4242, 1.0), (7, 1.0), (8, 0.7)]:
            params = SamplingParams(temperature=temperature, top_k=5, seed=seed)
            want = generate_text(plain, prompt, 24, params, ignore_eos=True)[1]
            got, stats = generate_text(spec, prompt, 24, params, ignore_eos=True)[1::2]
            assert got == want, (drafter.name, seed, temperature)
            drafted, accepted = drafted + stats.draft_n, accepted + stats.draft_n_accepted
        assert 0 < accepted < drafted, drafter.name  # some drafts accepted and some rejected
