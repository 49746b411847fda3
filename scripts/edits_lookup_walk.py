#!/usr/bin/env python
"""Offline walk of prompt-lookup variants over the greedy answers in a bench ``--json-out`` file.

At T=0 an answer is fixed, so how often a lookup drafter's tokens would be accepted can be
counted without the model: walk the answer step by step, draft from the prompt and the
answer so far, accept the leading drafts that equal the answer, add the bonus token. Each
variant drafts at a fixed depth; "est. speed" divides the answer's tokens by the summed
verify cost of its steps (the cost table measured at load on the 2-core machine of
docs/results/edits/: rows 1..17 of a checked block) and compares with one-token steps.
The answers are re-tokenised from their text, so counts can differ by a token or two.

    python scripts/edits_lookup_walk.py docs/results/edits/bench-edits.json none
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's flashdraft

import json  # noqa: E402

from transformers import AutoTokenizer  # noqa: E402

from flashdraft.prompts import load_prompt_set  # noqa: E402
from flashdraft.targets.torch import default_model_path  # noqa: E402

g = default_model_path()
tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)


def ids_of(prompt, answer):
    t = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    p = tok.encode(t, add_special_tokens=False)
    a = tok.encode(answer, add_special_tokens=False)
    return p, a


def ngram_propose(seq, n, max_ngram, min_ngram):
    L = len(seq)
    for size in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = seq[L - size:]
        for start in range(L - size - 1, -1, -1):
            if seq[start:start + size] == suffix:
                follow = seq[start + size:start + size + n]
                if follow:
                    return follow
                break
    return []


def longest_propose(seq, n, min_ngram, cap=64):
    """occurrence with the longest matching context (ties: most recent)."""
    L = len(seq)
    if L <= min_ngram:
        return []
    suffix = seq[L - min_ngram:]
    best, best_len = None, 0
    for start in range(L - min_ngram - 1, -1, -1):
        if seq[start:start + min_ngram] == suffix:
            k = min_ngram
            while k < cap and start - (k - min_ngram) - 1 >= 0 and seq[start - (k - min_ngram) - 1] == seq[L - k - 1]:
                k += 1
            if k > best_len:
                best, best_len = start, k
    if best is None:
        return []
    return seq[best + min_ngram:best + min_ngram + n]


def walk(p, a, propose, n, cost):
    seq = list(p) + [a[0]]
    i = 1
    steps = acc_total = 0
    t = 0.0  # the prefill's step is the same for every variant: left out
    drafted = 0
    while i < len(a):
        d = propose(seq, n)[: len(a) - i]
        k = 0
        while k < len(d) and d[k] == a[i + k]:
            k += 1
        steps += 1
        drafted += len(d)
        acc_total += k
        t += cost[min(len(d), len(cost) - 1)]
        take = min(k + 1, len(a) - i)
        seq += a[i:i + take]
        i += take
    toks = len(a) - 1
    return dict(steps=steps, tau=toks / max(steps, 1), acc=acc_total, drafted=drafted, time=t, plain=toks * cost[0])


NS = (4, 8, 16)
def main():
    path, config = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "none"
    data = json.load(open(path))
    texts = {}
    for r in data["outputs"]:
        if r.get("config") == config:
            texts.setdefault(r["prompt_id"], r["text"])
    sets = {r["prompt_set"]: None for r in data["outputs"]}
    prompts = {}
    for s in sets:
        for it in load_prompt_set(s):
            prompts[it["id"]] = it["prompt"]
    pairs = [ids_of(prompts[k], v) for k, v in texts.items() if k in prompts]
    # cost per rows (ms): a block of k drafts + anchor, a Q4_1 llama -t1 curve from the cost table
    cost = [23.4315, 39.1466, 51.1826, 61.4924, 82.7462, 91.5984, 102.7758, 105.2288, 121.7022, 131.7775, 140.6728, 148.1685, 162.8127, 178.7666, 184.5114, 190.0711, 208.9367]
    cost += [cost[-1] + 11.0 * (j + 1) for j in range(48)]
    variants = {}
    for n in NS:
        for mx in (3, 4, 6, 8):
            for mn in (1, 2, 3):
                if mn <= mx:
                    variants[f"ngram max{mx} min{mn} n{n}"] = (lambda s, k, mx=mx, mn=mn: ngram_propose(s, k, mx, mn), n)
        for mn in (1, 2, 3, 4):
            variants[f"longest min{mn} n{n}"] = (lambda s, k, mn=mn: longest_propose(s, k, mn), n)
    print(f"{len(pairs)} answers, {sum(len(a) for _, a in pairs)} answer tokens")
    rows = []
    for name, (prop, n) in variants.items():
        tot = dict(steps=0, acc=0, drafted=0, time=0.0, plain=0.0, toks=0)
        for p, a in pairs:
            w = walk(p, a, prop, n, cost)
            for k in ("steps", "acc", "drafted", "time", "plain"):
                tot[k] += w[k]
            tot["toks"] += len(a) - 1
        rows.append((tot["plain"] / tot["time"], name, tot["toks"] / tot["steps"], tot["acc"] / max(tot["drafted"], 1)))
    for sp, name, tau, rate in sorted(rows, reverse=True):
        print(f"{name:28s} tau {tau:5.2f}  accepted/drafted {rate:5.2f}  est. speed vs plain (fixed depth) {sp:5.2f}")


main()
