#!/usr/bin/env python
"""Time to first token by turn on the ``replay`` set, from a ``flashdraft bench --json-out``
file: per configuration and conversation, each turn's TTFT (median over passes) and its
ratio to the first turn's and the prompt tokens it took from the cache (a later turn reuses
the prompt cache of the one before it).

    python scripts/replay_ttft.py docs/results/agents/bench-replay.json
"""
import json
import statistics
import sys
from collections import defaultdict


def main(path: str) -> None:
    doc = json.load(open(path))
    ttft = defaultdict(list)  # (config, conversation, turn) -> TTFT ms of each pass
    cached = {}  # (config, conversation, turn) -> prompt tokens from the cache (the last pass's)
    tokens = {}
    for r in doc["runs"]:
        if r["prompt_set"] != "replay" or r.get("error"):
            continue
        _, conv, turn = r["prompt_id"].split("/")
        ttft[(r["config"], conv, int(turn))].append(r["ttft_ms"])
        cached[(r["config"], conv, int(turn))] = r.get("cached_tokens")
        tokens[(conv, int(turn))] = r["prompt_tokens"]
    print(f"{path}: TTFT ms, median over passes; in brackets ÷ the conversation's first turn, c = the prompt tokens from the cache\n")
    convs = sorted({(c, t) for _, c, t in ttft})
    print("| config | " + " | ".join(f"{c} turn {t} ({tokens[(c, t)]} tok)" for c, t in convs) + " |")
    print("| --- |" + " --- |" * len(convs))
    for config in dict.fromkeys(k[0] for k in ttft):
        cells = []
        for c, t in convs:
            ms = statistics.median(ttft[(config, c, t)])
            first = statistics.median(ttft[(config, c, 1)])
            c_n = cached[(config, c, t)]
            cells.append(f"{ms:.0f}" + ("" if t == 1 else f" ({ms / first:.2f})") + ("" if c_n is None else f", c {c_n}"))
        print(f"| {config} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
