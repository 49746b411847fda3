"""How much of the held-out answers a draft vocabulary can propose at all.

A drafter with a draft vocabulary of the k most frequent training-answer tokens (the
trainer's ``draft_vocabulary``) can never propose a token outside it, so the share of
held-out answer tokens inside it bounds per-position acceptance. This counts that share
for several k on each held-out answer set (greedy answers, ``datasets/heldout``). Only
answer tokens are ranked: where the training answers hold fewer than k distinct tokens, the
trainer fills the rest from the prompts, which this count leaves out (so coverage stops
growing at the number of distinct answer tokens, reported as ``distinct_answer_tokens``).

    .venv/bin/python scripts/vocab_coverage.py --data datasets/smollm2-regen-greedy \
        --json-out docs/results/vocab-coverage.json

``--model GGUF`` ranks as the trainer does, prompts included (its tokenizer fills the rest
of the vocabulary from the training prompts), e.g. for Gemma 3 270M, whose repetitive
base-model answers hold few distinct tokens (docs/training.md, "Train a drafter for your model").
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from flashdraft.train.loop import draft_vocabulary
from flashdraft.train.shards import read_shards


def coverage(vocab: set[int], seqs) -> float:
    """Share of answer tokens of ``seqs`` (``(id, ids, n_prompt)``) that are in ``vocab``."""
    counts = Counter()
    for _, ids, n_prompt in seqs:
        counts.update(ids[n_prompt:].tolist())
    total = sum(counts.values())
    return sum(c for t, c in counts.items() if t in vocab) / total if total else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="training answer directory the vocabulary is counted on")
    p.add_argument("--heldout", default="datasets/heldout/SmolLM2-135M-Instruct.Q4_1",
                   help="directory of held-out answer sets (one sub-directory per set)")
    p.add_argument("--sets", default="humaneval-t0,sharegpt-heldout-t0,seed-t0")
    p.add_argument("--sizes", default="4096,8192,16384,32768")
    p.add_argument("--json-out", default=None)
    p.add_argument("--model", default=None, help="target GGUF: fill from the training prompts as the trainer does")
    args = p.parse_args()
    train = read_shards(Path(args.data))
    sizes = [int(s) for s in args.sizes.split(",")]
    texts, tokenizer = (), None
    if args.model:
        from transformers import AutoTokenizer

        from flashdraft.train.data import training_prompts

        path = Path(args.model)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        texts = [q["prompt"] for q in training_prompts()]
    vocabs = {k: set(draft_vocabulary(train, k, set(), texts, tokenizer).tolist()) for k in sizes}
    distinct = len({t for _, ids, n in train for t in ids[n:].tolist()})
    print(f"{len(train)} training answers, {distinct} distinct answer tokens")
    rows = {}
    for name in args.sets.split(","):
        seqs = read_shards(Path(args.heldout) / name)
        rows[name] = {"answers": len(seqs), **{str(k): round(coverage(v, seqs), 4) for k, v in vocabs.items()}}
    print("| held-out set | answers | " + " | ".join(f"{k // 1024}k" for k in sizes) + " |")
    print("| --- | --- |" + " --- |" * len(sizes))
    for name, r in rows.items():
        print(f"| {name} | {r['answers']} | " + " | ".join(f"{100 * r[str(k)]:.1f}%" for k in sizes) + " |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"data": args.data, "model": args.model, "training_answers": len(train), "distinct_answer_tokens": distinct, "sizes": sizes, "coverage": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
