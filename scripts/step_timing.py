#!/usr/bin/env python3
"""Milliseconds per target forward: transformers path vs lean path, fp32 / bf16 / q4 weights.

Measures what a decode step (1 token) and a verify step (16 tokens by default) cost after a
~300-token context, for every configuration *in one process, interleaved* (round r runs
each configuration once before round r+1 starts), so machine load hits them alike; reports
medians. This is the measurement behind docs/performance.md.

    .venv/bin/python scripts/step_timing.py                      # packaged SmolLM2-135M
    .venv/bin/python scripts/step_timing.py --threads 2 --rounds 30 --context 300 --verify 16
    .venv/bin/python scripts/step_timing.py -m path/to/model.gguf --configs hf-fp32,lean-fp32
    .venv/bin/python scripts/step_timing.py --configs lean-fp32,lean-bf16,lean-q4 --verify 8,16

``lean-q4`` runs the GGUF's Q4_0/Q4_1 projections on the int4 kernel (``--weights q4``).
The table gives each verify's ratio to the 1-token step: what a verify costs in decode
steps, the bound on what drafting can gain.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

CONFIGS = ("hf-fp32", "lean-fp32", "hf-bf16", "lean-bf16", "lean-q4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="target (default: packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--context", type=int, default=300, help="context tokens before the measured step")
    ap.add_argument("--verify", default="16", help="tokens in the verify block (comma list for several)")
    ap.add_argument("--rounds", type=int, default=20, help="measured rounds (after 2 warm-up rounds)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from flashdraft.prompts import SEED_PROMPTS
    from flashdraft.quant import read_q4
    from flashdraft.targets.torch import Target, default_model_path, load_hf_model

    verify = [int(v) for v in str(args.verify).split(",") if v.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    model32, tokenizer = load_hf_model(args.model, torch.float32)
    models = {"fp32": model32}
    if any(c.endswith("bf16") for c in configs):
        models["bf16"] = copy.deepcopy(model32).to(torch.bfloat16)
    q4 = None
    if "lean-q4" in configs:
        models["q4"] = model32  # the float32 model plus the file's 4-bit codes
        q4 = read_q4(args.model or default_model_path(), model32)
    targets = {c: Target(models[c.split("-")[1]], tokenizer, fast=c.startswith("lean"),
                         q4=q4 if c == "lean-q4" else None) for c in configs}

    first = next(iter(targets.values()))
    ids = first.chat_prompt_ids([{"role": "user", "content": " ".join(SEED_PROMPTS)}])
    while len(ids) < args.context:
        ids = ids + ids
    ctx = torch.tensor(ids[: args.context])
    caches = {}
    for c, t in targets.items():
        caches[c] = t.new_cache(capacity=args.context + max(verify) + 1)
        t.forward(ctx, caches[c], logits_from=args.context - 1)  # prefill, not measured

    sizes = (1, *verify)
    times: dict[tuple[str, int], list[float]] = {(c, n): [] for c in configs for n in sizes}
    for r in range(args.rounds + 2):
        for n in sizes:
            block = ctx[:n]
            for c, t in targets.items():
                t0 = time.perf_counter()
                t.forward(block, caches[c])
                dt = time.perf_counter() - t0
                caches[c].rollback(args.context)  # same context length every round
                if r >= 2:
                    times[(c, n)].append(1e3 * dt)

    print(f"context {args.context} tokens, {args.threads} thread(s), {args.rounds} rounds, median (p10-p90) ms")
    print("| config | 1-token step | " + " | ".join(f"{n}-token verify (× step)" for n in verify) + " |")
    print("| --- " * (len(sizes) + 1) + "|")
    for c in configs:
        cells = []
        step = statistics.median(times[(c, 1)])
        for n in sizes:
            v = sorted(times[(c, n)])
            med = statistics.median(v)
            ratio = "" if n == 1 else f", {med / step:.2f}×"
            cells.append(f"{med:.1f} ({v[len(v) // 10]:.1f}-{v[(9 * len(v)) // 10]:.1f}{ratio})")
        print(f"| {c} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
