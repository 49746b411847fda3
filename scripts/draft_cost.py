#!/usr/bin/env python3
"""Milliseconds per DFlash draft (one block) by draft vocabulary, beside the target's steps.

The recipe table in docs/training.md finds a larger draft vocabulary raises τ; it also makes
every draft dearer (the LM head runs over ``V_d`` rows for each block position). This
measures that cost in one process, interleaved round by round: a draft of ``--draft`` tokens
with each vocabulary (the shipped drafter's weights, only ``d2t`` changed: the head is the
target's, so cost does not depend on the training), a 1-token target decode step and a
``draft + 1``-token verify step, all after a ~300-token context. Medians are reported.

    .venv/bin/python scripts/draft_cost.py --vocab 8192,16384,0 --rounds 30

Another target: ``-m GGUF --data ITS_REGENERATED_ANSWERS`` with ``-md`` its drafter (any
drafter of that target's shape: only ``d2t`` is changed, and the cost does not depend on the
weights), e.g. Gemma 3 270M (docs/training.md, "Train a drafter for your model").
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", default="8192,16384,0", help="draft vocabulary sizes (0 = full)")
    ap.add_argument("--draft", type=int, default=15, help="draft tokens per block")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-m", "--model", default=None, help="target GGUF (default: the packaged SmolLM2)")
    ap.add_argument("-md", "--draft-model", default=None, help="a DFlash drafter of the target (default: shipped)")
    ap.add_argument("--data", default="datasets/smollm2-regen-greedy", help="answers that rank the draft vocabulary")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from flashdraft.drafters.dflash import DFlashDrafter, load_dflash_model
    from flashdraft.prompts import SEED_PROMPTS
    from flashdraft.sampling import SamplingParams
    from flashdraft.engine import DEFAULT_DRAFTER_DIR
    from flashdraft.targets.torch import Target
    from flashdraft.train.shards import read_shards

    from flashdraft.engine import shipped_drafter_for

    target = Target.load(args.model)
    base = load_dflash_model(args.draft_model or (DEFAULT_DRAFTER_DIR if args.model is None
                                                  else shipped_drafter_for(target)))
    target.set_feature_layers(base.target_layer_ids)
    ids = torch.tensor(target.user_prompt_ids(" ".join(SEED_PROMPTS))[:300])
    cache = target.new_cache(1024)  # the lean forward the server runs, where the target has one
    _, feats = target.forward(ids, cache, ids.shape[0] - 1)
    n_ctx = cache.length

    # most frequent ids of the training answers first: the same rule as the trainer's d2t
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    for _, seq, n in read_shards(args.data)[:2000]:
        counts += torch.bincount(seq[n:], minlength=target.vocab_size)
    order = torch.argsort(counts, descending=True)
    drafters = {}
    for v in (int(x) for x in args.vocab.split(",")):
        model = copy.deepcopy(base)
        model.set_draft_vocab(None if v == 0 else torch.sort(order[:v]).values)
        d = DFlashDrafter(model, target.embed_tokens, target.lm_head)
        d.commit(n_ctx, feats)
        drafters[f"draft, V_d = {v or target.vocab_size}"] = d
    params, gen = SamplingParams(), torch.Generator().manual_seed(0)
    verify_ids = torch.full((args.draft + 1,), 42, dtype=torch.long)

    def decode():
        target.forward(verify_ids[:1], cache)
        cache.rollback(n_ctx)

    def verify():
        target.forward(verify_ids, cache)
        cache.rollback(n_ctx)

    jobs = {name: (lambda d=d: d.propose(ids, args.draft, params, gen)) for name, d in drafters.items()}
    jobs["target decode (1 token)"] = decode
    jobs[f"target verify ({args.draft + 1} tokens)"] = verify
    times = {name: [] for name in jobs}
    for r in range(args.rounds + 2):
        for name, job in jobs.items():
            t0 = time.perf_counter()
            job()
            if r >= 2:
                times[name].append(1e3 * (time.perf_counter() - t0))
    decode_ms = statistics.median(times["target decode (1 token)"])
    print(f"threads {args.threads}, context {n_ctx}, {args.rounds} rounds (medians)")
    print("| step | ms | in decode steps |")
    print("| --- | --- | --- |")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.2f} | {m / decode_ms:.2f} |")


if __name__ == "__main__":
    main()
