"""Requantise a GGUF with llama.cpp's own quantiser (``llama_model_quantize``, what
``llama-quantize --allow-requantize`` runs), for ``flashdraft bench --quant TYPE`` and the
per-type exactness tests.

A requantised copy of a Q4_1 model is a *different* model (its weights are Q4_1's
dequantised values quantised again), so it is only for measuring what a weight type costs
on this CPU; the bench runs every engine of a row on the same file. Copies are cached by the
source's size and mtime under ``~/.cache/flashdraft/requantized/``; a Q4_1 model requantises
in seconds.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

#: ``--quant`` names → llama.cpp file types (``enum llama_ftype``)
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K_M": 15, "Q4_K_S": 14, "Q5_K_M": 17, "Q6_K": 18,
          "F16": 1, "BF16": 32}


def cache_dir() -> Path:
    """Where requantised copies are kept."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flashdraft" / "requantized"


def requantize(src: str | Path, quant: str, out_dir: str | Path | None = None, threads: int = 0) -> Path:
    """``src`` requantised to ``quant`` (a key of :data:`FTYPES`, case-insensitive).

    Args:
        src: a GGUF llama.cpp loads.
        quant: the weight type to write.
        out_dir: where to write (default :func:`cache_dir`); an existing copy is reused.
        threads: quantiser threads (0: llama.cpp's default).
    Returns:
        the path of the copy.
    Raises:
        ValueError: an unknown type, or llama.cpp refused the file.
        flashdraft.targets.binding.BindingUnavailableError: no llama.cpp here.
    """
    from flashdraft.targets.binding import binding

    key = quant.upper()
    if key not in FTYPES:
        raise ValueError(f"--quant {quant!r}: choose from {', '.join(FTYPES)}")
    src = Path(src)
    if not src.is_file():
        raise ValueError(f"--quant: model file not found: {src}")
    st = src.stat()
    tag = hashlib.sha256(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = Path(out_dir) if out_dir is not None else cache_dir()
    dst = out / f"{src.stem}.{tag}.{key}.gguf"
    if dst.is_file():
        return dst
    out.mkdir(parents=True, exist_ok=True)
    api = binding().api
    params = api.llama_model_quantize_default_params()
    params.ftype = FTYPES[key]
    params.allow_requantize = True
    params.nthread = threads
    tmp = dst.with_suffix(".part")
    rc = api.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise ValueError(f"llama.cpp could not requantise {src} to {key} (code {rc})")
    tmp.replace(dst)
    return dst
