"""The host-RAM prompt store (``--cache-ram``, :mod:`flashdraft.prompt_store`): a side request
no longer costs a conversation its prompt cache, with one slot too; what is restored answers
exactly as a fresh prefill, on both backends and with a drafter that keeps context state."""

from __future__ import annotations

import httpx
import pytest
from inproc import chat_target, serve
from tiny import byte_tokenizer, tiny_target
from tiny_gguf import write_tiny_gguf

from flashdraft.drafters.dflash import DFlashDrafter, random_dflash_model
from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.generate import GenerationRequest, SpeculativeGenerator, generate_text
from flashdraft.prompt_store import PromptStore
from flashdraft.sampling import SamplingParams

CONVERSATION = [5, 9, 17, 3, 22, 41, 8, 12, 30, 7, 5, 9, 17, 3, 22, 41, 11, 6, 2, 19, 27, 33, 14, 15, 26, 35]
SIDE = [40, 2, 50, 13, 44]


def _answer(gen, prompt, n=12):
    return generate_text(gen, prompt, n, SamplingParams(), ignore_eos=True, cache_prompt=True)


def _turns(gen):
    """Turn 1, a side request, turn 2 (turn 1's prompt and answer, then more): turn 2's answer
    and timings."""
    _, first, _, _ = _answer(gen, CONVERSATION)
    _answer(gen, SIDE)
    second = CONVERSATION + first + [23, 4, 18]
    _, ids, _, t = _answer(gen, second)
    return second, ids, t


def _drafters(target):
    return {"ngram": lambda: NgramDrafter(),
            "dflash": lambda: DFlashDrafter(random_dflash_model(target.model, 1, 5), target.embed_tokens,
                                            target.lm_head)}


@pytest.mark.parametrize("kind", ["ngram", "dflash"])
def test_a_side_request_does_not_cost_the_conversation_its_cache(kind):
    target = tiny_target("llama", seed=1, layers=2, hidden=32)
    make = _drafters(target)[kind]
    gen = SpeculativeGenerator(target, make(), ctx_size=128, n_draft=4)
    gen.prompt_store = PromptStore(None)
    second, ids, t = _turns(gen)
    # turn 1 saved before the side request, the side request before turn 2; turn 1 loaded
    store = gen.prompt_store
    assert (store.saves, store.loads) == (2, 1) and [e.tokens[: len(SIDE)] for e in store.entries] == [SIDE]
    assert t.cache_n == len(second) - 4  # turn 1's prompt and answer (its last anchor aside)
    fresh = _answer(SpeculativeGenerator(target, make(), ctx_size=128, n_draft=4), second)[1]
    assert ids == fresh
    # without the store the side request overwrote turn 1
    gen = SpeculativeGenerator(target, make(), ctx_size=128, n_draft=4)
    assert _turns(gen)[2].cache_n == 0


def test_the_store_keeps_its_size_and_drops_the_oldest():
    target = tiny_target("llama", seed=1, layers=2, hidden=32)
    gen = SpeculativeGenerator(target, NgramDrafter(), ctx_size=128, n_draft=4)
    gen.prompt_store = store = PromptStore(None)
    prompts = [[i + 3] * 6 + [i + 40, i + 50, i + 60] for i in range(4)]
    for p in prompts:
        _answer(gen, p, 4)
    assert [e.tokens[:9] for e in store.entries] == prompts[:3]
    one = store.entries[0].nbytes
    gen.prompt_store = store = PromptStore(int(one * 2.5))
    for p in prompts:
        _answer(gen, p, 4)
    assert [e.tokens[:9] for e in store.entries] == prompts[1:3] and store.nbytes <= store.limit
    # a request that keeps most of the slot's cache saves nothing
    saves = store.saves
    _answer(gen, prompts[3] + [1, 2])
    assert store.saves == saves


def test_the_llama_backend_saves_and_restores_a_sequence(tmp_path):
    pytest.importorskip("llama_cpp")
    from flashdraft.targets.llama import LlamaTarget

    t = LlamaTarget(write_tiny_gguf(tmp_path / "tiny.gguf"), n_ctx=256, n_seq=2, tokenizer=byte_tokenizer())
    conversation, side = t.encode("the quick brown fox jumps over " * 3), t.encode("abc")
    global CONVERSATION, SIDE
    saved = CONVERSATION, SIDE
    CONVERSATION, SIDE = conversation, side
    try:
        gen = SpeculativeGenerator(t, NgramDrafter(), ctx_size=256, n_draft=4)
        gen.prompt_store = PromptStore(None)
        second, ids, timings = _turns(gen)
        assert gen.prompt_store.loads == 1 and timings.cache_n == len(second) - 4
        assert ids == _answer(SpeculativeGenerator(t, NgramDrafter(), ctx_size=256, n_draft=4), second)[1]
    finally:
        CONVERSATION, SIDE = saved


def test_over_http_the_next_turn_starts_from_the_saved_prompt():
    gen = SpeculativeGenerator(chat_target(), NgramDrafter(), ctx_size=256, n_draft=4)
    words = " ".join(f"t{t}" for t in CONVERSATION)
    with serve(gen, cache_ram_mib=64) as url:  # one slot
        first = httpx.post(url + "/completion", json={"prompt": words, "n_predict": 6, "temperature": 0}).json()
        httpx.post(url + "/completion", json={"prompt": "t40 t2 t50", "n_predict": 4, "temperature": 0})
        again = httpx.post(url + "/completion", json={"prompt": words + " t23 t4", "n_predict": 6,
                                                      "temperature": 0}).json()
    assert first["timings"]["cache_n"] == 0 and again["timings"]["cache_n"] >= len(CONVERSATION) - 1


def test_parallel_slots_save_and_load_through_the_store():
    """-np 2 with both slots taken by side requests at once: the conversation's slot is saved
    as it is overwritten, and its next turn (in either slot) starts from the copy."""
    from flashdraft import batch

    target = tiny_target("llama", seed=1, layers=2, hidden=32)
    gen = SpeculativeGenerator(target, NgramDrafter(), ctx_size=128, n_draft=4)
    gen.prompt_store = PromptStore(None)
    slots = batch.make_slots(gen, 2)

    def run(prompts):
        for slot, ids in zip(slots, prompts):
            batch.start(gen, slot, GenerationRequest(ids, 8, SamplingParams(), ignore_eos=True, cache_prompt=True))
        out = {}
        while any(not s.free for s in slots):
            busy = [s for s in slots if not s.free]
            for s, step in zip(busy, batch.step_together(target, [s.seq for s in busy])):
                out.setdefault(s.index, []).extend(step.token_ids)
                if s.seq.done:
                    s.prompt_cache, s.seq = s.seq.leftover(), None
                    out[s.index] = (out[s.index], step.timings)
        return [out[i] for i in range(len(prompts))]

    (first, _), = run([CONVERSATION])
    run([SIDE, [45, 46, 47, 48]])
    second = CONVERSATION + first + [23, 4]
    (ids, t), = run([second])
    assert gen.prompt_store.loads == 1 and t.cache_n == len(second) - 3
    assert ids == generate_text(SpeculativeGenerator(target, NgramDrafter(), ctx_size=128, n_draft=4), second, 8,
                                SamplingParams(), ignore_eos=True)[1]
