"""Synthetic acceptance, for benchmarking only (llama-server's ``--spec-synth-rates`` /
``--spec-synth-len``): each draft token is accepted by a coin with a set probability,
whatever the target says, so an engine's speed can be measured at any acceptance length
with its real kernels, draft and verify costs. **The output is not the model's**: an
accepted draft token is returned even where the target would have chosen another.

The target is still sampled at every checked position (its draws are taken in order, as
in :func:`flashdraft.sampling.verify_sampling`), so with every rate 0 the output is plain
decoding's, token for token, for the same seed.
"""

from __future__ import annotations

import math
import random

import torch

from flashdraft.sampling import SamplingParams, choose_token


def accept_probs(rates: list[float] | None, length: float | None, n_max: int) -> list[float] | None:
    """The conditional acceptance probability of each draft position, from llama.cpp's two
    ways of asking.

    Args:
        rates: ``[n_max]`` unconditional probabilities that draft position ``i`` is accepted
            (non-increasing, in [0, 1]).
        length: the mean acceptance length wanted, the target's token included, in
            ``[1, n_max + 1]``: every position then accepts with the same ``p`` (found by
            bisection), so ``rates[i] = p ** (i + 1)``.
        n_max: draft tokens per step (``--spec-draft-n-max``).
    Returns:
        ``[n_max]`` probabilities ``rates[i] / rates[i - 1]`` (0 after a 0 rate), or None
        when neither is given.
    Raises:
        ValueError: both given, a rate list of another length, a rate outside [0, 1] or
            increasing, a length out of range, or ``n_max < 1``.
    """
    if rates is None and length is None:
        return None
    if rates is not None and length is not None:
        raise ValueError("--spec-synth-rates and --spec-synth-len are mutually exclusive")
    if n_max < 1:
        raise ValueError("synthetic acceptance needs at least one draft token (--spec-draft-n-max)")
    if rates is not None:
        if len(rates) != n_max:
            raise ValueError(f"--spec-synth-rates must hold {n_max} values (--spec-draft-n-max), got {len(rates)}")
        for i, r in enumerate(rates):
            if not math.isfinite(r) or not 0.0 <= r <= 1.0:
                raise ValueError(f"--spec-synth-rates must be finite and within [0, 1], got {r}")
            if i and r > rates[i - 1]:
                raise ValueError("--spec-synth-rates must be non-increasing")
    else:
        if not math.isfinite(length) or not 1.0 <= length <= n_max + 1:
            raise ValueError(f"--spec-synth-len must be within [1, {n_max + 1}], got {length}")
        p = 1.0 if length == n_max + 1 else _per_position(length - 1.0, n_max)
        rates = [p ** (i + 1) for i in range(n_max)]
    out, before = [], 1.0
    for r in rates:
        out.append(r / before if before > 0 else 0.0)
        before = r
    return out


def _per_position(accepted: float, n_max: int) -> float:
    """The ``p`` with ``p + p^2 + ... + p^n_max == accepted`` (mean accepted drafts), by bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if sum(mid ** (i + 1) for i in range(n_max)) < accepted:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def verify_synthetic(draft_tokens: torch.Tensor, target_logits: torch.Tensor, params: SamplingParams,
                     generator: torch.Generator, probs: list[float], coin: random.Random,
                     eos: set[int]) -> tuple[int, int]:
    """Synthetic verify: draft ``k`` is accepted when ``coin.random() < probs[k]`` and it is
    not an end-of-sequence token (one would end the answer early).

    Args:
        draft_tokens: ``[n]`` proposed ids (host).
        target_logits: ``[n + 1, V]`` target logits at [anchor, drafts] (biased / masked already).
        params / generator: the request's sampling and its random stream (the target's draws).
        probs: conditional acceptance per draft position (:func:`accept_probs`).
        coin: the coin's own stream (seeded with the request's seed).
        eos: end-of-sequence ids.
    Returns:
        ``(n_accepted, bonus_token)``: the bonus is the target's own token at the first
        rejected position (or after the last draft).
    """
    n = draft_tokens.shape[0]
    for k in range(n):
        own = choose_token(target_logits[k], params, generator)
        draft = int(draft_tokens[k])
        if coin.random() < probs[k] and draft not in eos:
            continue
        return k, own
    return n, choose_token(target_logits[n], params, generator)
