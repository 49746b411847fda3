"""Prompt caches kept in host RAM between requests (llama-server's ``--cache-ram``).

A slot holds one prompt cache: the K/V of its last sequence. A request that shares little
with it (an agent's side request for a title or a summary) would overwrite it, and the
conversation's next turn would prefill its whole prompt again: 7.9k tokens of opencode's,
minutes on a CPU. Before that happens the slot's cache is copied here, and a request that
matches a copy here better than its slot's cache starts from the copy instead.

The rule is llama-server's (``server_prompt_cache``, tools/server/server-task.cpp): a
slot's cache is saved when the new prompt would keep less than half of it; a saved
prompt is loaded when it keeps at least a quarter of itself and both keeps more of itself
and covers more of the new prompt than the slot's cache does; a loaded copy leaves the
store. The oldest copies go first when the store holds more than its size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from flashdraft.generate import PromptCache, shared_prefix

log = logging.getLogger("flashdraft.prompt_store")

#: save the slot's cache when the new prompt keeps less than this share of it
SAVE_BELOW = 0.5
#: a saved prompt is a candidate only when the new prompt keeps at least this share of it
LOAD_MIN_KEEP = 0.25


@dataclass
class Saved:
    """One prompt in the store: ``tokens`` ``[L]``, the target's K/V copy, the drafter's context copy."""

    tokens: list[int]
    target_state: object
    drafter_state: object
    nbytes: int


class PromptStore:
    """Saved prompt caches, most recently used last.

    Args:
        limit_bytes: most bytes of K/V copies kept (the target's; a drafter's context copy
            is counted when it reports ``nbytes``); None = no limit.
    Raises:
        ValueError: ``limit_bytes`` < 1.
    """

    def __init__(self, limit_bytes: int | None):
        if limit_bytes is not None and limit_bytes < 1:
            raise ValueError(f"limit_bytes must be >= 1 or None, got {limit_bytes}")
        self.limit = limit_bytes
        self.entries: list[Saved] = []
        self.saves = self.loads = 0
        self._unsaved: set[str] = set()  # drafters whose context cannot be saved (logged once)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def swap(self, current: PromptCache | None, prompt_ids: list[int], target, drafter,
             reuse: bool = True) -> PromptCache | None:
        """The prompt cache a request for ``prompt_ids`` should start from.

        ``current`` is the slot's cache (``drafter`` holds its context). When the request
        would keep less than half of it, it is copied into the store first; then the saved
        prompt that suits the request better (see the module docstring), if any, is loaded
        into the target and ``drafter`` and returned, and ``current`` is freed. Otherwise
        ``current`` is returned (the request keeps its common prefix).

        With ``reuse`` False (a request without ``cache_prompt``: it reuses nothing) the
        slot's cache is saved and nothing is loaded.

        Args:
            target: has ``save_cache(cache)`` / ``load_cache(state)`` / ``free_cache(cache)``.
            drafter: the slot's drafter (:meth:`~flashdraft.drafters.base.Drafter.save_context`).
        """
        n_cur = 0 if current is None else min(len(current.tokens), getattr(current.cache, "length", 0))
        lcp = 0 if current is None or not reuse else current.reusable(prompt_ids)
        if n_cur and lcp >= SAVE_BELOW * n_cur:
            return current
        if n_cur:
            self._save(current, n_cur, target, drafter)
        if not reuse:
            return current
        best, keep_best, sim_best = None, (lcp / n_cur if n_cur else -1.0), lcp / len(prompt_ids)
        for entry in self.entries:
            n = shared_prefix(entry.tokens, prompt_ids)
            keep, sim = n / len(entry.tokens), n / len(prompt_ids)
            if keep >= LOAD_MIN_KEEP and keep > keep_best and sim > sim_best:
                best, keep_best, sim_best = entry, keep, sim
        if best is None:
            return current
        self.entries.remove(best)
        if current is not None:
            target.free_cache(current.cache)  # its copy is saved; the slot's sequence is needed now
        drafter.load_context(best.drafter_state)
        self.loads += 1
        log.info("prompt store: loaded a saved prompt of %d tokens (%d shared with this one); %d saved, %.1f MiB",
                 len(best.tokens), round(sim_best * len(prompt_ids)), len(self.entries), self.nbytes / 2**20)
        return PromptCache(best.tokens, target.load_cache(best.target_state))

    def _save(self, current: PromptCache, n: int, target, drafter) -> None:
        try:
            drafter_state = drafter.save_context()
        except NotImplementedError as e:
            if drafter.name not in self._unsaved:
                self._unsaved.add(drafter.name)
                log.info("prompt store: nothing saved with the %s drafter (%s)", drafter.name, e)
            return
        tokens = current.tokens[:n]
        # a saved prompt this one extends says nothing more: drop it
        self.entries = [e for e in self.entries if shared_prefix(e.tokens, tokens) < len(e.tokens)]
        state = target.save_cache(current.cache)
        size = state.nbytes + int(getattr(drafter_state, "nbytes", 0) or 0)
        if self.limit is not None and size > self.limit:
            return
        self.entries.append(Saved(tokens, state, drafter_state, size))
        while self.limit is not None and self.nbytes > self.limit:
            self.entries.pop(0)
        self.saves += 1
        log.info("prompt store: saved a prompt of %d tokens (%.1f MiB); %d saved, %.1f MiB", n, size / 2**20,
                 len(self.entries), self.nbytes / 2**20)

