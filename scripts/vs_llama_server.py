"""A bench result file as ratios to llama-server's plain decoding at its best thread count
(the faster of its ``-tN`` rows per prompt set), for README's table.

    python scripts/vs_llama_server.py docs/results/cheap-verify/bench-q41-t2.json
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    d = json.load(open(path))
    rows = [r for r in d["summary"] if r["temperature"] == 0]
    sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
    tps = {(r["prompt_set"], r["config"]): r["decode_tokens_per_s"]["median"] for r in rows}
    same = {(r["prompt_set"], r["config"]): r.get("same_as_baseline") for r in rows}
    configs = list(dict.fromkeys(r["config"] for r in rows))
    best = {s: max(v for (ps, c), v in tps.items() if ps == s and c.startswith("llama-server -t")) for s in sets}
    print(f"{path}: decode tok/s ÷ llama-server plain at its faster thread count "
          f"({', '.join(f'{s} {best[s]:.1f} tok/s' for s in sets)})\n")
    print("| config | " + " | ".join(sets) + " |")
    print("| --- |" + " --- |" * len(sets))
    for c in configs:
        cells = []
        for s in sets:
            v = tps.get((s, c))
            cells.append("–" if v is None else f"{v / best[s]:.2f}× ({v:.0f})")
        print(f"| {c} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
