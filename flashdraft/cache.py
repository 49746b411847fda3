"""Static KV cache of the target: preallocated, written by position, rolled back by a length.

gpt-fast's shape (DESIGN.md §4): one buffer holds every layer's keys and values; a forward
writes the K/V of its T new tokens at positions ``length .. length+T-1`` and attends over
``[:length+T]``; rejecting draft tokens is ``rollback(n)``, which only moves ``length``
(the stale K/V past it are overwritten by the next forward). No tensor is copied or
re-created inside the decode loop; the buffer is reallocated only when a sequence outgrows
its capacity (doubling, so at most log2(ctx) times per sequence).
"""

from __future__ import annotations

import torch


class StaticKVCache:
    """K/V of one sequence for every layer: ``k[layer]``, ``v[layer]`` are ``[kv_heads, capacity, head_dim]``.

    Args:
        n_layers: decoder layers.
        n_kv_heads: key/value heads per layer (GQA: fewer than query heads).
        head_dim: channels per head.
        capacity: positions allocated up front (pass the context size to never grow).
        dtype: K/V dtype (the model's compute dtype).
        device: where the buffer lives (the model's device).
    Attributes:
        length: positions whose K/V are valid (``0..length-1``).
        capacity: positions allocated.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.n_layers, self.n_kv_heads, self.head_dim, self.dtype = n_layers, n_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        self.length = 0
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        # torch.empty: pages are touched only where K/V get written, so a large capacity
        # costs address space, not time. One buffer [layers, 2, kv_heads, capacity, hd].
        old = getattr(self, "buffer", None)
        self.buffer = torch.empty(self.n_layers, 2, self.n_kv_heads, capacity, self.head_dim, dtype=self.dtype,
                                  device=self.device)
        if old is not None and self.length:
            self.buffer[:, :, :, : self.length].copy_(old[:, :, :, : self.length])
        self.capacity = capacity
        self.k = list(self.buffer[:, 0].unbind(0))  # [layers] x [kv_heads, capacity, hd] views
        self.v = list(self.buffer[:, 1].unbind(0))

    def reserve(self, n_new: int) -> None:
        """Make room for ``n_new`` more positions (doubles the capacity when needed; copies once)."""
        need = self.length + n_new
        if need > self.capacity:
            self._allocate(max(need, 2 * self.capacity))

    def rollback(self, length: int) -> None:
        """Drop the K/V of every position >= ``length`` (rejected draft tokens): a length move.

        Raises:
            ValueError: ``length`` is negative or beyond what the cache holds.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds only {self.length}")
        self.length = length

    @property
    def nbytes(self) -> int:
        """Bytes allocated (address space; pages are committed as positions are written)."""
        return self.buffer.numel() * self.buffer.element_size()
