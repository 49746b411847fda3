"""A lean forward of llama-family / qwen3 targets over a :class:`StaticKVCache`.

The transformers forward (the reference path, kept in :mod:`flashdraft.targets.torch`) spends
most of a 1-token decode step on this CPU in Python and per-step setup: building the
attention mask, DynamicCache updates (``torch.cat`` per layer), hooks, output objects.
This module runs the same math directly on the transformers model's own weight tensors
(nothing copied for float32 weights; bf16 weights are prepacked once for oneDNN): per layer RMSNorm -> q/k/v projections (-> qwen3 q_norm/k_norm) -> RoPE
from a precomputed table -> K/V written into the static cache by position -> attention ->
o_proj -> RMSNorm -> SiLU MLP; hidden states are kept only at the requested layers and the
LM head runs only on the rows that need logits.

Numerics follow transformers' modeling_llama / modeling_qwen3 (RMSNorm in float32, RoPE
in "rotate_half" layout, softmax in float32); tests/test_fast_forward.py checks the two
paths agree at float32 tolerance.

Supported: ``model_type`` in :data:`SUPPORTED_MODEL_TYPES`, SiLU MLP, no sliding window,
RoPE types whose tables do not depend on the sequence length (:data:`SUPPORTED_ROPE_TYPES`).
:func:`unsupported_reason` says why a model is not; the caller then keeps transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import logging

from flashdraft.cache import StaticKVCache
from flashdraft.kv_cache import KVCacheSpec, QuantizedKVCache
from flashdraft.quant import Int4Linear, Int8Linear, Q4Weight

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral")
#: RoPE types with a fixed inverse-frequency vector; "dynamic"/"longrope" rescale per length
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def unsupported_reason(model) -> str | None:
    """None when :class:`LeanForward` can run ``model``, else a short reason."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {cfg.model_type!r} (lean path supports {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if getattr(cfg, "use_sliding_window", False) or (
            cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None)):
        return "sliding-window attention"
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return "non-full attention layers"
    decoder = model.get_decoder()
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return "no rotary_emb.inv_freq on the decoder"
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        return f"rope_type {rope_type!r}"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if 2 * rotary.inv_freq.numel() != head_dim:
        return "partial rotary embedding"
    if model.get_output_embeddings() is None:
        return "no LM head"
    return None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: statistics in float32, weight applied in the input dtype.

    float32 input goes through the fused ``F.rms_norm`` (same values here, fewer ops).
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


#: q4: blocks of more rows (a prefill) run on the float32 weights instead: the int4 kernel's
#: cost grows ~linearly with the rows on an AVX2 CPU, float32 gemm's does not (a 98-token
#: prefill took 1.0 s on the kernel, 0.47 s in float32). Losslessness needs only verify
#: blocks (at most n_draft + 1 rows, so --spec-draft-n-max < 32 under q4) to match one-token
#: steps, and both the baseline and speculative decoding prefill the same way.
QUANT_MAX_ROWS = 32


class _Projections:
    """Several linear projections of the same input, ``x [T, K] -> tuple of [T, N_j]``.

    Unpacked: ``F.linear`` on the modules' own weights (read at every call, so nothing is
    copied and a later ``model.to(...)`` is seen). Packed: the weights concatenated into
    one matrix and reordered once into oneDNN's blocked layout (a copy), then one
    ``mkldnn._linear_pointwise`` call per group. Measured here (docs/performance.md), bf16
    matrix-vector products run ~1.5x faster packed than through ``F.linear``; fp32 gains
    nothing, so fp32 stays unpacked.

    Quantised (``--weights q4``): ``q4`` maps ``id(module)`` to its GGUF 4-bit codes
    (:class:`flashdraft.quant.Q4Weight`); when every module of the group has them, the
    group runs on one :class:`~flashdraft.quant.Int4Linear`. ``int8`` puts the group on
    :class:`~flashdraft.quant.Int8Linear` instead (the LM head). Blocks of more than
    :data:`QUANT_MAX_ROWS` rows use the float32 weights.
    """

    def __init__(self, modules: list, pack: bool, q4: dict | None = None, int8: bool = False):
        self.modules = modules
        self.sizes = [int(m.weight.shape[0]) for m in modules]
        self.packed = self.bias = self.kernel = None
        no_bias = all(m.bias is None for m in modules)
        if q4 and no_bias and all(id(m) in q4 for m in modules):
            # the GGUF's own 4-bit codes (flashdraft.quant): one int4 kernel call per group
            self.kernel = Int4Linear(Q4Weight.cat([q4[id(m)] for m in modules]))
        elif int8 and no_bias:  # q4's LM head (flashdraft.quant.Int8Linear)
            self.kernel = Int8Linear(torch.cat([m.weight.detach() for m in modules]))
        elif pack:
            w = torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1 else modules[0].weight.detach()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            if any(m.bias is not None for m in modules):
                self.bias = torch.cat([m.bias.detach() if m.bias is not None else w.new_zeros(n)
                                       for m, n in zip(modules, self.sizes)])

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.kernel is not None and x.shape[0] <= QUANT_MAX_ROWS:
            y = self.kernel(x)
            return y.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (y,)
        if self.packed is None:
            return tuple(F.linear(x, m.weight, m.bias) for m in self.modules)
        if x.shape[0] == 1:
            # oneDNN runs a single row through a different kernel that (for K > 1024 here)
            # sums in another order than any multi-row call; with bf16 outputs that flips
            # roundings, so a 1-token step would not reproduce the rows of a verify block
            # and greedy speculative output could drift from the baseline. Two identical
            # rows cost the same memory traffic and take the multi-row kernel.
            y = torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), self.packed, self.bias,
                                                   "none", [], "")[:1]
        else:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (y,)


def can_pack(dtype: torch.dtype) -> bool:
    """True when oneDNN can run prepacked linears of ``dtype`` here (bf16 needs AVX512-BF16/AMX)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, hd]`` by ``cos/sin_signed [T, 1, hd]`` (HF "rotate_half" layout).

    ``rotate_half(x) * sin == roll(x, hd/2) * sin_signed`` with the first half of
    ``sin_signed`` negated: three ops instead of five.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


class LeanForward:
    """The target's forward without transformers' per-step machinery.

    Args:
        model: a transformers ``*ForCausalLM`` for which :func:`unsupported_reason` is None.
        pack: prepack the projection and LM-head weights for oneDNN (a second copy of the
            weights in a blocked layout; q/k/v and gate/up fused). None = only for bf16
            weights on the CPU, where it pays (docs/performance.md). oneDNN packing is
            CPU-only: on another device the portable ``F.linear`` path runs (logged). Unpacked, the forward reads the
            model's modules at every call (nothing copied; a later ``model.to(...)`` is seen);
            packed, it is a snapshot: build a new LeanForward after changing the weights.
        attn_dtype: dtype of the attention arithmetic; None = float32 for float32 weights,
            float64 otherwise (what keeps bf16 speculative decoding token-identical to the
            bf16 baseline; float32 is faster but only nearly identical); float32 on MPS,
            which has no float64.
        q4: ``{module name: Q4Weight}`` from :func:`flashdraft.quant.read_q4`: those
            projections run on the int4 kernel (``--weights q4``, CPU only); the others as above.
    Raises:
        ValueError: the model is not supported (with the reason), or ``q4`` with weights
            that are not on the CPU.
    """

    def __init__(self, model, pack: bool | None = None, attn_dtype: torch.dtype | None = None,
                 q4: dict | None = None):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"lean forward does not support this model: {reason}")
        cfg = model.config
        decoder = model.get_decoder()
        self.config = cfg
        self.embed = model.get_input_embeddings()
        self.final_norm = decoder.norm
        self.layers = list(decoder.layers)
        self.n_layers = len(self.layers)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.group = self.n_heads // self.n_kv_heads
        self.scale = self.head_dim ** -0.5
        self.eps = float(cfg.rms_norm_eps)
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        dtype = self.embed.weight.dtype
        #: every cache, table and mask of this forward is made here (the weights' device)
        self.device = self.embed.weight.device
        on_cpu = self.device.type == "cpu"
        if q4 and not on_cpu:
            raise ValueError(f"--weights q4: the int4 kernels are CPU-only; the weights are on {self.device}")
        self.pack = (dtype == torch.bfloat16) if pack is None else bool(pack)
        if self.pack and not on_cpu:  # oneDNN's prepacked linears run on the CPU only
            log.info("lean forward on %s: oneDNN weight prepacking is CPU-only, portable F.linear path", self.device)
        self.pack = self.pack and on_cpu and can_pack(dtype)
        # K/V are stored in the weights' dtype (with bf16 weights they are bf16 values
        # anyway). Attention runs in float32, or in float64 for bf16 weights: float32 sums a
        # verify block in another order than a 1-token step, and that ~1e-7 noise flips bf16
        # roundings downstream (greedy speculative output drifted from the baseline on a
        # real prompt); in float64 (where q.k of bf16 vectors is even exact) it practically
        # never does. Costs ~2x attention time; docs/performance.md has the numbers.
        # q4 too: its kernels round their inputs to bf16, which would turn the same ~1e-7
        # float32 noise into different rows of a verify block and a one-token step
        exact = torch.float32 if self.device.type == "mps" else torch.float64  # MPS has no float64
        self.attn_dtype = attn_dtype or (torch.float32 if dtype == torch.float32 and not q4 else exact)
        self.q4 = bool(q4)
        q4 = {id(m): q4[name] for name, m in model.named_modules() if name in q4} if q4 else None
        # per layer: (q, k, v) projections, o_proj, (gate, up), down
        self.proj = [(_Projections([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj], self.pack, q4),
                      _Projections([l.self_attn.o_proj], self.pack, q4),
                      _Projections([l.mlp.gate_proj, l.mlp.up_proj], self.pack, q4),
                      _Projections([l.mlp.down_proj], self.pack, q4)) for l in self.layers]
        # q4: the LM head on the int8 kernel, whose rows (like the int4 kernel's) do not depend
        # on the block size, so a verify block's logits equal one-token steps bit for bit
        self.lm_head = _Projections([model.get_output_embeddings()], self.pack, q4, int8=self.q4)
        # RoPE: transformers already computed the (possibly scaled) inverse frequencies and
        # the attention scaling for this config; reuse them so every supported rope_type
        # is handled the same way it is there.
        rotary = decoder.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float().clone()
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self._cos = self._sin = torch.empty(0, device=self.device)
        self._rope_table(min(int(getattr(cfg, "max_position_embeddings", 0) or 0) or 4096, 4096))  # grown on demand

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, capacity: int, kv: KVCacheSpec | None = None) -> StaticKVCache | QuantizedKVCache:
        """An empty cache for this model (``capacity`` positions up front): a plain
        :class:`StaticKVCache`, or a :class:`QuantizedKVCache` when ``kv`` asks for
        compressed types.

        Raises:
            ValueError: a cache type this head_dim cannot use.
        """
        if kv is not None and not kv.plain:
            if self.device.type != "cpu":
                raise ValueError(f"compressed KV cache types ({kv.label()}) run on the CPU only; use -ctk/-ctv f32 "
                                 f"on {self.device}, or --device cpu")
            return QuantizedKVCache(kv, self.n_layers, self.n_kv_heads, self.head_dim, capacity, self.dtype)
        return StaticKVCache(self.n_layers, self.n_kv_heads, self.head_dim, capacity, self.dtype, self.device)

    def _rope_table(self, n: int) -> None:
        """cos/sin ``[n, head_dim]`` for positions ``0..n-1``, computed like transformers'
        rotary embedding (float32 angles, then cast); grown by doubling."""
        if n <= self._cos.shape[0] and self._cos.dtype == self.dtype:
            return
        n = max(n, 2 * self._cos.shape[0])
        angles = torch.arange(n, dtype=torch.float32, device=self.device)[:, None] * self.inv_freq  # [n, hd/2]
        cos, sin = angles.cos() * self.rope_scale, angles.sin() * self.rope_scale
        self._cos = torch.cat((cos, cos), dim=-1).to(self.dtype)
        self._sin = torch.cat((-sin, sin), dim=-1).to(self.dtype)  # signed for _rope

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   bias: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """``q [T, n_heads, hd]`` over ``keys/values [n_kv, S, hd]`` -> ``[T, n_heads*hd]``.

        GQA without repeating K/V: the ``group`` query heads that share a K/V head become
        extra query rows of that head (``[n_kv, group*T, hd]``); then bmm, softmax, bmm
        (faster here than SDPA for short query blocks). ``bias [group*T, S]`` is an additive
        mask (0 or -inf, fused into the first bmm by ``baddbmm``) or None; ``causal`` only
        for a block starting at position 0.
        """
        T = q.shape[0]
        if causal:
            # prefill from an empty cache: the rows of one group are not in causal order, so
            # use SDPA's own GQA broadcast with its causal (top-left) mask instead
            out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, is_causal=True,
                                                 scale=self.scale, enable_gqa=True)  # [n_heads, T, hd]
            return out.transpose(0, 1).reshape(T, -1)
        # scale the (small) queries rather than the [n_kv, group*T, S] scores
        qg = (q * self.scale).transpose(0, 1).reshape(self.n_kv_heads, self.group * T, self.head_dim)
        if bias is None:
            scores = torch.bmm(qg, keys.transpose(1, 2))  # [n_kv, group*T, S]
        else:
            scores = torch.baddbmm(bias, qg, keys.transpose(1, 2))
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs, values)  # [n_kv, group*T, hd]
        return out.view(self.n_heads, T, self.head_dim).transpose(0, 1).reshape(T, -1)

    def _qkv(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer i's queries, keys and values of ``x [N, H]`` at the rows' RoPE angles
        ``cos/sin [N, 1, hd]``: ``([N, n_heads, hd], [N, n_kv, hd], [N, n_kv, hd])``."""
        layer, N = self.layers[i], x.shape[0]
        h = _rms_norm(x, layer.input_layernorm.weight, self.eps)
        q, k, v = self.proj[i][0](h)
        q, k, v = (q.view(N, self.n_heads, self.head_dim), k.view(N, self.n_kv_heads, self.head_dim),
                   v.view(N, self.n_kv_heads, self.head_dim))
        if self.qk_norm:
            q = _rms_norm(q, layer.self_attn.q_norm.weight, self.eps)
            k = _rms_norm(k, layer.self_attn.k_norm.weight, self.eps)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP block with its residual: ``x [N, H] -> [N, H]``."""
        h = _rms_norm(x, self.layers[i].post_attention_layernorm.weight, self.eps)
        gate, up = self.proj[i][2](h)
        return x + self.proj[i][3](F.silu(gate) * up)[0]

    def forward(self, token_ids: torch.Tensor, cache: StaticKVCache | QuantizedKVCache, logits_from: int = 0,
                feature_layer_ids: list[int] | tuple[int, ...] = (),
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``token_ids`` at positions ``cache.length ..``; the cache grows by T.

        Args:
            token_ids: ``[T]`` int64.
            cache: the sequence's static cache (capacity grown when needed).
            logits_from: logits only for input rows ``>= logits_from``.
            feature_layer_ids: decoder layers whose outputs to return, in this order.
            inputs_embeds: ``[T, H]`` the first layer's input instead of the embeddings of
                ``token_ids`` (an EAGLE-style drafter fuses features into it).
        Returns:
            ``(logits [T - logits_from, V] float32, features [T, k*H] or None)``.
        """
        T = int(token_ids.shape[0])
        L = cache.length
        S = L + T
        cache.reserve(T)
        self._rope_table(S)
        cos = self._cos[L:S, None]  # [T, 1, hd]
        sin = self._sin[L:S, None]  # first half negated
        # one mask per forward, shared by every layer: a 1-token step needs none; a block
        # after cached context is causal inside the block (row t sees positions <= L+t)
        quantized = isinstance(cache, QuantizedKVCache)
        causal = L == 0 and T > 1 and not quantized
        bias = None
        if T > 1 and not causal and not quantized:
            allowed = torch.ones(T, S, dtype=torch.bool, device=self.device).tril_(L)  # row t: positions <= L+t
            bias = torch.zeros(T, S, dtype=self.attn_dtype, device=self.device)
            bias.masked_fill_(allowed.logical_not(), float("-inf"))
            bias = bias.repeat(self.group, 1)  # [group*T, S], rows ordered like the GQA query rows
        want = set(feature_layer_ids)
        kept: dict[int, torch.Tensor] = {}  # layer id -> its output [T, H] (ids may repeat)
        eps = self.eps

        # the step's only host->device copy: its token ids
        x = (F.embedding(token_ids.to(self.device), self.embed.weight) if inputs_embeds is None
             else inputs_embeds)  # [T, H]
        for i in range(self.n_layers):
            q, k, v = self._qkv(i, x, cos, sin)
            ad = self.attn_dtype  # no-ops for float32 weights
            if quantized:  # compressed K/V: the cache quantises, dequantises and attends
                a = cache.attend(i, q, k, v, L, self.scale)
            else:
                keys, values = cache.k[i], cache.v[i]  # [n_kv, capacity, hd]
                keys[:, L:S] = k.transpose(0, 1)  # written by position: rollback is a length move
                values[:, L:S] = v.transpose(0, 1)
                a = self._attention(q.to(ad), keys[:, :S].to(ad), values[:, :S].to(ad), bias, causal)  # [T, nh*hd]
            a = a.to(x.dtype)
            x = self._mlp(i, x + self.proj[i][1](a)[0])
            if i in want:
                kept[i] = x
        cache.length = S

        h = _rms_norm(x[logits_from:], self.final_norm.weight, eps)
        logits = self.lm_head(h)[0].float()  # [T - logits_from, V]
        features = torch.cat([kept[i] for i in feature_layer_ids], dim=-1) if feature_layer_ids else None
        return logits, features

    # -- several sequences in one forward (the server's parallel slots) ------------------
    def _block_mask(self, T: int, L: int) -> tuple[bool, torch.Tensor | None]:
        """``(causal, bias)`` for a block of ``T`` rows after ``L`` cached positions, as in
        :meth:`forward`: nothing for one row, SDPA's causal mask from position 0, else an
        additive ``[group*T, L+T]`` bias (row t sees positions <= L+t)."""
        causal = L == 0 and T > 1
        if T == 1 or causal:
            return causal, None
        allowed = torch.ones(T, L + T, dtype=torch.bool, device=self.device).tril_(L)
        bias = torch.zeros(T, L + T, dtype=self.attn_dtype, device=self.device)
        return False, bias.masked_fill_(allowed.logical_not(), float("-inf")).repeat(self.group, 1)

    def forward_packed(self, items: list[tuple[torch.Tensor, StaticKVCache, int]],
                       feature_layer_ids: list[int] | tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """:meth:`forward` for several sequences at once, packed into one set of matmuls.

        A decode or verify step reads every weight once for a handful of rows, so on a
        memory-bound CPU its cost is mostly the weight traffic. Here the rows of all
        sequences are concatenated: embedding, q/k/v, o_proj, MLP and LM-head matmuls run
        once over all of them (the weights are read once per step instead of once per
        sequence); RoPE is per row (each row carries its own position); only the cache
        write and the attention run per sequence, over that sequence's own cache.

        Args:
            items: per sequence ``(token_ids [T_i] int64, cache, logits_from_i)``; each
                sequence's tokens go at positions ``cache.length ..`` of its own cache.
            feature_layer_ids: decoder layers whose outputs to return, in this order.
        Returns:
            per item, in order, ``(logits [T_i - logits_from_i, V] float32, features
            [T_i, k*H] or None)``: what :meth:`forward` returns for it alone (equal up to
            float32 summation order; bit-identical with bf16 weights, whose prepacked
            multi-row matmuls are row-invariant). Each cache grows by its ``T_i``.
        Raises:
            ValueError: the same cache appears twice (the rows would overwrite each other).
        A cache that is not a plain :class:`StaticKVCache` (e.g. a compressed one) makes the
        whole call fall back to one :meth:`forward` per item.
        """
        if any(type(cache) is not StaticKVCache for _, cache, _ in items) or len(items) == 1:
            return [self.forward(t, cache, lf, feature_layer_ids) for t, cache, lf in items]
        if len({id(cache) for _, cache, _ in items}) != len(items):
            raise ValueError("forward_packed: each item needs its own cache")
        if self.q4 and sum(int(t.shape[0]) for t, _, _ in items) > QUANT_MAX_ROWS:
            # q4: keep every short block on the int4 kernel (QUANT_MAX_ROWS): long items
            # alone, the short ones in packs of at most QUANT_MAX_ROWS rows
            out: list = [None] * len(items)
            pack, rows = [], 0
            for j, (t, cache, lf) in enumerate(items + [(None, None, 0)]):
                n = 0 if t is None else int(t.shape[0])
                if pack and (t is None or rows + n > QUANT_MAX_ROWS):
                    for k, res in zip(pack, self.forward_packed([items[k] for k in pack], feature_layer_ids)):
                        out[k] = res
                    pack, rows = [], 0
                if t is None:
                    break
                if n > QUANT_MAX_ROWS:
                    out[j] = self.forward(t, cache, lf, feature_layer_ids)
                else:
                    pack.append(j)
                    rows += n
            return out
        spans = []  # per item: (first row, T, L, S, causal, bias)
        row = 0
        for token_ids, cache, _ in items:
            T, L = int(token_ids.shape[0]), cache.length
            cache.reserve(T)
            spans.append((row, T, L, L + T, *self._block_mask(T, L)))
            row += T
        self._rope_table(max(s[3] for s in spans))
        positions = torch.cat([torch.arange(L, S, device=self.device) for _, _, L, S, _, _ in spans])
        cos, sin = self._cos[positions, None], self._sin[positions, None]  # [N, 1, hd]
        want = set(feature_layer_ids)
        kept: dict[int, torch.Tensor] = {}
        eps, ad = self.eps, self.attn_dtype

        x = F.embedding(torch.cat([t for t, _, _ in items]).to(self.device), self.embed.weight)  # [N, H]
        for i in range(self.n_layers):
            q, k, v = self._qkv(i, x, cos, sin)
            parts = []
            for (r, T, L, S, causal, bias), (_, cache, _) in zip(spans, items):
                keys, values = cache.k[i], cache.v[i]  # this sequence's [n_kv, capacity, hd]
                keys[:, L:S] = k[r:r + T].transpose(0, 1)
                values[:, L:S] = v[r:r + T].transpose(0, 1)
                parts.append(self._attention(q[r:r + T].to(ad), keys[:, :S].to(ad), values[:, :S].to(ad),
                                             bias, causal))
            a = torch.cat(parts).to(x.dtype)  # [N, nh*hd]
            x = self._mlp(i, x + self.proj[i][1](a)[0])
            if i in want:
                kept[i] = x
        for (_, _, _, S, _, _), (_, cache, _) in zip(spans, items):
            cache.length = S

        # one LM-head matmul over the rows that need logits, split back per sequence
        rows = torch.cat([torch.arange(r + lf, r + T, device=self.device)
                          for (r, T, *_), (_, _, lf) in zip(spans, items)])
        logits = self.lm_head(_rms_norm(x[rows], self.final_norm.weight, eps))[0].float()
        out = []
        for (r, T, *_), part in zip(spans, logits.split([T - lf for (_, T, *_), (_, _, lf) in zip(spans, items)])):
            features = torch.cat([kept[j][r:r + T] for j in feature_layer_ids], dim=-1) if feature_layer_ids else None
            out.append((part, features))
        return out

    # -- many sequences, one token each (batched regeneration) --------------------------
    @torch.inference_mode()
    def prefill_row(self, token_ids: torch.Tensor, kv: "BatchKV", row: int,
                    feature_layer_ids: list[int] | tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prefill one sequence into row ``row`` of ``kv`` (a new sequence reuses the row).

        Returns ``(logits [T, V] float32, features [T, k*H] or None)``: every position's
        logits (regeneration keeps each position's next-token distribution).
        Raises ValueError when the prompt does not fit the row.
        """
        T = int(token_ids.shape[0])
        if T >= kv.capacity:
            raise ValueError(f"prompt of {T} tokens does not fit a batch cache of {kv.capacity} positions")
        cache = StaticKVCache(self.n_layers, self.n_kv_heads, self.head_dim, T, self.dtype, self.device)
        logits, features = self.forward(token_ids, cache, 0, feature_layer_ids)
        for i in range(self.n_layers):
            kv.k[i][row, :, :T] = cache.k[i][:, :T]
            kv.v[i][row, :, :T] = cache.v[i][:, :T]
        kv.lengths[row] = T
        return logits, features

    @torch.inference_mode()
    def decode_rows(self, token_ids: torch.Tensor, kv: "BatchKV",
                    feature_layer_ids: list[int] | tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step for every row of ``kv``: ``token_ids [N]`` at positions ``kv.lengths``.

        Attention is one batched matmul over ``[N, n_kv, group, S]`` with each row's padding
        masked, so N sequences cost one set of weight reads and one attention call per layer
        (:meth:`forward_packed` loops over sequences for attention). Each row's length grows
        by one. Returns ``(logits [N, V] float32, features [N, k*H] or None)``; equal to
        :meth:`forward` per row up to float32 summation order.
        Raises ValueError when a row would outgrow the capacity.
        """
        N = int(token_ids.shape[0])
        pos = kv.lengths.clone()  # [N]
        S = int(pos.max()) + 1
        if S > kv.capacity:
            raise ValueError(f"a row would pass the batch cache capacity {kv.capacity}")
        self._rope_table(S)
        cos, sin = self._cos[pos, None], self._sin[pos, None]  # [N, 1, hd]
        rows, ad = torch.arange(N, device=self.device), self.attn_dtype
        bias = torch.zeros(N, 1, 1, S, dtype=ad, device=self.device)  # -inf past each row's own length
        bias.masked_fill_((torch.arange(S, device=self.device)[None] > pos[:, None])[:, None, None], float("-inf"))
        nkv, g, hd = self.n_kv_heads, self.group, self.head_dim
        want, kept = set(feature_layer_ids), {}
        x = F.embedding(token_ids.to(self.device), self.embed.weight)  # [N, H]
        for i in range(self.n_layers):
            q, k, v = self._qkv(i, x, cos, sin)  # [N, nh, hd], [N, nkv, hd] x2
            kv.k[i][rows, :, pos] = k
            kv.v[i][rows, :, pos] = v
            keys, values = kv.k[i][:, :, :S].to(ad), kv.v[i][:, :, :S].to(ad)  # [N, nkv, S, hd]
            qg = (q * self.scale).to(ad).view(N, nkv, g, hd)
            scores = torch.matmul(qg, keys.transpose(2, 3)) + bias  # [N, nkv, g, S]
            a = torch.matmul(torch.softmax(scores, dim=-1), values)  # [N, nkv, g, hd]
            x = self._mlp(i, x + self.proj[i][1](a.reshape(N, -1).to(x.dtype))[0])
            if i in want:
                kept[i] = x
        kv.lengths += 1
        logits = self.lm_head(_rms_norm(x, self.final_norm.weight, self.eps))[0].float()
        features = torch.cat([kept[i] for i in feature_layer_ids], dim=-1) if feature_layer_ids else None
        return logits, features


class BatchKV:
    """K/V of ``n_rows`` independent sequences in one buffer, for batched one-token decoding.

    ``k[layer]`` / ``v[layer]`` are ``[n_rows, n_kv, capacity, hd]``; ``lengths [n_rows]``
    counts each row's valid positions. A row is reused for a new sequence by
    :meth:`LeanForward.prefill_row` (its stale K/V past the new length are never read).
    """

    def __init__(self, lean: LeanForward, n_rows: int, capacity: int):
        shape = (n_rows, lean.n_kv_heads, capacity, lean.head_dim)
        self.k = [torch.zeros(shape, dtype=lean.dtype, device=lean.device) for _ in range(lean.n_layers)]
        self.v = [torch.zeros(shape, dtype=lean.dtype, device=lean.device) for _ in range(lean.n_layers)]
        self.lengths = torch.zeros(n_rows, dtype=torch.long, device=lean.device)
        self.capacity = capacity
