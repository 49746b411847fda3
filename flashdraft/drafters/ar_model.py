"""A small autoregressive "assistant" drafter built from the target itself.

The classic draft model of speculative decoding (Leviathan et al. 2023, §3), shaped the way a
drafter for a 135M target can be cheap on a CPU:

- **body:** the target's first ``N`` decoder layers (``self:N`` untrained, or trained further
  by ``flashdraft train --kind ar``), run with the target's own rotary embedding and norm;
- **embeddings:** the target's table, never stored with the drafter;
- **LM head:** rows of the target's head for a reduced *draft vocabulary* (``d2t``, as the
  DFlash drafter uses), or the whole head;
- **context features (optional, EAGLE-1, Li et al. 2024, §3):** with ``use_features`` the input
  at position ``t`` is ``fc([embed(x_t), g_{t-1}])``, where ``g`` is the target's last
  layer's output (before its final norm) scaled to unit RMS. Drafted positions have no target
  state yet and feed back the drafter's own output instead; training regresses that output
  onto the target's state so the two agree.

Checkpoints are a directory: ``config.json`` (the target's transformers config with
``num_hidden_layers = N`` and ``architectures: ["FlashdraftARDrafter"]``, plus an ``ar_drafter``
block) and ``model.safetensors`` (fp16: ``layers.*``, ``norm.weight``, ``lm_head.weight``,
``d2t``, and with features ``fc.weight``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel

ARCHITECTURE = "FlashdraftARDrafter"


def is_ar_drafter(path: str | Path) -> bool:
    """True when ``path`` is a directory holding an AR drafter checkpoint."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return ARCHITECTURE in json.loads(cfg.read_text()).get("architectures", [])
    except (OSError, ValueError):
        return False


class ARDraftModel(nn.Module):
    """``N`` causal decoder layers + final norm + (draft-vocabulary) LM head.

    Args:
        config: the target's transformers config dict (``num_hidden_layers`` = N) with
            ``ar_drafter: {"use_features": bool, "num_target_layers": int, "target": str}``.
    Shapes: hidden ``H``; draft vocabulary ``V_d`` (``d2t [V_d]`` maps draft index -> target
    id; None = the full vocabulary ``V``).
    """

    def __init__(self, config: dict):
        super().__init__()
        self.config = copy.deepcopy(config)
        cfg = {k: v for k, v in self.config.items() if k not in ("architectures", "ar_drafter", "model_type")}
        cfg["vocab_size"] = 1  # inputs come in as embeddings: the body keeps no table
        cfg["tie_word_embeddings"] = False
        cfg.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
        # the target's own architecture (llama, qwen3, ...) with N layers
        self.lcfg = AutoConfig.for_model(self.config["model_type"], **cfg)
        self.lcfg._attn_implementation = "sdpa"
        self.body = AutoModel.from_config(self.lcfg)
        del self.body.embed_tokens
        # the final norm sits outside the body: the pre-norm state is what features feed back
        self.norm = self.body.norm
        self.body.norm = nn.Identity()
        H = self.lcfg.hidden_size
        extra = self.config.setdefault("ar_drafter", {})
        self.use_features = bool(extra.get("use_features", False))
        self.fc = nn.Linear(2 * H, H, bias=False) if self.use_features else None
        n_draft = int(extra.get("draft_vocab_size") or self.config["vocab_size"])
        self.lm_head = nn.Linear(H, n_draft, bias=False)
        self.d2t: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return self.lcfg.num_hidden_layers

    @property
    def feature_layer_ids(self) -> list[int] | None:
        """Target layers the drafter reads (the last one, EAGLE), or None without features."""
        if not self.use_features:
            return None
        return [int(self.config["ar_drafter"]["num_target_layers"]) - 1]

    def set_draft_vocab(self, d2t: torch.Tensor | None) -> None:
        """Use the reduced vocabulary ``d2t [V_d]`` (target ids, sorted). Raises ValueError
        when its size differs from the head's rows."""
        if d2t is not None and d2t.numel() != self.lm_head.weight.shape[0]:
            raise ValueError(f"d2t has {d2t.numel()} ids, the head {self.lm_head.weight.shape[0]} rows")
        self.d2t = None if d2t is None else d2t.long()
        self.config["ar_drafter"]["draft_vocab_size"] = None if d2t is None else int(d2t.numel())

    @staticmethod
    def state(hidden: torch.Tensor) -> torch.Tensor:
        """``g``: a pre-norm last-layer state ``[..., H]`` (the target's or the drafter's) scaled
        to unit RMS without weights, so the target's and the drafter's are comparable."""
        h = hidden.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(hidden.dtype)

    def inputs(self, embeds: torch.Tensor, prev_state: torch.Tensor | None) -> torch.Tensor:
        """The decoder's input ``[1, T, H]`` from token embeddings ``[1, T, H]`` and, with
        features, the previous positions' states ``g_{t-1}`` ``[1, T, H]`` (:meth:`state`)."""
        if not self.use_features:
            return embeds
        return self.fc(torch.cat([embeds, prev_state.to(embeds.dtype)], dim=-1))

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache=None,
                prev_state: torch.Tensor | None = None) -> torch.Tensor:
        """Pre-norm hidden states ``[1, T, H]`` of the last drafter layer (``cache``: a
        transformers ``DynamicCache`` extended in place, or None for one causal pass)."""
        x = self.inputs(inputs_embeds, prev_state)
        out = self.body(inputs_embeds=x, position_ids=position_ids, past_key_values=cache,
                        use_cache=cache is not None)
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., V_d]`` of pre-norm hidden states ``[..., H]``."""
        return self.lm_head(self.norm(hidden).to(self.lm_head.weight.dtype))


def ar_config_for_target(target_config, num_layers: int, use_features: bool, target_name: str) -> dict:
    """The drafter config: the target's own config (its architecture) with ``num_layers``
    decoder layers.

    Raises:
        ValueError: a config without the decoder fields, or ``num_layers`` out of range.
    """
    src = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
        if key not in src:
            raise ValueError(f"the AR drafter copies a decoder-only target; its config lacks {key!r}")
    drop = ("architectures", "auto_map", "torch_dtype", "dtype", "transformers_version", "quantization_config",
            "_name_or_path", "id2label", "label2id")
    cfg = {k: v for k, v in src.items() if k not in drop and v is not None}
    if not 1 <= num_layers <= src["num_hidden_layers"]:
        raise ValueError(f"an AR drafter has 1..{src['num_hidden_layers']} layers (the target's), not {num_layers}")
    if isinstance(cfg.get("layer_types"), list):  # per-layer attention kinds: the first N
        cfg["layer_types"] = cfg["layer_types"][:num_layers]
    cfg.update(architectures=[ARCHITECTURE], num_hidden_layers=num_layers,
               ar_drafter={"use_features": use_features, "num_target_layers": src["num_hidden_layers"],
                           "target": target_name, "draft_vocab_size": None})
    return cfg


@torch.no_grad()
def ar_from_target(target_model, num_layers: int, use_features: bool = False,
                   d2t: torch.Tensor | None = None, target_name: str = "model") -> ARDraftModel:
    """A drafter that starts as the target's first ``num_layers`` layers, final norm and head
    (``self:N``); with ``use_features`` its ``fc`` starts as ``[I, 0]`` so it is the same
    function until trained.

    Args:
        target_model: a transformers decoder-only ``*ForCausalLM`` (``.model.layers``, ``.model.norm``).
        d2t: ``[V_d]`` draft vocabulary (target ids), or None for the full head.
    Raises:
        ValueError: ``num_layers`` out of range, or a config without the decoder fields.
    """
    cfg = ar_config_for_target(target_model.config, num_layers, use_features, target_name)
    if d2t is not None:
        cfg["ar_drafter"]["draft_vocab_size"] = int(d2t.numel())
    model = ARDraftModel(cfg)
    src = target_model.model
    for i, layer in enumerate(model.body.layers):
        layer.load_state_dict(src.layers[i].state_dict())
    model.norm.load_state_dict(src.norm.state_dict())
    head = target_model.get_output_embeddings().weight
    model.lm_head.weight.copy_(head if d2t is None else head[d2t])
    model.set_draft_vocab(d2t)
    if use_features:
        H = model.lcfg.hidden_size
        model.fc.weight.zero_()
        model.fc.weight[:, :H] = torch.eye(H)
    return model.to(head.dtype)


def save_ar_drafter(out_dir: str | Path, model: ARDraftModel, dtype: torch.dtype = torch.float16) -> None:
    """Write ``config.json`` + ``model.safetensors`` (floating weights as ``dtype``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        name = name.removeprefix("body.")
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    if model.d2t is not None:
        tensors["d2t"] = model.d2t.cpu().contiguous()
    cfg = dict(model.config, torch_dtype=str(dtype).removeprefix("torch."))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_ar_drafter(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> ARDraftModel:
    """Read a directory written by :func:`save_ar_drafter`.

    Raises:
        FileNotFoundError: no ``config.json`` / ``model.safetensors`` there.
        ValueError: not an AR drafter, or weights that do not match its config.
    """
    p = Path(path)
    if not (p / "config.json").is_file() or not (p / "model.safetensors").is_file():
        raise FileNotFoundError(f"{p}: an AR drafter directory holds config.json and model.safetensors")
    cfg = json.loads((p / "config.json").read_text())
    if ARCHITECTURE not in cfg.get("architectures", []):
        raise ValueError(f"{p} is not an AR drafter (architectures {cfg.get('architectures')})")
    model = ARDraftModel(cfg)
    tensors = load_file(str(p / "model.safetensors"))
    d2t = tensors.pop("d2t", None)
    state = {(f"body.{k}" if k.startswith("layers.") else k): v for k, v in tensors.items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{p}: weights do not match its config.json: {e}") from None
    model.set_draft_vocab(d2t)
    return model.to(device=device, dtype=dtype).eval()
