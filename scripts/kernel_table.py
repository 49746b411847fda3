"""What a checked block costs on the llama backend, per weight type, repack and threads
(docs/performance.md, "Cheap verify"): ms per ``llama_decode`` of k rows at a fixed context,
and whether a 16-row verify equals 16 one-token steps bit for bit (one-token steps on one
thread, blocks on all, as the backend runs them when drafting).

    .venv/bin/python scripts/kernel_table.py [--types Q4_1,Q4_0,Q4_K_M,Q8_0,BF16] [--threads 1,2]
        [--rows 1,4,8,16] [--reps 9] [--context 300] [--out docs/results/cheap-verify/kernels.md]

The types other than the default GGUF's Q4_1 are its requantisations (llama.cpp's quantiser,
flashdraft/targets/requantize.py). ``FLASHDRAFT_CPU_VARIANT=haswell`` measures another CPU
backend variant. One process, medians of ``--reps``; configurations run one after another.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from flashdraft.targets.torch import default_model_path
from flashdraft.targets.binding import binding
from flashdraft.targets.llama import LlamaTarget
from flashdraft.targets.requantize import requantize
from llama_step_profile import median_ms  # scripts/ is on the path of a script run from it


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_1,Q4_0,Q4_K_M,Q8_0,BF16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repack", default="off,on")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    threads = [int(x) for x in args.threads.split(",")]
    rows = [int(x) for x in args.rows.split(",")]
    src = default_model_path()
    b = binding()
    head = ["GGUF", "repack"] + [f"{k} rows, {n} thr" for n in threads for k in rows] + ["exact (16 rows)"]
    lines = [f"{b.cpu.describe()}; context {args.context}; ms per call, median of {args.reps} "
             f"(÷ that row's 1-row, {threads[0]}-thread call)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    print("\n".join(lines), flush=True)
    text = "Write a Python function that reverses a string and explain how slicing works. " * 40
    for quant in args.types.split(","):
        path = src if quant.upper() == "Q4_1" else requantize(src, quant)
        for repack in args.repack.split(","):
            t = LlamaTarget(path, n_ctx=1024, threads=max(threads), warn=False, repack=repack)
            if repack == "on" and not t.repack_mib:
                t.close()
                continue  # nothing of this type repacks: the same as off
            ids = t.encode(text)[: args.context]
            cache = t.new_cache()
            t.forward(torch.tensor(ids), cache, len(ids) - 1)
            base = cache.length
            cells, one = [], None
            for n in threads:
                t._b.api.llama_set_n_threads(t._ctx, n, n)
                for k in rows:
                    x = torch.tensor(ids[:k])
                    ms = median_ms(lambda: (t.forward(x, cache), cache.rollback(base)), args.reps)
                    one = one or ms
                    cells.append(f"{ms:.1f}" if k == 1 and n == threads[0] else f"{ms:.1f} ({ms / one:.1f})")
            # exactness as drafting runs it: steps on 1 thread, blocks on the most threads
            t._b.api.llama_set_n_threads(t._ctx, 1, max(threads))
            t.__dict__.pop("_drift", None)
            drift = t.verify_drift(16)
            mib = f" ({t.repack_mib:.0f} MiB)" if t.repack_mib else ""
            row = [quant, f"{repack}{mib}"] + cells + ["yes" if drift == 0 else f"no ({drift:.3g})"]
            line = "| " + " | ".join(row) + " |"
            print(line, flush=True)
            lines.append(line)
            t.close()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
