"""Prompt lookup (flashdraft/drafters/ngram.py): the incremental n-gram index proposes what a
scan of the whole sequence finds, through appends, rollbacks and other sequences, and its
confidence follows the matched n-gram's length."""

from __future__ import annotations

import random

import torch

from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.sampling import SamplingParams


def scan(seq: list[int], n: int, max_ngram: int = 3, min_ngram: int = 1, cap: int = 16) -> tuple[list[int], int]:
    """The reference: the latest earlier occurrence of the longest suffix n-gram, by a scan
    right to left; ``(continuation, match length)``, the length counted back from the
    occurrence's end while its context equals the sequence's end (at most ``cap``)."""
    L = len(seq)
    for size in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        for start in range(L - size - 1, -1, -1):
            if seq[start:start + size] == seq[L - size:]:
                end, m = start + size - 1, size
                while m < cap and end - m >= 0 and seq[end - m] == seq[L - 1 - m]:
                    m += 1
                return seq[start + size:start + size + n], m
    return [], 0


def test_incremental_index_equals_a_scan_through_appends_and_rollbacks():
    rng = random.Random(1)
    d = NgramDrafter()
    for _ in range(30):
        d.reset()
        seq = [rng.randint(0, 5) for _ in range(rng.randint(1, 6))]
        for _ in range(60):
            draft = d.propose(torch.tensor(seq), 5, SamplingParams(), None)
            want, m = scan(seq, 5)
            assert draft.tokens.tolist() == want
            assert d.last_match_length == m
            if want:
                k = next((i for i, top in enumerate(d.MATCH_BUCKETS) if m <= top), len(d.MATCH_BUCKETS))
                assert draft.confidence == [d.FIRST_CONFIDENCE[k]] + [d.LATER_CONFIDENCE[k]] * (len(want) - 1)
            else:
                assert not draft.confidence
            if rng.random() < 0.15 and len(seq) > 2:  # a rollback: a shorter, then different, sequence
                seq = seq[:rng.randint(1, len(seq) - 1)]
            else:
                seq = seq + [rng.randint(0, 5) for _ in range(rng.randint(1, 3))]
        # the same drafter handed an unrelated sequence of the same length starts over
        other = [(t + 1) % 6 for t in seq]
        assert d.propose(torch.tensor(other), 5, SamplingParams(), None).tokens.tolist() == scan(other, 5)[0]


def test_longer_matches_are_more_confident():
    d = NgramDrafter()
    one = d.propose(torch.tensor([1, 2, 9, 8, 2]), 3, SamplingParams(), None)  # only "2" recurs
    d.reset()
    three = d.propose(torch.tensor([1, 2, 3, 4, 5, 1, 2, 3]), 3, SamplingParams(), None)  # "1 2 3" recurs
    assert d.last_match_length == 3
    d.reset()
    text = list(range(10, 30))
    long = d.propose(torch.tensor(text + [7] + text[:12]), 3, SamplingParams(), None)  # 12 tokens recur
    assert d.last_match_length == 12
    assert one.tokens.tolist() == [9, 8, 2] and three.tokens.tolist() == [4, 5, 1] and long.tokens.tolist() == [22, 23, 24]
    assert one.confidence[0] < three.confidence[0] < long.confidence[0]
    assert one.confidence[0] < one.confidence[1]  # a copy that started well goes on well
