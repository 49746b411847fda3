"""The scheduler in-process on a tiny random target: order, cancellation, fault isolation."""

from __future__ import annotations

import asyncio

import pytest

from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.generate import Cancelled, GenerationRequest, SpeculativeGenerator
from flashdraft.sampling import SamplingParams
from flashdraft.server.metrics import ServerMetrics
from flashdraft.server.scheduler import JobFailed, Scheduler
from tiny import tiny_target

PROMPT = [5, 9, 17, 3, 22, 41]


class RecordingGenerator(SpeculativeGenerator):
    """Records the prompts it was asked to run."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.started: list[list[int]] = []

    def generate(self, request, *a, **kw):
        self.started.append(list(request.prompt_ids))
        return super().generate(request, *a, **kw)


@pytest.fixture(scope="module")
def generator():
    return RecordingGenerator(tiny_target(), NgramDrafter(), ctx_size=256, n_draft=4)


def job(prompt=PROMPT, n=8) -> GenerationRequest:
    return GenerationRequest(list(prompt), n, SamplingParams(), [], ignore_eos=True, cache_prompt=True)


async def drain(ticket) -> list:
    return [step async for step in ticket.events()]


def run(coro_fn, generator, metrics=None, n_slots: int = 1):
    """Run ``coro_fn(scheduler)`` on a fresh loop with a started scheduler."""
    async def main():
        s = Scheduler(generator, metrics, n_slots=n_slots)
        s.start()
        try:
            return await coro_fn(s)
        finally:
            s.stop()
    return asyncio.run(main())


def test_jobs_run_in_order_and_update_metrics(generator):
    metrics = ServerMetrics()

    async def go(s):
        a, b = s.submit(job(n=5)), s.submit(job(PROMPT[::-1], n=3))
        return await drain(a), await drain(b)

    steps_a, steps_b = run(go, generator, metrics)
    assert sum(len(st.token_ids) for st in steps_a) == 5 and steps_a[-1].finish_reason == "length"
    assert sum(len(st.token_ids) for st in steps_b) == 3
    text = metrics.render().decode()
    assert "llamacpp:tokens_predicted_total 8.0" in text
    assert "llamacpp:requests_processing 0.0" in text and "llamacpp:requests_deferred 0.0" in text


def test_cancelled_while_queued_never_runs(generator):
    generator.started.clear()
    marker = [7, 7, 7, 7]

    async def go(s):
        first = s.submit(job(n=60))
        queued = s.submit(job(marker))
        queued.cancel()  # its client left before its turn
        await drain(first)
        with pytest.raises(Cancelled):
            await drain(queued)

    run(go, generator)
    assert marker not in generator.started


def test_cancel_stops_a_running_job_within_a_step(generator):
    metrics = ServerMetrics()

    async def go(s):
        t = s.submit(job(n=200))
        events = t.events()
        await anext(events)
        t.cancel()
        produced = 0
        with pytest.raises(Cancelled):
            async for step in events:
                produced += len(step.token_ids)
        return produced

    produced = run(go, generator, metrics)
    assert produced < 199
    assert "llamacpp:requests_processing 0.0" in metrics.render().decode()


def test_worker_survives_a_failing_job(generator):
    async def go(s):
        bad = s.submit(job([10**9]))  # a token id far outside the embedding table
        with pytest.raises(JobFailed):
            await drain(bad)
        return await drain(s.submit(job(n=4)))

    steps = run(go, generator)
    assert steps[-1].finish_reason == "length" and sum(len(st.token_ids) for st in steps) == 4
