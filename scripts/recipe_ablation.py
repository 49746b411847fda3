"""Recipe levers at (about) equal CPU time, each a short warm-started run from one drafter.

Every row starts from the same drafter (``--init`` , a SpecForge directory), trains on the
same data with one changed lever for ``--cpu-hours`` of one thread (the cosine schedule
runs over CPU time: ``flashdraft train --max-cpu-hours``), and is then walked offline on the first ``--eval-answers`` held-out answers of
HumanEval and ShareGPT (T=0, :mod:`flashdraft.train.walk`). Shape levers (layers, feature
layers, block size, draft vocabulary) reshape the warm start so that it starts as the same
function (:mod:`flashdraft.train.warm_start`). Rows run ``--jobs`` at a time, one thread
each; a row whose run already ended is read, not rerun, so the command resumes.

    python scripts/recipe_ablation.py --init runs/abl-init --data datasets/smollm2-regen-greedy \\
        --json docs/results/recipe-ablation.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# name -> the lever's flags (on top of BASE)
ROWS = {
    "base": [],
    "lr2e-4": ["--lr", "2e-4"],
    "hard-ce": ["--soft-weight", "0"],
    "soft-only": ["--soft-weight", "1"],
    "block8": ["--block-size", "8"],
    "anchors256": ["--blocks-per-step", "256"],
    "vocab16k": ["--draft-vocab", "16384"],
    "vocab-full": ["--draft-vocab", "0"],
    "block8-vocab-full": ["--block-size", "8", "--draft-vocab", "0"],
    "layers2": ["--layers", "2"],
    "features+8+20": ["--feature-layer-ids", "1,8,14,20,27"],
    "features+29": ["--feature-layer-ids", "1,14,27,29"],
}
BASE = ["--prompts", "0", "--ngram-seeded", "--threads", "1", "--seqs-per-step", "2", "--eval-minutes", "999",
        "--blocks-per-step", "128", "--soft-weight", "0.5", "--lr", "6e-4"]


def result(out: Path) -> dict | None:
    """The run's final evaluation and CPU-hours, or None while it has not ended."""
    log = out / "train_log.jsonl"
    if not log.exists():
        return None
    recs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    evals = [r for r in recs if "eval" in r]
    steps = [r["step"] for r in recs if "loss" in r]
    if not evals:
        return None
    return {"step": evals[-1]["step"], "cpu_hours": evals[-1]["cpu_hours"], **evals[-1]["eval"],
            "train_acc": next((r["acc"] for r in reversed(recs) if "acc" in r), None),
            "logged_steps": max(steps) if steps else 0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init", required=True, help="warm-start drafter every row starts from")
    p.add_argument("--data", required=True)
    p.add_argument("--runs", default="runs", help="rows write RUNS/abl-NAME")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names")
    p.add_argument("--cpu-hours", type=float, default=0.23, help="CPU-hours of training per row")
    p.add_argument("--eval-answers", type=int, default=48)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    names = args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    running: dict[str, subprocess.Popen] = {}
    todo = [n for n in names if result(Path(args.runs) / f"abl-{n}") is None]
    while todo or running:
        for n, proc in list(running.items()):
            if proc.poll() is not None:
                print(f"{n}: exit {proc.returncode}", flush=True)
                del running[n]
        while todo and len(running) < args.jobs:
            n = todo.pop(0)
            flags = ROWS[n]
            out = Path(args.runs) / f"abl-{n}"
            out.mkdir(parents=True, exist_ok=True)
            cmd = ["flashdraft", "train", "--out", str(out), "--data", args.data, "--init-from", args.init, *BASE,
                   "--eval-answers", str(args.eval_answers), "--steps", "1000000",
                   "--max-cpu-hours", str(args.cpu_hours), *flags]
            print(f"{n}: {' '.join(cmd)}", flush=True)
            running[n] = subprocess.Popen(cmd, stdout=open(out / "stdout.log", "w"), stderr=subprocess.STDOUT)
        time.sleep(10)
    rows = {n: result(Path(args.runs) / f"abl-{n}") for n in names}
    print(f"| row | flags | CPU-min | steps | τ HumanEval | τ ShareGPT | P(k=1) HE / SG |")
    for n, r in rows.items():
        if r is None:
            print(f"| {n} | failed |")
            continue
        print(f"| {n} | {' '.join(ROWS[n])} | {60 * r['cpu_hours']:.1f} | {r['step']} | "
              f"{r['tau_humaneval']:.3f} | {r['tau_sharegpt-heldout']:.3f} | "
              f"{r['accept1_humaneval']:.3f} / {r['accept1_sharegpt-heldout']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"init": args.init, "data": args.data, "base_flags": BASE,
                                               "eval_answers": args.eval_answers, "cpu_hours": args.cpu_hours,
                                               "rows": {n: {"flags": ROWS[n], **(r or {})} for n, r in rows.items()}},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
