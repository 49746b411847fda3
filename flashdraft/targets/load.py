"""``--backend auto|torch|llama``: which engine runs the target, and why, in one log line.

- ``torch``: :class:`flashdraft.targets.torch.Target` (the reference; GPUs; the trainer's forward;
  ``--weights``, compressed KV caches, ``-md target``).
- ``llama``: :class:`flashdraft.targets.llama.LlamaTarget` on llama.cpp's kernels (GGUF
  files on the CPU).
- ``auto`` (default): ``llama`` for a GGUF target on the CPU when nothing asked for a
  torch-only feature and llama.cpp passed its probe decode on this machine
  (:func:`flashdraft.targets.binding.probe`), else ``torch``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGUFReader

from flashdraft.targets.binding import BindingUnavailableError, binding, probe
from flashdraft.targets.llama import KV_TYPES, LAYER_INPUT_ARCHS, LlamaTarget
from flashdraft.targets.torch import Target, default_model_path

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "llama")


@dataclass
class BackendChoice:
    """The resolved backend and the reason, for the startup log."""

    backend: str
    why: str

    def line(self) -> str:
        return f"target backend: {self.backend} ({self.why})"


def gguf_architecture(path: str | Path) -> str | None:
    """``general.architecture`` of a GGUF file (its metadata only), None when unreadable."""
    try:
        field = GGUFReader(str(path)).fields.get("general.architecture")
        return None if field is None else str(field.contents())
    except (OSError, ValueError):
        return None


#: the context ``-c 0`` gives a model whose files name none
FALLBACK_CONTEXT = 4096


def training_context(model: str | Path | None) -> int:
    """The context length a model was trained for, what ``-c 0`` asks for (llama-server: "0 =
    loaded from model"): a GGUF's ``{arch}.context_length``, a transformers directory's
    ``max_position_embeddings`` (config.json), the packaged default model's when ``model`` is
    None; :data:`FALLBACK_CONTEXT` with a warning where the files name none.

    Reads metadata only (no weights); raises nothing."""
    import json

    path = Path(model) if model is not None else None
    if path is None:
        try:
            path = default_model_path()
        except Exception:  # noqa: BLE001 - the load that follows names what is missing
            return FALLBACK_CONTEXT
    n = None
    try:
        if path.suffix == ".gguf":
            arch = gguf_architecture(path)
            field = GGUFReader(str(path)).fields.get(f"{arch}.context_length") if arch else None
            n = None if field is None else int(field.contents())
        elif (path / "config.json").is_file():
            n = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, TypeError):
        n = None
    if not isinstance(n, int) or n <= 0:
        log.warning("-c 0: %s names no training context; using %d tokens", path, FALLBACK_CONTEXT)
        return FALLBACK_CONTEXT
    return n


def torch_only_reason(model: str | None, weights: str | None, device: torch.device, kv=None,
                      draft_model: str | None = None, features: bool = False) -> str | None:
    """Why the llama backend cannot run these settings, or None when it can (``features``:
    the drafter reads the target's context features, as DFlash and the hybrid do)."""
    path = None if model is None else Path(model)
    if path is not None and path.suffix != ".gguf":
        return f"{model} is not a GGUF file"
    if device.type != "cpu":
        return f"device {device} (the llama backend runs on the CPU)"
    if weights not in (None, "fp32"):
        return f"--weights {weights} is a torch-backend option"
    if kv is not None and (kv.type_k not in KV_TYPES or kv.type_v not in KV_TYPES or kv.sink_tokens
                           or kv.tail_tokens):
        return f"KV cache {kv.label()} is the torch backend's own codec"
    if draft_model == "target":
        return "-md target drafts with the target's torch model"
    if draft_model is not None and draft_model.startswith("random"):
        return "-md random builds its drafter from the target's torch config"
    if features and path is not None:
        arch = gguf_architecture(path)
        if arch is not None and arch not in LAYER_INPUT_ARCHS:
            return f"llama.cpp's {arch} graph does not export the layer inputs DFlash reads as context features"
    return None


def choose_backend(backend: str, model: str | None, weights: str | None, device: torch.device,
                   kv=None, draft_model: str | None = None, features: bool = False) -> BackendChoice:
    """Resolve ``--backend`` (``features``: as :func:`torch_only_reason`).

    Raises:
        ValueError: an unknown backend, or ``llama`` with settings it cannot run.
        BindingUnavailableError: ``llama`` asked for explicitly and the binding is missing.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown --backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if backend == "torch":
        return BackendChoice("torch", "asked for")
    reason = torch_only_reason(model, weights, device, kv, draft_model, features)
    if backend == "llama":
        if reason is not None:
            raise ValueError(f"--backend llama cannot run this: {reason}; use --backend torch")
        binding()  # BindingUnavailableError with the fix
        return BackendChoice("llama", "asked for")
    if reason is not None:
        return BackendChoice("torch", reason)
    try:
        b = binding()
    except BindingUnavailableError as e:
        return BackendChoice("torch", f"llama.cpp unavailable: {e}")
    ok, detail = probe(str(default_model_path() if model is None else model))
    if not ok:
        return BackendChoice("torch", f"llama.cpp's probe decode failed on this CPU ({detail}); "
                                      "see docs/performance.md, 'The llama backend'")
    return BackendChoice("llama", f"GGUF target on the CPU, {b.version}")


def load_target(model: str | None, choice: BackendChoice, weights: str | None = None,
                device: torch.device | str = "cpu", n_ctx: int = 4096, n_seq: int = 1, kv=None,
                ubatch: int | None = None):
    """Load the target on the chosen backend (threads: torch's current setting, ``-t``;
    ``ubatch``: rows per llama.cpp decode, None = :data:`~flashdraft.targets.llama.DEFAULT_UBATCH`).

    Returns:
        a :class:`~flashdraft.targets.torch.Target` or :class:`~flashdraft.targets.llama.LlamaTarget`.
    """
    if choice.backend == "llama":
        path = default_model_path() if model is None else model
        types = {} if kv is None else dict(cache_type_k=kv.type_k, cache_type_v=kv.type_v)
        if ubatch is not None:
            types["ubatch"] = ubatch
        return LlamaTarget.load(path, n_ctx=n_ctx, n_seq=n_seq, threads=torch.get_num_threads(), **types)
    return Target.load(model, weights=weights, device=device)
