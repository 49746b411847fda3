"""The AR assistant drafter (``--spec-type draft`` with ``self:N`` or ``flashdraft train --kind ar``)
on tiny random targets: lossless, the target's own layers accept everything, save/load, the
walk equals the online loop, and the trainer resumes from its checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from flashdraft.drafters.ar import ARDrafter
from flashdraft.drafters.ar_model import (ARDraftModel, ar_from_target, is_ar_drafter, load_ar_drafter,
                                          save_ar_drafter)
from flashdraft.engine import EngineConfig, draft_model_drafter
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from tiny import VOCAB, tiny_target

PROMPTS = [[5, 9, 3, 7], [11, 2, 2, 40, 8, 1], [7, 7, 7, 12, 50, 3, 3, 9, 21]]
D2T = torch.tensor(sorted(set(range(0, VOCAB, 2)) | {1, 3, 7}))  # a draft vocabulary of 35 ids


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=3, layers=4)


def _drafter(target, layers, features=False, d2t=None, seed=None):
    model = ar_from_target(target.model, layers, features, d2t)
    if seed is not None:  # move it off "the target's first layers" so it is sometimes wrong
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
    return ARDrafter(model, target.embed_tokens.weight.detach(), target.vocab_size)


def _greedy(gen, prompt, n=30):
    _, ids, _, timings = generate_text(gen, prompt, n, SamplingParams(), ignore_eos=True)
    return ids, timings


def test_all_target_layers_accept_every_draft(target):
    """``self:N`` with N = every layer is the target itself: every draft is accepted, τ = depth + 1."""
    gen = SpeculativeGenerator(target, _drafter(target, 4), n_draft=4)
    ids, t = _greedy(gen, PROMPTS[0], 21)
    assert ids == _greedy(SpeculativeGenerator(target), PROMPTS[0], 21)[0]
    assert t.draft_n_accepted == t.draft_n > 0
    assert t.verify_n / (t.n_steps - 1) == 5.0  # 1 + 4 steps of 5 tokens: no step cut by the limit


@pytest.mark.parametrize("features", [False, True])
@pytest.mark.parametrize("d2t", [None, D2T])
def test_greedy_output_equals_plain_decoding(target, features, d2t):
    plain = SpeculativeGenerator(target)
    drafter = _drafter(target, 3, features, d2t, seed=4)
    gen = SpeculativeGenerator(target, drafter, n_draft=5)
    accepted = drafted = 0
    for prompt in PROMPTS:
        ids, t = _greedy(gen, prompt)
        assert ids == _greedy(plain, prompt)[0]
        accepted, drafted = accepted + t.draft_n_accepted, drafted + t.draft_n
        if d2t is not None:  # drafts come from the draft vocabulary only
            assert drafted > 0
    assert 0 < accepted < drafted  # neither trivial case: rollback is exercised


def test_features_start_as_the_same_function(target):
    """``fc`` starts as ``[I, 0]``: with features the untrained drafter drafts as without."""
    ids = torch.tensor(PROMPTS[2])
    x = torch.nn.functional.embedding(ids, target.embed_tokens.weight)[None]
    pos = torch.arange(ids.shape[0])[None]
    plain, feat = ar_from_target(target.model, 2), ar_from_target(target.model, 2, use_features=True)
    state = torch.randn(1, ids.shape[0], x.shape[-1])
    torch.testing.assert_close(feat.logits(feat(x, pos, None, state)), plain.logits(plain(x, pos)))
    assert feat.feature_layer_ids == [3] and plain.feature_layer_ids is None


def test_save_and_load_round_trip(tmp_path, target):
    model = ar_from_target(target.model, 2, True, D2T)
    save_ar_drafter(tmp_path / "d", model, dtype=torch.float32)
    assert is_ar_drafter(tmp_path / "d") and not is_ar_drafter(tmp_path)
    back = load_ar_drafter(tmp_path / "d")
    assert torch.equal(back.d2t, D2T) and back.use_features and back.num_layers == 2
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


def test_engine_refuses_bad_self_and_another_targets_drafter(tmp_path, target):
    for bad in ("self:0", "self:9", "self:x"):
        with pytest.raises(ValueError, match="self:N takes N = 1..4"):
            draft_model_drafter(EngineConfig(spec_type="draft", draft_model=bad), target)
    other = tiny_target("llama", seed=3, layers=6)
    save_ar_drafter(tmp_path / "d", ar_from_target(other.model, 1))
    with pytest.raises(ValueError, match="trained for another target"):
        draft_model_drafter(EngineConfig(spec_type="draft", draft_model=str(tmp_path / "d")), target)
    assert isinstance(draft_model_drafter(EngineConfig(spec_type="draft", draft_model="self:2"), target), ARDrafter)


@pytest.mark.parametrize("features", [False, True])
def test_walk_equals_online(target, features):
    from flashdraft.train.walk import ar_proposer
    from flashdraft.train.evaluate import _run_one
    from flashdraft.train.stats import AcceptanceStats
    from flashdraft.train.walk import walk_dataset

    answers = []
    plain = SpeculativeGenerator(target)
    for i, prompt in enumerate(PROMPTS):
        _, ids, finish, _ = generate_text(plain, prompt, 30, SamplingParams())
        answers.append((str(i), torch.tensor(prompt + ids + ([0] if finish == "stop" else [])), len(prompt), None))
    drafter = _drafter(target, 3, features, D2T, seed=4)
    gen = SpeculativeGenerator(target, drafter, n_draft=4)  # asks the target for its features
    stats = AcceptanceStats()
    for prompt in PROMPTS:
        _run_one(gen, prompt, 30, SamplingParams(), False, stats)
    want = stats.to_dict(5)
    got = walk_dataset(answers, ar_proposer(drafter, target), 4, 30, target.eos_token_ids)
    assert 0 < want["draft_n_accepted"] < want["draft_n"]
    for key in ("tau", "verify_steps", "draft_n", "draft_n_accepted", "per_position_acceptance", "tokens"):
        assert got[key] == want[key], key


def _tiny_data(tmp_path, target):
    gen = SpeculativeGenerator(target)
    lines = []
    for i, prompt in enumerate(PROMPTS * 3):
        _, ids, _, _ = generate_text(gen, prompt, 20, SamplingParams(), ignore_eos=True)
        lines.append(json.dumps({"id": f"p{i}", "prompt_ids": prompt, "response_ids": ids}))
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-00000.jsonl").write_text("\n".join(lines) + "\n")
    return data


@pytest.mark.parametrize("features", [False, True])
def test_trainer_learns_and_resumes_from_its_checkpoint(tmp_path, target, features):
    from flashdraft.train.ar_loop import ARTrainer, ar_loss
    from flashdraft.train.loop import TrainConfig

    data = _tiny_data(tmp_path, target)
    cfg = dict(data_dir=str(data), out_dir=str(tmp_path / "run"), num_layers=1, draft_vocab=0, seqs_per_step=2,
               eval_minutes=0, bf16=False, lr=3e-3, kind="ar", ar_features=features)
    first = ARTrainer(TrainConfig(steps=4, **cfg), target=target)
    seqs = [(ids, n) for _, ids, n in first.seqs[:3]]

    def loss_now(trainer):
        with torch.no_grad():
            return sum(float(ar_loss(trainer.model, trainer.embed_weight, ids, n, None,
                                     trainer._target_last(f"x{i}", ids) if features else None)[0])
                       for i, (ids, n) in enumerate(seqs))

    before = loss_now(first)
    first.train()
    assert first.step == 4 and (tmp_path / "run" / "checkpoint.pt").exists()
    assert is_ar_drafter(tmp_path / "run" / "drafter")
    weights = {k: v.clone() for k, v in first.model.state_dict().items()}
    resumed = ARTrainer(TrainConfig(steps=8, **cfg), target=target)
    assert resumed.step == 4 and resumed.cpu_seconds == first.cpu_seconds
    for k, v in resumed.model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    resumed.train()
    assert resumed.step == 8
    assert loss_now(resumed) < before
    assert isinstance(resumed.model, ARDraftModel) and resumed.model.use_features == features


@pytest.mark.parametrize("features", [False, True])
def test_lean_forward_drafts_what_transformers_drafts(target, features):
    """The 1-token steps run on the lean forward; transformers' forward is the reference."""
    model = ar_from_target(target.model, 2, features, D2T)
    embed = target.embed_tokens.weight.detach()
    lean, ref = ARDrafter(model, embed, target.vocab_size), ARDrafter(model, embed, target.vocab_size, lean=False)
    assert lean.lean is not None and ref.lean is None
    drafts = []
    for d in (lean, ref):
        gen = SpeculativeGenerator(target, d, n_draft=4)
        _, ids, _, t = generate_text(gen, PROMPTS[1], 24, SamplingParams(), ignore_eos=True)
        drafts.append((ids, t.draft_n, t.draft_n_accepted, t.accepted_per_position))
    assert drafts[0] == drafts[1]
