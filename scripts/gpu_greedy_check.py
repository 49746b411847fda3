"""Greedy equality on the real default model, every drafter, one device (scripts/gpu_check.sh).

For each weight type (fp32, bf16) the plain greedy answer to a few seed prompts is the
reference; each drafter (dflash, ngram, hybrid, draft with the target drafting for itself)
must give the same tokens. fp32 must match exactly (exit 1 otherwise). bf16 is reported,
not failed: GPU matmul kernels may pick another reduction order for a 16-row verify block
than for a 1-row step (not batch-invariant), which can flip a bf16 rounding; the line says
how many answers differed and at which token.

Usage: python scripts/gpu_greedy_check.py [--device cuda] [-n 64] [--weights fp32,bf16]
"""

from __future__ import annotations

import argparse
import sys
import time

from flashdraft.device import describe, resolve_device
from flashdraft.engine import EngineConfig, load_engine
from flashdraft.generate import generate_text
from flashdraft.prompts import load_prompt_set
from flashdraft.sampling import SamplingParams
from flashdraft.targets.torch import Target

SPEC_TYPES = ("dflash", "ngram", "hybrid", "draft")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("-n", "--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=3, help="seed prompts (default 3)")
    p.add_argument("--weights", default="fp32,bf16")
    args = p.parse_args()
    device = resolve_device(args.device)
    print(f"device: {describe(device)}")
    prompts = [x["prompt"] for x in load_prompt_set("seed", limit=args.prompts)]
    failed = False
    for weights in args.weights.split(","):
        target = Target.load(None, weights=weights, device=device)
        ids = [target.chat_prompt_ids([{"role": "user", "content": q}]) for q in prompts]

        def run(spec_type: str):
            gen = load_engine(EngineConfig(spec_type=spec_type, weights=weights, device=str(device),
                                           draft_model="target" if spec_type == "draft" else None,
                                           controller="off"), target=target)
            t0, out, steps, produced = time.perf_counter(), [], 0, 0
            for x in ids:
                _, tokens, _, t = generate_text(gen, x, args.max_tokens, SamplingParams())
                out.append(tokens)
                steps, produced = steps + t.n_steps - 1, produced + t.verify_n
            rate = sum(map(len, out)) / (time.perf_counter() - t0)
            return out, (produced / steps if steps else 0.0), rate

        base, _, base_rate = run("none")
        print(f"[{weights}] none: {base_rate:.1f} tok/s (prefill included)")
        for spec_type in SPEC_TYPES:
            got, tau, rate = run(spec_type)
            diffs = [first_difference(b, g) for b, g in zip(base, got)]
            bad = [(i, d) for i, d in enumerate(diffs) if d is not None]
            verdict = "equal" if not bad else "DIFFERS " + ", ".join(f"prompt {i} at token {d}" for i, d in bad)
            print(f"[{weights}] {spec_type}: greedy {verdict}; tau {tau:.2f}; {rate:.1f} tok/s")
            failed |= bool(bad) and weights == "fp32"
    print("greedy equality:", "FAILED (fp32)" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
