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
from flashdraft.generate import Cancelled, GenerationRequest, SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from test_server_scheduler import run as run_scheduler
from tiny import tiny_model, tiny_target, tiny_tokenizer
from flashdraft.targets.torch import Target

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


# -- the scheduler with -np > 1 -----------------------------------------------------------

def _job(prompt, n, params=GREEDY, stop=()) -> GenerationRequest:
    return GenerationRequest(list(prompt), n, params, list(stop), ignore_eos=True, cache_prompt=True)


async def _collect(ticket) -> tuple[list[int], str, float]:
    """(token ids, finish reason, monotonic time of the last event)."""
    ids, finish = [], None
    async for step in ticket.events():
        ids.extend(step.token_ids)
        finish = step.finish_reason
    return ids, finish, time.monotonic()


def _serve(generator, n_slots, coro_fn):
    return run_scheduler(coro_fn, generator, n_slots=n_slots)


def _drafters(target):
    return [None, NgramDrafter(), DFlashDrafter(random_dflash_model(target.model, num_layers=1, block_size=6),
                                                target.embed_tokens, target.lm_head)]


@pytest.mark.parametrize("which", ["none", "ngram", "dflash"])
def test_concurrent_greedy_requests_equal_each_request_alone(which):
    target = tiny_target("llama")
    drafter = _drafters(target)[["none", "ngram", "dflash"].index(which)]
    gen = SpeculativeGenerator(target, drafter, ctx_size=256, n_draft=5)
    lengths = [30, 11, 24, 17]
    alone = [generate_text(gen, p, n, GREEDY, ignore_eos=True)[1] for p, n in zip(PROMPTS, lengths)]

    async def go(s):
        tickets = [s.submit(_job(p, n)) for p, n in zip(PROMPTS, lengths)]
        return await asyncio.gather(*(_collect(t) for t in tickets))

    results = _serve(gen, 4, go)
    assert [r[0] for r in results] == alone
    assert [r[1] for r in results] == ["length"] * 4


def test_more_requests_than_slots_all_finish_identically():
    gen = SpeculativeGenerator(tiny_target("qwen3"), NgramDrafter(), ctx_size=256, n_draft=4)
    jobs = [(p, 9 + 3 * i) for i, p in enumerate(PROMPTS + PROMPTS[::-1])]
    alone = [generate_text(gen, p, n, GREEDY, ignore_eos=True)[1] for p, n in jobs]

    async def go(s):
        return await asyncio.gather(*(_collect(s.submit(_job(p, n))) for p, n in jobs))

    assert [r[0] for r in _serve(gen, 3, go)] == alone


def test_a_long_request_does_not_block_a_short_one():
    gen = SpeculativeGenerator(tiny_target("llama"), NgramDrafter(), ctx_size=1024, n_draft=4)

    async def go(s):
        long = asyncio.ensure_future(_collect(s.submit(_job(PROMPTS[0], 600))))
        await asyncio.sleep(0.05)  # the long one is already decoding
        short = await _collect(s.submit(_job(PROMPTS[1], 5)))
        return short, await long

    short, long = _serve(gen, 2, go)
    assert len(short[0]) == 5 and len(long[0]) == 600
    assert short[2] < long[2], "the short request waited for the long one"


def test_cancelled_request_frees_its_slot_while_others_finish():
    gen = SpeculativeGenerator(tiny_target("llama"), NgramDrafter(), ctx_size=1024, n_draft=4)
    expected = generate_text(gen, PROMPTS[2], 8, GREEDY, ignore_eos=True)[1]
    b_ids: list[int] = []

    async def follow(ticket):
        async for step in ticket.events():
            b_ids.extend(step.token_ids)

    async def go(s):
        a = s.submit(_job(PROMPTS[0], 900))
        b = asyncio.ensure_future(follow(s.submit(_job(PROMPTS[1], 900))))
        events = a.events()
        await events.__anext__()  # a is decoding
        a.cancel()  # its client left
        with pytest.raises(Cancelled):
            async for _ in events:
                pass
        c = await _collect(s.submit(_job(PROMPTS[2], 8)))  # takes a's slot while b decodes
        b_when_c_done = len(b_ids)
        await b
        return c, b_when_c_done

    c, b_when_c_done = _serve(gen, 2, go)
    assert c[0] == expected and len(b_ids) == 900
    # with a's slot still taken, c could start only after a or b ran all 900 tokens
    assert b_when_c_done < 450, "the new request did not get the cancelled request's slot"


def test_a_failing_request_fails_alone():
    gen = SpeculativeGenerator(tiny_target("llama"), NgramDrafter(), ctx_size=64, n_draft=4)
    from flashdraft.server.scheduler import JobFailed

    async def go(s):
        ok = asyncio.ensure_future(_collect(s.submit(_job(PROMPTS[0], 20))))
        bad = s.submit(_job(list(range(1, 60)) + [1] * 10, 5))  # longer than the context
        with pytest.raises(JobFailed, match="context size"):
            await _collect(bad)
        return await ok

    assert len(_serve(gen, 2, go)[0]) == 20


def test_seeded_sampling_in_slots_equals_alone():
    """Each slot samples from its own generator: a seeded request (fixed depth) reproduces
    its solo output while other requests decode next to it."""
    gen = SpeculativeGenerator(tiny_target("llama"), NgramDrafter(), ctx_size=256, n_draft=4)
    params = [SamplingParams(temperature=1.2, seed=7 + i) for i in range(3)]
    alone = [generate_text(gen, p, 15, sp, ignore_eos=True)[1] for p, sp in zip(PROMPTS, params)]

    async def go(s):
        return await asyncio.gather(*(_collect(s.submit(_job(p, 15, sp))) for p, sp in zip(PROMPTS, params)))

    assert [r[0] for r in _serve(gen, 3, go)] == alone


@pytest.mark.real
def test_real_model_concurrent_greedy_equals_alone():
    from flashdraft.engine import EngineConfig, load_engine
    from flashdraft.prompts import SEED_PROMPTS

    gen = load_engine(EngineConfig(spec_type="dflash"))  # packaged SmolLM2 + shipped drafter, profit controller
    t = gen.target
    prompts = [t.chat_prompt_ids([{"role": "user", "content": p}]) for p in SEED_PROMPTS]
    prompts.append(t.chat_prompt_ids([{"role": "user", "content": "Write a haiku about caches."}]))
    alone = [generate_text(gen, p, 24, GREEDY)[1] for p in prompts]

    async def go(s):
        return await asyncio.gather(*(_collect(s.submit(GenerationRequest(p, 24, GREEDY, [], cache_prompt=True))) for p in prompts))

    assert [r[0] for r in _serve(gen, 4, go)] == alone


def test_http_server_with_parallel_slots():
    """``-np 4`` over real HTTP: /props reports the slots; concurrent requests answer as alone."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from inproc import PROMPT, new_generator, serve

    gen = new_generator()
    prompts = [PROMPT, "t7 t30 t2 t11 t7 t30", "t40 t41 t42", "t12 t13 t12 t13 t12"]
    alone = [generate_text(gen, gen.target.encode(p), 12, GREEDY, ignore_eos=True)[1] for p in prompts]
    with serve(gen, n_parallel=4) as url:
        assert httpx.get(url + "/props", timeout=30).json()["total_slots"] == 4

        def ask(prompt):
            body = {"prompt": prompt, "n_predict": 12, "temperature": 0, "ignore_eos": True, "return_tokens": True}
            return httpx.post(url + "/completion", json=body, timeout=60).json()["tokens"]

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, prompts)) == alone


@pytest.mark.parametrize("which", ["none", "ngram", "dflash"])
def test_a_long_prompt_is_prefilled_in_chunks_between_the_other_slots_steps(which):
    """-b: a 50-token prompt with prefill_chunk 8 takes 7 packed steps; in each of the first 6
    (empty steps, nothing handed out) the slot already decoding gets its step, and both answers
    equal each request alone (the drafter's context too: DFlash commits chunk by chunk)."""
    from flashdraft import batch

    target = tiny_target("llama")
    drafter = _drafters(target)[["none", "ngram", "dflash"].index(which)]
    gen = SpeculativeGenerator(target, drafter, ctx_size=256, n_draft=5)
    long_prompt = [(7 * i) % 60 + 1 for i in range(50)]
    want_long = generate_text(gen, long_prompt, 12, GREEDY, ignore_eos=True)[1]
    want_short = generate_text(gen, PROMPTS[1], 40, GREEDY, ignore_eos=True)[1]
    slots = batch.make_slots(gen, 2)
    batch.start(gen, slots[0], GenerationRequest(PROMPTS[1], 40, GREEDY, ignore_eos=True), prefill_chunk=8)
    got = {0: [], 1: []}
    got[0] += batch.step_together(target, [slots[0].seq])[0].token_ids  # the short one is decoding
    batch.start(gen, slots[1], GenerationRequest(long_prompt, 12, GREEDY, ignore_eos=True), prefill_chunk=8)
    chunks, short_during = 0, 0
    while any(s.seq is not None for s in slots):
        busy = [s for s in slots if s.seq is not None]
        prefilling = slots[1].seq is not None and not slots[1].seq.prefilled
        for s, step in zip(busy, batch.step_together(target, [s.seq for s in busy])):
            assert not isinstance(step, Exception), step
            got[s.index] += step.token_ids
            if s.index == 1 and prefilling and not s.seq.prefilled:
                chunks += 1
                assert step.token_ids == [] and step.text == ""
            if s.index == 0 and prefilling and step.token_ids:
                short_during += 1
            if s.seq.done:
                assert step.timings.prompt_n == (50 if s.index == 1 else len(PROMPTS[1]))
                s.seq = None
    assert chunks == 6 and short_during >= 6
    assert got[0] == want_short and got[1] == want_long
