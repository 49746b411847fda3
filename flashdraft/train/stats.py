"""Acceptance counters shared by the online evaluation and the offline walk.

Both ``flashdraft eval`` (:mod:`flashdraft.train.evaluate`, the real loop) and the walk
(:mod:`flashdraft.train.walk`, regenerated answers) fill one :class:`AcceptanceStats`, so
their τ, histograms and per-position acceptance are the same numbers by construction; the
glossary of every counter is in :mod:`flashdraft.train.evaluate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashdraft.generate import Timings


@dataclass
class AcceptanceStats:
    """Counters summed over prompts (vLLM ``SpecDecodingStats`` style).

    ``total`` holds the counters: the sum of every answered prompt's :class:`Timings`
    (:meth:`add`); its ``n_steps`` counts each prompt's prefill too.
    """

    prompts: int = 0
    skipped_prompts: int = 0
    total: Timings = field(default_factory=Timings)
    finish_reasons: dict[str, int] = field(default_factory=dict)

    def add(self, t: Timings, finish_reason: str) -> None:
        """Count one answered prompt: its final timings and how it ended."""
        self.prompts += 1
        self.total.add(t)
        self.finish_reasons[finish_reason] = self.finish_reasons.get(finish_reason, 0) + 1

    @property
    def tau(self) -> float:
        """Mean tokens produced per verify step, rounded (:func:`ratio`)."""
        return ratio(self.total.verify_n, sum(self.total.step_hist))

    def to_dict(self, block_size: int) -> dict:
        """Summary; per-position lists and the histogram are padded to ``block_size - 1`` / ``block_size``.

        Per-position acceptance is None where nothing was drafted at that position.
        """
        t = self.total
        drafted = t.drafted_per_position + [0] * (block_size - 1 - len(t.drafted_per_position))
        accepted = t.accepted_per_position + [0] * (len(drafted) - len(t.accepted_per_position))
        return {
            "prompts": self.prompts,
            "skipped_prompts": self.skipped_prompts,
            "tokens": t.predicted_n,
            "verify_steps": t.n_steps - self.prompts,  # the prefill's token is not a verify step
            "drafted_steps": t.n_drafts,
            "tau": self.tau,
            "tau_drafted": 1.0 + ratio(t.draft_n_accepted, t.n_drafts) if t.n_drafts else None,
            "draft_n": t.draft_n,
            "draft_n_accepted": t.draft_n_accepted,
            "acceptance_rate": ratio(t.draft_n_accepted, t.draft_n),
            "per_position_acceptance": [ratio(a, d) if d else None for a, d in zip(accepted, drafted)],
            "per_position_drafted": drafted,
            "histogram": t.step_hist + [0] * (block_size - len(t.step_hist)),
            "prompt_tokens": t.prompt_n,
            "prompt_ms": round(t.prompt_ms, 3),
            "decode_ms": round(t.predicted_ms, 3),
            "decode_tokens_per_second": round(1e3 * t.predicted_n / t.predicted_ms, 3) if t.predicted_ms else 0.0,
            "finish_reasons": dict(self.finish_reasons),
        }


def ratio(a: float, b: float) -> float:
    """``a / b`` rounded to 4 places; 0.0 when ``b`` is 0 (nothing counted)."""
    return round(a / b, 4) if b else 0.0
