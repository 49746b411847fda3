"""The AR assistant drafter on the real SmolLM2-135M-Instruct: the shipped drafter's greedy
output equals plain decoding on both target backends, ``self:30`` (every target layer)
accepts every draft, and ``--spec-type draft`` picks the shipped drafter by default."""

from __future__ import annotations

import os

import pytest

from flashdraft.drafters.ar import ARDrafter
from flashdraft.engine import DEFAULT_AR_DRAFTER_DIR, EngineConfig, draft_model_drafter
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from flashdraft.targets.torch import Target

pytestmark = pytest.mark.real

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "What are three tips for staying focused while studying?"]


@pytest.fixture(scope="module")
def target():
    return Target.load()


def _ids(target, text):
    return target.chat_prompt_ids([{"role": "user", "content": text}])


def test_every_target_layer_accepts_every_draft(target):
    drafter = draft_model_drafter(EngineConfig(spec_type="draft", draft_model="self:30"), target)
    gen = SpeculativeGenerator(target, drafter, n_draft=4)
    # 1 token from the prefill, then 6 steps of 4 drafts + the bonus token
    _, ids, _, t = generate_text(gen, _ids(target, PROMPTS[0]), 31, SamplingParams(), ignore_eos=True)
    assert ids == generate_text(SpeculativeGenerator(target), _ids(target, PROMPTS[0]), 31, SamplingParams(),
                                ignore_eos=True)[1]
    assert t.draft_n_accepted == t.draft_n == 24
    assert t.acceptance_length == 5.0


def test_spec_type_draft_defaults_to_the_shipped_drafter(target):
    drafter = draft_model_drafter(EngineConfig(spec_type="draft"), target)
    assert isinstance(drafter, ARDrafter) and drafter.model.config["ar_drafter"]["num_target_layers"] == 30
    assert (DEFAULT_AR_DRAFTER_DIR / "MODEL_CARD.md").exists()


def _check_lossless(target, plain_target=None):
    drafter = draft_model_drafter(EngineConfig(spec_type="draft", draft_model=str(DEFAULT_AR_DRAFTER_DIR)), target)
    gen = SpeculativeGenerator(target, drafter, n_draft=7)
    plain = SpeculativeGenerator(target)
    accepted = 0
    for text in PROMPTS:
        _, want, _, _ = generate_text(plain, _ids(target, text), 96, SamplingParams())
        gen.target.set_feature_layers(drafter.feature_layer_ids)
        _, got, _, t = generate_text(gen, _ids(target, text), 96, SamplingParams())
        assert got == want, text
        accepted += t.draft_n_accepted
    assert accepted > 0  # the trained drafter is right some of the time


def test_shipped_drafter_is_lossless_on_the_torch_backend(target):
    _check_lossless(target)


def test_shipped_drafter_is_lossless_on_the_llama_backend():
    from flashdraft.targets.binding import BindingUnavailableError, binding

    try:
        binding()
    except BindingUnavailableError as e:
        if os.environ.get("FLASHDRAFT_REQUIRE_LLAMA") == "1":
            raise
        pytest.skip(f"llama backend unavailable: {e}")
    from flashdraft.engine import load_engine_target

    _check_lossless(load_engine_target(EngineConfig(spec_type="none", backend="llama")))
