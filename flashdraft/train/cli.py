"""``flashdraft train``: regenerate responses with the target, then train a DFlash drafter.

Both phases resume where they stopped: run the same command again after an interruption.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", "-m", default=None, help="target model (default: packaged SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output directory (checkpoint.pt, drafter/, train_log.jsonl)")
    p.add_argument("--data", default=None, help="regenerated data directory (default: OUT/data)")
    p.add_argument("--prompts", type=int, default=2000,
                   help="responses to regenerate before training (0 = use what DATA has; default 2000)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length cap for regeneration")
    p.add_argument("--regen-batch-size", type=int, default=16)
    p.add_argument("--max-hours", type=float, default=None, help="stop training after this many hours")
    p.add_argument("--steps", type=int, default=6000, help="optimizer steps (cosine schedule length)")
    p.add_argument("--layers", type=int, default=1, help="drafter decoder layers (default 1)")
    p.add_argument("--feature-layers", type=int, default=3, help="target layers fused as context features")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks-per-step", type=int, default=32, help="blocks of one sequence per step")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary size (0 = full)")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--no-bf16", action="store_true", help="train in float32 instead of bf16 autocast")
    p.add_argument("--eval-minutes", type=float, default=20.0, help="held-out τ every N minutes (0 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)


def run(args) -> int:
    import torch

    from flashdraft.target import Target
    from flashdraft.train.loop import TrainConfig, Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    data = Path(args.data) if args.data else out / "data"
    start = time.time()
    if args.prompts:  # resumable: ids already in DATA are skipped
        from flashdraft.train.data import regenerate, training_prompts
        regenerate(args.target, None, data, training_prompts()[: args.prompts], max_new_tokens=args.max_new_tokens,
                   batch_size=args.regen_batch_size)
    target = Target.load(args.target)
    hours = None if args.max_hours is None else max(0.01, args.max_hours - (time.time() - start) / 3600)
    cfg = TrainConfig(data_dir=str(data), out_dir=str(out), target=args.target, num_layers=args.layers,
                      num_feature_layers=args.feature_layers, block_size=args.block_size,
                      blocks_per_step=args.blocks_per_step, steps=args.steps, max_hours=hours, lr=args.lr,
                      draft_vocab=args.draft_vocab, mask_token_id=args.mask_token_id, seed=args.seed,
                      bf16=not args.no_bf16, eval_minutes=args.eval_minutes)
    result = Trainer(cfg, target=target).train()
    print(json.dumps(result))
    print(f"drafter written to {out / 'drafter'}; serve it with: flashdraft serve -md {out / 'drafter'}")
    return 0
