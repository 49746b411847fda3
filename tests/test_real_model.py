"""Lossless greedy decoding on the real SmolLM2-135M-Instruct GGUF (the packaged default)."""

from __future__ import annotations

import pytest

from flashdraft.engine import DEFAULT_DRAFTER_DIR, EngineConfig, load_drafter
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.kv_cache import KVCacheSpec
from flashdraft.prompts import SEED_PROMPTS
from flashdraft.sampling import SamplingParams
from flashdraft.targets.torch import Target

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def target():
    return Target.load()  # packaged default; fails with install instructions if missing


def test_default_model_is_the_packaged_smollm2(target):
    assert target.config.model_type == "llama" and target.num_layers == 30
    assert target.has_chat_template and 2 in target.eos_token_ids


@pytest.mark.parametrize("prompt", SEED_PROMPTS, ids=["task-store", "kv-report", "linked-list"])
def test_seed_prompts_identical_tokens_for_every_drafter(target, prompt):
    ids = target.chat_prompt_ids([{"role": "user", "content": prompt}])
    base = generate_text(SpeculativeGenerator(target), ids, 128, SamplingParams())
    assert base[3].predicted_n > 0
    # the shipped drafter when present, else an untrained one: lossless either way
    dflash = str(DEFAULT_DRAFTER_DIR) if (DEFAULT_DRAFTER_DIR / "config.json").exists() else "random"
    for spec, draft_model in [("ngram", None), ("dflash", dflash), ("hybrid", dflash)]:
        drafter = load_drafter(EngineConfig(spec_type=spec, draft_model=draft_model), target)
        out = generate_text(SpeculativeGenerator(target, drafter, n_draft=15), ids, 128, SamplingParams())
        assert out[1] == base[1], spec
        assert out[0] == base[0] and out[2] == base[2]
        assert out[3].draft_n > 0
    # an n-gram-seeded DFlash drafter (blocks start from the prompt-lookup continuation)
    drafter = load_drafter(EngineConfig(spec_type="dflash", draft_model=dflash), target)
    drafter.model.ngram_seeded = True
    out = generate_text(SpeculativeGenerator(target, drafter, n_draft=15), ids, 128, SamplingParams())
    assert out[1] == base[1] and out[0] == base[0], "ngram-seeded dflash"


def test_compressed_cache_greedy_speculative_equals_its_baseline(target):
    """Under a compressed cache (a llama.cpp format for K, rotated 3-bit V with exact sinks
    and tail), greedy speculative output equals the greedy baseline under the same cache,
    rollbacks included. (Without Target.stable_lean this failed at token 23 with q5_0/q4_1.)"""
    kv = KVCacheSpec("q5_0", "turbo3", sink_tokens=4, tail_tokens=16)
    ids = target.chat_prompt_ids([{"role": "user", "content": SEED_PROMPTS[2]}])
    base = generate_text(SpeculativeGenerator(target, kv=kv), ids, 64, SamplingParams())
    dflash = str(DEFAULT_DRAFTER_DIR) if (DEFAULT_DRAFTER_DIR / "config.json").exists() else "random"
    for spec, draft_model in [("ngram", None), ("dflash", dflash), ("hybrid", dflash)]:
        drafter = load_drafter(EngineConfig(spec_type=spec, draft_model=draft_model, cache_type_k_draft=kv.type_k,
                                            cache_type_v_draft=kv.type_v), target)
        out = generate_text(SpeculativeGenerator(target, drafter, n_draft=15, kv=kv), ids, 64, SamplingParams())
        assert out[1] == base[1], spec
        assert out[3].draft_n > out[3].draft_n_accepted
