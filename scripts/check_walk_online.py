"""Does the offline walk give the online τ on the real model? One run, a few held-out prompts.

    python scripts/check_walk_online.py --dataset humaneval --limit 3 [--drafter DIR] [--spec-type hybrid]

For each prompt: the online loop (``flashdraft eval``'s counters, fixed draft length, T=0)
and the walk over the stored regenerated answer (``flashdraft eval --offline``). They agree
exactly when the stored answer equals the online greedy answer; the regenerated answers
come from a batched forward, equal to the single-sequence one up to float32 summation
order, so the script also reports whether each answer matched token for token.
"""

from __future__ import annotations

import argparse
import json

import torch

from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.engine import DEFAULT_DRAFTER_DIR, EngineConfig, load_drafter
from flashdraft.generate import SpeculativeGenerator
from flashdraft.sampling import SamplingParams
from flashdraft.targets.torch import Target
from flashdraft.train.evaluate import _run_one
from flashdraft.train.stats import AcceptanceStats
from flashdraft.train.walk import (DFlashProposals, DrafterProposals, heldout_answers_dir, load_answers,
                                   target_features, walk_dataset)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--drafter", default=str(DEFAULT_DRAFTER_DIR))
    ap.add_argument("--spec-type", default="dflash", choices=["dflash", "ngram"])
    ap.add_argument("--heldout-root", default="datasets/heldout")
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = Target.load(None)
    drafter = load_drafter(EngineConfig(spec_type=args.spec_type, draft_model=args.drafter), target)
    n_draft = 15
    answers = load_answers(heldout_answers_dir(args.heldout_root, target.name, args.dataset, 0.0), target,
                           drafter.feature_layer_ids or [], args.limit)
    gen = SpeculativeGenerator(target, drafter, n_draft=n_draft)
    rows = []
    for sid, ids, n_prompt, feats in answers:
        baseline = list(SpeculativeGenerator(target).generate(ids[:n_prompt].tolist(), args.max_tokens,
                                                              SamplingParams()))
        target.set_feature_layers(drafter.feature_layer_ids)  # the baseline generator cleared them
        online = AcceptanceStats()
        _run_one(gen, ids[:n_prompt].tolist(), args.max_tokens, SamplingParams(), False, online)
        plain = [t for step in baseline for t in step.token_ids]
        stored = ids[n_prompt:].tolist()
        same_answer = plain == [t for t in stored if t not in target.eos_token_ids][:len(plain)]
        if args.spec_type == "dflash":
            model = drafter.model
            head = drafter.head_weight
            f = feats if feats is not None else target_features(target, ids, model.target_layer_ids)

            def proposer(i, n, _, f=f):
                return DFlashProposals(model, target.embed_tokens.weight, head, model.d2t, f, i, n)
        else:
            def proposer(i, n, _):
                return DrafterProposals(NgramDrafter(), i, n)
        walked = walk_dataset([(sid, ids, n_prompt, feats)], proposer, n_draft, args.max_tokens,
                              target.eos_token_ids)
        on = online.to_dict(n_draft + 1)
        rows.append({"id": sid, "same_answer": same_answer, "tau_online": on["tau"], "tau_walk": walked["tau"],
                     "accepted_online": on["draft_n_accepted"], "accepted_walk": walked["draft_n_accepted"],
                     "steps_online": on["verify_steps"], "steps_walk": walked["verify_steps"]})
        print(json.dumps(rows[-1]), flush=True)
    print("\n| answer | stored answer = online greedy | τ online | τ walk | accepted online / walk | verify steps online / walk |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['id']} | {'yes' if r['same_answer'] else 'no'} | {r['tau_online']:.3f} | {r['tau_walk']:.3f} | "
              f"{r['accepted_online']} / {r['accepted_walk']} | {r['steps_online']} / {r['steps_walk']} |")


if __name__ == "__main__":
    main()
