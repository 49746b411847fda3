"""Held-out τ against CPU-hours from ``flashdraft train`` logs (``train_log.jsonl``).

    python scripts/plot_learning_curve.py docs/results/train_log-smollm2-dflash-v5-seeded.jsonl \\
        --out docs/results/learning-curve.png

Each evaluation record (``{"eval": {"tau_humaneval": ..., ...}, "cpu_hours": ...}``) is one
point per held-out set; ``--offset`` adds CPU-hours spent before the log began (a warm
start). ``LOG:cpu-only`` moves the axis by that log's CPU-hours without plotting its
evaluations (a segment evaluated on another answer count, measured again in a later log). Needs matplotlib (``pip install 'flashdraft[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", help="train_log.jsonl files, plotted in order on one CPU-hour axis")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--offset", type=float, default=0.0, help="CPU-hours before the first log")
    p.add_argument("--title", default="DFlash drafter for SmolLM2-135M-Instruct: held-out τ (offline walk, T=0)")
    args = p.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("this plot needs matplotlib: pip install 'flashdraft[bench]'", file=sys.stderr)
        return 1
    series: dict[str, list[tuple[float, float]]] = {}
    offset = args.offset
    for path in args.logs:
        cpu_only = path.endswith(":cpu-only")
        path = path.removesuffix(":cpu-only")
        last = 0.0
        seen = set()
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                last = max(last, rec.get("cpu_hours", 0.0))
                if cpu_only or "eval" not in rec or (rec["step"], rec["cpu_hours"]) in seen:
                    continue
                seen.add((rec["step"], rec["cpu_hours"]))
                for key, value in rec["eval"].items():
                    if key.startswith("tau_"):
                        series.setdefault(key[4:], []).append((offset + rec["cpu_hours"], value))
        offset += last
    if not series:
        print("no evaluation records in these logs", file=sys.stderr)
        return 1
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in series.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("training CPU-hours")
    ax.set_ylabel("τ (tokens per verify step)")
    ax.set_title(args.title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
