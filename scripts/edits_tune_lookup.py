#!/usr/bin/env python
"""``flashdraft bench`` with prompt-lookup variants as extra configurations, side by side.

The bench's lookup settings (n-gram sizes, draft length) are one per run; a tuning needs
several in one run, on the same prompts, interleaved, beside ``none`` and the shipped
``default``. This runs the bench unchanged and adds the configurations of ``VARIANTS``: each
is an existing configuration built with other lookup settings, or with the ``longest``
drafter below. Usage: the bench's own flags, e.g.

    python scripts/edits_tune_lookup.py --prompts edits,seed --limit 8 -n 256 -t 1 \\
        --configs none,default,ngram-cost/min2,... --json-out FILE

Variants (name = base configuration / change):

- ``ngram-cost/minK``, ``ngram-cost/maxJ-minK``: prompt lookup with n-gram sizes K..J
  (the default is 1..3);
- ``ngram-cost/longest``: the earlier occurrence whose context matches the current one for
  the most tokens (at least 2, at most 32), not the most recent of the longest n-gram, and a
  draft of at most 2 × the matched length: a short match drafts a little, a long one (a
  file being copied) drafts as far as the controller allows.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's flashdraft

import torch  # noqa: E402

from flashdraft import engine  # noqa: E402
from flashdraft.bench import contender, ours, runner  # noqa: E402
from flashdraft.device import HOST  # noqa: E402
from flashdraft.drafters.base import Draft  # noqa: E402
from flashdraft.drafters.ngram import NgramDrafter  # noqa: E402


class LongestMatchDrafter(NgramDrafter):
    """Prompt lookup at the occurrence with the longest matching context; drafts at most
    ``factor`` × the matched length."""

    name = "ngram"

    def __init__(self, min_match: int = 2, max_match: int = 32, factor: float = 2.0):
        super().__init__(max_ngram=min_match, min_ngram=min_match)
        self.min_match, self.max_match, self.factor = min_match, max_match, factor

    def fork(self):
        return LongestMatchDrafter(self.min_match, self.max_match, self.factor)

    def propose(self, tokens, n, params, generator, constraint=None):
        seq = tokens.tolist()
        L, m = len(seq), self.min_match
        if L <= m or n < 1:
            return Draft.empty()
        suffix = seq[L - m:]
        best, best_len = -1, 0
        for start in range(L - m - 1, -1, -1):
            if seq[start:start + m] != suffix:
                continue
            k = m
            while k < self.max_match and start - (k - m) - 1 >= 0 and seq[start - (k - m) - 1] == seq[L - k - 1]:
                k += 1
            if k > best_len:
                best, best_len = start, k
                if k >= self.max_match:
                    break
        if best < 0:
            return Draft.empty()
        room = min(n, math.ceil(self.factor * best_len))
        follow = seq[best + m:best + m + room]
        return Draft(torch.tensor(follow, dtype=torch.long, device=HOST)) if follow else Draft.empty()


#: name -> (configuration it varies, EngineConfig changes, lookup drafter factory or None)
VARIANTS = {
    "ngram-cost/min2": ("ngram-cost", {"ngram_min": 2}, None),
    "ngram-cost/min3": ("ngram-cost", {"ngram_min": 3}, None),
    "ngram-cost/max6-min2": ("ngram-cost", {"ngram_max": 6, "ngram_min": 2}, None),
    "ngram-cost/max6-min3": ("ngram-cost", {"ngram_max": 6, "ngram_min": 3}, None),
    "ngram-cost/longest": ("ngram-cost", {}, lambda: LongestMatchDrafter()),
    "ngram-cost/longest-m3": ("ngram-cost", {}, lambda: LongestMatchDrafter(min_match=3)),
    "suffix-adaptive/f1": ("suffix-adaptive", {"suffix_factor": 1.0}, None),
    "suffix-adaptive/p03": ("suffix-adaptive", {"suffix_min_prob": 0.3}, None),
}

_factory = None
_lookup = engine.lookup_drafter
_build = ours.build_ours


def lookup_drafter(cfg, kind):
    return _factory() if _factory is not None and kind == "ngram" else _lookup(cfg, kind)


def build_ours(name, base, target, draft_model, self_draft_layers=ours.SELF_DRAFT_LAYERS):
    global _factory
    if name not in VARIANTS:
        return _build(name, base, target, draft_model, self_draft_layers)
    head, changes, factory = VARIANTS[name]
    _factory = factory
    try:
        built = _build(head, dataclasses.replace(base, **changes), target, draft_model, self_draft_layers)
    finally:
        _factory = None
    built.name = name
    built.description = f"{contender.describe(head)}; {name.split('/', 1)[1]}"
    return built


engine.lookup_drafter = lookup_drafter
ours.build_ours = build_ours
ours.is_ours = lambda name, _is=ours.is_ours: name in VARIANTS or _is(name)
runner.ALL_CONFIGS = contender.ALL_CONFIGS + tuple(VARIANTS)
for _name, (_head, _, _) in VARIANTS.items():
    contender.DESCRIPTIONS[_name] = f"{contender.DESCRIPTIONS[_head]}; {_name.split('/', 1)[1]}"

if __name__ == "__main__":
    from flashdraft.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
