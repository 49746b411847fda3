"""Prompt lookup (flashdraft/drafters/ngram.py): the incremental n-gram index proposes what a
scan of the whole sequence finds, through appends, rollbacks and other sequences, and its
confidence follows the matched n-gram's length."""

from __future__ import annotations

import random

import pytest
import torch

from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.sampling import SamplingParams


def scan(seq: list[int], n: int, max_ngram: int = 3, min_ngram: int = 1, cap: int = 16,
         occurrences: int = 1) -> tuple[list[int], int]:
    """The reference: of the ``occurrences`` latest earlier occurrences of the longest suffix
    n-gram (a scan right to left), the one whose context matches longest, the latest among
    equals; ``(continuation, match length)``, the length counted back from the occurrence's
    end while its context equals the sequence's end (at most ``cap``)."""
    L = len(seq)
    for size in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        best, seen = None, 0
        for start in range(L - size - 1, -1, -1):
            if seq[start:start + size] == seq[L - size:]:
                end, m = start + size - 1, size
                while m < cap and end - m >= 0 and seq[end - m] == seq[L - 1 - m]:
                    m += 1
                if best is None or m > best[1]:
                    best = (seq[start + size:start + size + n], m)
                seen += 1
                if seen == occurrences:
                    break
        if best is not None:
            return best
    return [], 0


@pytest.mark.parametrize("occurrences", [1, 4])
def test_incremental_index_equals_a_scan_through_appends_and_rollbacks(occurrences):
    rng = random.Random(1)
    d = NgramDrafter(occurrences=occurrences)
    for _ in range(30):
        d.reset()
        seq = [rng.randint(0, 5) for _ in range(rng.randint(1, 6))]
        for _ in range(60):
            draft = d.propose(torch.tensor(seq), 5, SamplingParams(), None)
            want, m = scan(seq, 5, occurrences=occurrences)
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
        assert d.propose(torch.tensor(other), 5, SamplingParams(), None).tokens.tolist() == scan(
            other, 5, occurrences=occurrences)[0]


def test_several_occurrences_copy_the_one_whose_context_matches():
    """A line shown, then a variant of it, then the line again: the latest "3 4 5" is the
    variant's; the line's own occurrence matches 8 tokens back and is the copy being made."""
    line, variant = [1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12, 3, 4, 5, 60, 70]
    seq = line + [0] + variant + [0] + line[:5]
    latest = NgramDrafter().propose(torch.tensor(seq), 4, SamplingParams(), None)
    best = NgramDrafter(occurrences=8)
    draft = best.propose(torch.tensor(seq), 4, SamplingParams(), None)
    assert latest.tokens.tolist() == [60, 70, 0, 1] and draft.tokens.tolist() == [6, 7, 8, 9]
    assert best.last_match_length == 5 and draft.confidence[0] > latest.confidence[0]
    with pytest.raises(ValueError, match="occurrences"):
        NgramDrafter(occurrences=0)


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
