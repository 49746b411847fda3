"""How much DFlash2 path selection could gain: top-k coverage of a drafter's blocks.

For every anchor of the held-out answers, the drafter's block is run once (as in the offline
walk) and each block position's label is looked up in the drafter's top-k. An *oracle*
selector that picks the label whenever it is a candidate accepts the leading run of positions
whose label is in the top-k; a trained selector can do at most that. Reported per k: the
share of rows whose label is in the top-k at block positions 1..3, and the mean tokens per
step of an anchor (1 + the accepted run), with k = 1 being the drafter's own argmax.
With ``--selector``, the same for the selector's own path given the true prefix.

    python scripts/selector_ceiling.py --drafter D [--limit 60] [--out docs/results/...json]

Feeds docs/training.md ("DFlash2 path selection").
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from flashdraft.drafters.dflash import load_dflash_model, seed_block
from flashdraft.drafters.ngram import lookup_candidates
from flashdraft.train.walk import heldout_answers_dir, load_answers, target_features

KS = (1, 2, 4, 8, 16)


@torch.inference_mode()
def block_rows(model, target, ids, n_prompt, feats):
    """``(hidden [A, B-1, H], logits [A, B-1, V_d], labels [A, B-1] target ids or -1, anchors [A])``."""
    B = model.block_size
    head = target.lm_head.weight.detach()
    head = head if model.d2t is None else head[model.d2t]
    T = feats.shape[0]
    fused = model.fuse(feats[None].to(model.fc.weight.dtype))
    ctx = model.context_kv(fused, torch.arange(T)[None])
    anchors = torch.arange(n_prompt, min(ids.shape[0] - 1, T + 1))
    block = torch.full((anchors.shape[0], B), model.mask_token_id, dtype=torch.long)
    block[:, 0] = ids[anchors]
    if model.ngram_seeded:
        for j, cand in enumerate(lookup_candidates(ids.tolist(), anchors.tolist(), B - 1)):
            seed_block(block[j], cand)
    x = F.embedding(block, target.embed_tokens.weight.detach()).to(model.fc.weight.dtype)
    hidden = model.forward_blocks(x, anchors, ctx)[:, 1:]
    logits = (hidden @ head.t()).float()
    pos = anchors[:, None] + torch.arange(1, B)[None]
    labels = torch.where(pos < ids.shape[0], ids[pos.clamp(max=ids.shape[0] - 1)], torch.full_like(pos, -1))
    return hidden, logits, labels, anchors


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafter", required=True)
    p.add_argument("--datasets", default="humaneval,sharegpt-heldout,seed")
    p.add_argument("--limit", type=int, default=60)
    p.add_argument("--heldout-root", default="datasets/heldout")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    from flashdraft.engine import EngineConfig, load_engine_target

    target = load_engine_target(EngineConfig(spec_type="none", device="cpu"))
    model = load_dflash_model(args.drafter).eval()
    d2t = model.d2t
    report = {}
    for dataset in args.datasets.split(","):
        answers = load_answers(heldout_answers_dir(args.heldout_root, target.name, dataset, 0.0), target,
                               model.target_layer_ids, args.limit)
        inside = {k: [] for k in KS}
        sel = []
        for _, ids, n_prompt, feats in answers:
            if feats is None:
                feats = target_features(target, ids, model.target_layer_ids)
            hidden, logits, labels, anchors = block_rows(model, target, ids, n_prompt, feats)
            top = logits.topk(max(KS), -1).indices
            top_ids = top if d2t is None else d2t[top]
            for k in KS:
                inside[k].append((top_ids[..., :k] == labels[..., None]).any(-1))
            if model.candidate_selector is not None:
                # the selector's pick at each position given the true previous token
                prev = torch.cat([ids[anchors][:, None], labels[:, :-1].clamp(min=0)], 1)
                s = model.candidate_selector
                unary, cand, cand_ids = s.candidates(logits, d2t)
                scores = s.scores(prev.reshape(-1), hidden.reshape(-1, hidden.shape[-1]),
                                  unary.reshape(-1, s.top_k), cand_ids.reshape(-1, s.top_k))
                pick = cand_ids.reshape(-1, s.top_k).gather(1, scores.argmax(-1, keepdim=True)).view(labels.shape)
                sel.append(pick == labels)
        row = {}

        def summary(hits):
            h = torch.cat(hits)  # [anchors, B-1]
            run = h.int().cumprod(1).sum(1).float()
            return {"in_top_k_pos_1_2_3": [round(float(v), 4) for v in h[:, :3].float().mean(0)],
                    "tokens_per_step": round(float(1 + run.mean()), 4)}

        for k in KS:
            row[f"top{k}"] = summary(inside[k])
        if sel:
            row["selector"] = summary(sel)
        report[dataset] = row
        print(dataset, json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"drafter": args.drafter, "limit": args.limit, "sets": report}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
