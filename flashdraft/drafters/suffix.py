"""``--spec-type suffix``: SuffixDecoding, prompt lookup over a suffix tree and past answers (no model).

Oliaro et al. 2024, "SuffixDecoding" (arXiv 2411.04975; Snowflake's Arctic Inference ships
it). Each step drafts from two trees (:class:`~flashdraft.drafters.suffix_tree.SuffixTree`)
and keeps the draft with the higher score (expected accepted tokens: the paper's
"speculation tree scoring"):

- the *request's* tree: this request's prompt and its answer so far, extended as tokens
  are committed (what prompt lookup searches, but every earlier occurrence votes);
- the *past answers* tree of the request's client (:class:`SuffixStore`): the answers of
  earlier requests that carried the same API key, across slots; a coding agent repeats
  itself from one request to the next.

Each draft is at most ``factor × match length`` tokens and stops where the estimated
probability of its path falls below ``min_prob`` (the paper's "determining MAX_SPEC"), so a
short, ambiguous match drafts little and a long one drafts deep. Drafts are deterministic (verified as one-hot), so the
output is the target's own.

Clients: the server keys each request by a hash of the API key it presented (``Authorization:
Bearer`` or ``X-Api-Key``; :mod:`flashdraft.server.clients`); requests without one share
the key ``None``. One client's answers are never drafted for another.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque

import torch

from flashdraft.device import HOST
from flashdraft.drafters.base import Draft, Drafter
from flashdraft.drafters.suffix_tree import Speculation, SuffixTree
from flashdraft.sampling import SamplingParams

#: defaults (``--spec-suffix-*``): the floor 0.1 is Arctic Inference's; factor 4 drafted
#: deeper than its 1 at about as many drafts as prompt lookup in the offline walk
#: (docs/benchmarks.md, "Results: the suffix drafter and the confidence gate")
DEFAULT_CACHE = 256
DEFAULT_FACTOR = 4.0
DEFAULT_MIN_PROB = 0.1
DEFAULT_DEPTH = 32


def client_key(secret: str | bytes | None) -> str | None:
    """A stable key for a client's credential: the SHA-256 of it (the tree never holds the
    credential itself), or None when the request carried none."""
    if not secret:
        return None
    raw = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(raw).hexdigest()


class SuffixStore:
    """Past answers per client, in one suffix tree each, bounded in answers kept.

    Args:
        max_answers: answers kept over all clients; the oldest is taken out first. 0 = none
            kept (drafting from the request alone).
        max_depth: the trees' depth (:class:`SuffixTree`).
    Raises:
        ValueError: ``max_answers < 0``.
    Thread-safe: slots of one server share a store.
    """

    def __init__(self, max_answers: int = DEFAULT_CACHE, max_depth: int = DEFAULT_DEPTH):
        if max_answers < 0:
            raise ValueError(f"max_answers must be >= 0, got {max_answers}")
        self.max_answers, self.max_depth = max_answers, max_depth
        self.trees: dict[str | None, SuffixTree] = {}
        self._order: deque[tuple[str | None, list[int]]] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Answers kept."""
        return len(self._order)

    def add(self, client: str | None, answer: list[int]) -> None:
        """Keep ``answer`` (token ids) for ``client``; evicts the oldest answers past the bound."""
        if not self.max_answers or not answer:
            return
        with self._lock:
            tree = self.trees.get(client)
            if tree is None:
                tree = self.trees[client] = SuffixTree(self.max_depth)
            tree.add(answer)
            self._order.append((client, answer))
            while len(self._order) > self.max_answers:
                old_client, old = self._order.popleft()
                self.trees[old_client].remove(old)
                if not len(self.trees[old_client]):
                    del self.trees[old_client]

    def speculate(self, client: str | None, context: list[int], n: int, factor: float,
                  min_prob: float) -> Speculation:
        """:meth:`SuffixTree.speculate` in ``client``'s tree (empty when it has none)."""
        with self._lock:
            tree = self.trees.get(client)
            return tree.speculate(context, n, factor, min_prob) if tree is not None else Speculation([])


class SuffixDrafter(Drafter):
    """SuffixDecoding drafter; deterministic (its drafts are verified as one-hot).

    Args:
        store: past answers shared by the server's slots (None = a new one of ``DEFAULT_CACHE``).
        factor: draft at most ``ceil(factor × match length)`` tokens.
        min_prob: stop a draft where its path probability falls below this.
        max_depth: the request tree's depth (match + draft length at most).
    Raises:
        ValueError: ``factor <= 0`` or ``min_prob`` outside [0, 1].
    """

    name = "suffix"

    def __init__(self, store: SuffixStore | None = None, factor: float = DEFAULT_FACTOR,
                 min_prob: float = DEFAULT_MIN_PROB, max_depth: int = DEFAULT_DEPTH):
        if factor <= 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
        self.store = store if store is not None else SuffixStore(max_depth=max_depth)
        self.factor, self.min_prob, self.max_depth = factor, min_prob, max_depth
        self.client: str | None = None
        self.reset()

    def reset(self) -> None:
        self.tree = SuffixTree(self.max_depth)  # this request's prompt and answer so far
        self._seen: list[int] = []  # what the tree holds (a prefix of every later ``tokens``)

    def start_request(self, client: str | None) -> None:
        self.client = client

    def finish_request(self, tokens: torch.Tensor, n_prompt: int) -> None:
        self.store.add(self.client, tokens[n_prompt:].tolist())

    def propose(self, tokens: torch.Tensor, n: int, params: SamplingParams,
                generator: torch.Generator, constraint=None) -> Draft:
        seq = tokens.tolist()
        seen = self._seen
        if len(seen) > len(seq) or seq[:len(seen)] != seen:  # another sequence: start over
            self.reset()
            seen = self._seen
        self.tree.extend(seq[len(seen):])
        self._seen = seq
        if n < 1:
            return Draft.empty()
        own = self.tree.speculate(seq, n, self.factor, self.min_prob)
        past = self.store.speculate(self.client, seq, n, self.factor, self.min_prob)
        best = past if past.score > own.score else own
        if not best.tokens:
            return Draft.empty()
        return Draft(torch.tensor(best.tokens, dtype=torch.long, device=HOST))
