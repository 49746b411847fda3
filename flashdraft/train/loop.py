"""Training loop for a DFlash drafter on a CPU (or any torch device), resumable.

Data: shards (:mod:`flashdraft.train.shards`) written by ``flashdraft.train.regen`` (prompt ids + target-regenerated
response ids). Shards are re-read at every epoch, so training can run while
regeneration is still adding data. Target features are computed once per sequence and
kept (fp16) in memory, so later epochs cost only the drafter.

Device (``--device``): the drafter, the target, features, labels and the loss live on the
target's device; bf16 autocast runs for that device type. Token ids are read and anchors
drawn on the host (one small copy per sequence), so the data order does not depend on the
device.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from flashdraft.device import autocast_device_type, bf16_pays, resolve_device
from flashdraft.drafters.dflash import (DFlashDraftModel, DFlashDrafter, build_target_layer_ids,
                                        drafter_config_for_target, init_from_target)
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from flashdraft.targets.torch import Target
from flashdraft.train.objective import cosine_lr, default_gamma, dflash_loss, sample_anchors
from flashdraft.train.shards import read_shards

log = logging.getLogger(__name__)

#: the largest finite float16 (65504), rounded down: features beyond it are cached as bf16
FP16_MAX = 65000.0
#: ``<empty_output>`` — a pretraining-only special token of SmolLM2 that chat never uses
SMOLLM2_MASK_TOKEN_ID = 16


def shipped_block_size() -> int:
    """The block size of the drafter shipped for the packaged target (its ``config.json``):
    ``flashdraft train``'s default, so a new drafter matches what ships.

    Raises:
        FileNotFoundError: the shipped drafter is missing from this install.
    """
    import json

    from flashdraft.engine import DEFAULT_DRAFTER_DIR

    return int(json.loads((DEFAULT_DRAFTER_DIR / "config.json").read_text())["block_size"])


@dataclass
class TrainConfig:
    """Hyper-parameters (defaults: the CPU recipe recorded in the shipped model card)."""

    data_dir: str
    out_dir: str
    target: str | None = None
    #: drafter shape: None = the warm start's (``init_from``), else 1 layer, 3 feature
    #: layers, block 16 and an 8 k draft vocabulary (0 = full); given with ``init_from``,
    #: the warm start is reshaped (:func:`flashdraft.train.warm_start.adapt_drafter`)
    num_layers: int | None = None
    num_feature_layers: int | None = None
    block_size: int | None = None
    blocks_per_step: int = 32
    steps: int = 6000
    max_hours: float | None = None
    #: stop after this many CPU-hours of training steps (``cpu_hours`` in the log, resumed
    #: runs included); the cosine schedule then runs over CPU time instead of ``steps``, so
    #: runs of different per-step cost can be compared at equal CPU time
    max_cpu_hours: float | None = None
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    draft_vocab: int | None = None
    mask_token_id: int | None = None
    seed: int = 0
    #: bf16 autocast: True, False, or None = when it pays on this device (:func:`bf16_default`)
    bf16: bool | None = None
    #: where the target is loaded when the Trainer loads it (``--device``); a given target's
    #: own device wins
    device: str = "auto"
    checkpoint_minutes: float = 5.0
    eval_minutes: float = 20.0
    eval_prompts: int = 4
    eval_tokens: int = 64
    feature_cache_gb: float = 6.0
    init_layers: list[int] = field(default_factory=list)
    #: explicit target layers for the context features (overrides ``num_feature_layers``)
    feature_layer_ids: list[int] = field(default_factory=list)
    #: sequences per optimizer step (their blocks' losses are averaged)
    seqs_per_step: int = 1
    #: share of the soft-label term (the target's top-k next-token distribution), 0 = hard CE
    soft_weight: float = 0.0
    #: GRIFFIN-style loss mask: drop block positions after the drafter's first miss
    #: (:func:`~flashdraft.train.objective.dflash_loss` ``after_miss=False``)
    mask_after_miss: bool = False
    #: decay of the per-position loss weight ``exp(-(k-1)/gamma)`` (None = the paper's,
    #: :func:`~flashdraft.train.objective.default_gamma`); smaller puts more weight on position 1
    loss_gamma: float | None = None
    #: held-out answers walked per set at each evaluation (offline τ, ``flashdraft.train.walk``)
    eval_answers: int = 48
    heldout_root: str = "datasets/heldout"
    #: start from this drafter's weights (a SpecForge directory or GGUF) instead of a fresh init
    init_from: str | None = None
    #: train an n-gram-seeded drafter (``dflash_config.ngram_seeded``; see :func:`seed_block`)
    ngram_seeded: bool = False
    #: ``dflash`` (block diffusion) or ``ar`` (an autoregressive assistant drafter,
    #: :mod:`flashdraft.train.ar_loop`)
    kind: str = "dflash"
    #: AR drafter only: read the target's last-layer state (EAGLE-1) instead of tokens alone
    ar_features: bool = False
    #: DFlash2 path selection: candidates per position (0 = plain DFlash; a DFlash warm start
    #: gains identity convolutions and a fresh selector, :func:`to_dflash2`) and codebook rank
    selector_top_k: int = 0
    selector_rank: int = 32
    #: ``all`` trains every drafter weight; ``selector`` only the DFlash2 selector (the rest
    #: frozen, so its forward needs no gradients: a cheap selector on a trained drafter)
    train_only: str = "all"
    #: peak learning rate of the DFlash2 selector (None = ``lr``): a fresh low-rank selector
    #: learns at ~10x the rate that keeps a trained drafter body stable (docs/training.md)
    selector_lr: float | None = None

    @property
    def selector_peak_lr(self) -> float:
        """The DFlash2 selector's peak learning rate: ``selector_lr``, else ``lr``."""
        return self.lr if self.selector_lr is None else self.selector_lr


def to_dflash2(model: DFlashDraftModel, top_k: int, rank: int = 32) -> DFlashDraftModel:
    """A DFlash2 drafter computing what ``model`` computes: its weights, identity dynamic
    convolutions and a selector whose successor codebook is zero, so the first path is the
    argmax path (:mod:`flashdraft.drafters.selector`)."""
    from flashdraft.drafters.dflash_format import dflash2_config

    new = DFlashDraftModel(dflash2_config(model.config, top_k, rank))
    new.set_draft_vocab(model.d2t)
    missing, unexpected = new.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("conv" in m or "selector" in m for m in missing), (missing, unexpected)
    new.ngram_seeded = model.ngram_seeded
    return new.to(model.fc.weight.dtype)


def draft_vocabulary(seqs, size: int, always: set[int], extra_texts=(), tokenizer=None) -> torch.Tensor:
    """The ``size`` most frequent tokens, plus ``always``, sorted: ``d2t [V_d]``.

    Response tokens rank first; tokens of ``extra_texts`` (e.g. all training prompts) fill
    the rest, so a vocabulary chosen while regeneration is young still covers the domain.
    """
    counts = Counter()
    for item in seqs:  # (id, ids, n_prompt, ...)
        counts.update(item[1][item[2]:].tolist())
    top = [t for t, _ in counts.most_common()]
    if tokenizer is not None and len(top) < size:
        more = Counter()
        for ids in tokenizer(list(extra_texts), add_special_tokens=False)["input_ids"]:
            more.update(ids)
        seen = set(top)
        top += [t for t, _ in more.most_common() if t not in seen]
    room = size - len(always - set(top[:size]))
    vocab = sorted(set(top[:room]) | always)
    return torch.tensor(vocab, dtype=torch.long)


def bf16_default(device: torch.device) -> bool:
    """Whether bf16 autocast is on by default on ``device``: on CUDA when the GPU supports
    bf16 (tensor cores run it several times faster than float32), measured on the CPU
    (:func:`bf16_pays`), off on MPS (its bf16 autocast is recent and unmeasured here)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bf16_pays()
    return False


class Trainer:
    """Owns target, drafter, optimiser and checkpoints; see :meth:`train`."""

    def __init__(self, cfg: TrainConfig, target: Target | None = None):
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        self.target = target or Target.load(cfg.target, device=resolve_device(cfg.device))
        self.device = self.target.device
        self.gen = torch.Generator().manual_seed(cfg.seed)  # host: anchors do not depend on the device
        self.features: dict[str, torch.Tensor] = {}
        self.feature_bytes = 0
        self.data_dirs = [Path(d) for d in str(cfg.data_dir).split(",") if d]
        self.seqs = self._read_all()
        if not self.seqs:
            raise ValueError(f"no training sequences in {cfg.data_dir}: run the regeneration first")
        self.cpu_seconds = 0.0
        self.best_tau = None
        ckpt = self.out / "checkpoint.pt"
        state = torch.load(ckpt, weights_only=False) if ckpt.exists() else None
        self.drafter = self._build_drafter(state).to(self.device)
        if cfg.train_only == "selector" and self.drafter.candidate_selector is None:
            raise ValueError("--train-only selector needs a DFlash2 drafter (--selector-top-k K)")
        self._unfreeze()
        self.opt = torch.optim.AdamW(self._param_groups(), lr=cfg.lr, betas=(0.9, 0.95),
                                     weight_decay=cfg.weight_decay)
        self.step, self.tokens_seen, self.epoch, self.order_pos = 0, 0, 0, 0
        if state:
            try:
                self.opt.load_state_dict(state["optimizer"])
            except ValueError as e:  # a different group split (e.g. --selector-lr added on resume)
                raise ValueError(f"{ckpt}: the checkpoint's optimizer does not match this run's parameter groups "
                                 f"({e}); resume with the flags it was started with, or start a new --out "
                                 "with --init-from") from e
            self.step, self.tokens_seen = state["step"], state["tokens_seen"]
            self.epoch, self.order_pos = state["epoch"], state["order_pos"]
            self.gen.set_state(state["rng"])
            self.cpu_seconds = state.get("cpu_seconds", 0.0)
            self.best_tau = state.get("best_tau")
            log.info("resumed from %s at step %d", ckpt, self.step)
        self.stores = self._open_stores()
        self._warn_mixed_backends()
        self.target.set_feature_layers(self.drafter.target_layer_ids)
        emb = self.target.embed_tokens.weight.detach()
        self.embed_weight = emb
        head = self.target.lm_head.weight.detach()
        d2t = self.drafter.d2t
        self.head_weight = head if d2t is None else head[d2t].contiguous()
        self.t2d = None
        if d2t is not None:
            self.t2d = torch.full((head.shape[0],), -1, dtype=torch.long, device=self.device)
            self.t2d[d2t] = torch.arange(d2t.shape[0], device=self.device)

    def _build_drafter(self, state) -> DFlashDraftModel:
        cfg, t = self.cfg, self.target
        if state:
            model = DFlashDraftModel(state["config"])
            if state.get("d2t") is not None:
                model.set_draft_vocab(state["d2t"])
            model.load_state_dict(state["model"])
            return model
        if cfg.init_from:
            from flashdraft.drafters.dflash import load_dflash_model

            model = load_dflash_model(cfg.init_from)
            log.info("initialised from %s (layers %s)", cfg.init_from, model.target_layer_ids)
            if any(v is not None for v in (cfg.block_size, cfg.num_layers, cfg.draft_vocab)) or cfg.feature_layer_ids:
                from flashdraft.train.warm_start import adapt_drafter

                extra = {} if cfg.draft_vocab is None else {"d2t": self._draft_vocab(cfg.draft_vocab)}
                model = adapt_drafter(model, t.model, block_size=cfg.block_size, num_layers=cfg.num_layers,
                                      feature_layer_ids=cfg.feature_layer_ids or None,
                                      init_layers=cfg.init_layers or None, **extra)
                log.info("warm start reshaped: %d layers, block %d, feature layers %s, draft vocabulary %s",
                         len(model.layers), model.block_size, model.target_layer_ids,
                         "full" if model.d2t is None else model.d2t.numel())
            return self._mark_seeded(model)
        mask = self._mask_token_id()
        n_layers = cfg.num_layers or 1
        layer_ids = cfg.feature_layer_ids or build_target_layer_ids(t.num_layers, cfg.num_feature_layers or 3)
        config = drafter_config_for_target(t.config, n_layers, cfg.block_size or shipped_block_size(), mask,
                                           layer_ids)
        model = DFlashDraftModel(config)
        # the last target layers map hidden states into the LM head's input space
        init = cfg.init_layers or list(range(t.num_layers - n_layers, t.num_layers))
        init_from_target(model, t.model, init)
        model.set_draft_vocab(self._draft_vocab(8192 if cfg.draft_vocab is None else cfg.draft_vocab, mask))
        return self._mark_seeded(model)

    def _mask_token_id(self) -> int:
        """``--mask-token-id``, else SmolLM2's ``<empty_output>``, else the pad token (or 0)."""
        if self.cfg.mask_token_id is not None:
            return self.cfg.mask_token_id
        t = self.target
        return SMOLLM2_MASK_TOKEN_ID if t.vocab_size == 49152 else t.tokenizer.pad_token_id or 0

    def _draft_vocab(self, size: int, mask: int | None = None) -> torch.Tensor | None:
        """The ``size`` most useful target ids (:func:`draft_vocabulary`), None for 0 = full."""
        if not size:
            return None
        from flashdraft.train.data import training_prompts

        t = self.target
        mask = self._mask_token_id() if mask is None else mask
        texts = [p["prompt"] for p in training_prompts()]
        return draft_vocabulary(self.seqs, size, t.eos_token_ids | {mask}, texts, t.tokenizer)

    def _mark_seeded(self, model: DFlashDraftModel) -> DFlashDraftModel:
        if self.cfg.ngram_seeded:
            model.config["dflash_config"]["ngram_seeded"] = True
            model.ngram_seeded = True
        if self.cfg.selector_top_k and model.candidate_selector is None:
            model = to_dflash2(model, self.cfg.selector_top_k, self.cfg.selector_rank)
            log.info("DFlash2: top-%d candidates, selector rank %d", self.cfg.selector_top_k, self.cfg.selector_rank)
        return model

    def _unfreeze(self) -> None:
        """Gradients on for what ``train_only`` trains, off for the rest."""
        if self.cfg.train_only == "selector":
            self.drafter.requires_grad_(False)
            self.drafter.candidate_selector.requires_grad_(True)
        else:
            self.drafter.requires_grad_(True)

    def _param_groups(self) -> list[dict]:
        """Optimizer groups: the drafter body at ``lr``, the DFlash2 selector at ``selector_lr``
        (each group's ``lr_scale`` multiplies the schedule)."""
        sel = self.drafter.candidate_selector
        sel_ids = {id(p) for p in sel.parameters()} if sel is not None else set()
        body = [p for p in self.drafter.parameters() if p.requires_grad and id(p) not in sel_ids]
        picked = [p for p in self.drafter.parameters() if p.requires_grad and id(p) in sel_ids]
        scale = self.cfg.selector_peak_lr / self.cfg.lr
        return [g for g in ({"params": body, "lr_scale": 1.0}, {"params": picked, "lr_scale": scale}) if g["params"]]

    # -- data -------------------------------------------------------------------------
    def _read_all(self) -> list[tuple[str, torch.Tensor, int, int]]:
        """``(id, ids, n_prompt, data dir index)`` of every data directory's sequences."""
        return [(sid, ids, n, d) for d, path in enumerate(self.data_dirs) for sid, ids, n in read_shards(path)]

    def _open_stores(self) -> list:
        """Per data directory: ``(FeatureStore, columns of the drafter's layers)`` or None."""
        from flashdraft.train.features import FeatureStore

        stores = []
        for path in self.data_dirs:
            try:
                store = FeatureStore(path)
                stores.append((store, store.columns(self.drafter.target_layer_ids)))
                # the rows of the backend that made them; what the store lacks comes from the
                # trainer's own (torch) target
                log.info("%s: %d sequences' features stored by the %s backend", path, len(store), store.backend)
            except (FileNotFoundError, ValueError) as e:
                log.warning("%s: no stored features for layers %s (%s); computing them with the target",
                            path, self.drafter.target_layer_ids, e)
                stores.append(None)
        return stores

    def _warn_mixed_backends(self) -> None:
        """Warn when a data directory's stored rows come from another engine than the trainer's
        own target and some of its sequences have no stored row: those are computed here with
        the trainer's target, so the run would train on two engines' numbers at once."""
        own = self.target.backend
        for d, entry in enumerate(self.stores):
            if entry is None or entry[0].backend == own:
                continue
            missing = sum(1 for sid, _, _, dd in self.seqs if dd == d and sid not in entry[0])
            if missing:
                log.warning("%s: %d sequences have no stored rows and are computed with the %s target, "
                            "while the stored rows come from the %s backend; run `flashdraft train "
                            "--build-features --backend %s` on it first to train on one engine's features",
                            self.data_dirs[d], missing, own, entry[0].backend, entry[0].backend)

    def _sequence(self, seq_id: str, ids: torch.Tensor, d: int):
        """``(features [T', k*H] float32, soft labels or None)`` of one training sequence, on
        the training device."""
        entry = self.stores[d]
        if entry is not None and seq_id in entry[0]:
            rows = entry[0].get(seq_id)
            # stored features are read on the host (memory-mapped), copied once per step
            feats = torch.from_numpy(np.ascontiguousarray(rows.features[:, entry[1]])).to(self.device).float()
            soft = (torch.from_numpy(np.array(rows.topk_ids)).to(self.device),
                    torch.from_numpy(np.array(rows.topk_logp)).to(self.device))
            return feats, soft
        return self._features(seq_id, ids), None

    def _features(self, seq_id: str, ids: torch.Tensor) -> torch.Tensor:
        """Target context features ``[T, k*H]`` of a sequence, computed and cached on the
        target's device: fp16, or bf16 where a value exceeds fp16's range (Gemma's hidden
        states reach 1e5; fp16 made them inf and the loss NaN)."""
        f = self.features.get(seq_id)
        if f is None:
            _, f = self.target.forward(ids, self.target.new_cache(), logits_from=ids.shape[0] - 1)
            f = f.to(torch.float16) if float(f.abs().max()) < FP16_MAX else f.to(torch.bfloat16)
            if self.feature_bytes + f.numel() * 2 < self.cfg.feature_cache_gb * 2**30:
                self.features[seq_id] = f
                self.feature_bytes += f.numel() * 2
        return f.float()

    def _order(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.cfg.seed + self.epoch)
        return torch.randperm(len(self.seqs), generator=g)

    # -- checkpoints -----------------------------------------------------------------------
    def save(self) -> None:
        """Checkpoint (resume state) and the current drafter in SpecForge layout (fp16)."""
        from flashdraft.drafters.dflash_format import save_specforge

        state = {"config": self.drafter.config, "model": self.drafter.state_dict(), "d2t": self.drafter.d2t,
                 "optimizer": self.opt.state_dict(), "step": self.step, "tokens_seen": self.tokens_seen,
                 "epoch": self.epoch, "order_pos": self.order_pos, "rng": self.gen.get_state(),
                 "train_config": asdict(self.cfg), "cpu_seconds": self.cpu_seconds, "best_tau": self.best_tau}
        tmp = self.out / "checkpoint.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.out / "checkpoint.pt")
        save_specforge(self.out / "drafter", self.drafter.config, self.drafter.state_dict())

    def evaluate(self) -> dict:
        """Held-out acceptance length τ at T=0 (and per-position acceptance at k=1).

        Walks up to ``eval_answers`` stored held-out answers of HumanEval and the ShareGPT
        held-out ids (:mod:`flashdraft.train.walk`: equal to the online τ at T=0) when
        ``heldout_root`` has them; otherwise runs the online loop on a few prompts.
        """
        from flashdraft.train.walk import DFlashProposals, heldout_answers_dir, load_answers, target_features, walk_dataset

        was_training = self.drafter.training
        self.drafter.eval()
        result = {}
        try:
            for name in ("humaneval", "sharegpt-heldout"):
                directory = heldout_answers_dir(self.cfg.heldout_root, self.target.name, name, 0.0)
                if not any(directory.glob("shard-*")):
                    return self._evaluate_online()
                answers = load_answers(directory, self.target, self.drafter.target_layer_ids, self.cfg.eval_answers)
                d2t = self.drafter.d2t

                def proposer(ids, n_prompt, feats):
                    if feats is None:
                        feats = target_features(self.target, ids, self.drafter.target_layer_ids)
                    return DFlashProposals(self.drafter, self.embed_weight, self.head_weight, d2t, feats, ids, n_prompt)

                r = walk_dataset(answers, proposer, self.drafter.block_size - 1, 256, self.target.eos_token_ids)
                result[f"tau_{name}"] = r["tau"]
                result[f"accept1_{name}"] = r["per_position_acceptance"][0]
        finally:
            self.drafter.train(was_training)
            self._unfreeze()
        return result

    def _evaluate_online(self) -> dict:
        """Held-out τ at T=0 through the online loop on a few prompts of each held-out set."""
        from flashdraft.prompts import load_prompt_set

        was_training = self.drafter.training
        drafter = DFlashDrafter(self.drafter, self.target.embed_tokens, self.target.lm_head)
        gen = SpeculativeGenerator(self.target, drafter, n_draft=self.drafter.block_size - 1)
        result = {}
        for name in ("sharegpt-heldout", "humaneval"):
            produced = steps = 0
            for p in load_prompt_set(name, limit=self.cfg.eval_prompts):
                ids = self.target.user_prompt_ids(p["prompt"], p.get("raw_prompt"))
                _, _, _, t = generate_text(gen, ids, self.cfg.eval_tokens, SamplingParams())
                produced, steps = produced + t.verify_n, steps + t.n_steps - 1
            result[f"tau_{name}"] = round(produced / max(1, steps), 4)
        self.drafter.train(was_training)
        self._unfreeze()
        self.target.set_feature_layers(self.drafter.target_layer_ids)
        return result

    # -- the loop --------------------------------------------------------------------------
    def train(self) -> dict:
        """Run until ``steps`` or ``max_hours``; checkpoints every few minutes and on SIGTERM."""
        cfg = self.cfg
        if cfg.bf16 is None:
            cfg.bf16 = bf16_default(self.device)
            log.info("bf16 autocast %s on %s (default for this device)", "on" if cfg.bf16 else "off", self.device)
        self.drafter.train()
        self._unfreeze()
        gamma = cfg.loss_gamma or default_gamma(self.drafter.block_size)
        deadline = time.time() + 3600 * cfg.max_hours if cfg.max_hours else math.inf
        stop = {"flag": False}
        old = signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
        log_file = open(self.out / "train_log.jsonl", "a")
        last_ckpt = last_eval = time.time()
        B = self.drafter.block_size
        correct, counted, loss_avg = torch.zeros(B - 1), torch.zeros(B - 1), None
        order = self._order()
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", dynamic_ncols=True)
        t_window, rows_window = time.time(), 0
        try:
            budget = None if cfg.max_cpu_hours is None else cfg.max_cpu_hours * 3600
            while (self.step < cfg.steps and time.time() < deadline and not stop["flag"]
                   and (budget is None or self.cpu_seconds < budget)):
                # 1. a step's sequences (a new epoch picks up newly regenerated data)
                batch = []
                while len(batch) < cfg.seqs_per_step:
                    if self.order_pos >= len(order):
                        self.epoch, self.order_pos = self.epoch + 1, 0
                        self.seqs = self._read_all()
                        for entry in self.stores:
                            if entry is not None:
                                entry[0].refresh()
                        order = self._order()
                    seq_id, ids, n_prompt, d = self.seqs[int(order[self.order_pos])]
                    self.order_pos += 1
                    feats, soft = self._sequence(seq_id, ids, d)
                    # an anchor needs the context rows before it: at most features' length
                    anchors = sample_anchors(n_prompt, min(ids.shape[0], feats.shape[0] + 1),
                                             cfg.blocks_per_step, self.gen)
                    if anchors.numel():
                        batch.append((ids.to(self.device), anchors.to(self.device), feats, soft))
                lr = (cosine_lr(self.step, cfg.steps, cfg.lr, cfg.warmup_frac) if budget is None else
                      cosine_lr(int(1000 * self.cpu_seconds), int(1000 * budget), cfg.lr, cfg.warmup_frac))
                for group in self.opt.param_groups:
                    group["lr"] = lr * group.get("lr_scale", 1.0)
                # 2. the blocks' loss, averaged over the step's sequences
                cpu0 = time.process_time()
                self.opt.zero_grad(set_to_none=True)
                c = n = 0
                total = 0.0
                for ids, anchors, feats, soft in batch:
                    with torch.autocast(autocast_device_type(self.device), dtype=torch.bfloat16, enabled=cfg.bf16):
                        loss, c_i, n_i = dflash_loss(self.drafter, feats, ids, anchors, self.embed_weight,
                                                     self.head_weight, self.t2d, gamma, soft, cfg.soft_weight,
                                                     after_miss=not cfg.mask_after_miss)
                    (loss / len(batch)).backward()
                    # the counters go to the host (a few floats; float(loss) syncs anyway)
                    total, c, n = total + float(loss.detach()) / len(batch), c + c_i.cpu(), n + n_i.cpu()
                torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
                self.opt.step()
                self.cpu_seconds += time.process_time() - cpu0
                loss = torch.tensor(total)
                anchors = torch.cat([a.cpu() for _, a, _, _ in batch])
                self.step += 1
                rows = anchors.numel() * B
                self.tokens_seen += rows
                rows_window += rows
                correct, counted = 0.98 * correct + c, 0.98 * counted + n
                loss_avg = float(loss) if loss_avg is None else 0.98 * loss_avg + 0.02 * float(loss)
                acc = correct / counted.clamp(min=1)
                bar.update(1)
                if self.step % 10 == 0:
                    rate = rows_window / (time.time() - t_window)
                    t_window, rows_window = time.time(), 0
                    bar.set_postfix(loss=f"{loss_avg:.3f}", acc1=f"{acc[0]:.2f}", acc4=f"{acc[min(3, acc.numel() - 1)]:.2f}",
                                    acc_mean=f"{acc.mean():.2f}", tok_s=f"{rate:.0f}", ep=self.epoch)
                    write_log(self, log_file, {"loss": loss_avg, "acc": [round(float(a), 4) for a in acc],
                                               "tok_s": rate, "epoch": self.epoch, "sequences": len(self.seqs)})
                last_ckpt, last_eval = checkpoint_and_eval(self, log_file, last_ckpt, last_eval)
        finally:
            bar.close()
            self.save()
            signal.signal(signal.SIGTERM, old)
        # a stop on SIGTERM saves and leaves at once: the held-out walk takes minutes
        result = self._log_eval(log_file) if cfg.eval_minutes and not stop["flag"] else {}
        log_file.close()
        return {"step": self.step, "tokens_seen": self.tokens_seen, "stopped": stop["flag"], **result}

    def _log_eval(self, log_file) -> dict:
        """Evaluate, log, and keep the best drafter so far in ``OUT/drafter-best``."""
        from flashdraft.drafters.dflash_format import save_specforge

        return record_eval(self, log_file, self.evaluate(),
                           lambda d: save_specforge(d, self.drafter.config, self.drafter.state_dict()))


def write_log(trainer, log_file, fields: dict) -> None:
    """One training-log line: step, tokens, ``fields``, CPU-hours and the wall clock."""
    log_file.write(json.dumps({"step": trainer.step, "tokens": trainer.tokens_seen, **fields,
                               "cpu_hours": round(trainer.cpu_seconds / 3600, 4), "time": time.time()}) + "\n")
    log_file.flush()


def checkpoint_and_eval(trainer, log_file, last_ckpt: float, last_eval: float) -> tuple[float, float]:
    """Checkpoint every ``checkpoint_minutes`` and evaluate every ``eval_minutes`` (0 = never)
    of wall time; returns the new ``(last_ckpt, last_eval)`` times."""
    cfg = trainer.cfg
    if time.time() - last_ckpt > 60 * cfg.checkpoint_minutes:
        trainer.save()
        last_ckpt = time.time()
    if cfg.eval_minutes and time.time() - last_eval > 60 * cfg.eval_minutes:
        trainer._log_eval(log_file)
        last_eval = time.time()
    return last_ckpt, last_eval


def record_eval(trainer, log_file, result: dict, save_best) -> dict:
    """Log a held-out evaluation ``result`` (``tau_*`` keys) of ``trainer`` (a :class:`Trainer`
    or :class:`~flashdraft.train.ar_loop.ARTrainer`: ``out``, ``step``, ``tokens_seen``,
    ``cpu_seconds``, ``best_tau``) and, when its mean τ is the best so far, write the drafter
    with ``save_best(OUT / "drafter-best")`` beside an ``eval.json``. Returns ``result``."""
    taus = [v for k, v in result.items() if k.startswith("tau_")]
    tau = sum(taus) / len(taus) if taus else 0.0
    improved = trainer.best_tau is None or tau > trainer.best_tau
    cpu_hours = round(trainer.cpu_seconds / 3600, 4)
    if improved:
        trainer.best_tau = tau
        save_best(trainer.out / "drafter-best")
        (trainer.out / "drafter-best" / "eval.json").write_text(json.dumps(
            {"step": trainer.step, "cpu_hours": cpu_hours, **result}) + "\n")
    log.info("step %d (%.3f CPU-h): held-out %s%s", trainer.step, cpu_hours, result,
             " (best so far)" if improved else "")
    log_file.write(json.dumps({"step": trainer.step, "tokens": trainer.tokens_seen, "eval": result,
                               "cpu_hours": cpu_hours, "best": improved, "time": time.time()}) + "\n")
    log_file.flush()
    return result
