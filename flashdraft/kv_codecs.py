"""KV cache value formats: how one head vector of K or V is stored, per position.

Each :class:`Codec` turns head vectors ``x [..., head_dim]`` (float32) into a tuple of
packed tensors ``[..., *part_shape]`` (``encode``) and back (``decode``). Everything works on
arbitrary leading dimensions, so a cache stores every part as one preallocated tensor
``[layers, kv_heads, capacity, *part_shape]`` and a position is written by indexing: rollback
stays a length move.

Formats (``CACHE_TYPES``):

- ``f32``, ``f16``, ``bf16``: plain casts.
- ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``: llama.cpp's block formats (ggml-quants.c), blocks
  of 32 consecutive values of a head vector, same rounding and dequantisation:
  q8_0 ``x = d*q`` (int8 q, fp16 d = amax/127; 8.5 bits/value); q4_0 ``x = d*(q-8)``
  (4-bit q, d = the signed value of largest magnitude / -8; 4.5 bits); q4_1 ``x = d*q + m``
  (4-bit q, fp16 d and min m; 5.0 bits); q5_0 ``x = d*(q-16)`` (5-bit q split into a nibble
  and one bit of a 32-bit mask; 5.5 bits). Nibbles are packed as llama.cpp packs them: byte
  j of a block holds value j (low nibble) and value j+16 (high nibble).
- ``q3_0``: flashdraft's own 3-bit analogue of q4_0 (``x = d*(q-4)``, 3.5 bits), the
  "plain 3-bit scalar quantisation" that turbo3 is measured against.
- ``turbo4``, ``turbo3``: TurboQuant-style (Zandieh et al., 2025, "TurboQuant: Online
  Vector Quantization with Near-optimal Distortion Rate", §3): each block of
  ``min(head_dim, 128)`` values is rotated by a fixed random-sign Walsh–Hadamard transform,
  which spreads outlier channels so every rotated coordinate is close to Gaussian; then each
  coordinate is scalar-quantised with the Lloyd–Max codebook of N(0, 1) (16 or 8 levels),
  scaled by the block's RMS (one fp16 per block). 4 + 16/B and 3 + 16/B bits per value
  (4.25 / 3.25 for head_dim 64, 4.125 / 3.125 from head_dim 128 up). The rotation is
  orthonormal, so attention can run in the rotated domain: rotate the queries, attend, rotate
  the output back (:mod:`flashdraft.kv_cache`); decoded values stay rotated
  (``codec.rotated``).
"""

from __future__ import annotations

import math

import torch

QK = 32  # llama.cpp block size of the q* formats
TURBO_BLOCK = 128  # largest turbo block (values per scale)


# -- rotation -------------------------------------------------------------------------------
def _signs(n: int, seed: int = 0x7F4A) -> torch.Tensor:
    """Fixed ±1 vector ``[n]`` (a seeded generator, so every process rotates the same way)."""
    g = torch.Generator().manual_seed(seed + n)
    return torch.randint(0, 2, (n,), generator=g).float().mul_(2).sub_(1)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh–Hadamard transform over the last dim ``n`` (a power of two).

    A fast butterfly (log2 n stages of add/subtract): elementwise, so a vector transforms
    to the same bits whether it comes alone or inside a block, which keeps speculative
    decoding token-identical with a rotated cache. The transform is its own inverse.
    """
    n = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    y = x
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(*lead, n) * (1.0 / math.sqrt(n))


class Rotation:
    """``R(x) = H (s ⊙ x)`` per block of ``block`` values: random signs s, normalised
    Hadamard H. Orthonormal, so ``q·k = R(q)·R(k)`` and ``inverse(R(x)) = x``.

    Args:
        head_dim: vector length (a multiple of ``block``).
        block: values per rotated block (a power of two).
    """

    def __init__(self, head_dim: int, block: int):
        self.head_dim, self.block = head_dim, block
        self.signs = _signs(block)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., head_dim]`` -> rotated ``[..., head_dim]`` (same dtype)."""
        xb = x.reshape(*x.shape[:-1], -1, self.block)
        return hadamard(xb * self.signs.to(x.dtype)).reshape(x.shape)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Undo :meth:`__call__` on ``y [..., head_dim]``."""
        yb = y.reshape(*y.shape[:-1], -1, self.block)
        return (hadamard(yb) * self.signs.to(y.dtype)).reshape(y.shape)


# -- Lloyd–Max codebooks --------------------------------------------------------------------
def lloyd_max_gaussian(bits: int, iters: int = 300) -> torch.Tensor:
    """The MSE-optimal scalar quantiser levels ``[2**bits]`` (ascending) for N(0, 1).

    Lloyd's algorithm on the exact density: thresholds at midpoints, each level the
    conditional mean of its cell, ``(φ(a) - φ(b)) / (Φ(b) - Φ(a))``. Float64 throughout.
    Known values: 3 bits ±0.245, ±0.756, ±1.344, ±2.152 (Max, 1960).
    """
    n = 2 ** bits
    levels = torch.linspace(-2.5, 2.5, n, dtype=torch.float64)
    inv_sqrt2pi = 1.0 / math.sqrt(2 * math.pi)
    for _ in range(iters):
        mid = (levels[1:] + levels[:-1]) / 2
        edges = torch.cat([torch.tensor([-math.inf], dtype=torch.float64), mid,
                           torch.tensor([math.inf], dtype=torch.float64)])
        pdf = torch.exp(-edges.clamp(-40, 40) ** 2 / 2) * inv_sqrt2pi
        cdf = 0.5 * (1 + torch.erf(edges / math.sqrt(2)))
        levels = (pdf[:-1] - pdf[1:]) / (cdf[1:] - cdf[:-1])
    return levels


# -- bit packing ----------------------------------------------------------------------------
def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``q [..., 2m]`` uint8 values < 16 -> ``[..., m]``: byte j = q[j] | q[j+m] << 4."""
    m = q.shape[-1] // 2
    return q[..., :m] | (q[..., m:] << 4)


def _unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_pack_nibbles`: ``[..., m]`` -> ``[..., 2m]`` uint8."""
    return torch.cat((p & 15, p >> 4), dim=-1)


_BIT = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``bits [..., 8m]`` in {0, 1} -> ``[..., m]`` uint8, value 8i+j in bit j of byte i."""
    b = bits.reshape(*bits.shape[:-1], -1, 8)
    return (b * _BIT).sum(-1, dtype=torch.uint8)


def _unpack_bits(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_pack_bits`: ``[..., m]`` -> ``[..., 8m]`` uint8 in {0, 1}."""
    return ((p[..., None] & _BIT) != 0).to(torch.uint8).reshape(*p.shape[:-1], -1)


_HIGH_BIT_16 = _unpack_bits(torch.arange(256, dtype=torch.uint8)[:, None]) << 4  # [256, 8]: 0 or 16


def _pack_3bit(q: torch.Tensor) -> torch.Tensor:
    """``q [..., n]`` values < 8 -> ``[..., 3n/8]``: two bits per value in n/4 bytes
    (four values a byte: value j, j+n/4, j+n/2, j+3n/4 of byte j) plus one bit plane."""
    n = q.shape[-1]
    lo = q & 3
    c = n // 4
    two = lo[..., :c] | (lo[..., c:2 * c] << 2) | (lo[..., 2 * c:3 * c] << 4) | (lo[..., 3 * c:] << 6)
    return torch.cat((two, _pack_bits(q >> 2)), dim=-1)


def _unpack_3bit(p: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`_pack_3bit` for ``n`` values."""
    c = n // 4
    two, hi = p[..., :c], p[..., c:]
    lo = torch.cat((two & 3, (two >> 2) & 3, (two >> 4) & 3, two >> 6), dim=-1)
    return lo | (_unpack_bits(hi) << 2)


# -- codecs ---------------------------------------------------------------------------------
class Codec:
    """How one head vector ``[head_dim]`` is stored.

    Attributes:
        name: the cache type (``--cache-type-k`` value).
        parts: per stored tensor, ``(shape per head vector, dtype)``.
        exact: values are stored without loss for a model of this dtype.
        rotated: decoded values are in the rotated domain (:class:`Rotation`).
    """

    name = ""
    rotated = False
    exact = False

    def __init__(self, head_dim: int):
        self.head_dim = head_dim
        self.parts: list[tuple[tuple[int, ...], torch.dtype]] = []

    @property
    def bytes_per_vector(self) -> int:
        """Bytes one head vector takes."""
        return sum(math.prod(shape) * torch.empty(0, dtype=dt).element_size() for shape, dt in self.parts)

    @property
    def bits_per_value(self) -> float:
        return 8 * self.bytes_per_vector / self.head_dim

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [..., head_dim]`` -> parts ``[..., *shape]``."""
        raise NotImplementedError

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """parts ``[..., *shape]`` -> ``[..., head_dim]`` in ``dtype`` (decoded straight into
        it: the float64 attention path pays no extra conversion pass)."""
        raise NotImplementedError


class CastCodec(Codec):
    """Plain ``f32`` / ``f16`` / ``bf16`` storage."""

    def __init__(self, head_dim: int, dtype: torch.dtype, name: str):
        super().__init__(head_dim)
        self.name, self.dtype = name, dtype
        self.parts = [((head_dim,), dtype)]

    def encode(self, x):
        return (x.to(self.dtype),)

    def decode(self, parts, dtype=torch.float32):
        return parts[0].to(dtype)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], -1, block)


def _signed_absmax(xb: torch.Tensor) -> torch.Tensor:
    """Per block, the value of largest magnitude with its sign ``[..., nb, 1]`` (llama.cpp's ``max``)."""
    idx = xb.abs().argmax(-1, keepdim=True)
    return xb.gather(-1, idx)


class Q8_0(Codec):
    name = "q8_0"

    def __init__(self, head_dim):
        super().__init__(head_dim)
        nb = head_dim // QK
        self.parts = [((nb, QK), torch.int8), ((nb,), torch.float16)]

    def encode(self, x):
        xb = _blocks(x.float(), QK)
        d = xb.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        y = xb * inv  # C roundf (half away from zero), not torch.round's half-to-even
        return (y.sign() * (y.abs() + 0.5).floor()).to(torch.int8), d[..., 0].half()

    def decode(self, parts, dtype=torch.float32):
        q, d = parts
        return (q.to(dtype) * d.to(dtype)[..., None]).flatten(-2)


class _SymmetricQ(Codec):
    """llama.cpp q4_0 / q5_0 rounding for ``bits``-bit codes: ``d = max / -2**(bits-1)``,
    ``q = min(2**bits - 1, trunc(x/d + 2**(bits-1) + 0.5))``, ``x ≈ d*(q - 2**(bits-1))``."""

    bits = 4

    def _codes(self, x):
        xb = _blocks(x.float(), QK)
        half = 2 ** (self.bits - 1)
        d = _signed_absmax(xb) / -half
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = (xb * inv + (half + 0.5)).floor().clamp_(0, 2 ** self.bits - 1).to(torch.uint8)
        return q, d[..., 0].half()

    def _values(self, q, d, dtype):
        return ((q.to(dtype) - 2 ** (self.bits - 1)) * d.to(dtype)[..., None]).flatten(-2)


class Q4_0(_SymmetricQ):
    name, bits = "q4_0", 4

    def __init__(self, head_dim):
        super().__init__(head_dim)
        nb = head_dim // QK
        self.parts = [((nb, QK // 2), torch.uint8), ((nb,), torch.float16)]

    def encode(self, x):
        q, d = self._codes(x)
        return _pack_nibbles(q), d

    def decode(self, parts, dtype=torch.float32):
        return self._values(_unpack_nibbles(parts[0]), parts[1], dtype)


class Q5_0(_SymmetricQ):
    name, bits = "q5_0", 5

    def __init__(self, head_dim):
        super().__init__(head_dim)
        nb = head_dim // QK
        self.parts = [((nb, QK // 2), torch.uint8), ((nb, QK // 8), torch.uint8), ((nb,), torch.float16)]

    def encode(self, x):
        q, d = self._codes(x)
        return _pack_nibbles(q & 15), _pack_bits(q >> 4), d

    def decode(self, parts, dtype=torch.float32):
        qs, qh, d = parts
        # the 32 high bits by table: byte b -> its 8 bits already shifted to 16
        hi = _HIGH_BIT_16.index_select(0, qh.reshape(-1).to(torch.int32)).view(*qh.shape[:-1], QK)
        return self._values(_unpack_nibbles(qs) | hi, d, dtype)


class Q3_0(_SymmetricQ):
    name, bits = "q3_0", 3

    def __init__(self, head_dim):
        super().__init__(head_dim)
        nb = head_dim // QK
        self.parts = [((nb, 3 * QK // 8), torch.uint8), ((nb,), torch.float16)]

    def encode(self, x):
        q, d = self._codes(x)
        return _pack_3bit(q), d

    def decode(self, parts, dtype=torch.float32):
        return self._values(_unpack_3bit(parts[0], QK), parts[1], dtype)


class Q4_1(Codec):
    name = "q4_1"

    def __init__(self, head_dim):
        super().__init__(head_dim)
        nb = head_dim // QK
        self.parts = [((nb, QK // 2), torch.uint8), ((nb,), torch.float16), ((nb,), torch.float16)]

    def encode(self, x):
        xb = _blocks(x.float(), QK)
        lo, hi = xb.amin(-1, keepdim=True), xb.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = ((xb - lo) * inv + 0.5).floor().clamp_(0, 15).to(torch.uint8)
        return _pack_nibbles(q), d[..., 0].half(), lo[..., 0].half()

    def decode(self, parts, dtype=torch.float32):
        qs, d, m = parts
        return (_unpack_nibbles(qs).to(dtype) * d.to(dtype)[..., None] + m.to(dtype)[..., None]).flatten(-2)


class Turbo(Codec):
    """Rotated Lloyd–Max codes (see the module docstring); ``bits`` 3 or 4.

    Packing is built for decoding by table look-up rather than bit twiddling per value:
    turbo4 puts values 2j, 2j+1 in byte j (one look-up in a 256 x 2 table per byte);
    turbo3 puts 8 values in 3 bytes as one little-endian 24-bit word (value i in bits
    3i..3i+2), decoded as two 12-bit halves in a 4096 x 4 table.
    """

    rotated = True

    def __init__(self, head_dim: int, bits: int):
        super().__init__(head_dim)
        self.name, self.bits = f"turbo{bits}", bits
        self.block = min(head_dim, TURBO_BLOCK)
        if self.block & (self.block - 1) or head_dim % self.block:
            raise ValueError(f"{self.name} needs a power-of-two head_dim or a multiple of {TURBO_BLOCK}, "
                             f"got {head_dim}")
        self.rotation = Rotation(head_dim, self.block)
        self.levels = lloyd_max_gaussian(bits).float()
        self.thresholds = (self.levels[1:] + self.levels[:-1]) / 2
        nb = head_dim // self.block
        code_bytes = self.block // 2 if bits == 4 else 3 * self.block // 8
        self.parts = [((nb, code_bytes), torch.uint8), ((nb,), torch.float16)]
        # decoding tables: every byte (turbo4) or 12-bit half word (turbo3) -> its values
        idx = torch.arange(256 if bits == 4 else 4096)
        per = 2 if bits == 4 else 4
        self.table = self.levels[(idx[:, None] >> (bits * torch.arange(per))) & (2 ** bits - 1)]  # [n, per]
        self._tables = {torch.float32: self.table}

    def encode(self, x):
        xb = _blocks(self.rotation(x.float()), self.block)
        scale = xb.pow(2).mean(-1, keepdim=True).sqrt()
        scale = scale.half().float()  # quantise against the scale that decode will use
        z = xb / torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.bucketize(z, self.thresholds).to(torch.uint8)
        if self.bits == 4:
            packed = q[..., 0::2] | (q[..., 1::2] << 4)
        else:
            w = q.reshape(*q.shape[:-1], -1, 8).to(torch.int32)
            w = (w << (3 * torch.arange(8, dtype=torch.int32))).sum(-1, dtype=torch.int32)  # 24-bit words
            packed = torch.stack([(w >> s) & 255 for s in (0, 8, 16)], -1).to(torch.uint8).flatten(-2)
        return packed, scale[..., 0].half()

    def decode(self, parts, dtype: torch.dtype = torch.float32):
        """parts -> ``[..., head_dim]`` in ``dtype`` (rotated domain)."""
        packed, scale = parts
        table = self._tables.get(dtype)
        if table is None:
            table = self._tables[dtype] = self.table.to(dtype)
        lead = packed.shape[:-1]
        if self.bits == 4:
            idx = packed.reshape(-1).to(torch.int32)
        else:
            b = packed.reshape(-1, 3).to(torch.int32)
            idx = torch.stack((b[:, 0] | ((b[:, 1] & 15) << 8), (b[:, 1] >> 4) | (b[:, 2] << 4)), -1).reshape(-1)
        values = table.index_select(0, idx).view(*lead, self.block)
        return (values * scale.to(dtype)[..., None]).flatten(-2)


CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_0", "q4_1", "q4_0", "q3_0", "turbo4", "turbo3")
_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def make_codec(cache_type: str, head_dim: int, model_dtype: torch.dtype = torch.float32) -> Codec:
    """The :class:`Codec` of ``cache_type`` for vectors of ``head_dim``.

    Raises:
        ValueError: unknown type, or a head_dim the format cannot block (q*: multiple of 32;
            turbo*: a power of two or a multiple of 128).
    """
    if cache_type in _DTYPES:
        codec = CastCodec(head_dim, _DTYPES[cache_type], cache_type)
        codec.exact = _DTYPES[cache_type] == model_dtype or cache_type == "f32"
        return codec
    if cache_type not in CACHE_TYPES:
        raise ValueError(f"unknown cache type {cache_type!r}; choose from {', '.join(CACHE_TYPES)}")
    if cache_type.startswith("turbo"):
        return Turbo(head_dim, int(cache_type[-1]))
    if head_dim % QK:
        raise ValueError(f"cache type {cache_type} needs head_dim divisible by {QK}, got {head_dim}")
    return {"q8_0": Q8_0, "q5_0": Q5_0, "q4_1": Q4_1, "q4_0": Q4_0, "q3_0": Q3_0}[cache_type](head_dim)
