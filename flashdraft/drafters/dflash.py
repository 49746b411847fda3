"""``--spec-type dflash``: the block-diffusion drafter of DFlash (arXiv 2602.06036).

The drafter is a few decoder layers with the target's hidden size and *no* embedding or
LM head of its own: it embeds ``[anchor, mask, ..., mask]`` with the target's embedding,
denoises the whole block in one forward (bidirectional inside the block), and projects
with the target's LM head. Keys/values of the context come from the target's hidden
states at ``target_layer_ids``, fused by ``fc`` + ``hidden_norm`` (paper §3, reference
z-lab/dflash ``dflash/model.py``). Parameter names follow the z-lab/SpecForge checkpoint
layout so ``state_dict()`` *is* the checkpoint.
"""

from __future__ import annotations

import copy

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.device import HOST
from flashdraft.drafters.base import Draft, Drafter
from flashdraft.kv_cache import KVCacheSpec, KVStore
from flashdraft.kv_codecs import make_codec
from flashdraft.sampling import SamplingParams, filtered_probs, sample


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the drafter (paper §3.1; reference default).

    One drafter layer uses the middle layer; otherwise ids spread evenly from layer 1 to
    layer ``L-3``.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for ``positions`` (any shape ``[...]``) -> cos, sin ``[..., head_dim]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.float()[..., None] * inv_freq  # [..., hd/2]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [N, heads, T, hd]`` with ``cos/sin [N, T, hd]`` (HF "rotate_half" layout)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from [context | block]; no causal mask."""

    def __init__(self, cfg: dict):
        super().__init__()
        h, self.n_heads, self.n_kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or h // self.n_heads
        bias = bool(cfg.get("attention_bias", False))
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])
        self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)  # [N, n, T, hd]

    def kv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of ``x [N, T, H]`` -> two ``[N, n_kv, T, hd]`` (keys normed + rotated)."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv)), cos, sin)
        return k, self._heads(self.v_proj(x), self.n_kv)

    def forward(self, x, cos, sin, ctx_k, ctx_v, attn_mask=None) -> torch.Tensor:
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        k = torch.cat([ctx_k, k_blk], dim=2)
        v = torch.cat([ctx_v, v_blk], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


    def forward_blocks(self, x, cos, sin, ctx_k, ctx_v, anchors) -> torch.Tensor:
        """Many independent blocks of one sequence against its context, without a dense mask.

        Args:
            x: ``[K, B, H]`` K blocks of B rows.
            cos / sin: ``[K, B, hd]`` RoPE tables at the blocks' positions.
            ctx_k / ctx_v: ``[1, n_kv, T, hd]`` context keys/values of the whole sequence.
            anchors: ``[K]`` block j sees context positions ``< anchors[j]`` and its own rows.
        Returns ``[K, B, H]``. Same result as :meth:`forward` with
        :func:`flashdraft.train.objective.block_attention_mask`, but the block-to-block part
        costs ``K*B*B`` scores instead of ``(K*B)**2`` (paper §4.2 packs blocks the same way).
        """
        K, B, _ = x.shape
        nkv, g, hd = self.n_kv, self.n_heads // self.n_kv, self.head_dim
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), cos, sin)  # [K, nh, B, hd]
        k_blk, v_blk = self.kv(x, cos, sin)  # [K, nkv, B, hd]
        # attention arithmetic in float32: CPU bf16 batched matmuls of these shapes are slow
        dtype = q.dtype
        q = q.float().view(K, nkv, g, B, hd) * hd ** -0.5
        ctx_k, ctx_v, k_blk, v_blk = ctx_k.float(), ctx_v.float(), k_blk.float(), v_blk.float()
        T = ctx_k.shape[2]
        s_ctx = torch.einsum("kngbd,ntd->kngbt", q, ctx_k[0])  # [K, nkv, g, B, T]
        hidden_ctx = torch.arange(T, device=x.device)[None] >= anchors[:, None]  # [K, T]
        s_ctx = s_ctx.masked_fill(hidden_ctx[:, None, None, None], float("-inf"))
        s_own = torch.einsum("kngbd,kncd->kngbc", q, k_blk)  # [K, nkv, g, B, B]
        p = torch.softmax(torch.cat([s_ctx, s_own], dim=-1), dim=-1)
        out = (torch.einsum("kngbt,ntd->kngbd", p[..., :T], ctx_v[0])
               + torch.einsum("kngbc,kncd->kngbd", p[..., T:], v_blk))  # [K, nkv, g, B, hd]
        out = out.reshape(K, self.n_heads, B, hd).transpose(1, 2).reshape(K, B, -1)
        return self.o_proj(out.to(dtype))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    """One drafter layer; with ``dflash2`` (``(conv_kernel_size, conv_group_size)``) its
    attention and MLP are wrapped in :class:`~flashdraft.drafters.selector.DynamicCausalConv`
    (before: side 0, after: side 1, both reading coefficients of the sublayer's input)."""

    def __init__(self, cfg: dict, dflash2: tuple[int, int] | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = DFlashMLP(cfg)
        self.attention_conv = self.mlp_conv = None
        if dflash2 is not None:
            from flashdraft.drafters.selector import DynamicCausalConv

            self.attention_conv = DynamicCausalConv(cfg["hidden_size"], *dflash2)
            self.mlp_conv = DynamicCausalConv(cfg["hidden_size"], *dflash2)

    @staticmethod
    def _wrapped(conv, sublayer, h):
        """``sublayer(h)``, between the two sides of ``conv`` when the layer has one."""
        if conv is None:
            return sublayer(h)
        dyn = conv.coefficients(h)
        return conv.apply(sublayer(conv.apply(h, dyn, 0)), dyn, 1)

    def forward(self, x, cos, sin, ctx_k, ctx_v, attn_mask=None):
        attn = lambda h: self.self_attn(h, cos, sin, ctx_k, ctx_v, attn_mask)  # noqa: E731
        x = x + self._wrapped(self.attention_conv, attn, self.input_layernorm(x))
        return x + self._wrapped(self.mlp_conv, self.mlp, self.post_attention_layernorm(x))

    def forward_blocks(self, x, cos, sin, ctx_k, ctx_v, anchors):
        attn = lambda h: self.self_attn.forward_blocks(h, cos, sin, ctx_k, ctx_v, anchors)  # noqa: E731
        x = x + self._wrapped(self.attention_conv, attn, self.input_layernorm(x))
        return x + self._wrapped(self.mlp_conv, self.mlp, self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """The drafter network; ``state_dict()`` uses z-lab/SpecForge weight names.

    Args:
        config: the checkpoint's ``config.json`` dict (DESIGN.md §2).
    Raises:
        KeyError: a required config key is missing.
    """

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        dcfg = config.get("dflash_config", {})
        self.block_size = int(config.get("block_size", dcfg.get("block_size", 16)))
        self.mask_token_id = int(dcfg.get("mask_token_id", config.get("mask_token_id")))
        #: n-gram-seeded blocks (a flashdraft extension, off in z-lab/SpecForge drafters): the
        #: mask positions of a block start as the prompt-lookup continuation of the anchor
        #: where one exists (:func:`seed_block`), so the drafter refines candidates
        self.ngram_seeded = bool(dcfg.get("ngram_seeded", False))
        self.target_layer_ids = list(dcfg.get("target_layer_ids") or build_target_layer_ids(
            config["num_target_layers"], config["num_hidden_layers"]))
        rope = config.get("rope_parameters") or {}
        self.rope_theta = float(config.get("rope_theta") or rope.get("rope_theta", 10000.0))
        h = config["hidden_size"]
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config["rms_norm_eps"])
        #: DFlash2 (``dflash_config.selector_top_k`` > 0): convolutions in every layer and a
        #: candidate selector picking the path (:mod:`flashdraft.drafters.selector`)
        self.candidate_selector = None
        top_k = int(dcfg.get("selector_top_k") or 0)
        conv = (int(dcfg.get("conv_kernel_size") or 2), int(dcfg.get("conv_group_size") or 16)) if top_k else None
        self.layers = nn.ModuleList(DFlashLayer(config, conv) for _ in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(h, config["rms_norm_eps"])
        if top_k:
            from flashdraft.drafters.selector import CandidateSelector

            self.candidate_selector = CandidateSelector(h, int(config["vocab_size"]), int(dcfg["selector_rank"]), top_k)
        self.head_dim = self.layers[0].self_attn.head_dim
        #: optional reduced draft vocabulary: draft index -> target token id ``[V_d]``
        self.register_buffer("d2t", None)  # a None buffer is left out of state_dict()

    def set_draft_vocab(self, d2t: torch.Tensor | None) -> None:
        """Restrict drafting to the target ids in ``d2t`` (saved as the ``d2t`` tensor)."""
        self.d2t = None if d2t is None else d2t.to(torch.long).clone()

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Context features ``[..., k*H]`` -> fused ``[..., H]`` (fc + RMSNorm)."""
        return self.hidden_norm(self.fc(features))

    def pick(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """Greedy draft indices ``[N, n]`` (draft vocabulary) of blocks whose positions 1..n
        have states ``hidden [N, n, H]`` and logits ``[N, n, V_d]``; ``anchor_ids [N]`` are
        the blocks' anchors (target ids). DFlash: the argmax per position; DFlash2: the
        selector's path (:meth:`CandidateSelector.walk`)."""
        if self.candidate_selector is None:
            return logits.argmax(-1)
        return self.candidate_selector.walk(hidden, logits, anchor_ids, self.d2t)[0]

    def rope(self, positions: torch.Tensor):
        return rope_cos_sin(positions, self.head_dim, self.rope_theta)

    def context_kv(self, fused: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V of fused features ``[N, T, H]`` at ``positions [N, T]``."""
        cos, sin = self.rope(positions)
        return [layer.self_attn.kv(fused, cos, sin) for layer in self.layers]

    def forward(self, noise_embedding: torch.Tensor, positions: torch.Tensor,
                ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Denoise blocks.

        Args:
            noise_embedding: ``[N, Lq, H]`` target embeddings of [anchor, mask, ...] blocks.
            positions: ``[N, Lq]`` absolute positions of those tokens.
            ctx_kv: per layer ``(k, v)`` each ``[N, n_kv, Lc, hd]``.
            attn_mask: ``[N or 1, 1, Lq, Lc + Lq]`` bool (True = may attend), or None for
                "everything visible" (inference: one block, all of its context).
        Returns:
            ``[N, Lq, H]`` final-normed hidden states (feed to the target's LM head).
        """
        cos, sin = self.rope(positions)
        x = noise_embedding
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, attn_mask)
        return self.norm(x)


    def forward_blocks(self, noise_embedding: torch.Tensor, anchors: torch.Tensor,
                       ctx_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Denoise K blocks of one sequence at once (training and the offline walk).

        Args:
            noise_embedding: ``[K, B, H]`` target embeddings of each [anchor, mask, ...] block.
            anchors: ``[K]`` anchor positions; block j sits at positions ``anchors[j] + 0..B-1``
                and sees the context strictly before its anchor, never another block.
            ctx_kv: per layer ``(k, v)`` each ``[1, n_kv, T, hd]`` (:meth:`context_kv` of the
                whole sequence).
        Returns:
            ``[K, B, H]`` final-normed hidden states.
        """
        B = noise_embedding.shape[1]
        cos, sin = self.rope(anchors[:, None] + torch.arange(B, device=anchors.device)[None])  # [K, B, hd]
        x = noise_embedding
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer.forward_blocks(x, cos, sin, k, v, anchors)
        return self.norm(x)


def seed_block(block: torch.Tensor, candidate: list[int]) -> torch.Tensor:
    """Write a prompt-lookup ``candidate`` into the mask positions of ``block [n+1]`` (in place).

    Position 0 (the anchor) is kept; positions 1.. take the candidate's tokens, the rest stay
    mask tokens. The candidate must come from tokens up to the anchor only
    (:func:`flashdraft.drafters.ngram.lookup_candidates`), at training and inference alike.
    """
    m = min(len(candidate), block.shape[0] - 1)
    if m:
        block[1:1 + m] = torch.tensor(candidate[:m], dtype=block.dtype, device=block.device)
    return block


def drafter_config_for_target(target_config, num_layers: int = 1, block_size: int = 16,
                              mask_token_id: int = 0, target_layer_ids: list[int] | None = None) -> dict:
    """A SpecForge-style ``config.json`` dict for a drafter of ``target_config``'s shape."""
    tc = target_config
    n_target = int(tc.num_hidden_layers)
    rope = getattr(tc, "rope_parameters", None) or {}
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": int(tc.hidden_size),
        "intermediate_size": int(tc.intermediate_size),
        "num_attention_heads": int(tc.num_attention_heads),
        "num_key_value_heads": int(tc.num_key_value_heads),
        "head_dim": int(getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads),
        "rms_norm_eps": float(tc.rms_norm_eps),
        "rope_theta": float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))),
        "max_position_embeddings": int(getattr(tc, "max_position_embeddings", 8192)),
        "vocab_size": int(tc.vocab_size),
        "num_hidden_layers": num_layers,
        "num_target_layers": n_target,
        "block_size": block_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "dflash_config": {"mask_token_id": int(mask_token_id),
                          "target_layer_ids": target_layer_ids or build_target_layer_ids(n_target, num_layers)},
    }


def init_from_target(drafter: DFlashDraftModel, target_model, layer_ids: list[int] | None = None) -> None:
    """Initialise drafter layer i from target layer ``layer_ids[i]``, final norm from the target's.

    Attention/MLP/norm weights are copied where shapes match (q/k norms stay 1 where the
    target has none); the final norm is the target's, so the shared LM head sees inputs on
    its usual scale. ``layer_ids`` defaults to the target's last layers. Norms are copied as
    their effective gain (:func:`norm_gain`: Gemma stores ``1 + w`` as ``w``).
    """
    layers = target_model.get_decoder().layers
    if layer_ids is None:
        layer_ids = list(range(len(layers) - len(drafter.layers), len(layers)))
    with torch.no_grad():
        for layer, src_id in zip(drafter.layers, layer_ids):
            copy_target_layer(layer, layers[src_id])
        drafter.norm.weight.copy_(norm_gain(target_model.get_decoder().norm))


def norm_gain(norm: nn.Module) -> torch.Tensor:
    """The per-channel gain ``g`` of an RMS norm module (``norm(x) = g * x / rms(x)``): its
    ``weight``, or ``1 + weight`` for norms that store the offset (Gemma), told apart by
    normalising a vector of ones."""
    w = norm.weight.detach().float()
    with torch.no_grad():
        out = norm(torch.ones(1, w.shape[0], dtype=norm.weight.dtype, device=w.device)).float()[0]
    return (1 + w) if (out - (1 + w)).abs().max() < (out - w).abs().max() else w


def copy_target_layer(layer: nn.Module, target_layer: nn.Module) -> None:
    """Copy a target decoder layer's weights into a drafter layer where names and shapes
    match (q/k norms the target lacks stay as they are). Norms go in as their gain
    (:func:`norm_gain`); a sandwich-norm layer (Gemma) gives its pre-MLP norm
    (``pre_feedforward_layernorm``), not the norm on the attention output, to the drafter's
    ``post_attention_layernorm``, which sits before the MLP."""
    own = dict(layer.named_parameters())
    modules = dict(target_layer.named_modules())
    rename = {"post_attention_layernorm": "pre_feedforward_layernorm"} if "pre_feedforward_layernorm" in modules else {}
    with torch.no_grad():
        for name, p in own.items():
            src = name.rsplit(".", 1)[0] if name.endswith(".weight") else None
            if src is not None and isinstance(dict(layer.named_modules())[src], RMSNorm):
                src_mod = modules.get(rename.get(src, src))
                if src_mod is not None and getattr(src_mod, "weight", None) is not None \
                        and src_mod.weight.shape == p.shape:
                    p.copy_(norm_gain(src_mod))
                continue
            q = dict(target_layer.named_parameters()).get(name)
            if q is not None and q.shape == p.shape:
                p.copy_(q)


class ContextKVCache:
    """Per-layer context K/V of the drafter, preallocated; rollback moves ``length``.

    Plain (``kv`` None or f32): each layer holds k, v ``[n_kv, capacity, hd]``. Compressed
    (``--cache-type-k-draft`` / ``-v-draft``): two :class:`~flashdraft.kv_cache.KVStore`; a
    window is decoded (rotation undone) on read, its first ``sink_tokens`` and last
    ``tail_tokens`` positions exact. The drafter's numbers never change what is returned
    (the target verifies), so its tail is simply the last positions of the window.
    """

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, capacity: int = 1024,
                 dtype: torch.dtype = torch.float32, kv: KVCacheSpec | None = None,
                 device: torch.device | str = "cpu"):
        self.length = 0
        self.dtype = dtype
        self.stores = None
        device = torch.device(device)
        if kv is not None and not kv.plain:
            if device.type != "cpu":
                raise ValueError(f"compressed drafter cache types ({kv.label()}) run on the CPU only; use "
                                 f"-ctkd/-ctvd f32 on {device}, or --device cpu")
            args = (n_layers, n_kv, capacity, dtype, kv.sink_tokens, kv.tail_tokens)
            self.stores = (KVStore(make_codec(kv.type_k, head_dim, dtype), *args),
                           KVStore(make_codec(kv.type_v, head_dim, dtype), *args))
            return
        self.k = [torch.zeros(n_kv, capacity, head_dim, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(n_kv, capacity, head_dim, dtype=dtype, device=device) for _ in range(n_layers)]

    def _grow(self, need: int) -> None:
        cap = self.k[0].shape[1]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)
        for store in (self.k, self.v):
            for i, t in enumerate(store):
                grown = t.new_zeros(t.shape[0], new_cap, t.shape[2])
                grown[:, :cap] = t
                store[i] = grown

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write per-layer ``(k, v)`` of shape ``[1, n_kv, m, hd]`` at ``length``."""
        m = kv[0][0].shape[2]
        if self.stores is not None:
            for i, (k, v) in enumerate(kv):
                self.stores[0].write(i, self.length, k[0])
                self.stores[1].write(i, self.length, v[0])
            self.length += m
            return
        self._grow(self.length + m)
        for i, (k, v) in enumerate(kv):
            self.k[i][:, self.length:self.length + m] = k[0]
            self.v[i][:, self.length:self.length + m] = v[0]
        self.length += m

    def window(self, i: int, max_ctx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's valid K/V (the last ``max_ctx`` positions if set) as ``[1, n_kv, T, hd]``."""
        start = 0 if max_ctx is None else max(0, self.length - max_ctx)
        if self.stores is not None:
            return tuple(self._decoded(s, i, start)[None] for s in self.stores)
        return self.k[i][None, :, start:self.length], self.v[i][None, :, start:self.length]

    def _decoded(self, store: KVStore, i: int, start: int) -> torch.Tensor:
        """Positions ``start .. length-1`` of one store, decoded to the model's domain."""
        x = store.read(i, self.length, torch.float32)
        if store.tail:
            lo = max(self.length - store.tail, 0)
            x[:, lo:] = store.recent(i, lo, self.length)
        return store.restore(i, x[:, start:]).to(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        if self.stores is not None:
            return sum(s.bytes_per_token for s in self.stores)
        return 2 * len(self.k) * self.k[0].shape[0] * self.k[0].shape[2] * self.k[0].element_size()


def confident_prefix(p: torch.Tensor, p_min: float) -> int:
    """Length of the leading run of ``p [n]`` (the drafter's probability of each drafted token)
    at or above ``p_min``: where a confidence-gated block is cut."""
    low = (p < p_min).nonzero()
    return int(low[0, 0]) if low.numel() else p.shape[0]


def draft_head_rows(head_weight: torch.Tensor, model: DFlashDraftModel) -> torch.Tensor:
    """The rows ``[V_d, H]`` of the target's LM head ``head_weight [V, H]`` that ``model``
    drafts over (all of them without a reduced draft vocabulary), in the drafter's dtype: bf16
    where it pays, since the head is most of a full-vocabulary draft's cost."""
    head = head_weight if model.d2t is None else head_weight[model.d2t]
    return head.to(model.fc.weight.dtype).contiguous()


class DFlashDrafter(Drafter):
    """Runs a :class:`DFlashDraftModel` against a target.

    Args:
        model: the drafter network.
        embed_tokens: the target's input embedding module (shared, frozen).
        lm_head: the target's LM head (shared, frozen).
        cross_ctx: attend to at most this many most recent context positions
            (``--spec-dflash-cross-ctx``; None = all).
        kv: the context cache's K/V types (``--cache-type-k-draft`` / ``-v-draft``); None = plain.
        p_min: confidence gate (``--spec-draft-p-min``): the block is cut before the first
            position where the drafter's own probability of its token is below ``p_min``
            (llama.cpp's ``p_min``, which its MTP drafting gates on the same way, PR #27836);
            0 = never cut. Only how many drafts are verified changes, never which tokens are
            returned.
    The drafter runs on the device of ``model``'s weights, which must be the target's
    (context features, the shared embedding and LM head are there).

    Raises:
        ValueError: drafter and target hidden sizes differ, or drafter and target weights
            are on different devices.
    """

    name = "dflash"

    def __init__(self, model: DFlashDraftModel, embed_tokens: nn.Module, lm_head: nn.Module,
                 cross_ctx: int | None = None, kv: KVCacheSpec | None = None, p_min: float = 0.0):
        if not 0.0 <= p_min <= 1.0:
            raise ValueError(f"p_min must be in [0, 1], got {p_min}")
        self.p_min = p_min
        if embed_tokens.weight.shape[1] != model.config["hidden_size"]:
            raise ValueError(f"drafter hidden size {model.config['hidden_size']} != target's "
                             f"{embed_tokens.weight.shape[1]}: this drafter was made for another model")
        self.device = model.fc.weight.device
        if embed_tokens.weight.device != self.device:
            raise ValueError(f"drafter weights on {self.device}, target's on {embed_tokens.weight.device}: "
                             "move the drafter to the target's device")
        self.model = model.eval().requires_grad_(False)
        self.embed_tokens, self.lm_head = embed_tokens, lm_head
        self.d2t = model.d2t
        self.head_weight = draft_head_rows(lm_head.weight, model)
        self.vocab_size = lm_head.weight.shape[0]
        self.feature_layer_ids = model.target_layer_ids
        self.max_draft = model.block_size - 1
        self.cross_ctx = cross_ctx
        self.kv = kv
        attn = model.layers[0].self_attn
        self._cache_shape = (len(model.layers), attn.n_kv, attn.head_dim)
        self.reset()

    def reset(self) -> None:
        self.cache = ContextKVCache(*self._cache_shape, dtype=self.model.fc.weight.dtype, kv=self.kv, device=self.device)

    def save_context(self) -> object:
        return copy.deepcopy(self.cache)

    def load_context(self, state: object) -> None:
        self.cache = state

    def rewind(self, n_context: int) -> int:
        # the context cache holds K/V of positions 0..length-1: keeping a prefix is a length move
        self.cache.length = min(self.cache.length, n_context)
        return self.cache.length

    @torch.inference_mode()
    def commit(self, n_context: int, features: torch.Tensor | None) -> None:
        if features is None:
            raise ValueError("the dflash drafter needs target context features")
        # rejected positions were never written: rolling back is only moving the length
        self.cache.length = min(self.cache.length, n_context - features.shape[0])
        if self.cache.length != n_context - features.shape[0]:
            raise RuntimeError("context features are not contiguous with the drafter cache")
        dtype = self.model.fc.weight.dtype
        fused = self.model.fuse(features.to(dtype)[None])  # [1, m, H]
        positions = torch.arange(self.cache.length, n_context, device=self.device)[None]
        self.cache.append(self.model.context_kv(fused, positions))

    @torch.inference_mode()
    def propose(self, tokens: torch.Tensor, n: int, params: SamplingParams,
                generator: torch.Generator, constraint=None) -> Draft:
        n = min(n, self.max_draft)
        if n <= 0:
            return Draft.empty()
        anchor_pos = tokens.shape[0] - 1
        # 1. block = [anchor, mask x n], embedded with the target's table
        # built on the host (prompt lookup seeds it from host ids), then one copy of n+1 ids
        block = torch.full((n + 1,), self.model.mask_token_id, dtype=torch.long, device=HOST)
        block[0] = tokens[-1]
        if self.model.ngram_seeded:  # start the mask positions from the prompt-lookup continuation
            from flashdraft.drafters.ngram import NgramDrafter

            # one anchor: the right-to-left scan stops at the first match (no per-step index build)
            seed_block(block, NgramDrafter().propose(tokens, n, params, generator).tokens.tolist())
        x = self.embed_tokens(block.to(self.device))[None].to(self.model.fc.weight.dtype)  # [1, n+1, H]
        positions = torch.arange(anchor_pos, anchor_pos + n + 1, device=self.device)[None]
        # 2. one bidirectional forward over [context | block]; block K/V are not kept
        ctx = [self.cache.window(i, self.cross_ctx) for i in range(len(self.model.layers))]
        hidden = self.model(x, positions, ctx)[0, 1:]  # [n, H]
        logits = (hidden.to(self.head_weight.dtype) @ self.head_weight.t()).float()  # [n, V_d]
        if constraint is not None:
            return self._constrained(logits, params, generator, constraint)
        if self.model.candidate_selector is not None:
            return self._selected(hidden, logits, block[0:1].to(self.device), params, generator)
        # 3. draft tokens: argmax at T=0, samples from q (same filters as the target) at T>0
        #    (the draft ids go to the host: the verify input and the stop rules are built there)
        if params.greedy:
            idx = torch.argmax(logits, dim=-1)
            # the drafter's probability of each argmax, under its own softmax
            conf = torch.softmax(logits, -1).gather(1, idx[:, None])[:, 0]
            if self.p_min > 0:
                idx = idx[: confident_prefix(conf, self.p_min)]
            return Draft((idx if self.d2t is None else self.d2t[idx]).to(HOST), confidence=conf[: idx.shape[0]].tolist())
        q = filtered_probs(logits, params)
        idx = sample(q, generator)
        conf = q.gather(1, idx[:, None])[:, 0]
        if self.p_min > 0:
            keep = confident_prefix(conf, self.p_min)
            idx, q = idx[:keep], q[:keep]
        conf = conf[: idx.shape[0]].tolist()
        if self.d2t is None:
            return Draft(idx.to(HOST), q, conf)
        full = q.new_zeros(q.shape[0], self.vocab_size).index_copy_(1, self.d2t, q)  # q over target ids
        return Draft(self.d2t[idx].to(HOST), full, conf)


    def _selected(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor,
                  params: SamplingParams, generator: torch.Generator) -> Draft:
        """Step 3 of a DFlash2 drafter: the selector's path through the top-k candidates
        (argmax of the scores at T = 0, a sample of softmax(scores / T) at T > 0, whose row,
        zero outside the candidates, is the q that verify reads). The gate cuts where the
        softmax of the scores at the chosen candidate falls below ``p_min``, as llama.cpp's
        DFlash2 walk does."""
        temperature = 0.0 if params.greedy else params.temperature
        idx, q, cand, scores = self.model.candidate_selector.walk(hidden[None], logits[None], anchor, self.d2t,
                                                        temperature, generator)
        idx, cand, scores = idx[0], cand[0], scores[0]  # [n], [n, k], [n, k]
        n = idx.shape[0]
        if self.p_min > 0:
            picked = (cand == idx[:, None]).float().argmax(-1)
            n = confident_prefix(torch.softmax(scores, -1).gather(1, picked[:, None])[:, 0], self.p_min)
        tokens = (idx if self.d2t is None else self.d2t[idx])[:n]
        if q is None:
            return Draft(tokens.to(HOST))
        cand_ids = cand[:n] if self.d2t is None else self.d2t[cand[:n]]
        full = q.new_zeros(n, self.vocab_size).scatter_(1, cand_ids, q[0, :n])  # q over target ids
        return Draft(tokens.to(HOST), full)

    def _constrained(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                     constraint) -> Draft:
        """Step 3 under a grammar: position by position, the argmax (or a sample of q) among
        the tokens the grammar allows after the drafts chosen so far; the draft ends where
        the grammar allows none of the drafter's vocabulary. Each q is renormalised over the
        allowed tokens, so verification reads the distribution the token was drawn from."""
        tokens, rows, pushed = [], [], 0
        try:
            for i in range(logits.shape[0]):
                allowed = constraint.here().to(logits.device)  # the grammar's mask is made on the host
                if self.d2t is not None:
                    allowed = allowed[self.d2t]
                if not allowed.any():
                    break
                row = logits[i].masked_fill(~allowed, float("-inf"))
                if params.greedy:
                    idx = int(torch.argmax(row))
                else:
                    q = filtered_probs(row[None], params)[0]
                    idx = int(sample(q[None], generator)[0])
                    rows.append(q)
                token = idx if self.d2t is None else int(self.d2t[idx])
                if token in constraint.eos:  # allowed, so the grammar is complete: the draft ends here
                    tokens.append(token)
                    break
                if not constraint.push(token):
                    break
                pushed += 1
                tokens.append(token)
        finally:
            constraint.rollback(pushed)
        ids = torch.tensor(tokens, dtype=torch.long, device=HOST)
        if params.greedy or not tokens:
            return Draft(ids)
        q = torch.stack(rows[: len(tokens)])
        if self.d2t is not None:
            q = q.new_zeros(len(tokens), self.vocab_size).index_copy_(1, self.d2t, q)
        return Draft(ids, q)


def load_dflash_model(path: str | Path, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> DFlashDraftModel:
    """Load a drafter from a SpecForge directory or a ``dflash-draft``/``dflash`` GGUF,
    with ``dtype`` weights on ``device``.

    Raises:
        FileNotFoundError / ValueError: see ``flashdraft.drafters.dflash_format``.
    """
    from flashdraft.drafters.dflash_format import load_dflash_checkpoint

    config, state = load_dflash_checkpoint(path)
    model = DFlashDraftModel(config)
    if "d2t" in state:
        model.set_draft_vocab(state["d2t"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith(("q_norm.weight", "k_norm.weight"))]
    if missing or unexpected:
        raise ValueError(f"drafter checkpoint {path}: missing {missing}, unexpected {unexpected}")
    return model.to(device=device, dtype=dtype)


def random_dflash_model(target_model, num_layers: int = 1, block_size: int = 16,
                        mask_token_id: int = 0, seed: int = 0) -> DFlashDraftModel:
    """A randomly initialised drafter of the right shape (tests and plumbing only)."""
    torch.manual_seed(seed)
    model = DFlashDraftModel(drafter_config_for_target(target_model.config, num_layers, block_size, mask_token_id))
    return model
