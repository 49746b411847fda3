#!/usr/bin/env python3
"""Decode tokens/s per thread setting, on a quiet machine and beside a CPU burner.

Each measurement is a fresh process (OpenMP reads ``OMP_WAIT_POLICY`` once, at start) that
loads the packaged target, prefills a seed prompt and decodes ``--tokens`` greedy tokens
with no drafter; it prints tokens/s of the decode alone. Settings run interleaved, round by
round, so drifting load hits them alike; the table gives medians.

Conditions: ``quiet`` (nothing of ours beside it) and ``burner`` (``--burners`` processes
spinning in pure Python for exactly as long as the measurement, then stopped).

    .venv/bin/python scripts/thread_policy.py --rounds 3 --out docs/results/thread-policy.json

The settings: ``t1`` (``-t 1``), ``t2`` (``-t 2``), ``t2-passive`` (2 threads with
``OMP_WAIT_POLICY=PASSIVE``: idle OpenMP threads sleep instead of spinning), and
``default`` (what ``flashdraft serve`` picks with no ``-t``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {
    "t1": ({}, ["--threads", "1"]),
    "t2": ({}, ["--threads", "2"]),
    "t2-passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, ["--threads", "2"]),
    "default": ({}, []),
}


def _spin(stop_at: float) -> None:
    while time.time() < stop_at:
        pass


def measure_once(tokens: int, extra: list[str], env: dict) -> float:
    """Decode tokens/s of one fresh process (``--child`` below)."""
    cmd = [sys.executable, __file__, "--child", "--tokens", str(tokens), *extra]
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def child(tokens: int, threads: int | None) -> None:
    import torch

    from flashdraft.engine import EngineConfig, load_engine
    from flashdraft.prompts import SEED_PROMPTS
    from flashdraft.sampling import SamplingParams
    from flashdraft.threads import apply_threads

    apply_threads(threads)
    gen = load_engine(EngineConfig(spec_type="none"))
    ids = gen.target.chat_prompt_ids([{"role": "user", "content": SEED_PROMPTS[0]}])
    for _ in gen.generate(ids, 8, SamplingParams(), ignore_eos=True):  # warm-up
        pass
    t0, n = None, 0
    for step in gen.generate(ids, tokens + 1, SamplingParams(), ignore_eos=True):
        if t0 is None:  # the first token comes from the prefill
            t0 = time.perf_counter()
            continue
        n += len(step.token_ids)
    print(n / (time.perf_counter() - t0))
    del torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=96, help="decoded tokens per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--burners", type=int, default=2, help="busy processes in the burner condition")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--conditions", default="quiet,burner")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.child:
        child(args.tokens, args.threads)
        return
    settings = [s for s in args.settings.split(",") if s]
    results: dict[str, dict[str, list[float]]] = {}
    for condition in args.conditions.split(","):
        results[condition] = {s: [] for s in settings}
        for r in range(args.rounds):
            for s in settings:
                env, extra = SETTINGS[s]
                burners = []
                if condition == "burner":
                    stop_at = time.time() + 600
                    burners = [mp.Process(target=_spin, args=(stop_at,), daemon=True) for _ in range(args.burners)]
                    for b in burners:
                        b.start()
                try:
                    tps = measure_once(args.tokens, extra, env)
                finally:
                    for b in burners:
                        b.terminate()
                        b.join()
                results[condition][s].append(tps)
                print(f"{condition:7s} round {r + 1} {s:11s} {tps:7.2f} tok/s", flush=True)
    print("\n| condition | " + " | ".join(settings) + " |")
    print("| --- | " + " | ".join("---" for _ in settings) + " |")
    for condition, per in results.items():
        best = max(statistics.median(v) for v in per.values())
        cells = [f"{statistics.median(v):.1f} ({statistics.median(v) / best:.2f}×)" for v in per.values()]
        print(f"| {condition} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tokens": args.tokens, "rounds": args.rounds, "burners": args.burners,
                       "cpu_count": os.cpu_count(), "tokens_per_s": results}, f, indent=1)


if __name__ == "__main__":
    main()
