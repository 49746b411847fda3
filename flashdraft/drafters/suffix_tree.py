"""A depth-bounded suffix tree of token sequences with occurrence counts, and speculation from it.

SuffixDecoding (Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for
Emerging AI Applications", arXiv 2411.04975, section "SuffixDecoding") drafts from suffix trees over earlier
token sequences: it matches the longest suffix of the current context in the tree, then
follows the most frequent continuation, one child at a time, while the estimated
probability of the drafted path stays above a floor, and drafts more tokens the longer
the match (its "speculation tree expansion" and "determining MAX_SPEC"; here one path,
not a tree of them, since verification here takes one linear block).

The tree here keeps every suffix of every inserted sequence, cut to ``max_depth`` tokens
(so it holds every substring of at most ``max_depth`` tokens, with how often it occurs).
Memory and insertion cost are ``O(len × max_depth)``; a match is a binary search over the
match length (if the last ``m`` tokens occur with a continuation, so do the last ``m - 1``).

Probability of a child: its count over the sum of its siblings' counts, i.e. the share of
earlier occurrences of the matched path that went on with that token. The path's
probability is the product along it; its *score* (the expected number of accepted drafts
if the estimates were right) is the sum of the path's prefix probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


@dataclass
class Speculation:
    """A drafted path: ``tokens``, the length ``match`` of the context suffix it continues,
    and ``score`` = Σ of the path's prefix probabilities (expected accepted drafts)."""

    tokens: list[int]
    match: int = 0
    score: float = 0.0


class SuffixTree:
    """Counts of every substring of up to ``max_depth`` tokens of the sequences added.

    Args:
        max_depth: longest substring kept (match + draft length at most).
    Raises:
        ValueError: ``max_depth < 2``.
    """

    def __init__(self, max_depth: int = 32):
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        #: nodes of the suffixes ending at the last token :meth:`extend` saw (an open sequence)
        self._open: list[_Node] = []

    def __len__(self) -> int:
        """Positions inserted (the root's count)."""
        return self.root.count

    # ------------------------------------------------------------------ building

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the open sequence: each new token extends every suffix that
        ends at the previous token (those shorter than ``max_depth``) and starts a new one."""
        open_nodes = self._open
        for tok in tokens:
            nxt = []
            for node in [self.root] + open_nodes:
                child = node.children.get(tok)
                if child is None:
                    child = node.children[tok] = _Node()
                child.count += 1
                nxt.append(child)
            self.root.count += 1
            # the suffix started at the oldest open position is now max_depth long: it stops
            open_nodes = nxt if len(nxt) < self.max_depth else nxt[: self.max_depth - 1]
        self._open = open_nodes

    def close(self) -> None:
        """End the open sequence: the next :meth:`extend` starts a new one (no suffix spans both)."""
        self._open = []

    def add(self, tokens: Sequence[int]) -> None:
        """Insert one whole sequence (and close it)."""
        self.close()
        self.extend(tokens)
        self.close()

    def remove(self, tokens: Sequence[int]) -> None:
        """Take out a sequence inserted earlier with :meth:`add` (its counts, and nodes left at 0).

        Raises:
            KeyError: a suffix of ``tokens`` is not in the tree (it was never added); the
                suffixes before it are already taken out.
        """
        tokens = list(tokens)
        for start in range(len(tokens)):
            node = self.root
            path = []
            for tok in tokens[start:start + self.max_depth]:
                child = node.children[tok]
                path.append((node, tok, child))
                node = child
            for parent, tok, child in path:
                child.count -= 1
                if child.count == 0:
                    del parent.children[tok]
                    break  # its subtree went with it
        self.root.count -= len(tokens)

    # ------------------------------------------------------------------ drafting

    def _walk(self, context: Sequence[int], m: int) -> _Node | None:
        node = self.root
        for tok in context[len(context) - m:]:
            node = node.children.get(tok)
            if node is None:
                return None
        return node

    def match(self, context: Sequence[int], max_match: int) -> tuple[int, _Node | None]:
        """Longest ``m <= max_match`` such that the last ``m`` tokens of ``context`` occur in
        the tree with a continuation; ``(m, its node)``, or ``(0, None)``."""
        def has_next(m: int) -> _Node | None:
            node = self._walk(context, m)
            return node if node is not None and node.children else None

        lo, hi, best = 1, min(max_match, len(context), self.max_depth - 1), None
        while lo <= hi:
            mid = (lo + hi) // 2
            node = has_next(mid)
            if node is not None:
                lo, best = mid + 1, (mid, node)
            else:
                hi = mid - 1
        return best if best is not None else (0, None)

    def speculate(self, context: Sequence[int], n: int, factor: float = 1.0, min_prob: float = 0.1,
                  max_match: int | None = None) -> Speculation:
        """Draft up to ``n`` tokens after ``context`` (SuffixDecoding, "determining MAX_SPEC").

        Args:
            context: the sequence so far (its last tokens are matched).
            n: most tokens to draft.
            factor: at most ``ceil(factor × match length)`` tokens are drafted.
            min_prob: stop before a token whose path probability would fall below this.
            max_match: longest suffix matched (default ``max_depth - n``, so that the
                tree's depth leaves room for ``n`` drafts after the longest match).
        Returns:
            the drafted path (empty when nothing matched or ``n < 1``).
        """
        m, node = self.match(context, max_match or max(1, self.max_depth - n))
        if node is None or n < 1:
            return Speculation([], m)
        budget = min(n, math.ceil(factor * m), self.max_depth - m)
        tokens, prob, score = [], 1.0, 0.0
        while len(tokens) < budget and node.children:
            total = sum(c.count for c in node.children.values())
            tok, child = max(node.children.items(), key=lambda kv: kv[1].count)
            if prob * child.count / total < min_prob:
                break
            prob *= child.count / total
            score += prob
            tokens.append(tok)
            node = child
        return Speculation(tokens, m, score)
