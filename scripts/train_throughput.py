"""Trained block positions per second: the earlier training step against the current one, one run.

    python scripts/train_throughput.py --data datasets/smollm2-regen-greedy --seconds 60

Configurations, each timed for ``--seconds`` of wall time on the same sequences, one thread:

- ``dense, features by forward``: the earlier recipe's first epoch: a target forward per
  sequence for its features, 32 blocks in one drafter forward under a dense
  ``[K*B, T+K*B]`` mask, bf16 autocast as that recipe had it;
- ``dense, cached features``: the same with features already in memory (its later epochs),
  with bf16 autocast and in float32;
- ``blocks, stored features``: :meth:`DFlashDraftModel.forward_blocks` (context and own-block
  attention separately), memory-mapped stored features and soft labels, 128 anchors,
  autocast only where it pays (:func:`flashdraft.device.bf16_pays`).

Prints a Markdown table (rows/s = trained block positions per second).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from flashdraft.drafters.dflash import load_dflash_model
from flashdraft.engine import DEFAULT_DRAFTER_DIR
from flashdraft.targets.torch import Target
from flashdraft.train.features import FeatureStore
from flashdraft.device import bf16_pays
from flashdraft.train.shards import read_shards
from flashdraft.train.objective import (IGNORE, block_attention_mask, build_blocks, default_gamma, dflash_loss,
                                        loss_weights, sample_anchors)


def dense_loss(drafter, features, ids, anchors, emb, head, t2d, gamma):
    """The earlier objective: every block in one forward under a dense visibility mask."""
    B = drafter.block_size
    block_ids, positions, labels = build_blocks(ids, anchors, B, drafter.mask_token_id)
    T = features.shape[0]
    ctx_kv = drafter.context_kv(drafter.fuse(features[None]), torch.arange(T)[None])
    mask = block_attention_mask(anchors, T, B)[None, None]
    hidden = drafter(F.embedding(block_ids, emb)[None], positions[None], ctx_kv, mask)[0]
    logits = hidden @ head.t()
    target = torch.where(labels >= 0, t2d[labels.clamp(min=0)], labels)
    target = torch.where(target < 0, torch.full_like(target, IGNORE), target)
    ce = F.cross_entropy(logits.float(), target, ignore_index=IGNORE, reduction="none")
    k = torch.arange(block_ids.shape[0]) % B
    w = torch.cat([torch.zeros(1), loss_weights(B, gamma)])[k] * (target != IGNORE)
    return (ce * w).sum() / w.sum().clamp(min=1e-6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a regenerated data directory with stored features")
    ap.add_argument("--seconds", type=float, default=60.0, help="wall time per configuration")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = Target.load(None)
    drafter = load_dflash_model(DEFAULT_DRAFTER_DIR).train()
    layers = drafter.target_layer_ids
    target.set_feature_layers(layers)
    store = FeatureStore(args.data)
    cols = store.columns(layers)
    seqs = [s for s in read_shards(Path(args.data)) if s[0] in store]
    emb = target.embed_tokens.weight.detach()
    head = target.lm_head.weight.detach()[drafter.d2t].contiguous()
    t2d = torch.full((target.vocab_size,), -1, dtype=torch.long)
    t2d[drafter.d2t] = torch.arange(drafter.d2t.shape[0])
    gamma = default_gamma(drafter.block_size)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    fast_bf16 = bf16_pays()

    def stored(sid):
        rows = store.get(sid)
        return (torch.from_numpy(np.ascontiguousarray(rows.features[:, cols])).float(),
                (torch.from_numpy(np.array(rows.topk_ids)), torch.from_numpy(np.array(rows.topk_logp))))

    def by_forward(ids):
        with torch.inference_mode():
            _, f = target.forward(ids, target.new_cache(), ids.shape[0] - 1)
        return f.clone()

    seqs = seqs[:40]  # every configuration cycles over the same sequences
    cached = {sid: by_forward(ids) for sid, ids, _ in seqs}  # the later epochs' in-memory features
    configs = {
        "dense, features by forward (earlier first epoch)": (32, True, "forward"),
        "dense, cached features (earlier later epochs)": (32, True, "cached"),
        "dense, cached features, float32": (32, False, "cached"),
        "blocks, stored features (now)": (128, fast_bf16, "stored"),
    }
    results = []
    for name, (n_blocks, bf16, source) in configs.items():
        rows = steps = 0
        t0 = time.perf_counter()
        i = 0
        while time.perf_counter() - t0 < args.seconds:
            sid, ids, n_prompt = seqs[i % len(seqs)]
            i += 1
            if source == "forward":
                feats, soft = by_forward(ids), None
            elif source == "cached":
                feats, soft = cached[sid], None
            else:
                feats, soft = stored(sid)
            anchors = sample_anchors(n_prompt, min(ids.shape[0], feats.shape[0] + 1), n_blocks, gen)
            if anchors.numel() == 0:
                continue
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                if source == "stored":
                    loss, _, _ = dflash_loss(drafter, feats, ids, anchors, emb, head, t2d, gamma, soft, 0.5)
                else:
                    loss = dense_loss(drafter, feats, ids, anchors, emb, head, t2d, gamma)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rows += anchors.numel() * drafter.block_size
            steps += 1
        wall = time.perf_counter() - t0
        results.append({"config": name, "bf16": bf16, "steps": steps, "rows": rows, "seconds": round(wall, 1),
                        "rows_per_s": round(rows / wall, 1)})
        print(json.dumps(results[-1]), flush=True)
    print("\n| configuration | bf16 autocast | steps | block positions | s | block positions/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['config']} | {r['bf16']} | {r['steps']} | {r['rows']} | {r['seconds']} | {r['rows_per_s']} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
