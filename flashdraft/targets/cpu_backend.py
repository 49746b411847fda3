"""Which of llama.cpp's CPU backends runs on this CPU, chosen at load time.

``make llama`` (scripts/build_llama.sh) builds ggml as loadable modules
(``GGML_BACKEND_DL``), the way llama.cpp's release builds do: a baseline CPU backend
(``libggml-cpu.so``, x86-64 with SSE2 only) and one variant per instruction-set level
(``libggml-cpu-haswell.so``: AVX2/FMA/F16C/BMI2, ``-alderlake``: + AVX-VNNI, ``-skylakex``:
AVX512, ``-icelake``: + VBMI/VNNI, ``-zen4``: + AVX512-BF16). ggml's own loader
(``ggml_backend_load_all_from_path``) asks each variant's score function, compiled without
the variant's instruction flags, whether the CPU has what the variant needs, and keeps the
highest-scoring one; the baseline is used where none fits. No AMX variant is built
(llama.cpp #20824: ``ggml_backend_amx_mul_mat`` crashed on an AMX Xeon); an AMX CPU gets zen4.

``FLASHDRAFT_CPU_VARIANT=NAME`` loads that variant instead (``x64`` = the baseline), to
compare kernels on one machine or to step down where the chosen one misbehaves.

A build made without ``GGML_BACKEND_DL`` links its CPU backend in; :func:`load` then reports
it as ``built-in`` and loads nothing.

``python -m flashdraft.targets.cpu_backend`` prints the choice (the test that checks the
choice on an emulated AVX2-only CPU runs it under ``qemu-x86_64 -cpu Haswell``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
from pathlib import Path

#: environment variable naming a variant to load instead of ggml's choice
VARIANT_ENV = "FLASHDRAFT_CPU_VARIANT"
_PREFIX, _SUFFIX = "libggml-cpu", ".so"
_loaded: "CpuBackend | None" = None  # ggml keeps a backend registered for the process's life


@dataclasses.dataclass(frozen=True)
class CpuBackend:
    """The CPU backend llama.cpp runs in this process.

    Attributes:
        variant: ``"zen4"``, ``"haswell"``, ... ``"x64"`` (the baseline module) or ``"built-in"``.
        path: the module loaded, or None for a built-in backend.
        available: the variants found beside it (what ggml chose from).
        forced: True where :data:`VARIANT_ENV` named it.
    """

    variant: str
    path: Path | None
    available: tuple[str, ...]
    forced: bool = False

    def describe(self) -> str:
        """One log line: which variant, out of which, and why."""
        if self.path is None:
            return "CPU backend: built into libggml (a build without GGML_BACKEND_DL: one kernel set for every CPU)"
        how = f"{VARIANT_ENV}={self.variant}" if self.forced else "ggml's pick for this CPU"
        return f"CPU backend: {self.variant} ({how}; built: {', '.join(self.available)})"


class CpuBackendError(RuntimeError):
    """No CPU backend of this llama.cpp build can run here, or the one asked for is missing."""


def variant_name(path: Path) -> str:
    """``libggml-cpu-zen4.so`` -> ``zen4``; the baseline ``libggml-cpu.so`` -> ``x64``."""
    stem = path.name[: -len(_SUFFIX)]
    return stem[len(_PREFIX) + 1:] if stem.startswith(_PREFIX + "-") else "x64"


def _modules(lib_dir: Path) -> dict[str, Path]:
    found = {}
    for p in sorted(lib_dir.glob(f"{_PREFIX}*{_SUFFIX}")):
        if p.name == _PREFIX + _SUFFIX or p.name.startswith(_PREFIX + "-"):
            found[variant_name(p)] = p
    return found


def _mapped(prefix: str) -> Path | None:
    """The first file mapped into this process whose name starts with ``prefix``."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1]
            if Path(path).name.startswith(prefix) and ".so" in path:
                return Path(path)
    except OSError:
        pass
    return None


def _ggml(lib_dir: Path) -> ctypes.CDLL:
    # the copy libllama already uses: pip writes libggml.so, .so.0 and .so.0.x as separate
    # files, and opening another of them would load a second registry that libllama never sees
    path = _mapped("libggml.so") or next((p for p in (lib_dir / "libggml.so.0", lib_dir / "libggml.so")
                                          if p.exists()), lib_dir / "libggml.so")
    ggml = ctypes.CDLL(str(path))
    ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_load_all_from_path.restype = None
    ggml.ggml_backend_load.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_load.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    ggml.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
    ggml.ggml_backend_reg_get.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_name.restype = ctypes.c_char_p
    return ggml


def _registered(ggml: ctypes.CDLL) -> list[str]:
    return [ggml.ggml_backend_reg_name(ggml.ggml_backend_reg_get(i)).decode()
            for i in range(ggml.ggml_backend_reg_count())]


def _mapped_module() -> Path | None:
    return _mapped(_PREFIX)


def load(lib_dir: Path, variant: str | None = None) -> CpuBackend:
    """Register llama.cpp's CPU backend for this process (once, before any model loads).

    Args:
        lib_dir: ``llama_cpp/lib`` of the installed binding.
        variant: a variant to load instead of ggml's choice (default: :data:`VARIANT_ENV`).
    Returns:
        the :class:`CpuBackend` in use.
    Raises:
        CpuBackendError: the asked-for variant is not built, or no CPU backend loads here.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    ggml = _ggml(lib_dir)
    if "CPU" in _registered(ggml):  # registered before any load: linked in (no GGML_BACKEND_DL)
        _loaded = CpuBackend("built-in", None, ())
        return _loaded
    modules = _modules(lib_dir)
    variant = variant if variant is not None else (os.environ.get(VARIANT_ENV) or None)
    if variant is not None:
        if variant not in modules:
            raise CpuBackendError(f"{VARIANT_ENV}={variant}: no such CPU backend in {lib_dir} "
                                  f"(built: {', '.join(modules) or 'none'})")
        ggml.ggml_backend_load(str(modules[variant]).encode())
    else:
        ggml.ggml_backend_load_all_from_path(str(lib_dir).encode())
    if "CPU" not in _registered(ggml):
        raise CpuBackendError(f"no CPU backend of llama.cpp loads on this CPU (looked in {lib_dir}: "
                              f"{', '.join(modules) or 'none built'}); rebuild with `make llama`")
    mapped = _mapped_module()
    _loaded = CpuBackend(variant_name(mapped) if mapped else "?", mapped, tuple(modules), forced=variant is not None)
    return _loaded


def decode(model: str, n: int = 4) -> list[int]:
    """Greedy ids of ``n`` tokens after "Hello, my name is" through llama.cpp's C API alone
    (no torch: cheap under an emulated CPU), on the CPU backend :func:`load` registered."""
    from llama_cpp import llama_cpp as api

    api.llama_backend_init()
    mp = api.llama_model_default_params()
    model_p = api.llama_model_load_from_file(model.encode(), mp)  # repacked weights on, as the backend loads them
    if not model_p:
        raise CpuBackendError(f"llama.cpp could not load {model}")
    cp = api.llama_context_default_params()
    cp.n_ctx, cp.n_threads, cp.n_threads_batch = 64, 1, 1
    ctx = api.llama_init_from_model(model_p, cp)
    vocab = api.llama_model_get_vocab(model_p)
    n_vocab = api.llama_vocab_n_tokens(vocab)
    toks = (api.llama_token * 32)()
    text = b"Hello, my name is"
    batch = api.llama_batch_get_one(toks, api.llama_tokenize(vocab, text, len(text), toks, 32, True, False))
    out = []
    for _ in range(n):
        if api.llama_decode(ctx, batch) != 0:
            raise CpuBackendError("llama_decode failed")
        logits = api.llama_get_logits_ith(ctx, -1)
        out.append(max(range(n_vocab), key=logits.__getitem__))
        one = (api.llama_token * 1)(out[-1])
        batch = api.llama_batch_get_one(one, 1)
    api.llama_free(ctx)
    api.llama_model_free(model_p)
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the CPU backend this machine gets; with ``--decode GGUF`` also decode a few
    tokens on it and print their ids. Exit 1 where no backend loads."""
    import argparse
    import importlib.util

    ap = argparse.ArgumentParser(description="which llama.cpp CPU backend variant this CPU gets")
    ap.add_argument("--decode", metavar="GGUF", default=None, help="also decode 4 greedy tokens of this model")
    args = ap.parse_args(argv)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None:
        print("llama-cpp-python is not installed", file=sys.stderr)
        return 1
    lib_dir = Path(list(spec.submodule_search_locations)[0]) / "lib"
    try:
        print(load(lib_dir).describe(), flush=True)
        if args.decode:
            print("decoded", decode(args.decode))
    except CpuBackendError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
