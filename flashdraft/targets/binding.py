"""llama.cpp's C API from Python: which binding, its quirks, and a crash-safe probe.

The llama backend (:mod:`flashdraft.targets.llama`) drives llama.cpp's C API through
``llama-cpp-python``'s low-level ctypes module (``llama_cpp.llama_cpp``), built from source
by pip (llama.cpp 0c1e570). Why this binding and not the 5 MB ``llama-cpp-py-sync`` wheel
(which does not load on glibc < 2.38, Debian 12 included): docs/performance.md, "The llama
backend".

Quirks kept here, so nothing else knows them:

- ``llama_{set,get}_embeddings_layer_inp`` (src/llama-ext.h: the input hidden states of a
  layer, what llama.cpp's own DFlash reads) are not in the Python module and, in builds
  where llama-ext.h has C++ linkage, exported only under mangled names: both are tried.
- ``make setup`` builds ggml's CPU backend as run-time variants (x64 baseline, haswell,
  alderlake, skylakex, icelake, zen4; no AMX variant, llama.cpp #20824), and
  :mod:`flashdraft.targets.cpu_backend` registers the best one for this CPU before any model
  loads. Repacked weights are on where a verify block still equals one-token steps
  (``LlamaTarget(repack="auto")``).
- ggml's tiled K-quant matmul (``GGML_CPU_TILED_MM``, on by default) takes a Q4_K/Q6_K
  matmul from 8 rows on and rounds otherwise than the one-row kernel a decode step uses:
  on Gemma 3 270M Q4_K_M a verify block's logits differed from one-token steps by up to 1.63,
  so greedy drafting could change the output. :data:`TILED_MM_ENV` is set to 0 before
  llama.cpp loads (a user's own setting wins; ``LlamaTarget.verify_drift`` reports the
  result); measured costs in docs/performance.md ("The llama backend").
- ggml's flash attention spreads a single query row over the KV cache across threads (its
  split-KV path, from a 512-cell cache on), so a one-token step on 2+ threads rounds otherwise
  than a row of a verify block (0.77 apart). ``make llama`` applies one patch to the vendored
  ggml (scripts/llama-patches/fa-split-kv-env.patch) that lets :data:`FA_SPLIT_KV_ENV` = 0
  turn that path off; it is set before llama.cpp loads, and where the loaded CPU module has
  the switch (:attr:`Binding.exact_threaded_steps`) one-token steps run on every ``-t``
  thread, otherwise on one (``flashdraft.engine.exact_step_threads``).
- A crash in native code kills the process, so :func:`probe` decodes a few tokens in a
  child process first; ``--backend auto`` uses the llama backend only when it passed.

Errors: :class:`BindingUnavailableError` (a RuntimeError) names the fix.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from flashdraft.targets import cpu_backend

log = logging.getLogger(__name__)

#: the binding the llama backend is tested against (pyproject and the Makefile pin the same)
BINDING = "llama-cpp-python"
BINDING_VERSION = "0.3.36"
INSTALL_HINT = "make llama (builds llama-cpp-python 0.3.36 from source with its CPU variants, ~8 min on 2 cores)"

#: ggml reads this once, at the process's first matmul: 0 keeps every K-quant matmul on the
#: one-row kernel, so a verify block's rows are bit-identical to decode steps
TILED_MM_ENV = "GGML_CPU_TILED_MM"
#: read by the patched ggml (scripts/llama-patches/fa-split-kv-env.patch): 0 keeps each
#: flash-attention row on one thread, so one-token steps on any thread count equal verify rows
FA_SPLIT_KV_ENV = "GGML_CPU_FA_SPLIT_KV"
_set_here: set[str] = set()  # the variables above that flashdraft set (a user's own value wins)


def _default_env(name: str, value: str) -> None:
    if name not in os.environ:
        os.environ[name] = value
        _set_here.add(name)


def has_fa_split_kv_switch(module: Path | None) -> bool:
    """True where the CPU backend ``module`` (a ``libggml-cpu*.so``) was built with the
    :data:`FA_SPLIT_KV_ENV` switch (its name is in the binary); False for None or an
    unreadable file. Reads the file once (a few MB)."""
    if module is None:
        return False
    try:
        return FA_SPLIT_KV_ENV.encode() in module.read_bytes()
    except OSError:
        return False


def child_env() -> dict[str, str]:
    """This process's environment for a llama.cpp program started from it (the llama-server
    peer): without :data:`TILED_MM_ENV` where flashdraft set it, so the peer runs with its
    own defaults."""
    env = dict(os.environ)
    for name in _set_here:
        env.pop(name, None)
    return env


# llama-ext.h functions: C names, then the C++-linkage names some builds export
_EXT = {
    "set_layer_inp": (["llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"],
                      [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None),
    "get_layer_inp": (["llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj"],
                      [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)),
}


class BindingUnavailableError(RuntimeError):
    """llama.cpp cannot be used from this process: the binding is missing, broken, or its
    probe failed on this CPU. The message names the fix."""


class Binding:
    """The loaded C API.

    Attributes:
        api: ``llama_cpp.llama_cpp`` (typed ctypes wrappers: ``api.llama_decode`` ...).
        set_layer_inp: ``(ctx, lid, on)``: capture the input of layer ``lid`` at every decode.
        get_layer_inp: ``(ctx, lid) -> float *``: those inputs, ``[n_tokens, n_embd]`` of the
            last decode; None where the build lacks them (no DFlash features then).
        version: ``"llama-cpp-python 0.3.36"``.
        cpu: the :class:`~flashdraft.targets.cpu_backend.CpuBackend` variant this process runs.
        exact_threaded_steps: True where a one-token step on several threads rounds as a verify
            row does (the CPU module has the :data:`FA_SPLIT_KV_ENV` switch and it is 0).
    """

    def __init__(self):
        _default_env(TILED_MM_ENV, "0")
        _default_env(FA_SPLIT_KV_ENV, "0")
        try:
            import llama_cpp
            from llama_cpp import llama_cpp as api
        except ImportError as e:
            raise BindingUnavailableError(f"the llama backend needs {BINDING}=={BINDING_VERSION}: {INSTALL_HINT} "
                                          f"({e})") from None
        except (OSError, RuntimeError) as e:  # installed, but libllama.so is missing or does not load
            raise BindingUnavailableError(f"{BINDING} is installed but its libllama cannot be loaded ({e}); "
                                          f"rebuild it: {INSTALL_HINT}") from None
        self.api = api
        self.version = f"{BINDING} {getattr(llama_cpp, '__version__', '?')}"
        self.set_layer_inp = self._ext("set_layer_inp")
        self.get_layer_inp = self._ext("get_layer_inp")
        self._quiet()
        try:  # ggml's pick of the CPU variants `make llama` built (before any model loads)
            self.cpu = cpu_backend.load(Path(api.__file__).parent / "lib")
        except (cpu_backend.CpuBackendError, OSError, AttributeError) as e:
            raise BindingUnavailableError(f"{e}; {INSTALL_HINT}") from None
        self.exact_threaded_steps = (os.environ.get(FA_SPLIT_KV_ENV) == "0"
                                     and has_fa_split_kv_switch(self.cpu.path))
        api.llama_backend_init()

    def _ext(self, key: str):
        names, argtypes, restype = _EXT[key]
        for name in names:
            fn = getattr(self.api._lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, restype
                return fn
        return None

    def _quiet(self) -> None:
        # llama.cpp logs every load to stderr; keep warnings and errors (ggml levels 3, 4),
        # or everything with FLASHDRAFT_LLAMA_LOG=1
        verbose = os.environ.get("FLASHDRAFT_LLAMA_LOG", "0") not in ("0", "", "false", "no")

        self.captured: list[str] | None = None  # llama.cpp's log lines while capturing (load_model)

        @self.api.llama_log_callback
        def _log(level, text, _ud):
            if self.captured is not None:
                self.captured.append(text.decode("utf-8", "replace"))
            if verbose or level in (3, 4):
                sys.stderr.write(text.decode("utf-8", "replace"))

        self._log_cb = _log  # keep the callback alive
        self.api.llama_log_set(_log, ctypes.c_void_p(0))

    def load_model(self, path: Path, repack: bool):
        """``llama_model_load_from_file`` on the CPU, with or without repacked weights (extra
        buffer types: ggml's CPU_REPACK layouts for Q4_0/Q4_K/IQ4_NL/BF16 ...).

        Returns:
            ``(model pointer or None, MiB of repacked weights)``: 0 where nothing was repacked.
        """
        mp = self.api.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = repack
        self.captured = []
        try:
            model = self.api.llama_model_load_from_file(str(path).encode(), mp)
        finally:
            lines, self.captured = self.captured, None
        mib = 0.0
        for line in lines:  # "load_tensors:   CPU_REPACK model buffer size =    52.50 MiB"
            if "REPACK model buffer size" in line:
                try:
                    mib += float(line.split("=")[1].split()[0])
                except (IndexError, ValueError):
                    pass
        return model, mib

    def system_info(self) -> str:
        """llama.cpp's CPU feature line (``AVX2 = 1 | ...``)."""
        return self.api.llama_print_system_info().decode()


@functools.lru_cache(maxsize=1)
def binding() -> Binding:
    """The process's :class:`Binding` (loaded once).

    Raises:
        BindingUnavailableError: not installed or not loadable, with the fix.
    """
    return Binding()


# -- crash-safe probe -----------------------------------------------------------------------
_PROBE_CODE = """
import sys
from flashdraft.targets.llama import LlamaTarget
t = LlamaTarget.load(sys.argv[1], n_ctx=64, threads=1, warn=False)
import torch
cache = t.new_cache()
logits, _ = t.forward(torch.tensor(t.encode("Hello, my name is")), cache)
ids = [int(logits[-1].argmax())]
for _ in range(3):
    logits, _ = t.forward(torch.tensor(ids[-1:]), cache)
    ids.append(int(logits[-1].argmax()))
print("ok", ids)
"""


def _probe_key(model: str) -> str:
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        cpu = ""
    try:
        import importlib.util
        spec = importlib.util.find_spec("llama_cpp")
        lib = Path(list(spec.submodule_search_locations)[0]) / "lib" / "libllama.so"
        libstat = f"{lib.stat().st_size}:{lib.stat().st_mtime_ns}"
    except Exception:
        libstat = "?"
    return hashlib.sha256(f"{cpu}|{libstat}|{model}".encode()).hexdigest()[:16]


def _probe_cache_file() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flashdraft"
    return root / "llama-probe.json"


def probe(model: str, timeout_s: float = 120.0, use_cache: bool = True) -> tuple[bool, str]:
    """Decode a few tokens of ``model`` on the llama backend in a child process.

    A CPU the build does not support (an illegal instruction) or a kernel bug (llama.cpp
    #20824 on AMX) kills the child, not the caller. A pass is remembered per CPU, library
    and model file (``~/.cache/flashdraft/llama-probe.json``), so a server starts without it.

    Returns:
        ``(ok, detail)``: detail is the failure (signal, exit code, last stderr line) or "ok".
    """
    key = _probe_key(model)
    cache_file = _probe_cache_file()
    if use_cache:
        try:
            if json.loads(cache_file.read_text()).get(key) == "ok":
                return True, "ok (cached)"
        except (OSError, ValueError):
            pass
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE_CODE, model], capture_output=True, text=True,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"the probe decode did not finish in {timeout_s:.0f} s"
    if out.returncode == 0 and out.stdout.startswith("ok"):
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            seen = json.loads(cache_file.read_text()) if cache_file.exists() else {}
            seen[key] = "ok"
            cache_file.write_text(json.dumps(seen))
        except (OSError, ValueError):
            pass
        return True, "ok"
    tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    how = f"killed by signal {-out.returncode}" if out.returncode < 0 else f"exit code {out.returncode}"
    return False, f"{how}: {tail}"


def main(argv: list[str] | None = None) -> int:
    """``python -m flashdraft.targets.binding [MODEL.gguf]``: the check ``make setup`` runs.

    Loads the binding, prints llama.cpp's CPU features and decodes a few tokens in a child
    process. Exit code 0 when the llama backend works here; 1 with the fix otherwise
    (``--backend auto`` then runs the target on torch).
    """
    import argparse

    p = argparse.ArgumentParser(prog="python -m flashdraft.targets.binding",
                                description="check that the llama backend works on this machine")
    p.add_argument("model", nargs="?", default=None, help="GGUF to decode (default: the packaged model)")
    args = p.parse_args(argv)
    try:
        b = binding()
    except BindingUnavailableError as e:
        print(f"llama backend: unavailable: {e}\n  --backend auto will run the target on torch", file=sys.stderr)
        return 1
    print(f"llama backend: {b.version}; {b.cpu.describe()}; {b.system_info().strip()}")
    if b.get_layer_inp is None:
        print("llama backend: this build lacks llama_get_embeddings_layer_inp: DFlash drafting needs --backend torch",
              file=sys.stderr)
    if args.model is None:
        from flashdraft.targets.torch import default_model_path

        args.model = str(default_model_path())
    ok, detail = probe(args.model, use_cache=False)  # records the pass for --backend auto
    if not ok:
        print(f"llama backend: the probe decode failed on this CPU ({detail}).\n"
              f"  Rebuild for this machine: {INSTALL_HINT}; or run with --backend torch.\n"
              "  --backend auto will run the target on torch.", file=sys.stderr)
        return 1
    print(f"llama backend: probe decode ok ({args.model})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
