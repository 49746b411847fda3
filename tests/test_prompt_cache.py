"""Prompt cache (``cache_prompt``): a request reuses the caches its slot's last request left.

Tiny random models here; the real-model multi-turn check is in ``test_real_model.py``.
"""

from __future__ import annotations

import pytest

from flashdraft import batch
from flashdraft.drafters.dflash import DFlashDrafter, random_dflash_model
from flashdraft.drafters.draft_model import DraftModelDrafter
from flashdraft.drafters.hybrid import HybridDrafter
from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.generate import GenerationRequest, PromptCache, SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from tiny import tiny_model, tiny_target

GREEDY = SamplingParams()
TURN1 = [5, 9, 17, 3, 22, 41, 7, 7, 12]


def _drafters(target):
    dflash = lambda: DFlashDrafter(random_dflash_model(target.model, num_layers=1, block_size=6),  # noqa: E731
                                   target.embed_tokens, target.lm_head)
    return {"none": None, "ngram": NgramDrafter(), "dflash": dflash(),
            "hybrid": HybridDrafter(dflash()),
            "draft": DraftModelDrafter(tiny_model("llama", seed=7), target.vocab_size)}


def _fresh(target, drafter, prompt, n):
    return generate_text(SpeculativeGenerator(target, drafter, n_draft=4), prompt, n, GREEDY, ignore_eos=True)


@pytest.mark.parametrize("kind", ["none", "ngram", "dflash", "hybrid", "draft"])
def test_second_turn_reuses_prefix_and_equals_fresh(kind):
    target = tiny_target("llama", seed=1)
    gen = SpeculativeGenerator(target, _drafters(target)[kind], n_draft=4)
    _, ids1, _, t1 = generate_text(gen, TURN1, 12, GREEDY, ignore_eos=True, cache_prompt=True)
    assert t1.cache_n == 0 and t1.prompt_n == len(TURN1)
    # the next turn: the whole first exchange, then new tokens
    turn2 = TURN1 + ids1 + [30, 31, 2]
    _, ids2, _, t2 = generate_text(gen, turn2, 15, GREEDY, ignore_eos=True, cache_prompt=True)
    # the cache holds the prompt and every answer token but the last (never run through the target)
    assert t2.cache_n == len(TURN1) + len(ids1) - 1
    assert t2.prompt_n == len(turn2) - t2.cache_n
    fresh = _fresh(target, _drafters(target)[kind], turn2, 15)
    assert ids2 == fresh[1]


def test_diverging_prompt_reuses_only_the_common_prefix():
    target = tiny_target("qwen3", seed=2)
    d = _drafters(target)
    gen = SpeculativeGenerator(target, d["dflash"], n_draft=4)
    generate_text(gen, TURN1, 10, GREEDY, ignore_eos=True)
    other = TURN1[:4] + [50, 51, 52]
    _, ids, _, t = generate_text(gen, other, 10, GREEDY, ignore_eos=True, cache_prompt=True)
    assert t.cache_n == 4
    assert ids == _fresh(target, _drafters(target)["dflash"], other, 10)[1]


def test_identical_prompt_reprefills_its_last_token():
    target = tiny_target("llama", seed=3)
    gen = SpeculativeGenerator(target, NgramDrafter(), n_draft=4)
    first = generate_text(gen, TURN1, 8, GREEDY, ignore_eos=True, cache_prompt=True)
    again = generate_text(gen, TURN1, 8, GREEDY, ignore_eos=True, cache_prompt=True)
    assert again[3].cache_n == len(TURN1) - 1 and again[3].prompt_n == 1
    assert again[1] == first[1]


def test_cache_prompt_off_prefills_everything():
    target = tiny_target("llama", seed=3)
    gen = SpeculativeGenerator(target, NgramDrafter(), n_draft=4)
    generate_text(gen, TURN1, 8, GREEDY, ignore_eos=True)
    t = generate_text(gen, TURN1 + [3], 8, GREEDY, ignore_eos=True, cache_prompt=False)[3]
    assert t.cache_n == 0 and t.prompt_n == len(TURN1) + 1


def test_failed_request_leaves_no_cache():
    target = tiny_target("llama", seed=3)
    gen = SpeculativeGenerator(target, NgramDrafter(), n_draft=4)
    generate_text(gen, TURN1, 8, GREEDY, ignore_eos=True)
    assert gen.prompt_cache is not None
    steps = gen.generate(TURN1, 8, GREEDY, cancelled=lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        list(steps)
    assert gen.prompt_cache is None


def test_reusable_prefix_rules():
    cached = PromptCache([1, 2, 3, 4], cache=None)
    assert cached.reusable([1, 2, 3, 4, 5]) == 4
    assert cached.reusable([1, 2, 3, 4]) == 3  # the last prompt token must be run for its logits
    assert cached.reusable([1, 2, 9]) == 2
    assert cached.reusable([7]) == 0


def test_slots_pick_the_slot_with_the_longest_prefix_and_reuse_it():
    target = tiny_target("llama", seed=4)
    d = _drafters(target)
    gen = SpeculativeGenerator(target, d["dflash"], n_draft=4)
    slots = batch.make_slots(gen, 2)
    a, b = TURN1, [40, 41, 42, 43, 44, 45]
    outs = {}
    for slot, prompt in zip(slots, (a, b)):  # one request per slot, run to the end together
        batch.start(gen, slot, GenerationRequest(prompt, 6, GREEDY, ignore_eos=True, cache_prompt=True))
    while any(not s.free and not s.seq.done for s in slots):
        live = [s for s in slots if not s.seq.done]
        batch.step_together(target, [s.seq for s in live])
    for slot in slots:
        outs[slot.index] = slot.seq.tokens[len(a if slot.index == 0 else b):].tolist()
        slot.prompt_cache, slot.seq = slot.seq.leftover(), None
    follow = b + outs[1][:-1] + [9, 9]
    assert batch.best_slot(slots, follow) is slots[1]
    slot = slots[1]
    batch.start(gen, slot, GenerationRequest(follow, 7, GREEDY, ignore_eos=True, cache_prompt=True))
    assert slot.seq.t.cache_n == len(b) + len(outs[1]) - 1
    ids = []
    while not slot.seq.done:
        ids += batch.step_together(target, [slot.seq])[0].token_ids
    assert ids == _fresh(target, _drafters(target)["dflash"], follow, 7)[1]


def test_a_side_request_takes_the_cheapest_slot_not_the_long_prefix():
    """An agent's short title request shares only the chat template's first tokens with the
    long conversation: it takes the empty (or least filled) slot, and the conversation's next
    turn still finds its prefix (llama-server's slot similarity, 0.1 of the prompt)."""

    class HeldCache:  # a cache that holds all its tokens
        def __init__(self, n: int):
            self.length = n

    def slot(index: int, tokens: list[int] | None) -> batch.Slot:
        cache = None if tokens is None else PromptCache(tokens, HeldCache(len(tokens)))
        return batch.Slot(index, None, None, prompt_cache=cache)

    long_turn = [1, 2, 3] + list(range(100, 400))
    side = [1, 2, 3] + list(range(7, 35))  # 3 of 31 tokens shared: under 0.1
    slots = [slot(0, long_turn), slot(1, None)]
    assert batch.best_slot(slots, side) is slots[1]
    assert batch.best_slot(slots, side, reuse=False) is slots[1]
    assert batch.best_slot(slots, long_turn + [5, 6]) is slots[0]
    slots = [slot(0, long_turn), slot(1, [1, 2, 3, 50, 51])]  # both filled: the smaller gives way
    assert batch.best_slot(slots, side) is slots[1]
    # a prompt that shares a real part (>= 0.1 of it) with a cache still goes there
    assert batch.best_slot(slots, [1, 2, 3, 50, 51, 60, 61]) is slots[1]
    assert batch.best_slot([slot(0, [1, 2, 3, 4]), slot(1, long_turn)], long_turn[:40] + [9]).index == 1
