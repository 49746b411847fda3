"""The offline walk equals the online loop (tiny random models, greedy)."""

from __future__ import annotations

import pytest
import torch

from flashdraft.drafters.dflash import DFlashDrafter, random_dflash_model
from flashdraft.drafters.draft_model import DraftModelDrafter
from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from flashdraft.drafters.ngram import lookup_candidates
from flashdraft.train.objective import build_blocks, dflash_loss, sample_anchors
from flashdraft.train.walk import (BigramTable, DFlashProposals, DrafterProposals, target_features,
                                   walk_dataset)
from tiny import tiny_target

PROMPTS = [[5, 9, 3, 7], [11, 2, 2, 40, 8, 1], [33], [7, 7, 7, 12, 50, 3, 3, 9, 21]]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=5, layers=4)


def baseline_answers(target, max_tokens=MAX_TOKENS):
    """Greedy answers of the target alone: ``[(id, ids, n_prompt, None)]``."""
    gen = SpeculativeGenerator(target)
    out = []
    for i, prompt in enumerate(PROMPTS):
        _, ids, finish, _ = generate_text(gen, prompt, max_tokens, SamplingParams())
        if finish == "stop":
            ids = ids + [0]  # the EOS the answer stopped on, as regenerated shards keep it
        out.append((str(i), torch.tensor(prompt + ids), len(prompt), None))
    return out


def _online_ids(gen):
    """The online loop's counters over PROMPTS (what ``flashdraft eval`` reports)."""
    from flashdraft.train.evaluate import _run_one
    from flashdraft.train.stats import AcceptanceStats

    stats = AcceptanceStats()
    for prompt in PROMPTS:
        _run_one(gen, prompt, MAX_TOKENS, SamplingParams(), False, stats)
    return stats.to_dict(gen.n_draft + 1)


SAME = ("tau", "verify_steps", "draft_n", "draft_n_accepted", "per_position_acceptance",
        "per_position_drafted", "histogram", "tokens")


def briefly_trained_drafter(target, answers, block_size: int, steps: int):
    """A DFlash drafter trained a few steps on the answers: it accepts some drafts, not all."""
    model = random_dflash_model(target.model, num_layers=1, block_size=block_size, mask_token_id=63, seed=2)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        _, ids, n_prompt, feats = answers[step % len(answers)]
        anchors = sample_anchors(n_prompt, ids.shape[0], 16, gen)
        loss, _, _ = dflash_loss(model, feats.clone(), ids, anchors, target.embed_tokens.weight.detach(),
                                 target.lm_head.weight.detach(), None, 4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@pytest.mark.parametrize("n_draft,seeded,dtype", [(3, False, torch.float32), (7, False, torch.float32),
                                                  (5, True, torch.float32), (5, False, torch.bfloat16)])
def test_walk_equals_online_dflash(target, n_draft, seeded, dtype):
    probe = random_dflash_model(target.model, num_layers=1, block_size=n_draft + 1, mask_token_id=63)
    layers = probe.target_layer_ids
    answers = [(sid, ids, n, target_features(target, ids, layers)) for sid, ids, n, _ in baseline_answers(target)]
    model = briefly_trained_drafter(target, answers, n_draft + 1, steps=30)
    model.ngram_seeded = seeded
    model = model.to(dtype)  # --spec-draft-dtype: the drafter and its head rows in bf16 online and in the walk
    drafter = DFlashDrafter(model, target.embed_tokens, target.lm_head)
    want = _online_ids(SpeculativeGenerator(target, drafter, n_draft=n_draft))
    assert 0 < want["draft_n_accepted"] < want["draft_n"]  # neither trivial case
    head = target.lm_head.weight.to(dtype)

    def proposer(ids, n_prompt, feats):
        return DFlashProposals(model, target.embed_tokens.weight, head, None, feats, ids, n_prompt)

    got = walk_dataset(answers, proposer, n_draft, MAX_TOKENS, target.eos_token_ids)
    for key in SAME:
        assert got[key] == want[key], key


def test_walk_equals_online_ngram(target):
    want = _online_ids(SpeculativeGenerator(target, NgramDrafter(), n_draft=5))
    assert want["draft_n_accepted"] > 0  # the tiny target loops: prompt lookup must hit
    got = walk_dataset(baseline_answers(target),
                       lambda ids, n, _: DrafterProposals(NgramDrafter(), ids, n), 5, MAX_TOKENS,
                       target.eos_token_ids)
    for key in SAME:
        assert got[key] == want[key], key


def test_target_as_its_own_drafter_reaches_the_maximum(target):
    n_draft = 4
    drafter = DraftModelDrafter(target.model, target.vocab_size)
    got = walk_dataset(baseline_answers(target),
                       lambda ids, n, _: DrafterProposals(drafter, ids, n), n_draft, MAX_TOKENS,
                       target.eos_token_ids)
    assert got["per_position_acceptance"] == [1.0] * n_draft
    # every full step returns n_draft + 1 tokens; only steps cut by max_tokens return fewer
    assert got["histogram"][n_draft] >= sum(got["histogram"]) - len(PROMPTS)


def test_bigram_table_counts_successors():
    seqs = [(torch.tensor([9, 1, 2, 1, 2, 1, 3]), 1), (torch.tensor([9, 9, 1, 2]), 2)]
    table = BigramTable(seqs, vocab_size=10)
    assert table.successor[1] == 2  # 1->2 three times, 1->3 once
    assert table.successor[2] == 1
    assert table.successor[9] == -1  # only ever in a prompt
    propose = table.proposer(torch.tensor([5, 1, 7]), 1)
    assert propose(0, 4) == [2, 1, 2, 1]


def test_candidates_never_look_past_the_anchor():
    import random

    rng = random.Random(0)
    ngram = NgramDrafter()
    for _ in range(200):
        ids = [rng.randint(0, 4) for _ in range(rng.randint(1, 40))]
        anchors = sorted(rng.sample(range(len(ids)), rng.randint(1, len(ids))))
        got = lookup_candidates(ids, anchors, 6)
        for a, cand in zip(anchors, got):
            want = ngram.propose(torch.tensor(ids[:a + 1]), 6, SamplingParams(), None).tokens.tolist()
            assert cand == want
            changed = ids[:a + 1] + [(t + 1) % 5 for t in ids[a + 1:]]  # another future
            assert lookup_candidates(changed, [a], 6)[0] == cand


def test_seeded_blocks_use_only_the_prefix():
    ids = torch.tensor([1, 2, 3, 1, 2, 3, 1, 2, 9, 9, 9, 9])
    anchors = torch.tensor([4, 7])
    blocks, _, _ = build_blocks(ids, anchors, 4, mask_token_id=0, ngram_seeded=True)
    # anchor 4 (token 2): "1 2" seen at 0..1, followed by 3 1 2 -> but only up to the anchor
    assert blocks.view(2, 4).tolist() == [[2, 3, 1, 2], [2, 3, 1, 2]]
    future = ids.clone()
    future[8:] = 5
    assert torch.equal(build_blocks(future, anchors, 4, 0, ngram_seeded=True)[0], blocks)


def test_hybrid_is_lossless_and_uses_both_sources(target):
    from flashdraft.drafters.hybrid import HybridDrafter

    model = random_dflash_model(target.model, num_layers=1, block_size=6, mask_token_id=63, seed=2)
    hybrid = HybridDrafter(DFlashDrafter(model, target.embed_tokens, target.lm_head))
    base_gen, gen = SpeculativeGenerator(target), SpeculativeGenerator(target, hybrid, n_draft=5)
    used = {"ngram": 0, "dflash": 0}
    for prompt in PROMPTS:
        want = generate_text(base_gen, prompt, MAX_TOKENS, SamplingParams())
        got = generate_text(gen, prompt, MAX_TOKENS, SamplingParams())
        assert got[1] == want[1] and got[2] == want[2]
        for k in used:
            used[k] += hybrid.steps[k]
    assert used["ngram"] > 0 and used["dflash"] > 0
    # a forked copy (a server slot) learns on its own
    other = hybrid.fork()
    assert other.dflash is not hybrid.dflash and other.steps == {"ngram": 0, "dflash": 0}


def test_hybrid_falls_back_when_lookup_stops_paying(target):
    from flashdraft.drafters.hybrid import HybridDrafter

    model = random_dflash_model(target.model, num_layers=1, block_size=6, mask_token_id=63, seed=2)
    hybrid = HybridDrafter(DFlashDrafter(model, target.embed_tokens, target.lm_head), probe_every=4)
    hybrid.accepted = {"ngram": 0.0, "dflash": 1.0}  # DFlash has been the better source
    hybrid.dflash.commit(6, target_features(target, torch.tensor([1, 2, 3, 1, 2, 3]), model.target_layer_ids))
    sources = []
    for _ in range(10):
        hybrid.propose(torch.tensor([1, 2, 3, 1, 2, 3, 1]), 5, SamplingParams(), torch.Generator())
        sources.append(hybrid._pending[0])
        hybrid._pending = None  # no verify in between: keep the averages fixed
    assert sources.count("dflash") >= 7 and "ngram" in sources  # mostly DFlash, n-gram probed


@pytest.mark.parametrize("fmt", ["specforge", "dflash-draft", "dflash"])
def test_ngram_seeded_flag_survives_export(tmp_path, target, fmt):
    from flashdraft.drafters.dflash import load_dflash_model
    from flashdraft.drafters.dflash_format import save_gguf, save_specforge

    model = random_dflash_model(target.model, num_layers=1, block_size=4, mask_token_id=63)
    model.config["dflash_config"]["ngram_seeded"] = True
    if fmt == "specforge":
        save_specforge(tmp_path / "d", model.config, model.state_dict())
        loaded = load_dflash_model(tmp_path / "d")
    else:
        save_gguf(tmp_path / "d.gguf", model.config, model.state_dict(), arch=fmt)
        loaded = load_dflash_model(tmp_path / "d.gguf")
    assert loaded.ngram_seeded and not random_dflash_model(target.model).ngram_seeded


def test_offline_hybrid_copies_past_the_dflash_block(tmp_path, target):
    """``offline_eval(ngram_depth=D)`` walks prompt lookup at depth D as well, and the
    hybrid's n-gram steps draft up to D while its DFlash steps stay within the block."""
    import json

    from flashdraft.train.walk import offline_eval

    answers = baseline_answers(target)
    with open(tmp_path / "shard-00000.jsonl", "w") as f:
        for sid, ids, n_prompt, _ in answers:
            f.write(json.dumps({"id": sid, "prompt_ids": ids[:n_prompt].tolist(),
                                "response_ids": ids[n_prompt:].tolist()}) + "\n")
    model = random_dflash_model(target.model, num_layers=1, block_size=4, mask_token_id=63, seed=2)
    out = offline_eval(target, model, tmp_path, 3, MAX_TOKENS, progress=False, ngram_depth=9)
    deep = walk_dataset(answers, lambda ids, n, _: DrafterProposals(NgramDrafter(), ids, n), 9, MAX_TOKENS,
                        target.eos_token_ids)
    assert out["ngram (depth 9)"] == deep and deep["draft_n_accepted"] > 0
    assert len(out["ngram"]["per_position_drafted"]) == 3
    hybrid = out["hybrid (ngram, else dflash)"]
    assert 3 < len(hybrid["per_position_drafted"]) <= 9 and hybrid["per_position_drafted"][3] > 0
    assert "ngram (depth 3)" not in offline_eval(target, model, tmp_path, 3, MAX_TOKENS, progress=False)
