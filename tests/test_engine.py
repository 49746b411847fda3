"""Unit tests of the speculative loop on tiny random-config models (llama and qwen3)."""

from __future__ import annotations

import pytest
import torch

from flashdraft.drafters.base import Draft, Drafter
from flashdraft.drafters.dflash import ContextKVCache, DFlashDrafter, random_dflash_model
from flashdraft.drafters.draft_model import DraftModelDrafter
from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.generate import ContextOverflowError, SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from flashdraft.targets.torch import Target
from tiny import tiny_model, tiny_target

GREEDY = SamplingParams()
PROMPT = [5, 9, 17, 3, 22, 41]


def drafters_for(target):
    """Every drafter kind, none of them trained: losslessness must not depend on quality."""
    return {
        "ngram": NgramDrafter(),
        "dflash": DFlashDrafter(random_dflash_model(target.model, num_layers=2, block_size=8),
                                target.embed_tokens, target.lm_head),
        "draft": DraftModelDrafter(tiny_model(target.config.model_type, seed=7), target.vocab_size),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equal_to_baseline_for_every_drafter(arch):
    target = tiny_target(arch)
    base = generate_text(SpeculativeGenerator(target), PROMPT, 40, GREEDY, ignore_eos=True)[1]
    assert len(base) == 40
    for name, drafter in drafters_for(target).items():
        out = generate_text(SpeculativeGenerator(target, drafter, n_draft=5), PROMPT, 40, GREEDY, ignore_eos=True)
        assert out[1] == base, name
        assert out[3].draft_n > 0, name


def test_identity_drafter_accepts_everything():
    """The target drafting for itself: every draft accepted, output equals baseline."""
    target = tiny_target("llama", seed=3)
    base = generate_text(SpeculativeGenerator(target), PROMPT, 33, GREEDY, ignore_eos=True)[1]
    gen = SpeculativeGenerator(target, DraftModelDrafter(target.model, target.vocab_size), n_draft=4)
    _, ids, finish, t = generate_text(gen, PROMPT, 33, GREEDY, ignore_eos=True)
    assert ids == base and finish == "length"
    assert t.draft_n == t.draft_n_accepted > 0
    assert t.n_steps == 1 + 7  # first token, 6 blocks of 4 drafts + bonus, then 1 draft + bonus
    assert t.acceptance_length == pytest.approx(32 / 7)  # verify steps only
    plain = generate_text(SpeculativeGenerator(target), PROMPT, 33, GREEDY, ignore_eos=True)[3]
    assert plain.acceptance_length == 1.0


def test_target_cache_rollback_matches_fresh_forward():
    target = tiny_target("qwen3")
    ids = torch.tensor(PROMPT + [7, 8, 9, 10])
    fresh, _ = target.forward(ids, target.new_cache())
    cache = target.new_cache()
    target.forward(ids[:6], cache)
    target.forward(torch.tensor([60, 61, 62]), cache)  # a rejected draft
    cache.rollback(6)
    assert cache.length == 6
    again, _ = target.forward(ids[6:], cache)
    torch.testing.assert_close(again, fresh[6:], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError):
        cache.rollback(100)


def test_dflash_context_cache_rollback_is_a_length_move():
    cache = ContextKVCache(n_layers=1, n_kv=2, head_dim=4, capacity=4)
    kv = [(torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4))]
    cache.append(kv)  # grows past capacity
    assert cache.length == 6
    cache.length = 3
    k, v = cache.window(0, None)
    torch.testing.assert_close(k[0], kv[0][0][0, :, :3])
    k, _ = cache.window(0, 2)  # --spec-dflash-cross-ctx
    torch.testing.assert_close(k[0], kv[0][0][0, :, 1:3])


class ScriptedDrafter(Drafter):
    """Proposes the baseline's own continuation, so whole blocks are accepted."""

    name = "scripted"

    def __init__(self, full: list[int]):
        self.full = full

    def propose(self, tokens, n, params, generator):
        L = tokens.shape[0]
        return Draft(torch.tensor(self.full[L:L + n], dtype=torch.long))


def _baseline(target, n=30):
    return generate_text(SpeculativeGenerator(target), PROMPT, n, GREEDY, ignore_eos=True)[1]


def test_eos_inside_accepted_block_is_not_returned_or_counted():
    target = tiny_target("llama", seed=5)
    base = _baseline(target)
    target.eos_token_ids = {base[6]} - set(base[:6])  # an EOS in the middle of the 2nd block
    assert target.eos_token_ids
    gen = SpeculativeGenerator(target, ScriptedDrafter(PROMPT + base), n_draft=4)
    text, ids, finish, t = generate_text(gen, PROMPT, 30, GREEDY)
    assert finish == "stop" and ids == base[:6]
    assert t.predicted_n == 6 and t.draft_n_accepted <= 5
    assert text == target.decode(base[:6])


def test_stop_string_spanning_a_block_boundary():
    target = tiny_target("llama", seed=5)
    base = _baseline(target)
    # blocks: token 0 from prefill, then [1..5], [6..10]: tokens 5 and 6 straddle a boundary
    stop = target.decode(base[5:7])
    assert stop not in target.decode(base[:6])
    gen = SpeculativeGenerator(target, ScriptedDrafter(PROMPT + base), n_draft=4)
    deltas, ids = [], []
    for step in gen.generate(PROMPT, 30, GREEDY, stop=[stop], ignore_eos=True):
        deltas.append(step.text)
        ids += step.token_ids
    text = "".join(deltas)
    assert stop not in text
    assert text == target.decode(base[:7])[: target.decode(base[:7]).index(stop)]
    assert step.finish_reason == "stop" and step.timings.predicted_n == len(ids) == 7


def test_max_tokens_inside_a_block():
    target = tiny_target("llama", seed=5)
    base = _baseline(target)
    gen = SpeculativeGenerator(target, ScriptedDrafter(PROMPT + base), n_draft=4)
    _, ids, finish, t = generate_text(gen, PROMPT, 8, GREEDY, ignore_eos=True)
    assert finish == "length" and ids == base[:8] and t.predicted_n == 8
    assert t.draft_n <= 7  # never drafts past max_tokens


def test_context_overflow_and_bad_arguments():
    target = tiny_target("llama")
    gen = SpeculativeGenerator(target, ctx_size=8)
    with pytest.raises(ContextOverflowError, match="8"):
        next(gen.generate(list(range(1, 9)), 4, GREEDY))
    with pytest.raises(ValueError):
        next(gen.generate([1, 2], 0, GREEDY))
    # generation stops at the context size with finish "length"
    _, ids, finish, _ = generate_text(gen, [1, 2, 3], 50, GREEDY, ignore_eos=True)
    assert finish == "length" and len(ids) == 5


def test_seeded_sampling_is_reproducible_and_seed_sensitive():
    target = tiny_target("llama")
    gen = SpeculativeGenerator(target, NgramDrafter())
    hot = SamplingParams(temperature=1.5, seed=11)
    a = generate_text(gen, PROMPT, 20, hot, ignore_eos=True)[1]
    b = generate_text(gen, PROMPT, 20, hot, ignore_eos=True)[1]
    c = generate_text(gen, PROMPT, 20, SamplingParams(temperature=1.5, seed=12), ignore_eos=True)[1]
    assert a == b and a != c


def test_load_hf_directory_llama_and_qwen3(tmp_path):
    for arch in ("llama", "qwen3"):
        t = tiny_target(arch)
        t.model.save_pretrained(tmp_path / arch)
        t.tokenizer.save_pretrained(tmp_path / arch)
        loaded = Target.load(tmp_path / arch)
        assert loaded.config.model_type == arch
        a = generate_text(SpeculativeGenerator(t), PROMPT, 10, GREEDY, ignore_eos=True)[1]
        b = generate_text(SpeculativeGenerator(loaded), PROMPT, 10, GREEDY, ignore_eos=True)[1]
        assert a == b


def test_missing_model_paths_give_clear_errors(tmp_path):
    from flashdraft.targets.torch import ModelNotFoundError
    with pytest.raises(ModelNotFoundError, match="not found"):
        Target.load(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        Target.load(tmp_path)


def test_feature_capture_equals_hidden_states():
    """Captured features are HF hidden_states[i+1] of the requested layers, nothing else."""
    target = tiny_target("qwen3")
    target.set_feature_layers([0, 2])
    ids = torch.tensor(PROMPT)
    _, feats = target.forward(ids, target.new_cache())
    ref = target.model(ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(feats, torch.cat([ref[1][0], ref[3][0]], -1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        target.set_feature_layers([99])


def test_spec_type_choices_come_from_the_drafter_registry():
    """Every command's --spec-type offers the registry's drafters, and every registered name
    loads a drafter (the model-free ones here) or refuses with the flag to fix."""
    import argparse

    from flashdraft.engine import DRAFTERS, SPEC_TYPES, EngineConfig, load_drafter
    from flashdraft.flags import add_model_arguments
    from flashdraft.targets.load import BACKENDS

    p = argparse.ArgumentParser()
    add_model_arguments(p)
    assert tuple(p._option_string_actions["--spec-type"].choices) == SPEC_TYPES == tuple(DRAFTERS)
    assert tuple(p._option_string_actions["--backend"].choices) == BACKENDS
    for name in ("none", "ngram", "suffix"):
        assert load_drafter(EngineConfig(spec_type=name), None).name == name
    with pytest.raises(ValueError, match="unknown --spec-type"):
        load_drafter(EngineConfig(spec_type="eagle"), None)
