"""Cost of keeping ggml's tiled K-quant matmul off (docs/performance.md, "The llama backend").

ggml takes Q4_K/Q6_K matmuls of 8+ rows through a tiled kernel that rounds otherwise than the
one-row kernel of a decode step, so a verify block's logits drift from plain decoding's. The
llama backend sets ``GGML_CPU_TILED_MM=0``; this script times a decode step, verify blocks of
8 and 16 rows and a 300-token prefill with ggml's default, with the tiled kernel off and with
it forced on every matmul (one child process per setting, the settings interleaved over
``--rounds``; medians in ms), and the verify drift of each.

    .venv/bin/python scripts/tiled_mm_cost.py --gguf GEMMA.gguf [--rounds 2] [-t 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# ggml's default is set explicitly: unset, the backend would turn the kernel off
MODES = {"ggml default (tiled from 8 rows)": {"GGML_CPU_TILED_MM": "1"}, "tiled off (flashdraft)": {"GGML_CPU_TILED_MM": "0"},
         "tiled forced on every matmul": {"GGML_CPU_TILED_MM": "1", "GGML_CPU_TILED_MM_FORCE": "1"}}

_CHILD = r"""
import json, statistics, sys, time, torch
from flashdraft.targets.llama import LlamaTarget
t = LlamaTarget(sys.argv[1], n_ctx=1024, threads=int(sys.argv[2]), cache_type_k="f16", cache_type_v="f16", warn=False)
ids = t.encode("def fibonacci(n):\n    '''Return the n-th Fibonacci number.'''\n" * 30)[:400]
def med(fn, reps):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(ts), 2)
ctx = torch.tensor(ids[:300])
out = {}
for k in (1, 8, 16):
    c = t.new_cache(); t.forward(ctx, c, 299)
    def f(k=k, c=c):
        t.forward(torch.tensor(ids[300:300 + k]), c)
        c.rollback(300)
    out[f"{k} row" + ("s" if k > 1 else "")] = med(f, 9)
out["prefill 300"] = med(lambda: t.forward(ctx, t.new_cache(), 299), 5)
out["drift 8 rows"] = t.verify_drift(8)
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=1)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode, extra in MODES.items():
            env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_CPU_TILED_MM")}
            env.update(extra)
            p = subprocess.run([sys.executable, "-c", _CHILD, args.gguf, str(args.threads)], env=env,
                               capture_output=True, text=True)
            if p.returncode:
                sys.exit(f"{mode}: child failed\n{p.stderr[-2000:]}")
            runs[mode].append(json.loads(p.stdout.strip().splitlines()[-1]))
    cols = list(runs[next(iter(MODES))][0])
    print(f"{os.path.basename(args.gguf)}, -t {args.threads}, medians in ms over {args.rounds} rounds")
    print("| setting | " + " | ".join(cols) + " |")
    print("| --- |" + " --- |" * len(cols))
    for mode, rs in runs.items():
        cells = [f"{statistics.median(r[c] for r in rs):.3g}" if "drift" in c else f"{statistics.median(r[c] for r in rs):.1f}"
                 for c in cols]
        print(f"| {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
