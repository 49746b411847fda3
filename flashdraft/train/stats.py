"""Acceptance counters shared by the online evaluation and the offline walk.

Both ``flashdraft eval`` (:mod:`flashdraft.train.evaluate`, the real loop) and the walk
(:mod:`flashdraft.train.walk`, regenerated answers) fill one :class:`AcceptanceStats`, so
their τ, histograms and per-position acceptance are the same numbers by construction; the
glossary of every counter is in :mod:`flashdraft.train.evaluate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceStats:
    """Counters summed over prompts (vLLM ``SpecDecodingStats`` style)."""

    prompts: int = 0
    skipped_prompts: int = 0
    tokens: int = 0  # returned tokens, prefill's first token included
    verify_tokens: int = 0  # produced by the verify steps (Timings.verify_n)
    verify_steps: int = 0
    drafted_steps: int = 0
    draft_n: int = 0
    draft_n_accepted: int = 0
    prompt_tokens: int = 0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)
    finish_reasons: dict[str, int] = field(default_factory=dict)

    def add_counts(self, dst: list[int], src: list[int]) -> None:
        dst.extend([0] * (len(src) - len(dst)))
        for k, n in enumerate(src):
            dst[k] += n

    def add_step_length(self, n_tokens: int) -> None:
        self.histogram.extend([0] * (n_tokens - len(self.histogram)))
        self.histogram[n_tokens - 1] += 1

    def to_dict(self, block_size: int) -> dict:
        """Summary; per-position lists and the histogram are padded to ``block_size - 1`` / ``block_size``.

        Per-position acceptance is None where nothing was drafted at that position.
        """
        drafted = self.drafted_per_position + [0] * (block_size - 1 - len(self.drafted_per_position))
        accepted = self.accepted_per_position + [0] * (len(drafted) - len(self.accepted_per_position))
        return {
            "prompts": self.prompts,
            "skipped_prompts": self.skipped_prompts,
            "tokens": self.tokens,
            "verify_steps": self.verify_steps,
            "drafted_steps": self.drafted_steps,
            "tau": ratio(self.verify_tokens, sum(self.histogram)),
            "tau_drafted": 1.0 + ratio(self.draft_n_accepted, self.drafted_steps) if self.drafted_steps else None,
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
            "acceptance_rate": ratio(self.draft_n_accepted, self.draft_n),
            "per_position_acceptance": [ratio(a, d) if d else None for a, d in zip(accepted, drafted)],
            "per_position_drafted": drafted,
            "histogram": self.histogram + [0] * (block_size - len(self.histogram)),
            "prompt_tokens": self.prompt_tokens,
            "prompt_ms": round(self.prompt_ms, 3),
            "decode_ms": round(self.decode_ms, 3),
            "decode_tokens_per_second": round(1e3 * self.tokens / self.decode_ms, 3) if self.decode_ms else 0.0,
            "finish_reasons": dict(self.finish_reasons),
        }


def ratio(a: float, b: float) -> float:
    """``a / b`` rounded to 4 places; 0.0 when ``b`` is 0 (nothing counted)."""
    return round(a / b, 4) if b else 0.0
