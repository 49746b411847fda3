"""``--spec-type ngram``: prompt-lookup drafting (no model).

Saxena 2023, "Prompt Lookup Decoding": find the most recent earlier occurrence of the
sequence's last n-gram and propose the tokens that followed it.
"""

from __future__ import annotations

import torch

from flashdraft.device import HOST
from flashdraft.drafters.base import Draft, Drafter
from flashdraft.sampling import SamplingParams


class NgramDrafter(Drafter):
    """Prompt-lookup drafter; deterministic (its drafts are verified as one-hot).

    Args:
        max_ngram: longest suffix n-gram to match (tried first).
        min_ngram: shortest suffix n-gram to match.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, tokens: torch.Tensor, n: int, params: SamplingParams,
                generator: torch.Generator, constraint=None) -> Draft:
        seq = tokens.tolist()
        L = len(seq)
        for size in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            suffix = seq[L - size:]
            # most recent earlier match: scan start positions right to left
            for start in range(L - size - 1, -1, -1):
                if seq[start:start + size] == suffix:
                    follow = seq[start + size:start + size + n]
                    if follow:
                        return Draft(torch.tensor(follow, dtype=torch.long, device=HOST))
                    break
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
