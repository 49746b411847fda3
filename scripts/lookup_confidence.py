#!/usr/bin/env python
"""Prompt lookup's acceptance by match length, from the greedy answers in a bench result file:
where :data:`flashdraft.drafters.ngram.NgramDrafter.FIRST_CONFIDENCE` and ``LATER_CONFIDENCE``
come from.

At T=0 an answer is fixed, so whether a lookup draft would be accepted can be counted without
the model: at every position of the plain (``none``) answer, draft from the prompt and the
answer so far with :class:`~flashdraft.drafters.ngram.NgramDrafter`, and count, per bucket of
its :attr:`last_match_length`, whether the first draft token equals the answer's next token and,
after an accepted first token, whether each later one does (up to 8). Answers are
re-tokenised from their text, so counts can differ by a token or two from the run's.

    python scripts/lookup_confidence.py docs/results/lookup-gate/bench-q41-t2.json [--occurrences 8] [--by-set]

``--occurrences N``: the drafter that copies from the best-matching of N occurrences
(``NgramDrafter(occurrences=N)``); ``--by-set``: one table per prompt set.
"""
import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's flashdraft

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from flashdraft.drafters.ngram import NgramDrafter  # noqa: E402
from flashdraft.prompts import load_prompt_set  # noqa: E402
from flashdraft.sampling import SamplingParams  # noqa: E402
from flashdraft.targets.torch import default_model_path  # noqa: E402


def main(path: str, occurrences: int = 1, by_set: bool = False) -> None:
    g = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    result = json.load(open(path))
    sets = sorted({o["prompt_set"] for o in result["outputs"]})
    prompts = {}
    for s in sets:
        for p in load_prompt_set(s):
            text = tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                           tokenize=False)
            prompts[p["id"]] = tok.encode(text, add_special_tokens=False)
    print(f"{path}: prompt sets {', '.join(sets)}; the `none` answers; NgramDrafter(occurrences={occurrences})\n")
    for group in ([[s] for s in sets] if by_set else [sets]):
        table(result, prompts, group, NgramDrafter(occurrences=occurrences), tok)


def table(result: dict, prompts: dict, sets: list[str], d: NgramDrafter, tok) -> None:
    """Print the acceptance-by-match-length table of the ``none`` answers of ``sets``."""
    buckets = list(d.MATCH_BUCKETS) + [None]
    first, later = defaultdict(lambda: [0, 0]), defaultdict(lambda: [0, 0])
    for o in result["outputs"]:
        if o["config"] != "none" or o["prompt_id"] not in prompts or o["prompt_set"] not in sets:
            continue
        seq = prompts[o["prompt_id"]] + tok.encode(o["text"], add_special_tokens=False)
        start = len(prompts[o["prompt_id"]])
        d.reset()
        for i in range(start, len(seq) - 1):
            draft = d.propose(torch.tensor(seq[:i]), 8, SamplingParams(), None).tokens.tolist()
            if not draft:
                continue
            k = next((j for j, top in enumerate(d.MATCH_BUCKETS) if d.last_match_length <= top), len(d.MATCH_BUCKETS))
            ok = draft[0] == seq[i]
            first[k][0] += 1
            first[k][1] += ok
            for j in range(1, min(len(draft), len(seq) - i)) if ok else ():
                later[k][0] += 1
                if draft[j] != seq[i + j]:
                    break
                later[k][1] += 1
    print(f"{', '.join(sets)}:\n")
    print("| match length | first token accepted | later token accepted (after an accepted one) |")
    print("| --- | --- | --- |")
    lo = 1
    for k, top in enumerate(buckets):
        name = f"{lo}-{top}" if top and top > lo else (str(lo) if top else f"{lo}+")
        f, la = first[k], later[k]
        print(f"| {name} | {f[1]}/{f[0]} = {f[1] / max(f[0], 1):.2f} | {la[1]}/{la[0]} = {la[1] / max(la[0], 1):.2f} |")
        lo = (top or lo) + 1
    print()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="prompt lookup's acceptance by match length")
    ap.add_argument("result", help="a flashdraft bench --json-out file")
    ap.add_argument("--occurrences", type=int, default=1)
    ap.add_argument("--by-set", action="store_true")
    a = ap.parse_args()
    main(a.result, a.occurrences, a.by_set)
