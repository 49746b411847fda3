"""Accepted drafts per step early in an answer and later, from the offline walk.

The adaptive controller decides from an answer's first steps; this shows whether those
are typical. Walks each held-out greedy answer with the walk of ``flashdraft eval --offline``
(full depth) and reports the mean accepted drafts per step over the first ``--early`` steps
and over the rest.

    .venv/bin/python scripts/early_acceptance.py -md runs/block8/drafter-best
"""

from __future__ import annotations

import argparse

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-md", "--drafter", default=None, help="DFlash drafter (default: the shipped one)")
    p.add_argument("--heldout", default="datasets/heldout/SmolLM2-135M-Instruct.Q4_1")
    p.add_argument("--sets", default="seed-t0:3,humaneval-t0:30,sharegpt-heldout-t0:30", help="SET:LIMIT,...")
    p.add_argument("--early", type=int, default=4, help="steps counted as early")
    args = p.parse_args()
    torch.set_num_threads(1)

    from flashdraft.drafters.dflash import load_dflash_model
    from flashdraft.engine import DEFAULT_DRAFTER_DIR
    from flashdraft.targets.torch import Target
    from flashdraft.train.stats import AcceptanceStats
    from flashdraft.train.walk import DFlashProposals, load_answers, target_features, walk_answer

    target = Target.load(None)
    model = load_dflash_model(args.drafter or DEFAULT_DRAFTER_DIR).eval()
    head = target.lm_head.weight.detach()
    head = head if model.d2t is None else head[model.d2t].contiguous()
    emb = target.embed_tokens.weight.detach()
    n_draft = model.block_size - 1
    print("| set | answers | accepted per step, first steps | accepted per step, later |")
    print("| --- | --- | --- | --- |")
    for spec in args.sets.split(","):
        name, limit = spec.split(":")
        early, late = [], []
        answers = load_answers(f"{args.heldout}/{name}", target, model.target_layer_ids, int(limit))
        for _, ids, n_prompt, feats in answers:
            if feats is None:
                feats = target_features(target, ids, model.target_layer_ids)
            drafter = DFlashProposals(model, emb, head, model.d2t, feats, ids, n_prompt)
            anchors: list[int] = []

            def propose(i, room, drafter=drafter, anchors=anchors):
                anchors.append(i)  # the walk asks once per step, at each step's anchor
                return drafter(i, room)

            # the walk of `flashdraft eval --offline` (max_tokens 256, as the held-out answers)
            walk_answer(ids[n_prompt:].tolist(), propose, n_draft, 256, target.eos_token_ids, AcceptanceStats())
            # a step accepted the drafts between its anchor and the next one (the last step is left out)
            for step, (a, b) in enumerate(zip(anchors, anchors[1:])):
                (early if step < args.early else late).append(b - a - 1)
        print(f"| {name} | {len(answers)} | {sum(early) / max(1, len(early)):.2f} | {sum(late) / max(1, len(late)):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
