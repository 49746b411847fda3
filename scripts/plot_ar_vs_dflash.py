"""Plot the DFlash vs AR-drafter comparison: decode speedup over plain decoding per
configuration, one panel per target backend, grouped by prompt set and temperature.

    python scripts/plot_ar_vs_dflash.py --torch docs/results/ar-vs-dflash/torch-*.json \
        --llama docs/results/ar-vs-dflash/llama-*.json --out docs/results/ar-vs-dflash/speedup.png

Reads `flashdraft bench --json-out` files (schema flashdraft.bench/1); feeds docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SETS = {"seed": "seed", "sharegpt-heldout": "ShareGPT", "humaneval": "HumanEval"}


def rows(paths: list[str]) -> dict[tuple[str, float], dict[str, float]]:
    """``{(set, T): {config: median speedup}}`` over the given bench JSONs."""
    out: dict[tuple[str, float], dict[str, float]] = {}
    for p in paths:
        for s in json.loads(Path(p).read_text())["summary"]:
            if s["speedup"]:
                out.setdefault((s["prompt_set"], s["temperature"]), {})[s["config"]] = s["speedup"]["median"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--torch", nargs="*", default=[], help="bench JSONs of the torch backend")
    p.add_argument("--llama", nargs="*", default=[], help="bench JSONs of the llama backend")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, rows(paths)) for name, paths in (("torch backend", args.torch), ("llama backend", args.llama))
              if paths]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), squeeze=False)
    for ax, (name, data) in zip(axes[:, 0], panels):
        groups = sorted(data, key=lambda k: (list(SETS).index(k[0]) if k[0] in SETS else 9, k[1]))
        configs = [c for c in ("dflash-adaptive", "draft-adaptive", "self-draft-adaptive", "ngram-adaptive",
                               "hybrid-adaptive") if any(c in data[g] for g in groups)]
        width = 0.8 / max(1, len(configs))
        for i, c in enumerate(configs):
            xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(groups))]
            ax.bar(xs, [data[g].get(c, 0) for g in groups], width, label=c)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(groups)), [f"{SETS.get(s, s)}, T={t:g}" for s, t in groups])
        ax.set_ylabel("speedup vs plain decoding")
        ax.set_title(name)
        ax.legend(fontsize=8, ncol=len(configs))
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
