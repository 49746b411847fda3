"""``--spec-type ngram``: prompt-lookup drafting (no model).

Saxena 2023, "Prompt Lookup Decoding": find the most recent earlier occurrence of the
sequence's last n-gram and propose the tokens that followed it.
"""

from __future__ import annotations

import torch

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
                generator: torch.Generator) -> Draft:
        seq = tokens.tolist()
        L = len(seq)
        for size in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            suffix = seq[L - size:]
            # most recent earlier match: scan start positions right to left
            for start in range(L - size - 1, -1, -1):
                if seq[start:start + size] == suffix:
                    follow = seq[start + size:start + size + n]
                    if follow:
                        return Draft(torch.tensor(follow, dtype=torch.long))
                    break
        return Draft.empty()
