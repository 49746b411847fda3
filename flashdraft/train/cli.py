"""``flashdraft train``: regenerate responses with the target, then train a drafter for it
(DFlash, or with ``--kind ar`` an autoregressive assistant drafter).

Both phases resume where they stopped: run the same command again after an interruption.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from flashdraft.argtypes import positive_float
from flashdraft.device import add_device_argument, device_from_args
from flashdraft.flags import add_backend_argument

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", "-m", default=None, help="target model (default: packaged SmolLM2-135M-Instruct)")
    p.add_argument("--kind", choices=["dflash", "ar"], default="dflash",
                   help="dflash: a block-diffusion drafter (one forward per block); ar: an autoregressive "
                        "assistant drafter built from the target's first --layers layers, served with "
                        "--spec-type draft -md OUT/drafter")
    p.add_argument("--ar-features", action="store_true",
                   help="--kind ar: condition on the target's last-layer state of the previous position "
                        "(EAGLE-1) instead of tokens alone")
    p.add_argument("--out", required=True, help="output directory (checkpoint.pt, drafter/, train_log.jsonl)")
    p.add_argument("--data", default=None,
                   help="regenerated data directory, or several separated by commas (default: OUT/data)")
    p.add_argument("--prompts", type=int, default=2000,
                   help="responses to regenerate before training (0 = use what DATA has; default: 2000)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length cap for regeneration")
    p.add_argument("--regen-batch-size", type=int, default=32, help="sequences regenerated together")
    p.add_argument("--max-hours", type=float, default=None, help="stop training after this many hours")
    p.add_argument("--max-cpu-hours", type=float, default=None,
                   help="stop after this many CPU-hours of training steps; the cosine schedule then runs "
                        "over CPU time instead of --steps (equal-CPU comparisons)")
    p.add_argument("--steps", type=int, default=6000, help="optimizer steps (cosine schedule length)")
    p.add_argument("--layers", type=int, default=None,
                   help="drafter decoder layers (default 1, or --init-from's; more than --init-from's "
                        "adds identity-initialised layers)")
    p.add_argument("--feature-layers", type=int, default=None,
                   help="target layers fused as context features (default 3)")
    from flashdraft.train.loop import shipped_block_size

    p.add_argument("--block-size", type=int, default=None,
                   help=f"block size (default: {shipped_block_size()}, the shipped drafter's, or --init-from's)")
    p.add_argument("--blocks-per-step", type=int, default=256,
                   help="anchors (blocks) per sequence per step, at most one per answer position (default 256)")
    p.add_argument("--seqs-per-step", type=int, default=2, help="sequences per optimizer step (default 2)")
    p.add_argument("--feature-layer-ids", default=None,
                   help="comma-separated target layers for the context features (overrides --feature-layers)")
    p.add_argument("--soft-weight", type=float, default=0.0,
                   help="share of the soft-label loss on the target's stored top-k distribution (0 = hard CE)")
    p.add_argument("--init-from", default=None, help="start from this drafter's weights (warm start)")
    p.add_argument("--ngram-seeded", action="store_true",
                   help="train an n-gram-seeded drafter: block mask positions start as the prompt-lookup "
                        "continuation of the anchor (dflash_config.ngram_seeded)")
    p.add_argument("--loss-gamma", type=positive_float, default=None,
                   help="decay of the per-position loss weight exp(-(k-1)/gamma); smaller weights block "
                        "position 1 more (default: the paper's, 4 for block size 8)")
    p.add_argument("--mask-after-miss", action="store_true",
                   help="GRIFFIN-style loss mask: a block position counts only while the drafter is right at "
                        "every position before it (decoding never reaches the others)")
    p.add_argument("--selector-top-k", type=int, default=0, metavar="K",
                   help="DFlash2 path selection: keep the top K candidates per block position and train a "
                        "selector that picks the path (0 = plain DFlash; 1 = the argmax path)")
    p.add_argument("--selector-rank", type=int, default=32, help="rank of the DFlash2 selector's codebooks")
    p.add_argument("--selector-lr", type=float, default=None,
                   help="peak learning rate of the DFlash2 selector (default: --lr); e.g. 3e-3 beside a --lr 1e-4 body")
    p.add_argument("--train-only", choices=["all", "selector"], default="all",
                   help="selector: train only the DFlash2 selector on a frozen drafter (with --init-from)")
    p.add_argument("--init-layers", default=None, help="comma-separated target layers to initialise drafter layers from")
    p.add_argument("--eval-answers", type=int, default=24,
                   help="held-out answers walked per set at each evaluation (default 24)")
    p.add_argument("--heldout-root", default="datasets/heldout",
                   help="held-out answers for the offline τ (made by `flashdraft eval --offline`)")
    p.add_argument("--build-features", action="store_true",
                   help="compute stored context features for DATA's shards that lack them, then exit")
    p.add_argument("--lr", type=float, default=6e-4, help="AdamW peak learning rate (cosine schedule, 4%% warm-up)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="reduced draft vocabulary size, 0 = full (default 8192, or --init-from's)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="token whose embedding fills the block's mask positions (default: None = SmolLM2's "
                        "<empty_output> for a 49152-token vocabulary, else the pad token or 0)")
    p.add_argument("--bf16", choices=["auto", "on", "off"], default="auto",
                   help="bf16 autocast: auto = when a measured bf16 matmul beats float32 on this CPU (default)")
    p.add_argument("--no-bf16", dest="bf16", action="store_const", const="off", help="same as --bf16 off")
    p.add_argument("--eval-minutes", type=float, default=20.0, help="held-out τ every N minutes (0 = off)")
    p.add_argument("--seed", type=int, default=0, help="seed of initialisation, anchors and data order")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: None = torch's own choice)")
    add_backend_argument(p)  # the regeneration's target engine (auto: llama.cpp for a GGUF on the CPU)
    add_device_argument(p)


def _int_list(text: str | None) -> list[int]:
    """``"1,14,27"`` -> ``[1, 14, 27]``. Raises ValueError naming the bad value."""
    if not text:
        return []
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def heldout_answers(args) -> None:
    """The target's answers to the held-out sets that the training evaluations and the model
    card walk (``--eval-answers`` of each), made once on the regeneration's backend."""
    from flashdraft.engine import EngineConfig, load_engine_target
    from flashdraft.train.card import CARD_SETS
    from flashdraft.train.walk import ensure_heldout_answers

    batch = min(16, args.eval_answers)
    target = load_engine_target(EngineConfig(model=args.target, spec_type="none", backend=args.backend,
                                             n_parallel=batch, ctx_size=1024))
    for name in CARD_SETS:
        # 256 tokens, as every held-out set here (the training evaluations walk that cap)
        ensure_heldout_answers(target, name, 0.0, args.heldout_root, 256, args.eval_answers, batch_size=batch)
    del target


def run(args) -> int:
    import torch

    from flashdraft.targets.torch import Target
    from flashdraft.train.loop import TrainConfig, Trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    device = device_from_args(args)  # an absent --device fails here, before any work
    out = Path(args.out)
    data = args.data or str(out / "data")
    start = time.time()
    # --build-features only fills in features for what DATA holds: it never regenerates
    regen = bool(args.prompts) and not args.build_features
    if regen:  # resumable: ids already in DATA are skipped; features stored as it goes
        from flashdraft.train.data import training_prompts
        from flashdraft.train.regen import regenerate_packed

        regenerate_packed(data.split(",")[0], training_prompts()[: args.prompts], model=args.target,
                          max_new_tokens=args.max_new_tokens, batch_size=args.regen_batch_size, device=device,
                          backend=args.backend)
    if regen and args.kind == "dflash":
        heldout_answers(args)
    if args.build_features:
        # on --backend's engine (auto: llama.cpp for a GGUF on the CPU), the one that serves
        from flashdraft.engine import EngineConfig, load_engine_target
        from flashdraft.train.features import build_features
        from flashdraft.train.regen import default_stored_layers

        target = load_engine_target(EngineConfig(model=args.target, spec_type="none", backend=args.backend,
                                                 device=str(device)))
        for d in str(data).split(","):
            n = build_features(d, target, default_stored_layers(target.num_layers))
            print(f"{d}: features computed for {n} sequences ({target.backend} backend)")
        return 0
    target = Target.load(args.target, device=device)
    hours = None if args.max_hours is None else max(0.01, args.max_hours - (time.time() - start) / 3600)
    cfg = TrainConfig(data_dir=data, out_dir=str(out), target=args.target, num_layers=args.layers,
                      num_feature_layers=args.feature_layers, block_size=args.block_size,
                      blocks_per_step=args.blocks_per_step, steps=args.steps, max_hours=hours, max_cpu_hours=args.max_cpu_hours, lr=args.lr,
                      draft_vocab=args.draft_vocab, mask_token_id=args.mask_token_id, seed=args.seed,
                      bf16={"auto": None, "on": True, "off": False}[args.bf16], eval_minutes=args.eval_minutes, seqs_per_step=args.seqs_per_step,
                      feature_layer_ids=_int_list(args.feature_layer_ids), soft_weight=args.soft_weight, mask_after_miss=args.mask_after_miss,
                      loss_gamma=args.loss_gamma,
                      init_layers=_int_list(args.init_layers), eval_answers=args.eval_answers,
                      heldout_root=args.heldout_root, init_from=args.init_from,
                      ngram_seeded=args.ngram_seeded, device=str(target.device), kind=args.kind,
                      ar_features=args.ar_features, selector_top_k=args.selector_top_k,
                      selector_rank=args.selector_rank, train_only=args.train_only,
                      selector_lr=args.selector_lr)
    if args.kind == "ar":
        from flashdraft.train.ar_loop import ARTrainer

        result = ARTrainer(cfg, target=target).train()
        print(json.dumps(result))
        print(f"drafter written to {out / 'drafter'}; serve it with: "
              f"flashdraft serve --spec-type draft -md {out / 'drafter'}")
        return 0
    trainer = Trainer(cfg, target=target)
    result = trainer.train()
    print(json.dumps(result))
    if result.get("stopped"):  # SIGTERM: leave at once; the card's walk takes minutes
        print(f"stopped: checkpoint saved in {out}; run the same command to resume (the model card is "
              "written when a run ends)")
        return 0
    from flashdraft.train.card import write_model_card

    card = write_model_card(trainer, result)
    if card is not None:
        print(f"model card: {card}")
    model = f"-m {args.target} " if args.target else ""
    print(f"drafter written to {out / 'drafter'}; serve it with: flashdraft serve {model}-md {out / 'drafter'}")
    return 0
