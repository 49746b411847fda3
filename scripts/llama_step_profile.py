"""Per-step costs of the llama backend (docs/performance.md, "The llama backend"): decode,
verify of k rows (k = 1..16), the DFlash drafter's propose, prefill, and the Python share of a step.

    .venv/bin/python scripts/llama_step_profile.py [-t 1] [--context 300] [--reps 15] [--gguf FILE]

Medians over ``--reps`` runs; one process, so the rows compare side by side. ``--kv f16|f32``
picks the cache type.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashdraft.engine import EngineConfig, load_drafter
from flashdraft.sampling import SamplingParams
from flashdraft.targets.torch import default_model_path
from flashdraft.targets.llama import LlamaTarget


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=300, help="positions in the cache before each step")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--gguf", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t = LlamaTarget(args.gguf or default_model_path(), n_ctx=2048, threads=args.threads,
                    cache_type_k=args.kv, cache_type_v=args.kv, warn=False)
    text = "Write a Python function that reverses a string and explain how slicing works. " * 40
    ids = t.encode(text)[: args.context]
    drafter = load_drafter(EngineConfig(spec_type="dflash"), t) if args.gguf is None else None
    t.set_feature_layers(drafter.feature_layer_ids if drafter else None)
    cache = t.new_cache()
    prefill = median_ms(lambda: (cache.rollback(0), t.forward(torch.tensor(ids), cache, len(ids) - 1)), 3)
    base = cache.length
    print(f"llama backend, {args.threads} thread(s), KV {args.kv}, context {base}")
    print(f"prefill of {base} tokens: {prefill:.1f} ms ({1e3 * base / prefill:.0f} tokens/s)")
    one = None
    print("| rows k | verify ms | / decode | ms per extra row |")
    print("|---|---|---|---|")
    for k in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16):
        x = torch.tensor(ids[:k])
        ms = median_ms(lambda: (t.forward(x, cache), cache.rollback(base)), args.reps)
        one = one or ms
        extra = (ms - one) / (k - 1) if k > 1 else 0.0
        print(f"| {k} | {ms:.2f} | {ms / one:.2f} | {extra:.2f} |")
    # the Python share: the same decode with llama_decode timed alone
    api, ctx = t._b.api, t._ctx
    inner = []
    orig = api.llama_decode

    def timed(c, b):
        t0 = time.perf_counter()
        rc = orig(c, b)
        inner.append(time.perf_counter() - t0)
        return rc

    api.llama_decode = timed
    try:
        outer = median_ms(lambda: (t.forward(torch.tensor(ids[:1]), cache), cache.rollback(base)), args.reps)
    finally:
        api.llama_decode = orig
    print(f"one-token step {outer:.2f} ms, of which llama_decode {1e3 * statistics.median(inner):.2f} ms "
          f"(Python and copies {outer - 1e3 * statistics.median(inner):.2f} ms)")
    if drafter is not None:
        logits, feats = t.forward(torch.tensor(ids), t.new_cache(), len(ids) - 1)
        drafter.reset()
        drafter.commit(len(ids), feats)
        toks = torch.tensor(ids + [int(logits[-1].argmax())])
        ms = median_ms(lambda: drafter.propose(toks, 7, SamplingParams(), None), args.reps)
        print(f"DFlash drafter propose (block 8, eager torch): {ms:.2f} ms = {ms / one:.2f} decode steps")


if __name__ == "__main__":
    main()
