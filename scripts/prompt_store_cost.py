#!/usr/bin/env python3
"""Bytes and time of saving and restoring a prompt in the prompt store (``--cache-ram``) on
the packaged model, llama backend: a prompt of N tokens is prefilled, copied to host RAM
(``llama_state_seq_get_data``) and loaded into a new sequence; the restored cache's next
logits are checked equal to the original's.

    python scripts/prompt_store_cost.py [--tokens 512 2048 8000]
"""

from __future__ import annotations

import argparse
import time

import torch

from flashdraft.engine import EngineConfig, load_engine_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8000])
    args = ap.parse_args()
    target = load_engine_target(EngineConfig(backend="llama", ctx_size=max(args.tokens) + 16))
    target.ensure_sequences(3)
    text = open(__file__).read() * 200
    for n in args.tokens:
        ids = torch.tensor(target.encode(text)[:n])
        cache = target.new_cache()
        target.forward(ids[:-1], cache, ids.shape[0] - 2)
        t0 = time.perf_counter()
        snap = target.save_cache(cache)
        t1 = time.perf_counter()
        restored = target.load_cache(snap)
        t2 = time.perf_counter()
        a = target.forward(ids[-1:], cache)[0]
        b = target.forward(ids[-1:], restored)[0]
        print(f"{n:6d} tokens: {snap.nbytes / 2**20:7.1f} MiB ({snap.nbytes / (n - 1) / 1024:.1f} KiB/token), "
              f"save {1e3 * (t1 - t0):6.1f} ms, load {1e3 * (t2 - t1):6.1f} ms, next logits equal: {torch.equal(a, b)}")
        target.free_cache(cache)
        target.free_cache(restored)


if __name__ == "__main__":
    main()
