"""Aggregate decode throughput of parallel slots: 1 client vs N concurrent clients, side by side.

Runs the server's own scheduler in-process (no HTTP: the numbers are the engine's) on the
packaged SmolLM2-135M-Instruct. Configurations, interleaved round by round so that load
from other processes hits them alike:

- ``np1 x1``: ``-np 1``, one client (today's single-request speed);
- ``np1 xN``: ``-np 1``, N concurrent clients (they queue: the same aggregate as x1);
- ``npN xN``: ``-np N``, N concurrent clients (one packed target forward per step).

Every request generates exactly ``--tokens`` tokens (EOS ignored) at T=0. Aggregate tokens/s
= all tokens returned / wall time from the first submit to the last token (prefill
included); per-request tokens/s is the mean of the requests' own ``predicted_per_second``.

    .venv/bin/python scripts/slots_bench.py --spec-type none --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from flashdraft.engine import EngineConfig, load_engine
from flashdraft.prompts import SEED_PROMPTS
from flashdraft.sampling import SamplingParams
from flashdraft.server.scheduler import GenerationJob, Scheduler

EXTRA_PROMPTS = ["Write a haiku about caches.", "Explain what a mutex is in two sentences.",
                 "List five prime numbers and say why they are prime.", "Translate 'good morning' into French."]


async def _client(scheduler: Scheduler, job: GenerationJob) -> tuple[int, float]:
    n, tps = 0, 0.0
    async for step in scheduler.submit(job).events():
        n += len(step.token_ids)
        if step.timings is not None:
            tps = 1e3 * step.timings.predicted_n / step.timings.predicted_ms if step.timings.predicted_ms else 0.0
    return n, tps


def run_config(generator, n_slots: int, jobs: list[GenerationJob]) -> tuple[float, float]:
    """(aggregate tokens/s, mean per-request tokens/s) of ``jobs`` sent at once."""
    async def main():
        s = Scheduler(generator, n_slots=n_slots)
        s.start()
        try:
            t0 = time.perf_counter()
            out = await asyncio.gather(*(_client(s, j) for j in jobs))
            return sum(n for n, _ in out) / (time.perf_counter() - t0), statistics.mean(t for _, t in out)
        finally:
            s.stop()
    return asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spec-type", default="none", choices=["none", "dflash", "ngram"])
    p.add_argument("--weights", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = load_engine(EngineConfig(spec_type=args.spec_type, weights=args.weights))
    t = gen.target
    texts = (list(SEED_PROMPTS) + EXTRA_PROMPTS)[: args.clients]
    jobs = [GenerationJob(t.chat_prompt_ids([{"role": "user", "content": x}]), args.tokens, SamplingParams(), [],
                          ignore_eos=True) for x in texts]
    n = args.clients
    configs = {"np1 x1": (1, jobs[:1]), f"np1 x{n}": (1, jobs), f"np{n} x{n}": (n, jobs)}
    run_config(gen, n, jobs[:2])  # warm the packed shapes once
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in configs}
    for r in range(args.rounds):
        for name, (slots, js) in configs.items():
            results[name].append(run_config(gen, slots, js))
            print(f"round {r + 1} {name:>8}: {results[name][-1][0]:6.1f} tok/s aggregate", flush=True)
    base = statistics.median(a for a, _ in results["np1 x1"])
    print(f"\n--spec-type {args.spec_type}, --weights {args.weights}, {args.threads} thread(s), "
          f"{args.tokens} tokens per request, median of {args.rounds} rounds")
    print(f"| config | aggregate tok/s | per-request tok/s | aggregate vs np1 x1 |\n| --- | --- | --- | --- |")
    for name, rs in results.items():
        agg, per = statistics.median(a for a, _ in rs), statistics.median(b for _, b in rs)
        print(f"| {name} | {agg:.1f} | {per:.1f} | {agg / base:.2f}x |")


if __name__ == "__main__":
    main()
