"""The contract every target backend meets: what the speculative loop, the drafters, training
and the server may ask of a target, and the capabilities a backend declares instead of being
probed for them.

Both :class:`flashdraft.targets.torch.Target` and :class:`flashdraft.targets.llama.LlamaTarget`
implement :class:`Target`; a capability one backend lacks has its declared value there (the
llama target's ``model`` is None, the torch target's ``ensure_sequences`` does nothing), so a
caller asks ``target.model is None`` or calls the method, never ``hasattr``.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch


class TargetCache(Protocol):
    """One sequence's K/V on a target (from :meth:`Target.new_cache`)."""

    #: positions ``0..length-1`` whose K/V are stored
    length: int

    def rollback(self, length: int) -> None:
        """Drop the K/V of every position >= ``length``.

        Raises:
            ValueError: ``length`` beyond what the cache holds.
        """

    def shift(self, n_keep: int, n_discard: int) -> None:
        """llama-server's context shift: drop positions ``n_keep .. n_keep + n_discard - 1``
        and move every later one down by ``n_discard`` (``length`` shrinks by ``n_discard``).
        Only on a target whose :attr:`Target.can_shift` is True.

        Raises:
            ValueError: a span outside what the cache holds.
        """


class Target(Protocol):
    """A decoder-only causal LM as the target of speculative decoding, on any backend."""

    #: the engine running it: ``"torch"`` or ``"llama"`` (one of :data:`flashdraft.targets.load.BACKENDS`)
    backend: ClassVar[str]
    #: the most threads a one-token step may use and still round as a verify row does (llama:
    #: ``-t`` with the patched ggml, else 1; torch: steps and blocks share torch's threads)
    exact_step_threads: int
    #: whether :meth:`TargetCache.shift` works (llama: llama.cpp re-rotates the moved keys;
    #: torch: False, its cached keys keep their rotary positions)
    can_shift: bool
    name: str
    #: a transformers tokenizer (the same on every backend, so both see the same token ids)
    tokenizer: object
    #: what callers read of a model config (``eos_token_id``, ``max_position_embeddings``, ``model_type``)
    config: object
    device: torch.device
    vocab_size: int
    hidden_size: int
    num_layers: int
    eos_token_ids: set[int]
    #: ``fp32``, ``bf16``, ``q4`` (torch) or ``gguf`` (llama): what the forward's weights are
    weights: str
    #: the transformers ``*ForCausalLM``, or None where the backend has none (llama): ``-md
    #: target``, ``-md random``, training and the transformers peers need it
    model: torch.nn.Module | None
    #: the lean forward (:class:`~flashdraft.fast_forward.LeanForward`), None on other paths
    lean: object | None
    #: the token embeddings ``[V, H]`` and LM head ``[V, H]`` a drafter shares, frozen
    embed_tokens: torch.nn.Module
    lm_head: torch.nn.Module

    # -- tokenizer side (:class:`~flashdraft.targets.torch.TokenizerSide`) ----------------------------
    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]: ...

    def user_prompt_ids(self, text: str, raw_text: str | None = None) -> list[int]: ...

    # -- forward and verify ------------------------------------------------------------------------
    def new_cache(self, capacity: int | None = None, fast: bool | None = None, kv=None) -> TargetCache:
        """An empty cache for one sequence (``kv``: a :class:`~flashdraft.kv_cache.KVCacheSpec`).

        Raises:
            ValueError: cache types this target cannot hold.
        """

    def forward(self, token_ids: torch.Tensor, cache: TargetCache,
                logits_from: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``token_ids [T]`` appended at ``cache.length``: ``(logits [T - logits_from, V] float32,
        features [T, feature_size] or None)``; the cache grows by T positions."""

    def forward_packed(self, items: list[tuple[torch.Tensor, TargetCache, int]]
                       ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """:meth:`forward` for several ``(token_ids, cache, logits_from)`` in one pass."""

    # -- context features ---------------------------------------------------------------------------
    def set_feature_layers(self, layer_ids: list[int] | None) -> None:
        """Return the outputs of these decoder layers (0-based) from :meth:`forward`.

        Raises:
            ValueError: a layer id this backend cannot export.
        """

    @property
    def feature_size(self) -> int:
        """Width of the features :meth:`forward` returns: layers x hidden size."""

    # -- threads and sequences (declared capabilities) -----------------------------------------------
    def set_step_threads(self, n: int) -> None:
        """Threads for one-token steps (llama: default :attr:`exact_step_threads`, so a step
        rounds as a verify row does; torch: steps and blocks share torch's threads, nothing to set)."""

    def ensure_sequences(self, n: int) -> None:
        """Make room for ``n`` live caches (llama: one context holds them all; torch: every
        cache is its own, nothing to do)."""

    def verify_drift(self, k: int = 8) -> float:
        """Max |logit| difference between a k-row verify block and k one-token steps, 0.0 when
        they are bit-identical (torch: 0.0, not measured: the backend that keeps drafting exact)."""
