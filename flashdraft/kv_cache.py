"""Compressed KV caches: quantise on write, dequantise on read, rollback = a length move.

:class:`KVStore` holds one of K or V for every layer in a :mod:`flashdraft.kv_codecs`
format, preallocated like :class:`~flashdraft.cache.StaticKVCache`; each position is
encoded on its own, so what a position stores never depends on which forward wrote it,
and rejecting draft tokens only moves ``length``.

Exact positions: the first ``sink_tokens`` positions (attention sinks) and, for every query
at position p, the keys/values of positions ``p - tail_tokens + 1 .. p`` are read exactly as
computed (``--kv-tail-tokens``). The tail is defined per query row, not per forward, so a
verify block reads exactly what the one-token steps of the baseline read and greedy
speculative output stays token-identical to the greedy baseline under the same cache type.
Exact copies of the recent positions live in a small ring of ``tail_tokens + ROLLBACK_MARGIN``
positions; the current forward's own K/V are passed in fresh.

:class:`QuantizedKVCache` is the target's cache (K and V stores, maybe of different types,
like llama.cpp's ``--cache-type-k q5_0 --cache-type-v q4_1``); its :meth:`attend` is the
attention of :class:`~flashdraft.fast_forward.LeanForward` over it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.kv_codecs import Codec, make_codec

#: positions a sequence may roll back past its furthest write and still have its exact tail
#: (a rejected draft is at most --spec-draft-n-max positions; load_engine checks)
ROLLBACK_MARGIN = 64


@dataclass(frozen=True)
class KVCacheSpec:
    """How a cache stores K and V.

    Attributes:
        type_k / type_v: cache types (:data:`flashdraft.kv_codecs.CACHE_TYPES`).
        sink_tokens: first positions kept exact.
        tail_tokens: most recent positions (per query) kept exact.
    """

    type_k: str = "f32"
    type_v: str = "f32"
    sink_tokens: int = 0
    tail_tokens: int = 0

    @property
    def plain(self) -> bool:
        """True when no quantisation is asked for (f32 K and V): the plain static cache."""
        return self.type_k == "f32" and self.type_v == "f32"

    def label(self) -> str:
        t = self.type_k if self.type_k == self.type_v else f"{self.type_k}/{self.type_v}"
        extra = [f"sink {self.sink_tokens}"] * bool(self.sink_tokens) + [f"tail {self.tail_tokens}"] * bool(self.tail_tokens)
        return t + (f" ({', '.join(extra)})" if extra else "")


class KVStore:
    """K or V of one sequence for every layer, in ``codec``'s format.

    Args:
        codec: the storage format.
        n_layers, n_kv_heads: layers and K/V heads.
        capacity: positions allocated up front (grown by doubling).
        dtype: the model's dtype.
        sink_tokens / tail_tokens: see the module docstring (ignored for exact codecs).
    """

    def __init__(self, codec: Codec, n_layers: int, n_kv_heads: int, capacity: int,
                 dtype: torch.dtype, sink_tokens: int = 0, tail_tokens: int = 0):
        self.codec, self.n_layers, self.n_kv, self.dtype = codec, n_layers, n_kv_heads, dtype
        self.head_dim = codec.head_dim
        lossy = not codec.exact
        self.sink = sink_tokens if lossy else 0
        self.tail = tail_tokens if lossy else 0
        self.ring_size = self.tail + ROLLBACK_MARGIN if self.tail else 0
        shape = (n_layers, n_kv_heads)
        # exact copies in float32: rotated values are not representable in a bf16 model's dtype
        self.sink_buf = torch.zeros(*shape, self.sink, self.head_dim)
        self.ring = torch.zeros(*shape, self.ring_size, self.head_dim)
        # per layer and head, the mean of the sequence's first forward (the prompt), removed
        # before quantising: see `write`
        self.lossy = lossy
        self.center = torch.zeros(*shape, self.head_dim)
        self.written = 0  # one past the furthest position ever written (ring validity)
        self.capacity = 0
        self.parts: list[torch.Tensor] = []
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        old, n = self.parts, min(self.capacity, self.written)
        self.parts = [torch.zeros(self.n_layers, self.n_kv, capacity, *shape, dtype=dt)
                      for shape, dt in self.codec.parts]
        for new, prev in zip(self.parts, old):
            new[:, :, :n] = prev[:, :, :n]
        self.capacity = capacity

    def reserve(self, end: int) -> None:
        """Make room for positions ``< end``."""
        if end > self.capacity:
            self._allocate(max(end, 2 * self.capacity))

    @property
    def rotated(self) -> bool:
        return self.codec.rotated

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., hd]`` rotated like the stored vectors (turbo types; else ``x``): queries
        meet rotated keys in the same orthonormal basis."""
        return self.codec.rotation(x) if self.codec.rotated else x

    def unrotate(self, x: torch.Tensor) -> torch.Tensor:
        return self.codec.rotation.inverse(x) if self.codec.rotated else x

    def restore(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Store-domain vectors ``x [n_kv, T, hd]`` (or attention-weighted sums of them) back
        to model values: rotation undone, the center added back."""
        x = self.unrotate(x)
        return x + self.center[layer][:, None].to(x.dtype) if self.lossy else x

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position takes over all layers and heads (exact sinks/tail not counted)."""
        return self.n_layers * self.n_kv * self.codec.bytes_per_vector

    def write(self, layer: int, start: int, x: torch.Tensor) -> torch.Tensor:
        """Store ``x [n_kv, T, hd]`` at positions ``start ..``; returns ``x`` in the store's
        domain (centered and rotated, float32, for lossy types; else ``x``) as an exact read
        would give it."""
        T = x.shape[1]
        self.reserve(start + T)
        if self.lossy:
            # Centering (as SageAttention's "smooth K", Zhang et al. 2024, §3.2): keys share
            # a large common component per head that costs most of the quantisation range.
            # Softmax ignores a shift of all scores of a query, so q·(k - c) attends exactly
            # like q·k; for values, sum_j p_j (v_j - c) + c = sum_j p_j v_j, so c is added
            # back to the output. c is fixed by the first forward (position 0), so every
            # later position - whichever forward writes it - is stored the same way.
            if start == 0:
                self.center[layer] = x.float().mean(dim=1)
            x = x.float() - self.center[layer][:, None]
        for part, enc in zip(self.parts, self.codec.encode(x)):
            part[layer, :, start:start + T] = enc
        dom = self.rotate(x.float()) if self.codec.rotated else x
        if self.sink and start < self.sink:
            n = min(self.sink, start + T) - start
            self.sink_buf[layer, :, start:start + n] = dom[:, :n]
        if self.ring_size:
            keep = min(T, self.ring_size)
            pos = torch.arange(start + T - keep, start + T) % self.ring_size
            self.ring[layer][:, pos] = dom[:, T - keep:].float()
        if layer == self.n_layers - 1:
            self.written = max(self.written, start + T)
        return dom

    def read(self, layer: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Positions ``0 .. end-1`` decoded, ``[n_kv, end, hd]`` in ``dtype`` (store domain:
        centered and rotated; :meth:`restore` maps back); sink positions exact."""
        out = self.codec.decode(tuple(p[layer, :, :end] for p in self.parts), dtype)
        if self.sink:
            n = min(self.sink, end)
            out[:, :n] = self.sink_buf[layer, :, :n].to(dtype)
        return out

    def recent(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Exact values of positions ``start .. end-1`` from the ring ``[n_kv, end-start, hd]``.

        Raises:
            RuntimeError: a position is no longer in the ring (rolled back too far).
        """
        if end <= start:
            return self.ring.new_zeros(self.n_kv, 0, self.head_dim)
        if start < self.written - self.ring_size:
            raise RuntimeError(f"exact tail lost: position {start} is older than the ring "
                               f"(rolled back more than {ROLLBACK_MARGIN} positions)")
        return self.ring[layer][:, torch.arange(start, end) % self.ring_size]


class QuantizedKVCache:
    """The target's cache with compressed K and V (same ``length`` / ``reserve`` / ``rollback``
    interface as :class:`~flashdraft.cache.StaticKVCache`).

    Args:
        spec: cache types and exact positions.
        n_layers, n_kv_heads, head_dim: the model's attention shape.
        capacity: positions allocated up front.
        dtype: the model's dtype.
    Raises:
        ValueError: a type the head_dim cannot use.
    """

    def __init__(self, spec: KVCacheSpec, n_layers: int, n_kv_heads: int, head_dim: int,
                 capacity: int, dtype: torch.dtype = torch.float32):
        self.spec = spec
        args = (n_layers, n_kv_heads, capacity, dtype, spec.sink_tokens, spec.tail_tokens)
        self.k = KVStore(make_codec(spec.type_k, head_dim, dtype), *args)
        self.v = KVStore(make_codec(spec.type_v, head_dim, dtype), *args)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.capacity

    def reserve(self, n_new: int) -> None:
        self.k.reserve(self.length + n_new)
        self.v.reserve(self.length + n_new)

    def rollback(self, length: int) -> None:
        """Drop positions >= ``length`` (a length move).

        Raises:
            ValueError: ``length`` negative or beyond what the cache holds.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds only {self.length}")
        self.length = length

    @property
    def bytes_per_token(self) -> int:
        return self.k.bytes_per_token + self.v.bytes_per_token

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for s in (self.k, self.v) for p in s.parts)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               scale: float) -> torch.Tensor:
        """Write ``k, v [T, n_kv, hd]`` at ``start`` and attend ``q [T, n_heads, hd]`` over
        positions ``0 .. start+T-1`` (causal); returns ``[T, n_heads*hd]`` float32.

        Scores and weighted sums run in the stores' domain (queries rotated for a rotated K,
        the output rotated back for a rotated V; the rotation is orthonormal). Exact tail:
        for row t (position p = start+t) the columns ``p-tail+1 .. p`` use exact K/V.
        Every product goes through :func:`matmul_nt`, whose rows do not depend on how many
        rows or columns come with them, so a verify block attends bit for bit like
        one-token steps (what keeps greedy speculative output equal to the baseline).
        """
        T, n_heads, hd = q.shape
        n_kv = k.shape[1]
        group = n_heads // n_kv
        S = start + T
        pos = torch.arange(start, S).repeat(group)  # position of each GQA row (g, t)
        cols = torch.arange(S)
        tail = max(self.k.tail, self.v.tail)
        # columns some row reads exactly: from the oldest row's tail start to S. Older exact
        # values come from the ring, read before this forward's writes can overwrite it.
        lo = max(start + 1 - tail, 0)
        k_old = self.k.recent(layer, lo, start) if self.k.tail else None
        v_old = self.v.recent(layer, lo, start) if self.v.tail else None
        kx = self.k.write(layer, start, k.transpose(0, 1))  # [n_kv, T, hd], store domain
        vx = self.v.write(layer, start, v.transpose(0, 1))
        keys = self.k.read(layer, S, torch.float32)  # [n_kv, S, hd]
        values_t = self.v.read(layer, S, torch.float32).transpose(1, 2).contiguous()  # [n_kv, hd, S]
        q = self.k.rotate(q.float())  # keys are centered too, which softmax ignores
        # GQA rows: the `group` query heads of one K/V head become rows (g, t) of that head
        qg = (q * scale).transpose(0, 1).reshape(n_kv, group * T, hd)
        # row r reads column j exactly when p - tail < j <= p (p = pos[r])
        mix = ((cols[None] > pos[:, None] - tail) & (cols[None] <= pos[:, None])) if tail else None
        future = cols[None] > pos[:, None] if T > 1 else None  # [group*T, S]
        out = []
        for h in range(n_kv):
            scores = matmul_nt(qg[h], keys[h])  # [group*T, S]
            if k_old is not None:
                exact = matmul_nt(qg[h], torch.cat((k_old[h], kx[h].float())))  # columns lo..S-1
                scores[:, lo:] = torch.where(mix[:, lo:], exact, scores[:, lo:])
            if future is not None:
                scores.masked_fill_(future, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            o = matmul_nt(probs, values_t[h])  # [group*T, hd]
            if v_old is not None:
                # exact minus decoded values in the tail, zero elsewhere: a product over all S
                # columns keeps the row sums in the same order as a one-token step's
                delta = torch.zeros(S, hd)
                delta[lo:] = torch.cat((v_old[h], vx[h].float())) - values_t[h, :, lo:].t()
                o = o + matmul_nt(probs * mix, delta.t().contiguous())
            out.append(o)
        out = self.v.restore(layer, torch.stack(out))  # [n_kv, group*T, hd]: rotation undone, center added
        return out.view(n_heads, T, hd).transpose(0, 1).reshape(T, -1)


def matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b[N, K]^T -> [M, N]`` float32, each output row independent of M and N.

    oneDNN's inner-product kernel computes every row of the result the same whatever the
    other rows and however many columns there are (and zero columns appended to K change
    nothing), checked bitwise in tests/test_kv_cache.py; MKL's GEMM behind ``torch.mm``
    does not (it picks kernels by shape, ~1e-6 apart). Without oneDNN: float64 products,
    whose rounding noise the float32 result practically never shows.
    """
    if _ONEDNN:
        if a.shape[0] == 1:  # a single row takes another kernel: run it as two
            return torch.ops.mkldnn._linear_pointwise(a.expand(2, -1).contiguous(), b, None, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(a.contiguous(), b.contiguous(), None, "none", [], "")
    return (a.double() @ b.double().t()).float()


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
