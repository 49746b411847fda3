"""The best speed a fixed-depth drafter can reach on a target whose verify rows are costly
(docs/training.md, "Train a drafter for your model": Gemma 3 on the llama backend).

From an offline walk at depth D (``flashdraft eval --offline`` JSON: each method's histogram of
accepted drafts per verify step) the acceptance length at a shallower depth d is
``1 + E[min(A, d)]`` (DFlash's first d drafts are the same at every depth), and a step of
depth d costs ``step_ms + d * row_ms + draft_ms`` against ``step_ms`` per plain token, so

    speed(d) / plain = tau(d) * step_ms / (step_ms + d * row_ms + draft_ms)

an upper bound: no controller probes, no Python overhead, no prefill. It assumes a draft at
every step, as DFlash makes; a lookup method that drafts only on a match is better measured
by `flashdraft bench`.

    python scripts/verify_cost_bound.py --walk docs/results/gemma3/offline-t0.json \
        --method dflash --step-ms 19.8 --row-ms 11.1 --draft-ms 8.7
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--walk", required=True, help="an offline walk report (flashdraft eval --offline --json-out)")
    ap.add_argument("--method", default="dflash", help="a method in the report (default dflash)")
    ap.add_argument("--step-ms", type=float, required=True, help="one decode step (1 row), ms")
    ap.add_argument("--row-ms", type=float, required=True, help="each verify row past the first, ms")
    ap.add_argument("--draft-ms", type=float, default=0.0, help="one draft, ms")
    args = ap.parse_args()
    report = json.load(open(args.walk))
    print(f"{report.get('target')}: {args.method}, step {args.step_ms} ms, +{args.row_ms} ms per verify row, "
          f"draft {args.draft_ms} ms")
    depth = report.get("n_draft", 7)
    print("| set | " + " | ".join(f"d = {d}: τ, × plain" for d in range(1, depth + 1)) + " | best |")
    print("| --- |" + " --- |" * (depth + 1))
    for name, methods in report["results"].items():
        if args.method not in methods:
            continue
        hist = methods[args.method]["histogram"]
        n = sum(hist)
        cells, best = [], (0.0, 0)
        for d in range(1, depth + 1):
            tau = 1 + sum(min(a, d) * c for a, c in enumerate(hist)) / n
            speed = tau * args.step_ms / (args.step_ms + d * args.row_ms + args.draft_ms)
            best = max(best, (speed, d))
            cells.append(f"{tau:.2f}, {speed:.2f}×")
        print(f"| {name} | " + " | ".join(cells) + f" | **{best[0]:.2f}×** (d = {best[1]}) |")


if __name__ == "__main__":
    main()
