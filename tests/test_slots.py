"""Parallel slots (``-np N``): the packed target forward and the batched scheduler.

Greedy outputs of requests decoded together must equal each request decoded alone; a
cancelled request frees its slot; a long request never blocks a short one.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from flashdraft.cache import StaticKVCache
from flashdraft.drafters.dflash import DFlashDrafter, random_dflash_model
from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.fast_forward import can_pack
from flashdraft.generate import Cancelled, SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from flashdraft.server.scheduler import GenerationJob, Scheduler
from tiny import tiny_model, tiny_target, tiny_tokenizer
from flashdraft.target import Target

GREEDY = SamplingParams()
PROMPTS = [[5, 9, 17, 3, 22, 41], [7, 30, 2, 11, 7, 30, 2], [40, 41, 42], [12, 13, 12, 13, 12, 13, 12, 13, 9]]


# -- forward_packed ----------------------------------------------------------------------

def _histories(target: Target, lengths: list[int]) -> list[StaticKVCache]:
    """Caches that already hold ``lengths[i]`` positions of a fixed token history."""
    caches = []
    for n in lengths:
        cache = target.new_cache()
        if n:
            target.forward(torch.arange(1, n + 1) % 60 + 1, cache)
        caches.append(cache)
    return caches


def _packed_vs_alone(target: Target):
    # a prefill from 0, a verify block after 7 positions, a 1-token step after 12, a block after 30
    lengths = [0, 7, 12, 30]
    blocks = [torch.tensor([5, 9, 17, 3, 22]), torch.tensor([8, 8, 2, 41]), torch.tensor([33]),
              torch.tensor([1, 2, 3, 4, 5, 6])]
    logits_from = [4, 0, 0, 2]
    alone_caches, packed_caches = _histories(target, lengths), _histories(target, lengths)
    alone = [target.forward(b, c, lf) for b, c, lf in zip(blocks, alone_caches, logits_from)]
    packed = target.forward_packed(list(zip(blocks, packed_caches, logits_from)))
    for c in packed_caches:
        c.rollback(c.length)  # still consistent
    assert [c.length for c in packed_caches] == [c.length for c in alone_caches]
    return alone, packed, alone_caches, packed_caches


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forward_packed_equals_forward_per_sequence_fp32(arch):
    target = tiny_target(arch)
    target.set_feature_layers([1, 3])
    alone, packed, ca, cp = _packed_vs_alone(target)
    for (la, fa), (lp, fp) in zip(alone, packed):
        assert lp.shape == la.shape and fp.shape == fa.shape
        torch.testing.assert_close(lp, la, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fp, fa, rtol=1e-5, atol=1e-5)
    for a, p in zip(ca, cp):  # the K/V written into each sequence's own cache
        torch.testing.assert_close(p.buffer[:, :, :, :p.length], a.buffer[:, :, :, :a.length], rtol=1e-5, atol=1e-5)


def test_forward_packed_is_bitwise_with_bf16_weights():
    if not can_pack(torch.bfloat16):
        pytest.skip("no bf16 oneDNN kernels on this CPU")
    target = Target(tiny_model("llama").to(torch.bfloat16), tiny_tokenizer())
    target.set_feature_layers([2])
    alone, packed, _, _ = _packed_vs_alone(target)
    for (la, fa), (lp, fp) in zip(alone, packed):
        assert torch.equal(lp, la) and torch.equal(fp, fa)


def test_forward_packed_falls_back_for_other_caches():
    target = tiny_target("llama")
    hf = [target.new_cache(fast=False), target.new_cache(fast=False)]
    out = target.forward_packed([(torch.tensor([5, 9, 17]), hf[0], 2), (torch.tensor([7]), hf[1], 0)])
    ref = target.forward(torch.tensor([5, 9, 17]), target.new_cache(fast=False), 2)
    torch.testing.assert_close(out[0][0], ref[0], rtol=1e-5, atol=1e-5)
    assert [c.length for c in hf] == [3, 1]
    cache = target.new_cache()
    with pytest.raises(ValueError, match="own cache"):
        target.forward_packed([(torch.tensor([5]), cache, 0), (torch.tensor([6]), cache, 0)])
