"""The drafter interface shared by every drafting method.

Positions (one sequence): ``tokens[0..L-1]`` are committed; the last one is the *anchor*
(the bonus token of the previous verify, not yet run through the target). The drafter's
*context* is positions ``0..L-2``; it learns about new context through :meth:`commit`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from flashdraft.device import HOST
from flashdraft.sampling import SamplingParams


@dataclass
class Draft:
    """Proposed tokens of one step.

    Attributes:
        tokens: ``[n]`` int64 draft tokens (n may be 0), on the host (see :mod:`flashdraft.device`).
        probs: ``[n, V]`` drafter distributions the tokens were sampled from, or None when
            the draft is deterministic (treated as one-hot by verify); on the target's device.
        confidence: ``[n]`` float, the drafter's own probability of each of its tokens (a
            DFlash drafter's softmax), or None where the drafter has none (prompt lookup); the
            depth controller cuts the draft where the expected tokens per millisecond peak
            (:meth:`flashdraft.adaptive.ProfitController.cut`). Never changes what is accepted.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    confidence: list[float] | None = None

    @classmethod
    def empty(cls) -> "Draft":
        return cls(torch.empty(0, dtype=torch.long, device=HOST))


class Drafter:
    """Base class: proposes draft tokens for the target to verify.

    Subclasses set ``name`` and, when they need target hidden states as context features,
    ``feature_layer_ids`` (0-based target decoder layers).
    """

    name = "none"
    feature_layer_ids: list[int] | None = None
    #: longest draft this drafter can propose in one step (None = unbounded)
    max_draft: int | None = None
    #: sources with their own depth-controller estimates (a mixed-source drafter: the hybrid)
    SOURCES: tuple[str, ...] = ()
    #: per source of :attr:`SOURCES`, the longest draft it can propose (None: no sources)
    source_max_draft: dict[str, int] | None = None
    #: a draft costs next to nothing beside a target step and carries a confidence per token
    #: (prompt lookup): under the ``cost`` controller the loop then asks for the longest draft
    #: on every step, and the measured cost table with that confidence decides how much of it
    #: to verify (:meth:`flashdraft.adaptive.ProfitController.cut`), instead of the
    #: controller's standing depth turning drafting on or off for many steps at a time
    free_drafts: bool = False

    def reset(self) -> None:
        """Forget the previous sequence (called before every request)."""

    def rewind(self, n_context: int) -> int:
        """Start a request that shares its first ``n_context`` context positions with the
        sequence this drafter served last (the prompt cache): keep the per-sequence context
        state of those positions, drop the rest and every per-request statistic.

        Returns:
            how many leading context positions the drafter kept (<= ``n_context``); the
            caller prefills the target from there. This default suits drafters that keep no
            context state over positions (prompt lookup, none): it resets and keeps them all.
        """
        self.reset()
        return n_context

    def save_context(self) -> object:
        """A copy of this drafter's per-sequence context state (what :meth:`rewind` keeps),
        for the host-RAM prompt store (:mod:`flashdraft.prompt_store`); this one stays as it
        is. This default suits drafters whose context comes from the token ids alone
        (prompt lookup, suffix, a draft model that catches up): None.

        Raises:
            NotImplementedError: the drafter's context cannot be saved (the store then keeps
                nothing for it).
        """
        return None

    def load_context(self, state: object) -> None:
        """Make ``state`` (from :meth:`save_context`) this drafter's context; :meth:`rewind`
        follows. This default forgets the previous sequence (its context comes from the ids)."""
        self.reset()

    def fork(self) -> "Drafter":
        """A drafter for another concurrent sequence (a server slot): a shallow copy that
        shares this one's weights and settings, with its own per-sequence state.

        Everything a drafter keeps per sequence is created by :meth:`reset` (a DFlash
        context cache, a draft model's KV cache), so resetting the copy detaches it; the
        weights are never written, so sharing them between slots is safe.
        """
        clone = copy.copy(self)
        clone.reset()
        return clone

    def start_request(self, client: str | None) -> None:
        """Whose request the next sequence serves: a key of the API key it carried
        (:func:`flashdraft.drafters.suffix.client_key`), None for none. Called after
        :meth:`reset` / :meth:`rewind`; drafters that keep nothing across requests ignore it."""

    def finish_request(self, tokens: torch.Tensor, n_prompt: int) -> None:
        """The sequence ended: ``tokens [L]`` are its prompt (the first ``n_prompt``) and answer.
        Drafters that learn from past answers (:class:`~flashdraft.drafters.suffix.SuffixDrafter`)
        keep the answer for later requests of the same client."""

    def commit(self, n_context: int, features: torch.Tensor | None) -> None:
        """Positions ``0..n_context-1`` are now final context.

        Args:
            n_context: committed tokens minus the anchor (L-1).
            features: ``[m, F]`` target features of the m newest context positions
                (``n_context-m..n_context-1``), or None when not requested.
        """

    def next_source(self, tokens: torch.Tensor, pick=None) -> str | None:
        """Which of its sources this drafter will draft from after ``tokens``, for drafters
        that mix sources of different acceptance and cost (the hybrid); None = one source.

        Args:
            pick: ``pick(candidates) -> source``, the depth controller's choice among the
                sources that can draft this step (by expected tokens per second,
                :meth:`~flashdraft.adaptive.SourcedController.pick`); None = the drafter's own rule.

        The depth controller keeps separate estimates per source, so one source's failures
        do not turn off another's drafts.
        """
        return None

    def propose(self, tokens: torch.Tensor, n: int, params: SamplingParams,
                generator: torch.Generator, constraint=None) -> Draft:
        """Propose up to ``n`` tokens following ``tokens`` (``[L]`` committed ids).

        ``constraint``: the request's :class:`~flashdraft.constraints.Constraint`, or None.
        A drafter may use it to draft among allowed tokens only; the loop cuts every draft
        at the first refused token anyway, and verification masks the target, so ignoring
        it costs acceptance, never correctness."""
        return Draft.empty()


class NoDrafter(Drafter):
    """``--spec-type none``: plain decoding through the same loop (the baseline)."""
