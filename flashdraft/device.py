"""Which torch device the target, drafter, caches and sampler live on (``--device``).

One device per engine: weights, KV caches, RoPE tables, masks, logits, context features
and the sampler's random generator are all created there, so a decode step moves only
token ids between host and device (the block's ids in, the accepted ids and bonus token
out). The committed token list of a sequence stays on the host: it feeds stop strings,
prompt lookup and the grammar matcher, all of which are host code.

``auto`` picks CUDA, then Apple MPS, then the CPU (llama-server's ``--device`` names a
backend device the same way; ``-dev`` is its short form).
"""

from __future__ import annotations

import argparse
import functools
import logging
import time

import torch

log = logging.getLogger(__name__)

#: token-id bookkeeping (committed ids, draft ids) is host data: stops, prompt lookup and
#: the grammar read it in Python
HOST = torch.device("cpu")

DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")
DEVICE_HELP = ("device for the target, drafter, caches and sampler: auto = CUDA, then MPS, then CPU "
               "(default: auto; the startup log says which)")


class DeviceUnavailableError(ValueError):
    """The requested device is not usable on this machine (a CLI error, exit code 1)."""


def mps_available() -> bool:
    """True when Apple's Metal backend is built into this torch and usable."""
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """The torch device ``name`` asks for, checked against this machine.

    Args:
        name: ``auto`` (or None), ``cpu``, ``cuda``, ``cuda:N``, ``mps``, or a torch.device.
    Returns:
        a concrete device (``auto`` resolved; plain ``cuda`` means ``cuda:0``).
    Raises:
        DeviceUnavailableError: CUDA or MPS asked for but absent (or ``cuda:N`` past the
            device count), or an unknown device name.
    """
    if name is None or str(name) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", 0)
        if mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise DeviceUnavailableError(f"unknown device {name!r}; choose from {', '.join(DEVICE_CHOICES)}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise DeviceUnavailableError(f"--device cuda: {why}; use --device cpu or --device auto")
        index = 0 if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise DeviceUnavailableError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here")
        return torch.device("cuda", index)
    if dev.type == "mps":
        if not mps_available():
            raise DeviceUnavailableError("--device mps: Apple MPS is not available here; use --device cpu or auto")
        return torch.device("mps")
    raise DeviceUnavailableError(f"unsupported device {name!r}; choose from {', '.join(DEVICE_CHOICES)}")


def describe(device: torch.device) -> str:
    """A one-line name for logs: ``cuda:0 (NVIDIA H200)``, ``mps``, ``cpu (2 threads)``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} threads)"
    return str(device)


def log_device(requested: str | None, device: torch.device) -> None:
    """The startup line that says which device ``--device`` chose."""
    how = "auto-selected" if requested in (None, "auto") else "requested"
    log.info("device: %s (%s)", describe(device), how)


def add_device_argument(p) -> None:
    """``--device/-dev`` on a parser or argument group (llama-server's names)."""
    p.add_argument("-dev", "--device", default="auto", choices=DEVICE_CHOICES, help=DEVICE_HELP)


def device_from_args(args: argparse.Namespace) -> torch.device:
    """Resolve ``args.device`` (absent = ``auto``) and log the choice.

    Raises:
        DeviceUnavailableError: see :func:`resolve_device`.
    """
    requested = getattr(args, "device", "auto")
    device = resolve_device(requested)
    log_device(requested, device)
    return device


def autocast_device_type(device: torch.device) -> str:
    """``torch.autocast``'s ``device_type`` for ``device`` (``cuda``, ``mps`` or ``cpu``)."""
    return device.type if device.type in ("cuda", "mps") else "cpu"


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels on ``device`` (timing: a GPU runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


#: ``--spec-draft-dtype`` choices: the dtype the drafter network and its LM head rows run in
DRAFT_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


@functools.lru_cache(maxsize=None)
def bf16_pays(rows: int = 1024, inner: int = 576, cols: int = 4096) -> bool:
    """True when a ``[rows, inner] x [inner, cols]`` bf16 matmul beats float32 on this CPU
    (measured once per shape and process, best of 3; ~0.5 s at the training size, ms at a
    drafter's block size).

    CPUs with AVX512-BF16 or AMX run bf16 2-5x faster than float32; AVX2-only CPUs emulate
    it and run it several times *slower* (seen: 8x), so the choice is measured, not assumed.
    """
    a, w = torch.randn(rows, inner), torch.randn(cols, inner)

    def best(dtype) -> float:
        x, y = a.to(dtype), w.to(dtype)
        x @ y.t()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            x @ y.t()
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(torch.bfloat16) < best(torch.float32)


def resolve_draft_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype a drafter runs in for ``--spec-draft-dtype name`` on ``device``.

    ``auto``: bf16 on a CPU where a bf16 matmul of a drafter's LM-head shape (a block of 8
    rows, 576 x 8192, the shipped SmolLM2 drafter's) beats float32 (:func:`bf16_pays`: AVX512-BF16 / AMX
    CPUs), else float32 (AVX2-only CPUs, GPUs, MPS). The dtype changes only which tokens are
    drafted, never the output: the target verifies every draft in its own precision.

    Raises:
        ValueError: an unknown name.
    """
    if name == "auto":
        return torch.bfloat16 if device.type == "cpu" and bf16_pays(8, 576, 8192) else torch.float32
    if name not in DRAFT_DTYPES:
        raise ValueError(f"unknown --spec-draft-dtype {name!r}; choose from auto, {', '.join(DRAFT_DTYPES)}")
    return DRAFT_DTYPES[name]
