"""The speed bound of drafting on this engine, measured: every draft accepted.

For each draft depth d it runs ``flashdraft bench --configs none,dflash,ngram`` with
``--spec-synth-rates 1,...,1`` (llama-server's synthetic acceptance: a draft position is
accepted whatever the target says, so τ is what the depth allows) and prints, per depth,
decode tok/s and speedup over plain decoding measured side by side in the same run, with
the real costs of the drafts (DFlash: its network; prompt lookup: ~free) and of the
verify blocks. Prompt lookup drafts only where the text so far repeats, so its τ stays
below d + 1 at large d; DFlash drafts every step.

    python scripts/speed_bound.py --depths 1,2,4,8,16 [--quant Q4_0] [-t 2] [--out FILE.md] [--json-dir DIR]

The output is a markdown table (docs/results/cheap-verify/bound-*.md holds the runs cited).
``--json-dir``: each depth's bench JSON is kept there as ``d<depth>.json``, and a depth whose
file is there already is read, not run again (a run resumes; a table is rebuilt from them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run_depth(d: int, args) -> dict:
    """One bench run at depth ``d``: ``{config: summary row}`` of the seed prompts."""
    kept = Path(args.json_dir) / f"d{d}.json" if args.json_dir else None
    if kept is not None and kept.exists():
        return {r["config"]: r for r in json.loads(kept.read_text())["summary"]}
    with tempfile.TemporaryDirectory() as tmp:
        out = kept or Path(tmp) / "bench.json"
        cmd = [sys.executable, "-c", "import sys; from flashdraft.cli import main; sys.exit(main())", "bench", "--configs", "none,dflash,ngram", "--prompts", args.prompts,
               "-n", str(args.max_tokens), "-t", str(args.threads), "--repeats", str(args.repeats),
               "--spec-draft-n-max", str(d), "--spec-synth-rates", ",".join(["1"] * d), "--json-out", str(out),
               "--no-per-prompt"]
        if args.quant:
            cmd += ["--quant", args.quant]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())["summary"]
    return {r["config"]: r for r in rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", default="1,2,4,8,16", help="draft depths to run (default: 1,2,4,8,16)")
    p.add_argument("--quant", default=None, help="bench a requantisation of the target (flashdraft bench --quant)")
    p.add_argument("--prompts", default="seed", help="prompt set (default: seed)")
    p.add_argument("-n", "--max-tokens", type=int, default=256)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the table to this file")
    p.add_argument("--json-dir", default=None, help="keep (and reuse) each depth's bench JSON here")
    args = p.parse_args(argv)
    lines = [f"every draft accepted (--spec-synth-rates 1,...), {args.prompts} prompts, {args.max_tokens} tokens, "
             f"-t {args.threads}, {args.repeats} passes, target {args.quant or 'as packaged'}; "
             "decode tok/s median, speedup over `none` in the same run (min-max over passes)", "",
             "| depth d | plain tok/s | DFlash tok/s | DFlash speedup | DFlash τ | DFlash draft ms/token "
             "| lookup tok/s | lookup speedup | lookup τ |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for d in (int(x) for x in args.depths.split(",")):
        r = run_depth(d, args)
        none, df, ng = r["none"], r["dflash"], r["ngram"]

        def sp(row):
            s = row["speedup"]
            return f"{s['median']:.2f} [{s['min']:.2f}–{s['max']:.2f}]"
        lines.append(f"| {d} | {none['decode_tokens_per_s']['median']:.1f} | {df['decode_tokens_per_s']['median']:.1f} "
                     f"| {sp(df)} | {df['acceptance_length']:.2f} | {df['draft_ms_per_token']:.2f} "
                     f"| {ng['decode_tokens_per_s']['median']:.1f} | {sp(ng)} | {ng['acceptance_length']:.2f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
