"""llama.cpp's CPU kernels under the llama backend: the run-time variant choice, and that
every weight type's kernels (repacked where that stays exact) give a verify block the logits
of one-token steps bit for bit, so drafting stays lossless (docs/performance.md, "Cheap verify").

The choice on another CPU is checked under QEMU's user-mode emulation (``qemu-x86_64 -cpu
Haswell``: an AVX2 CPU without AVX512; ``-cpu Nehalem``: SSE4.2 only), which reports that
CPU's CPUID to ggml's score functions. Skipped where qemu-user is missing, except under
``FLASHDRAFT_REQUIRE_LLAMA=1`` (CI installs it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashdraft.targets import cpu_backend
from flashdraft.targets import binding as binding_mod
from flashdraft.targets.binding import BindingUnavailableError

SCRIPT = Path(cpu_backend.__file__)


def _need_binding():
    try:
        b = binding_mod.binding()
    except BindingUnavailableError as e:
        if os.environ.get("FLASHDRAFT_REQUIRE_LLAMA") == "1":
            raise
        pytest.skip(f"llama backend unavailable: {e}")
    if b.cpu.path is None:
        if os.environ.get("FLASHDRAFT_REQUIRE_LLAMA") == "1":
            pytest.fail("the llama backend was built without CPU variants: rebuild with `make llama`")
        pytest.skip("this llama.cpp build has no run-time CPU variants")
    return b


def _site_packages() -> str:
    import llama_cpp

    return str(Path(llama_cpp.__file__).parent.parent)


def _choice(env: dict | None = None, emulate: str | None = None, *args: str) -> subprocess.CompletedProcess:
    """Run cpu_backend.py as a script (stdlib and llama_cpp only: cheap under emulation)."""
    py = os.path.realpath(sys.executable)
    cmd = [py, str(SCRIPT), *args]
    if emulate is not None:
        cmd = [shutil.which("qemu-x86_64"), "-cpu", emulate, *cmd]
    full = dict(os.environ, PYTHONPATH=_site_packages(), **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, env=full, timeout=300)


def _expected_variant(flags: set[str]) -> str:
    """The variant ggml's score functions pick for these /proc/cpuinfo flags, out of the ones
    scripts/build_llama.sh builds (highest score: AVX512 levels, then AVX-VNNI, then AVX2)."""
    avx2 = {"avx2", "fma", "f16c", "bmi2", "avx", "sse4_2"} <= flags
    avx512 = avx2 and {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"} <= flags
    if avx512 and {"avx512vbmi", "avx512_vnni", "avx512_bf16"} <= flags:
        return "zen4"
    if avx512 and {"avx512vbmi", "avx512_vnni"} <= flags:
        return "icelake"
    if avx512:
        return "skylakex"
    if avx2 and "avx_vnni" in flags:
        return "alderlake"
    return "haswell" if avx2 else "x64"


def test_this_cpu_gets_its_best_variant():
    b = _need_binding()
    flags = set(next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")).split())
    assert b.cpu.variant == _expected_variant(flags), b.cpu.describe()
    assert {"x64", "haswell", "skylakex", "zen4"} <= set(b.cpu.available)
    assert "sapphirerapids" not in b.cpu.available  # the AMX variant stays out (llama.cpp #20824)
    if "avx512f" in flags:
        assert "AVX512 = 1" in b.system_info()
    out = _choice()
    assert out.returncode == 0 and f"CPU backend: {b.cpu.variant} " in out.stdout, out.stderr


def _need_qemu():
    if shutil.which("qemu-x86_64") is None:
        if os.environ.get("FLASHDRAFT_REQUIRE_LLAMA") == "1":
            pytest.fail("qemu-user is missing (.ci/run installs it): the variant choice on other CPUs is untested")
        pytest.skip("qemu-user is not installed")


@pytest.mark.parametrize("cpu, want", [("Haswell", "haswell"), ("Nehalem", "x64")])
def test_an_emulated_older_cpu_gets_the_variant_it_can_run(cpu, want):
    _need_binding()
    _need_qemu()
    out = _choice(emulate=cpu)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"CPU backend: {want} (ggml's pick" in out.stdout


@pytest.mark.real
def test_an_emulated_avx2_cpu_decodes_like_the_haswell_variant_here():
    """The whole decode path (model load with repacked weights, matmuls, attention) runs on
    an emulated AVX2-only CPU without an illegal instruction, and gives the ids this machine
    gets from the same variant (QEMU emulates the instructions exactly)."""
    _need_binding()
    _need_qemu()
    from flashdraft.targets.torch import default_model_path

    model = str(default_model_path())
    emulated = _choice(None, "Haswell", "--decode", model)
    assert emulated.returncode == 0, emulated.stderr[-2000:]
    native = _choice({cpu_backend.VARIANT_ENV: "haswell"}, None, "--decode", model)
    assert native.returncode == 0, native.stderr[-2000:]
    ids = [line for line in emulated.stdout.splitlines() if line.startswith("decoded")]
    assert ids and ids == [line for line in native.stdout.splitlines() if line.startswith("decoded")]
    assert "CPU backend: haswell (ggml's pick" in emulated.stdout


def test_a_forced_variant_and_an_unknown_one():
    _need_binding()
    out = _choice({cpu_backend.VARIANT_ENV: "haswell"})
    assert out.returncode == 0 and "CPU backend: haswell (FLASHDRAFT_CPU_VARIANT=haswell" in out.stdout, out.stderr
    out = _choice({cpu_backend.VARIANT_ENV: "pentium3"})
    assert out.returncode == 1 and "no such CPU backend" in out.stderr and "zen4" in out.stderr


# ------------------------------------------------------------- every weight type, exact
TYPES = ["Q4_1", "Q4_0", "Q4_K_M", "Q8_0", "BF16"]
#: types whose verify rows equal one-token steps with the backend's settings (BF16: see below)
EXACT = ["Q4_1", "Q4_0", "Q4_K_M", "Q8_0"]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The packaged SmolLM2 GGUF (Q4_1) and its requantisations by llama.cpp's quantiser."""
    _need_binding()
    from flashdraft.targets.torch import default_model_path
    from flashdraft.targets.requantize import requantize

    out = tmp_path_factory.mktemp("quant")
    src = default_model_path()
    return {q: src if q == "Q4_1" else requantize(src, q, out) for q in TYPES}


def _block_vs_steps(t, ids: list[int], k: int) -> float:
    cache = t.new_cache()
    t.forward(torch.tensor(ids[:-k]), cache, len(ids) - k - 1)
    start = cache.length
    block = t.forward(torch.tensor(ids[-k:]), cache)[0].clone()
    cache.rollback(start)
    steps = torch.cat([t.forward(torch.tensor([x]), cache)[0].clone() for x in ids[-k:]])
    return float((block - steps).abs().max())


@pytest.mark.real
@pytest.mark.parametrize("quant", EXACT)
def test_every_weight_type_verifies_exactly(quantized, quant):
    """A verify block of 2..16 rows (2 threads, one-token steps on 1, as drafting runs) equals
    one-token steps bit for bit with the repack setting the backend chose for this type; and
    greedy prompt lookup reproduces plain decoding on it."""
    from flashdraft.engine import EngineConfig, load_drafter
    from flashdraft.generate import SpeculativeGenerator, generate_text
    from flashdraft.sampling import SamplingParams
    from flashdraft.targets.llama import LlamaTarget

    t = LlamaTarget(quantized[quant], n_ctx=512, threads=2, warn=False)
    try:
        ids = t.chat_prompt_ids([{"role": "user", "content": "Write a Python function that merges two sorted "
                                                              "lists, then explain it line by line."}])
        for k in (2, 3, 5, 8, 16):
            assert _block_vs_steps(t, ids, k) == 0.0, (quant, k, t.repack)
        if quant == "Q4_0":  # repacked on x86-64 with AVX2 and still exact
            assert t.repack == "on" and t.repack_mib > 0, t.repack
        if quant == "Q4_K_M":  # its repacked 4+-row kernel rounds otherwise: the check turned it off
            assert t.repack.startswith("off ("), t.repack
        plain = SpeculativeGenerator(t, ctx_size=512)
        want = generate_text(plain, ids, 96, SamplingParams())[1]
        gen = SpeculativeGenerator(t, load_drafter(EngineConfig(spec_type="ngram"), t), ctx_size=512, n_draft=7)
        assert generate_text(gen, ids, 96, SamplingParams())[1] == want
    finally:
        t.close()


@pytest.mark.real
def test_bf16_verify_rows_differ_and_the_engine_says_so(quantized, caplog):
    """BF16 on ggml's CPU backend: a one-token step and a block of 2+ rows take matmul kernels
    that sum in another order (0.18 apart in the logits at 2 rows, with or without repacking),
    so drafting on a BF16 GGUF is not token-exact on the llama backend. The backend measures
    it and the engine warns at load; when a ggml update makes the rows equal, this test fails
    and BF16 belongs in EXACT."""
    import logging

    from flashdraft.engine import EngineConfig, load_engine
    from flashdraft.targets.llama import LlamaTarget

    t = LlamaTarget(quantized["BF16"], n_ctx=512, threads=2, warn=False)
    try:
        assert t.verify_drift(2) > 0
        with caplog.at_level(logging.WARNING):
            load_engine(EngineConfig(spec_type="ngram", controller="off"), target=t, warmup=False)
        assert "greedy output with drafting may differ" in caplog.text
    finally:
        t.close()
