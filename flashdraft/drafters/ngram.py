"""``--spec-type ngram``: prompt-lookup drafting (no model).

Saxena 2023, "Prompt Lookup Decoding": find the most recent earlier occurrence of the
sequence's last n-gram and propose the tokens that followed it. ``--spec-type ngram`` keeps
the 8 latest occurrences and copies from the one whose context matches the sequence's end
longest (docs/performance.md §15); the DFlash drafter's seeding keeps Saxena's rule, as trained.
"""

from __future__ import annotations

import torch

from flashdraft.device import HOST
from flashdraft.drafters.base import Draft, Drafter
from flashdraft.sampling import SamplingParams


class NgramDrafter(Drafter):
    """Prompt-lookup drafter; deterministic (its drafts are verified as one-hot).

    The n-grams seen so far are kept in one dictionary per size (n-gram -> end of its
    latest occurrence), updated with the tokens each step adds, so a proposal costs the
    same at 100 and at 10,000 context tokens (a scan of the whole sequence cost ~1 ms per
    1,000 tokens, which a long agent prompt paid on every step).

    Each draft token carries a confidence (:attr:`Draft.confidence`): its chance of
    acceptance by how long the context of the copied occurrence matches the sequence's end
    (:attr:`last_match_length`, counted back up to :data:`MATCH_CAP` tokens, past the n-gram
    that found it) and whether it is the copy's first token (:data:`FIRST_CONFIDENCE`,
    :data:`LATER_CONFIDENCE`: measured on SmolLM2-135M's greedy answers to 20 bench prompts,
    ``scripts/lookup_confidence.py``). The ``cost`` controller calibrates them further by what
    it measures, bin by bin, and verifies only the prefix that pays
    (:meth:`flashdraft.adaptive.ProfitController.cut`).

    With ``occurrences > 1`` the drafter keeps that many latest occurrences of each n-gram
    and copies from the one whose context matches the sequence's end longest (the latest
    among equals): in a file shown twice, or code that repeats a line with one change, the
    latest occurrence of a 3-gram is often not the copy being made.

    Args:
        max_ngram: longest suffix n-gram to match (tried first).
        min_ngram: shortest suffix n-gram to match.
        occurrences: latest occurrences of each n-gram kept as candidates (1 = the latest
            only, Saxena's rule: the DFlash drafter's seeding, as trained).
    Raises:
        ValueError: unless ``1 <= min_ngram <= max_ngram`` and ``occurrences >= 1``.
    """

    name = "ngram"
    #: a draft costs ~20 µs, nothing next to a target step: under the cost controller the
    #: loop asks for the longest draft every step and the cut decides (generate.py)
    free_drafts = True
    #: longest match length counted (tokens)
    MATCH_CAP = 16
    #: upper ends of the match-length buckets (tokens); longer matches are the last bucket
    MATCH_BUCKETS = (1, 2, 4, 7, 15)
    #: P(a copy's first token is accepted) per bucket: lengths 1, 2, 3-4, 5-7, 8-15, 16+
    FIRST_CONFIDENCE = (0.24, 0.53, 0.71, 0.79, 0.93, 0.98)
    #: P(a later token is accepted | the ones before it were) per bucket
    LATER_CONFIDENCE = (0.69, 0.82, 0.81, 0.89, 0.94, 0.98)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, occurrences: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if occurrences < 1:
            raise ValueError(f"need occurrences >= 1, got {occurrences}")
        self.max_ngram, self.min_ngram, self.occurrences = max_ngram, min_ngram, occurrences
        self.reset()

    def reset(self) -> None:
        self._known = torch.empty(0, dtype=torch.long, device=HOST)  # the tokens indexed so far
        self._ids: list[int] = []
        # n-gram -> ends of its latest occurrences (oldest first, at most self.occurrences)
        self._ends: dict[int, dict[tuple, list[int]]] = {s: {} for s in range(self.min_ngram, self.max_ngram + 1)}
        self._indexed = 0  # n-grams ending at positions < this are in _ends
        #: tokens of context the last draft's occurrence shared with the sequence's end (0: none)
        self.last_match_length = 0

    def _sync(self, tokens: torch.Tensor) -> None:
        """Index the n-grams of ``tokens`` that end before its last position (the suffix
        being matched must not match itself); starts over when ``tokens`` does not extend
        what was indexed (another sequence, a rollback)."""
        n = self._known.shape[0]
        if tokens.shape[0] < n or not torch.equal(tokens[:n], self._known):
            self.reset()
            n = 0
        self._ids.extend(tokens[n:].tolist())
        self._known = tokens.clone()
        ids, tables, keep = self._ids, self._ends, self.occurrences
        for p in range(self._indexed, len(ids) - 1):
            for s, table in tables.items():
                if p - s + 1 >= 0:
                    ends = table.setdefault(tuple(ids[p - s + 1:p + 1]), [])
                    ends.append(p)
                    if len(ends) > keep:
                        del ends[0]
        self._indexed = max(self._indexed, len(ids) - 1)

    def propose(self, tokens: torch.Tensor, n: int, params: SamplingParams,
                generator: torch.Generator, constraint=None) -> Draft:
        """Up to ``n`` tokens that followed the latest earlier occurrence of the longest
        suffix n-gram of ``tokens [L]`` that occurred before (of its kept occurrences, the
        one whose context matches longest); empty where none did."""
        self._sync(tokens)
        ids, L = self._ids, len(self._ids)
        self.last_match_length = 0
        for size in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            ends = self._ends[size].get(tuple(ids[L - size:]))
            if ends:
                end, m = -1, 0
                for e in reversed(ends):  # latest first: an earlier one must match longer to win
                    k = size  # how far back this occurrence's context goes on matching
                    while k < self.MATCH_CAP and e - k >= 0 and ids[e - k] == ids[L - 1 - k]:
                        k += 1
                    if k > m:
                        end, m = e, k
                follow = ids[end + 1:end + 1 + n]
                self.last_match_length = m
                k = next((i for i, top in enumerate(self.MATCH_BUCKETS) if m <= top), len(self.MATCH_BUCKETS))
                conf = [self.FIRST_CONFIDENCE[k]] + [self.LATER_CONFIDENCE[k]] * (len(follow) - 1)
                return Draft(torch.tensor(follow, dtype=torch.long, device=HOST), confidence=conf)
        return Draft.empty()


def lookup_candidates(ids: list[int], anchors, n: int, max_ngram: int = 3, min_ngram: int = 1) -> list[list[int]]:
    """Prompt-lookup continuations at many anchors of one sequence, in one pass.

    For anchor ``a`` this is exactly ``NgramDrafter(max_ngram, min_ngram).propose(ids[:a+1], n)``
    (the most recent earlier occurrence of the longest matching suffix n-gram, and up to
    ``n`` tokens that followed it), but computed with one dictionary per n-gram size while
    walking the sequence once, so it never reads a token after the anchor (tested).

    Args:
        ids: token ids of the sequence.
        anchors: increasing anchor positions.
        n: tokens per continuation at most.
    Returns:
        one list of at most ``n`` token ids per anchor (empty where nothing matched).
    """
    sizes = range(max_ngram, min_ngram - 1, -1)
    last_end: dict[int, dict[tuple, int]] = {s: {} for s in sizes}  # n-gram -> end of its latest occurrence
    out: list[list[int]] = []
    want = iter(anchors)
    nxt = next(want, None)
    for p in range(len(ids)):
        if nxt is not None and p == nxt:
            cand: list[int] = []
            for s in sizes:
                if s > p:  # the suffix needs an earlier occurrence: at most p tokens long
                    continue
                e = last_end[s].get(tuple(ids[p - s + 1:p + 1]))
                if e is not None:
                    cand = ids[e + 1:min(e + 1 + n, p + 1)]
                    break
            out.append(cand)
            nxt = next(want, None)
        for s in sizes:  # the n-grams ending at p become visible to later anchors
            if p - s + 1 >= 0:
                last_end[s][tuple(ids[p - s + 1:p + 1])] = p
    while nxt is not None:  # anchors past the end
        out.append([])
        nxt = next(want, None)
    return out
