"""What one timed generation produced: tokens, times and speculative counters.

Every configuration (our engine, transformers, llama.cpp, a remote server) returns a
:class:`Generation`, so the statistics and the report never care where it came from.

Glossary (DESIGN.md §1): a *step* is one target forward that returns tokens (the prefill
counts as the first step); each verify step accepts ``k >= 0`` draft tokens and adds one
bonus token, so it yields ``k + 1`` tokens; τ (acceptance length) = tokens / verify steps,
the prefill left out and the last step counted through the token that ended the answer
(``Timings.verify_n``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashdraft.generate import Timings


@dataclass
class SpecCounts:
    """Speculative counters of one generation (vLLM spec_decode style).

    Attributes:
        steps: target forwards that returned tokens, prefill included; None when unknown
            (a server that reports only ``draft_n``/``draft_n_accepted``).
        draft_n: draft tokens proposed.
        draft_n_accepted: draft tokens accepted.
        accepted_per_position: ``[k]`` = steps whose draft token k+1 was accepted.
        drafted_per_position: ``[k]`` = steps that proposed a draft token k+1.
        accepted_hist: ``[k]`` = steps that accepted exactly k draft tokens (yielded k+1).
        acceptance_length: τ when the source reports it directly (a server); else derived.
        draft_ms: time spent drafting, ms (our engine's ``Timings.draft_ms``), else None.
    """

    steps: int | None = None
    draft_n: int = 0
    draft_n_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_hist: list[int] = field(default_factory=list)
    acceptance_length: float | None = None
    #: ms inside the drafter (our engine only; None where the source does not say)
    draft_ms: float | None = None

    def tau(self) -> float | None:
        """τ: mean tokens per step (accepted drafts + bonus) from the histogram, so the
        step that ends a run on EOS still counts its tokens; else the reported value."""
        if self.accepted_hist and sum(self.accepted_hist):
            return sum((k + 1) * n for k, n in enumerate(self.accepted_hist)) / sum(self.accepted_hist)
        return self.acceptance_length

    def add_step(self, drafted: int, accepted: int) -> None:
        """Count one step that proposed ``drafted`` tokens and accepted the first ``accepted``."""
        accepted = max(0, min(accepted, drafted))
        self.steps = (self.steps or 0) + 1
        self.draft_n += drafted
        self.draft_n_accepted += accepted
        _grow(self.drafted_per_position, drafted)
        _grow(self.accepted_per_position, drafted)
        for k in range(drafted):
            self.drafted_per_position[k] += 1
            self.accepted_per_position[k] += int(k < accepted)
        _grow(self.accepted_hist, accepted + 1)
        self.accepted_hist[accepted] += 1


def _grow(counts: list[int], n: int) -> None:
    counts.extend([0] * (n - len(counts)))


def counts_from_timings(t: Timings) -> SpecCounts:
    """Our engine's :class:`Timings` -> :class:`SpecCounts`: the histogram is the engine's
    own per-step count of the verify steps (``Timings.step_hist``), so the bench's τ is the
    server's ``timings.acceptance_length`` (the last step counted through the token that
    ended the answer, an end-of-sequence token included; the prefill's token left out).
    """
    hist = list(t.step_hist) or [0]
    return SpecCounts(steps=t.n_steps, draft_n=t.draft_n, draft_n_accepted=t.draft_n_accepted,
                      accepted_per_position=list(t.accepted_per_position),
                      drafted_per_position=list(t.drafted_per_position), accepted_hist=hist,
                      draft_ms=t.draft_ms)


#: :class:`~flashdraft.constraints.Constraint` calls by role in the loop: the verify rows'
#: masks, the drafting side (DFlash masks its own picks, the others' drafts are cut at the
#: first refused token) and moving the matcher along the returned tokens
GRAMMAR_ROLES = {"apply": "verify", "here": "draft", "allowed": "draft", "push": "draft", "rollback": "draft",
                 "valid_prefix": "draft", "unpack": "draft", "advance": "advance"}


@dataclass
class GrammarCost:
    """Time spent inside one generation's grammar constraint, measured call by call.

    Attributes:
        ms: milliseconds per :class:`~flashdraft.constraints.Constraint` method (outermost
            calls only: a method called from another is not counted twice).
        calls: calls per method.
        setup_ms: building the matcher for this request (before the clock of the run starts).
    """

    ms: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    setup_ms: float = 0.0

    def add(self, method: str, seconds: float) -> None:
        """Count one call of ``method`` that took ``seconds``."""
        self.ms[method] = self.ms.get(method, 0.0) + 1e3 * seconds
        self.calls[method] = self.calls.get(method, 0) + 1

    @property
    def total_ms(self) -> float:
        """Every timed call, setup excluded (ms)."""
        return sum(self.ms.values())

    def by_role(self) -> dict[str, float]:
        """``{"verify", "draft", "advance"}`` -> ms (see :data:`GRAMMAR_ROLES`)."""
        out = {"verify": 0.0, "draft": 0.0, "advance": 0.0}
        for method, ms in self.ms.items():
            out[GRAMMAR_ROLES.get(method, "draft")] += ms
        return out


@dataclass
class Generation:
    """One timed generation.

    Times are milliseconds from the moment the request was issued.

    Attributes:
        text: the generated text (decoded without special tokens).
        token_ids: generated token ids (EOS excluded); None when only text is known (servers).
        prompt_tokens: tokens of the prompt as the model saw it.
        completion_tokens: generated tokens returned (EOS excluded).
        ttft_ms: time to the first generated token; None when not measured.
        total_ms: time to the last generated token.
        finish_reason: ``"stop"`` (EOS / stop string) | ``"length"`` | None when unknown.
        spec: speculative counters; None for plain decoding or when the source has none.
        decode_ms / decode_tokens: the decode phase, from which decode tokens/s is computed.
            Default: the wall clock between the first and the last token and the tokens
            after the first one. Servers that report llama-server ``timings`` override it
            with ``predicted_ms`` / ``predicted_n`` (``decode_source`` says which).
        grammar: time inside the grammar constraint; None when unconstrained or not
            measurable (a remote server).
        cached_tokens: prompt tokens taken from the prompt cache instead of prefilled (a
            conversation's later turn, the ``replay`` set); None when the source does not say.
    """

    text: str
    token_ids: list[int] | None
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    total_ms: float
    finish_reason: str | None = None
    spec: SpecCounts | None = None
    decode_ms: float | None = None
    decode_tokens: int | None = None
    decode_source: str = "client"
    grammar: GrammarCost | None = None
    cached_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.decode_ms is None and self.ttft_ms is not None and self.completion_tokens > 1:
            self.decode_ms = self.total_ms - self.ttft_ms
            self.decode_tokens = self.completion_tokens - 1

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Decode speed in tokens/s (prefill and first token excluded); None if unmeasurable."""
        if not self.decode_ms or not self.decode_tokens or self.decode_ms <= 0:
            return None
        return 1e3 * self.decode_tokens / self.decode_ms
