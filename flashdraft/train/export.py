"""Export a trained DFlash drafter, and ``flashdraft convert`` between checkpoint formats.

Two formats (DESIGN.md §2; reading and writing live in ``flashdraft.drafters.dflash_format``):

- ``specforge``: a directory with ``config.json`` + ``model.safetensors`` (z-lab/SpecForge
  layout, loadable by vLLM and SGLang).
- ``gguf``: one llama.cpp file of arch ``dflash-draft`` (legacy forks) or ``dflash`` (upstream).

An optional ``d2t`` tensor (reduced draft vocabulary: draft index -> target token id, int64
``[V_draft]``) is carried through both formats unchanged.

    flashdraft convert drafter/ drafter.gguf                  # format from the .gguf suffix
    flashdraft convert drafter.gguf drafter-sf --to specforge --dtype bf16
    flashdraft convert drafter/ up.gguf --arch dflash --dtype q8_0
    flashdraft convert drafter/ up.gguf --arch dflash --target target.gguf   # loads in llama-server
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from flashdraft.drafters.dflash import DFlashDraftModel
from flashdraft.drafters.dflash_format import (GGUF_ARCHS, is_dflash2, load_dflash_checkpoint, save_gguf,
                                               save_specforge)


FORMATS = ("specforge", "gguf")
#: ``--dtype`` name -> what the writers take; ``q8_0`` exists only in GGUF
DTYPES: dict[str, torch.dtype | str] = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32,
                                        "q8_0": "q8_0"}


def infer_format(dst: str | Path) -> str:
    """``"gguf"`` when ``dst`` ends in ``.gguf`` (any case), else ``"specforge"``."""
    return "gguf" if str(dst).lower().endswith(".gguf") else "specforge"


def save_checkpoint(config: dict, state_dict: dict[str, torch.Tensor], out: str | Path, fmt: str,
                    dtype: torch.dtype | str = torch.float16, arch: str | None = None,
                    target_gguf: str | Path | None = None) -> Path:
    """Write ``(config, state_dict)`` (canonical SpecForge names, see ``dflash_format``) as ``fmt``.

    Args:
        config: the drafter's ``config.json`` dict.
        state_dict: SpecForge-named tensors, optionally with ``d2t`` (int64 ``[V_draft]``, kept as is).
        out: directory (``specforge``, created if needed) or file path (``gguf``).
        fmt: ``"specforge"`` or ``"gguf"``.
        dtype: storage type of floating weights: torch.float16/bfloat16/float32, or ``"q8_0"``
            (GGUF only). GGUF keeps norm vectors in F32 whatever ``dtype`` says.
        arch: GGUF arch, ``"dflash-draft"`` or ``"dflash"``; None = ``dflash`` for a DFlash2
            drafter (it has no other layout), else ``dflash-draft``; ignored for ``specforge``.
        target_gguf: the target's GGUF, whose tokenizer (and LM head rows ``d2t``) a GGUF for
            llama.cpp's ``draft-dflash`` needs (``dflash_format.save_gguf``); GGUF only.
    Returns:
        ``out`` as a Path.
    Raises:
        ValueError: unknown format/arch/dtype, ``q8_0`` for SpecForge, an existing file where a
            SpecForge directory should go, a config/state_dict that does not describe a
            DFlash drafter, a ``target_gguf`` for SpecForge or one whose vocabulary differs.
    """
    out = Path(out)
    if fmt not in FORMATS:
        raise ValueError(f"unknown drafter format {fmt!r}; choose from {', '.join(FORMATS)}")
    if target_gguf is not None and fmt != "gguf":
        raise ValueError("--target applies to GGUF output only (a SpecForge drafter carries no tokenizer)")
    if fmt == "gguf":
        if arch is None:
            arch = "dflash" if is_dflash2(config) else "dflash-draft"
        if arch not in GGUF_ARCHS:
            raise ValueError(f"unknown GGUF arch {arch!r}; choose from {', '.join(GGUF_ARCHS)}")
        if out.is_dir():
            raise ValueError(f"{out} is a directory; a GGUF drafter is a single file (e.g. {out}.gguf)")
        out.parent.mkdir(parents=True, exist_ok=True)
        save_gguf(out, config, state_dict, arch=arch, dtype=dtype, target_gguf=target_gguf)
        return out
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {dtype!r} exists only in GGUF; a SpecForge checkpoint takes f16, bf16 or f32")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; a SpecForge drafter is a directory (config.json + model.safetensors)")
    save_specforge(out, config, state_dict, dtype=dtype)
    return out


def export_drafter(model: DFlashDraftModel, out: str | Path, fmt: str = "specforge",
                   dtype: torch.dtype | str = torch.float16, arch: str | None = None,
                   d2t: torch.Tensor | None = None) -> Path:
    """Save a drafter network as a SpecForge directory or a GGUF file.

    ``model.state_dict()`` already uses SpecForge names, and ``model.config`` is the
    ``config.json`` dict, so this is :func:`save_checkpoint` on them. ``load_dflash_model(out)``
    gives back a drafter that proposes the same tokens (exactly so at ``dtype=torch.float32``).

    Args:
        model: the drafter (any dtype; weights are cast to ``dtype`` on write).
        out: SpecForge directory or GGUF file path.
        fmt: ``"specforge"`` or ``"gguf"``.
        dtype / arch: see :func:`save_checkpoint`.
        d2t: optional reduced-vocabulary map, int64 ``[V_draft]`` (draft index -> target id);
            a ``d2t`` buffer already in ``model.state_dict()`` is written too.
    Raises:
        ValueError: as :func:`save_checkpoint`, or ``d2t`` that is not a 1-D integer tensor.
    """
    state = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    if d2t is not None:
        if d2t.ndim != 1 or d2t.is_floating_point():
            raise ValueError(f"d2t must be a 1-D integer tensor [V_draft], got {d2t.dtype} {tuple(d2t.shape)}")
        state["d2t"] = d2t.detach().cpu().to(torch.int64)
    return save_checkpoint(model.config, state, out, fmt, dtype=dtype, arch=arch)


def convert(src: str | Path, dst: str | Path, fmt: str | None = None, arch: str | None = None,
            dtype: torch.dtype | str = torch.float16, target_gguf: str | Path | None = None) -> Path:
    """Convert a drafter checkpoint (SpecForge dir or GGUF) to ``fmt`` at ``dst``.

    ``fmt=None`` infers it from ``dst`` (:func:`infer_format`). Tensors go through the
    canonical ``(config, state_dict)`` form, so ``d2t`` survives. GGUF sources load as float32
    (dequantised), so converting a Q8_0 file keeps its quantisation error. ``target_gguf``: see
    :func:`save_checkpoint`.

    Raises:
        FileNotFoundError: ``src`` does not exist.
        ValueError: ``src`` is not a DFlash drafter, ``dst`` is ``src``, a ``.gguf`` destination
            asked to hold SpecForge, or see :func:`save_checkpoint`.
    """
    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise FileNotFoundError(f"no drafter checkpoint at {src}")
    fmt = fmt or infer_format(dst)
    if fmt == "specforge" and infer_format(dst) == "gguf":
        raise ValueError(f"{dst} ends in .gguf but the target format is specforge (a directory); "
                         f"drop --to or pick another name")
    if dst.resolve() == src.resolve():
        raise ValueError(f"source and destination are the same path: {src}")
    config, state = load_dflash_checkpoint(src)  # validates shapes; raises ValueError otherwise
    return save_checkpoint(config, state, dst, fmt, dtype=dtype, arch=arch, target_gguf=target_gguf)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``flashdraft convert``."""
    p.add_argument("src", help="source drafter: SpecForge directory or .gguf file")
    p.add_argument("dst", help="destination: directory (specforge) or .gguf file")
    p.add_argument("--to", choices=FORMATS, default=None,
                   help="output format (default: gguf if DST ends in .gguf, else specforge)")
    p.add_argument("--arch", choices=GGUF_ARCHS, default=None,
                   help="GGUF arch: dflash-draft (llama.cpp forks; the default for DFlash) or dflash "
                        "(upstream llama.cpp; the default, and the only layout, for DFlash2)")
    p.add_argument("--dtype", choices=list(DTYPES), default="f16",
                   help="weight type (default f16; q8_0 only for gguf)")
    p.add_argument("--target", default=None, metavar="TARGET.gguf",
                   help="the target model's GGUF: its tokenizer (and, for a reduced draft vocabulary, its LM head "
                        "rows) go into the file, which llama-server's --spec-type draft-dflash needs (with --arch dflash)")


def run(args) -> int:
    """``flashdraft convert``: prints the written path; errors raise ValueError/FileNotFoundError."""
    fmt = args.to or infer_format(args.dst)
    out = convert(args.src, args.dst, fmt=fmt, arch=args.arch, dtype=DTYPES[args.dtype], target_gguf=args.target)
    arch = None
    if fmt == "gguf":  # what the file says (None chose by the drafter's kind)
        import gguf

        arch = gguf.GGUFReader(out).fields["general.architecture"].contents()
    what = f"gguf ({arch}, {args.dtype})" if fmt == "gguf" else f"specforge ({args.dtype})"
    print(f"wrote {out} as {what}")
    if fmt == "gguf" and arch == "dflash" and args.target is None:
        print("note: without --target the file has no tokenizer; llama-server's draft-dflash will not load it")
    return 0
