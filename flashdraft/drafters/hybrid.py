"""``--spec-type hybrid``: per step, the prompt-lookup continuation or the DFlash drafter's block.

Prompt lookup (:class:`~flashdraft.drafters.ngram.NgramDrafter`) costs nothing and is often
right where the answer repeats its context; the DFlash drafter costs one small forward and
proposes everywhere. Each step the hybrid takes the n-gram continuation when there is one
and n-gram drafts have recently been accepted at least as well as DFlash drafts, else the
DFlash block. "Recently" is an exponential average of accepted drafts per step, kept per
source and learned from what each verify accepted (the length of the next :meth:`commit`);
an n-gram candidate is still tried every ``probe_every`` steps so its average can recover.
The choice is made before the step's depth (:meth:`HybridDrafter.next_source`), so the
depth controller can keep one set of estimates per source: DFlash failing early in an
answer must not turn off n-gram drafts that would be accepted later, and the other way round.
The choice only decides *which* tokens are verified, so output stays the target's own.

The two sources have their own longest draft: a DFlash drafter proposes at most its block
size - 1 tokens, while a prompt-lookup continuation may run to ``ngram_depth`` (a copied
span is often longer than a block 8 drafter's 7 drafts), so ``max_draft`` is the larger
and :attr:`HybridDrafter.source_max_draft` tells the depth controller each source's own.
"""

from __future__ import annotations

import torch

from flashdraft.drafters.base import Draft, Drafter
from flashdraft.drafters.dflash import DFlashDrafter
from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.sampling import SamplingParams


class HybridDrafter(Drafter):
    """Prompt lookup where it pays, the DFlash drafter elsewhere.

    Args:
        dflash: the DFlash drafter (its context cache is kept current every step).
        ngram: the lookup source: prompt lookup (:class:`NgramDrafter`, the default) or
            SuffixDecoding (:class:`~flashdraft.drafters.suffix.SuffixDrafter`); any
            feature-free, deterministic drafter. Its source keeps the name ``"ngram"``.
        decay: weight of the past in the per-source averages of accepted drafts per step.
        probe_every: matched steps sent to DFlash before prompt lookup is tried anyway.
        ngram_depth: longest prompt-lookup draft (default: the DFlash drafter's block size - 1);
            DFlash drafts stay at most the drafter's block size - 1.
    Raises:
        ValueError: ``decay`` outside [0, 1) or ``ngram_depth < 1``.
    Attributes:
        accepted: per source ("ngram", "dflash"), the running average of accepted drafts per
            step it drafted (starts equal, so n-gram candidates are tried first: they are free).
        steps: per source, how many steps it drafted in this sequence.
        source_max_draft: per source of :attr:`SOURCES`, the longest draft it can propose.
    """

    name = "hybrid"

    def __init__(self, dflash: DFlashDrafter, ngram: Drafter | None = None, decay: float = 0.8,
                 probe_every: int = 8, ngram_depth: int | None = None):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if ngram_depth is not None and ngram_depth < 1:
            raise ValueError(f"ngram_depth must be >= 1, got {ngram_depth}")
        self.dflash, self.ngram, self.decay = dflash, ngram or NgramDrafter(), decay
        self.probe_every = probe_every
        self.feature_layer_ids = dflash.feature_layer_ids
        self.ngram_depth = ngram_depth or dflash.max_draft
        self.max_draft = max(dflash.max_draft, self.ngram_depth)
        self.source_max_draft = {"ngram": self.ngram_depth, "dflash": dflash.max_draft,
                                 "dflash-matched": dflash.max_draft}
        self.reset()

    def reset(self) -> None:
        self.dflash.reset()
        self.ngram.reset()
        self._reset_stats()

    def _reset_stats(self) -> None:
        """Per-request choice state: running acceptance per source and the pending draft."""
        self.accepted = {"ngram": 0.0, "dflash": 0.0}
        self.steps = {"ngram": 0, "dflash": 0}
        self._pending: tuple[str, int] | None = None  # (source, anchor position) of the last draft
        self._since_ngram = 0  # steps with an n-gram candidate that went to DFlash
        self._choice: tuple[int, str, Draft] | None = None  # (length of tokens, source, n-gram draft)

    def save_context(self) -> object:
        return self.dflash.save_context()

    def load_context(self, state: object) -> None:
        self.dflash.load_context(state)
        self.ngram.reset()

    def rewind(self, n_context: int) -> int:
        self.ngram.reset()
        self._reset_stats()
        return self.dflash.rewind(n_context)

    def fork(self) -> "HybridDrafter":
        return HybridDrafter(self.dflash.fork(), self.ngram.fork(), self.decay, self.probe_every, self.ngram_depth)

    def start_request(self, client: str | None) -> None:
        self.ngram.start_request(client)

    def finish_request(self, tokens: torch.Tensor, n_prompt: int) -> None:
        self.ngram.finish_request(tokens, n_prompt)

    def commit(self, n_context: int, features: torch.Tensor | None) -> None:
        if self._pending is not None:  # what the last verify kept of that source's drafts
            source, anchor = self._pending
            n_acc = max(0, n_context - anchor - 1)
            self.accepted[source] = self.decay * self.accepted[source] + (1 - self.decay) * n_acc
            self._pending = None
        self.dflash.commit(n_context, features)

    #: sources with their own depth-controller estimates (``dflash-matched``: DFlash on a step
    #: where prompt lookup had a match)
    SOURCES = ("ngram", "dflash", "dflash-matched")

    def next_source(self, tokens: torch.Tensor, pick=None) -> str:
        """``"ngram"``, ``"dflash"`` or ``"dflash-matched"``: the source of the next draft after ``tokens`` (kept
        for :meth:`propose`). With a match, ``pick`` (the depth controller's comparison of
        the two sources' expected tokens per second) decides, else the running averages of
        accepted drafts; every ``probe_every`` matched steps that went to DFlash, prompt
        lookup is tried anyway so its estimates stay current."""
        lookup = self.ngram.propose(tokens, self.ngram_depth, SamplingParams(), None)
        probe = self._since_ngram >= self.probe_every
        if not lookup.tokens.numel():
            source = "dflash"
        elif probe:
            source = "ngram"
        elif pick is not None:
            # DFlash where prompt lookup has a match is another source than DFlash elsewhere
            # (a seeded drafter starts from that match): compare it with prompt lookup on
            # matched steps only, not with DFlash's acceptance where nothing could be copied
            source = pick(("ngram", "dflash-matched"))
        else:
            source = "ngram" if self.accepted["ngram"] >= self.accepted["dflash"] else "dflash"
        self._choice = (tokens.shape[0], source, lookup)
        return source

    def propose(self, tokens: torch.Tensor, n: int, params: SamplingParams,
                generator: torch.Generator, constraint=None) -> Draft:
        n = min(n, self.max_draft)  # each source cuts to its own longest draft below
        if n <= 0:
            return Draft.empty()
        if self._choice is None or self._choice[0] != tokens.shape[0]:
            self.next_source(tokens)
        _, source, lookup = self._choice
        self._choice = None
        if source == "ngram":
            draft = Draft(lookup.tokens[:n], None if lookup.probs is None else lookup.probs[:n])
            self._since_ngram = 0
        else:
            self._since_ngram += int(lookup.tokens.numel() > 0)
            draft = self.dflash.propose(tokens, n, params, generator, constraint)
            source = "dflash"
        self.steps[source] += 1
        self._pending = (source, tokens.shape[0] - 1)
        return draft
