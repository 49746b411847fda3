"""4-bit GGUF weights run as they are stored: Q4_0 / Q4_1 on torch's packed int4 CPU kernel.

A GGUF Q4_1 block holds 32 weights of one row as 4-bit codes ``q`` in 0..15 with an fp16
scale ``d`` and an fp16 minimum ``m``: ``w = d*q + m``. Q4_0 has ``w = d*(q - 8)``
(ggml's ``block_q4_0`` / ``block_q4_1``, llama.cpp ``ggml-common.h``). torch's
``_weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)`` computes ``x @ wᵀ`` with
``w = (q - 8)*s + z`` per group of 32 along the input dimension, so the GGUF codes map
one to one: Q4_1 ``s = d, z = m + 8d``; Q4_0 ``s = d, z = 0``.

What is not exact (measured in docs/performance.md): the kernel is fast only with bf16
activations on this CPU (fp32 activations take a scalar path ~10× slower than fp32
``F.linear``), and it wants the scales in the activations' dtype, so inputs are rounded to
bf16 and the fp16 scales to bf16 (8 mantissa bits instead of 11). The rest of the model
(norms, attention, residual stream, the Q8_0 embedding / LM head) stays float32.

Lossless speculative decoding needs every row of a verify block to equal a one-token
step: the kernel's rows do not depend on how many rows come with them (tested over every
projection shape of the real model, ``tests/test_quant.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

#: ggml block layouts: bytes per block of 32 weights
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
GROUP = 32

#: GGUF tensor name (after ``blk.N.``) -> transformers module (after ``model.layers.N.``)
GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass
class Q4Weight:
    """One 4-bit weight matrix in the kernel's terms.

    Attributes:
        codes: ``[N, K]`` uint8 in 0..15 (N output rows, K inputs).
        scale: ``[N, K/32]`` float32 (the GGUF's fp16 ``d``, exactly).
        zero: ``[N, K/32]`` float32: ``w = (q - 8)*scale + zero``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` float32 ``(q - 8)*scale + zero``, with the GGUF's own rounding for
        Q4_1 (``d*q + m``) when built by :func:`read_q4` (see :attr:`exact`)."""
        s = self.scale.repeat_interleave(GROUP, 1)
        z = self.zero.repeat_interleave(GROUP, 1)
        return (self.codes.float() - 8) * s + z

    def rows(self, index: torch.Tensor) -> "Q4Weight":
        """The rows ``index`` (a permutation or a subset)."""
        return Q4Weight(self.codes[index], self.scale[index], self.zero[index])

    @staticmethod
    def cat(parts: list["Q4Weight"]) -> "Q4Weight":
        """Rows of ``parts`` stacked (fused projections: q/k/v, gate/up)."""
        return Q4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                        torch.cat([p.zero for p in parts]))


def decode_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``raw [N, K/32 * bytes]`` uint8 of ggml blocks -> ``(codes [N, K], d [N, K/32], m [N, K/32])``.

    ``m`` is ``-8d`` for Q4_0 (so ``w = d*q + m`` in both cases). Low nibbles hold the
    block's first 16 weights, high nibbles the last 16 (ggml's layout).

    Raises:
        ValueError: ``kind`` is not Q4_0 / Q4_1 or the row length is not whole blocks.
    """
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"not a 4-bit GGUF type: {kind}")
    nb = _BLOCK_BYTES[kind]
    if raw.shape[1] % nb:
        raise ValueError(f"{kind} row of {raw.shape[1]} bytes is not whole {nb}-byte blocks")
    blocks = raw.reshape(raw.shape[0], -1, nb)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
    else:
        m = -8.0 * d
        qs = blocks[..., 2:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(raw.shape[0], -1)
    return codes, d, m


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row index into the GGUF tensor for each transformers row of a llama q/k projection.

    llama.cpp's converter interleaves the two RoPE halves of each head (``permute`` in
    convert_hf_to_gguf.py); transformers' GGUF loader undoes it. Head h's transformers row
    ``h*D + half*D/2 + i`` is GGUF row ``h*D + 2i + half`` (D = head dim).
    """
    dim = n_rows // n_head
    # GGUF rows indexed [head, i, half]; read them in transformers' [head, half, i] order
    return torch.arange(n_rows).view(n_head, dim // 2, 2).transpose(1, 2).reshape(-1)


def read_q4(path: str | Path, model) -> dict[str, Q4Weight]:
    """The 4-bit projection weights of GGUF ``path``, keyed by ``model``'s module names.

    Each one is checked against the float32 weight transformers dequantised from the same
    file: ``d*q + m`` must reproduce it bit for bit, so a name or layout mismatch cannot
    pass silently. Tensors of other types (Q8_0, F16, K-quants) are left out: those
    modules keep their float32 weights.

    Args:
        path: the ``.gguf`` file the model was loaded from.
        model: the transformers model (llama family: q/k rows un-permuted like its loader).
    Returns:
        ``{"model.layers.3.mlp.up_proj": Q4Weight, ...}``.
    Raises:
        ValueError: a 4-bit tensor does not match the model's weight.
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    modules = dict(model.named_modules())
    cfg = model.config
    out: dict[str, Q4Weight] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        parts = t.name.split(".")
        if kind not in _BLOCK_BYTES or len(parts) != 4 or parts[0] != "blk" or parts[2] not in GGUF_TO_HF:
            continue
        name = f"model.layers.{parts[1]}.{GGUF_TO_HF[parts[2]]}"
        module = modules.get(name)
        if module is None:
            raise ValueError(f"GGUF tensor {t.name} has no module {name} in the model")
        codes, d, m = decode_blocks(np.asarray(t.data), kind)
        exact = torch.from_numpy(codes.astype(np.float32) * np.repeat(d, GROUP, 1) + np.repeat(m, GROUP, 1))
        w = Q4Weight(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m + 8.0 * d))
        if parts[2] in ("attn_q", "attn_k") and cfg.model_type in ("llama", "mistral"):
            heads = cfg.num_attention_heads if parts[2] == "attn_q" else cfg.num_key_value_heads
            index = _unpermute_rows(codes.shape[0], int(heads))
            w, exact = w.rows(index), exact[index]
        if not torch.equal(exact, module.weight.detach().float()):
            raise ValueError(f"GGUF tensor {t.name} ({kind}) does not reproduce {name}'s weight")
        out[name] = w
    return out


class Int4Linear:
    """``x [M, K] -> x @ wᵀ [M, N]`` on torch's packed int4 CPU kernel (module docstring).

    Args:
        weight: the 4-bit codes, scales and zeros (several projections may be stacked).
    """

    def __init__(self, weight: Q4Weight):
        self.n, self.k = weight.codes.shape
        if self.k % GROUP:
            raise ValueError(f"input size {self.k} is not a multiple of {GROUP}")
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 2)
        # [K/32, N, 2] (scale, zero) in the activations' dtype, as the kernel requires
        self.scales_zeros = torch.stack([weight.scale.t(), weight.zero.t()], -1).to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self.packed, GROUP,
                                                       self.scales_zeros)
        return y.to(x.dtype)


class Int8Linear:
    """``x [M, K] -> x @ wᵀ [M, N]`` on torch's int8 CPU kernel, one scale per output row.

    Used for the LM head under ``--weights q4``: SmolLM2's GGUF stores it (the tied
    embedding) as Q8_0, one scale per 32 weights, which this kernel cannot hold, so the
    float32 weight is requantised per row (``s = max|w| / 127``): an approximation, measured
    with the rest of q4 in docs/performance.md. Chosen over float32 ``F.linear`` because
    float32 sums a 1-row product in another order than a block (gemv vs gemm), so a verify
    block's logits would not equal one-token steps bit for bit; this kernel's rows do.

    Args:
        weight: ``[N, K]`` float weight.
    """

    def __init__(self, weight: torch.Tensor):
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [N]
        self.codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.codes,
                                                  self.scale).to(x.dtype)
