"""Sampling filters and the verify rules of speculative decoding.

Glossary (DESIGN.md §1): the *target* gives distributions ``p``; the *drafter* proposed
``draft tokens`` with distributions ``q`` (or deterministically, ``q`` one-hot). A verify
step accepts a prefix of the draft and appends one *bonus token* from the target.

Every mode (plain decoding and every drafter) goes through :func:`filtered_probs`, so
temperature, top-k, top-p and min-p mean the same thing everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    Attributes:
        temperature: 0 means greedy (argmax); > 0 scales logits by ``1/temperature``.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set whose probability reaches top_p (1.0 = off).
        min_p: drop tokens whose probability is below ``min_p * max_prob`` (0.0 = off).
        seed: seed of the request's random generator (None = nondeterministic).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # Validate here so that no request with bad settings ever reaches the loop.
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if math.isinf(self.temperature):
            raise ValueError("temperature must be finite")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or math.isnan(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator on ``device`` (where the logits are sampled) seeded with ``seed``, or
        from the OS when seed is None. The same seed gives another stream on another device."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(int(self.seed))
        return gen


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the sampling distribution of ``params``.

    Order (as in transformers' logits processors): temperature, top-k, top-p, min-p.

    Args:
        logits: ``[N, V]`` logits (any float dtype).
        params: sampling settings with ``temperature > 0``.
    Returns:
        ``[N, V]`` float32 probabilities, each row summing to 1.
    Raises:
        ValueError: if called with temperature 0 (greedy has no distribution here).
    """
    if params.greedy:
        raise ValueError("filtered_probs needs temperature > 0; use argmax for greedy")
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        fast = _filtered_top_k(scores, params)
        if fast is not None:
            return fast
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep a token if the mass strictly before it is below top_p (always keeps the first)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _filtered_top_k(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """:func:`filtered_probs` after temperature when top-k applies: top-p and min-p work on
    the k survivors (already sorted by ``topk``) instead of sorting the whole vocabulary.
    On a 49k vocabulary with top-k 64: 0.49 instead of 2.35 ms for one row, 1.9 instead of
    23.8 ms for an 8-row verify (docs/performance.md §10). The same distribution (the other
    tokens have probability 0 either way; probabilities within 1e-7 of the full path); None
    when a tie at the k-th score would keep more than k tokens, which the full path handles."""
    vals, idx = torch.topk(scores, params.top_k, dim=-1)  # [N, k], descending
    kth = vals[..., -1:]
    if bool(((scores == kth).sum(-1) != (vals == kth).sum(-1)).any()):
        return None
    probs = torch.softmax(vals, dim=-1)
    if params.top_p < 1.0:
        # keep a token if the mass strictly before it is below top_p (always keeps the first)
        probs = probs.masked_fill((probs.cumsum(-1) - probs) >= params.top_p, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs[..., :1], 0.0)
    out = torch.zeros_like(scores)
    return out.scatter_(-1, idx, probs / probs.sum(dim=-1, keepdim=True))


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row. ``probs``: ``[N, V]`` -> ``[N]`` int64."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def choose_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick the next token from one row of logits ``[V]`` (argmax at T=0, else a sample)."""
    if params.greedy:
        return int(torch.argmax(logits))
    return int(sample(filtered_probs(logits[None], params), generator)[0])


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verify: accept the longest draft prefix equal to the target's argmax.

    Args:
        draft_tokens: ``[n]`` proposed token ids (n may be 0), on the host.
        target_logits: ``[n+1, V]`` target logits at [anchor, draft_1..draft_n], on any device.
    Returns:
        ``(n_accepted, bonus_token)``: the target's argmax after the accepted prefix.
    """
    argmax = torch.argmax(target_logits, dim=-1).to(draft_tokens.device)  # [n+1]: ids only cross
    n = draft_tokens.shape[0]
    matches = (draft_tokens == argmax[:n]).to(torch.int64)
    n_accepted = int(matches.cumprod(0).sum()) if n else 0
    return n_accepted, int(argmax[n_accepted])


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Lossless speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

    A deterministic draft (``q`` one-hot, ``draft_probs`` None: DFlash's argmax, prompt
    lookup) is checked by drawing the target's own token at each position in turn and
    accepting while it equals the draft; the first that differs is the bonus token. That is
    the same law as accepting with probability ``p(x)`` and resampling from ``p`` with ``x``
    removed, and it draws exactly one sample per emitted token from ``generator``, in order,
    as plain decoding does: with a fixed seed, drafting on or off gives the same tokens
    (llama-server's ``test_with_and_without_draft``), not only the same distribution.

    A sampled draft is accepted with probability ``min(1, p_k(x)/q_k(x))``; at the first
    rejection the bonus token is drawn from ``normalise(max(p_k - q_k, 0))``; if all are
    accepted it is drawn from ``p_{n+1}``.

    Args:
        draft_tokens: ``[n]`` proposed ids (host).
        draft_probs: ``[n, V]`` drafter distributions the tokens were sampled from, or None
            when the draft was deterministic; on the target's device.
        target_probs: ``[n+1, V]`` filtered target distributions at [anchor, drafts].
        generator: the request's random generator, on ``target_probs``' device.
    Returns:
        ``(n_accepted, bonus_token)``.
    """
    n = draft_tokens.shape[0]
    if draft_probs is None:
        for k in range(n):
            y = int(sample(target_probs[k][None], generator)[0])
            if y != int(draft_tokens[k]):
                return k, y
        return n, int(sample(target_probs[n][None], generator)[0])
    for k in range(n):
        x = int(draft_tokens[k])
        p_x, q_x = float(target_probs[k, x]), float(draft_probs[k, x])
        u = float(torch.rand((), generator=generator, device=generator.device))
        if q_x > 0 and u < min(1.0, p_x / q_x):
            continue
        # rejected: sample from the residual distribution
        residual = (target_probs[k] - draft_probs[k]).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q exactly: any sample from p is correct
            residual = target_probs[k]
            total = float(residual.sum())
        return k, int(sample((residual / total)[None], generator)[0])
    return n, int(sample(target_probs[n][None], generator)[0])
