"""``flashdraft train --kind ar``: train an AR assistant drafter on the regenerated answers.

The drafter (:class:`~flashdraft.drafters.ar_model.ARDraftModel`) starts as the target's first
``--layers`` layers with its final norm and (draft-vocabulary) head, i.e. as ``-md self:N``,
and learns next-token prediction on the target's own answers (teacher forcing, one causal
pass per answer, loss on the answer's positions only). With ``--ar-features`` it is
EAGLE-1-shaped (Li et al. 2024, §3.2): it reads the target's last-layer state of the
previous position and is also trained to reproduce that state (smooth L1 on unit-RMS
states), because at drafting time it feeds its own state back for positions the target has
not verified yet.

Same data, schedule, checkpointing, CPU-hour budget and held-out walk as the DFlash trainer
(:mod:`flashdraft.train.loop`), so the two can be compared at equal CPU time.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from flashdraft.device import autocast_device_type, resolve_device
from flashdraft.drafters.ar import ARDrafter
from flashdraft.drafters.ar_model import ARDraftModel, ar_from_target, load_ar_drafter, save_ar_drafter
from flashdraft.targets.torch import Target
from flashdraft.train.loop import (TrainConfig, bf16_default, checkpoint_and_eval, draft_vocabulary, record_eval,
                                   write_log)
from flashdraft.train.objective import cosine_lr
from flashdraft.train.shards import read_shards

log = logging.getLogger(__name__)

IGNORE = -100


def ar_loss(model: ARDraftModel, embed_weight: torch.Tensor, ids: torch.Tensor, n_prompt: int,
            t2d: torch.Tensor | None, target_last: torch.Tensor | None = None,
            feature_weight: float = 1.0) -> tuple[torch.Tensor, int, int]:
    """Next-token loss of one answer (teacher forcing).

    Args:
        embed_weight: ``[V, H]`` the target's (frozen) embeddings.
        ids: ``[T]`` prompt + answer token ids; the loss covers answer tokens ``ids[n_prompt:]``.
        t2d: ``[V]`` target id -> draft index (-1 outside the draft vocabulary), or None.
        target_last: ``[T, H]`` the target's last-layer outputs (pre-norm); required with
            features: position t reads state t-1, and the drafter's state at t is pulled
            towards the target's (weight ``feature_weight``).
    Returns:
        ``(loss, correct, counted)``: the scalar loss and how many answer tokens the drafter's
        argmax predicted out of how many were predictable (inside the draft vocabulary).
    """
    T = ids.shape[0]
    dev = ids.device
    x = F.embedding(ids, embed_weight)[None].to(model.lm_head.weight.dtype)  # [1, T, H]
    prev = None
    if model.use_features:
        g = ARDraftModel.state(target_last.float())
        prev = torch.cat([torch.zeros_like(g[:1]), g[:-1]])[None]  # [1, T, H]
    hidden = model(x, torch.arange(T, device=dev)[None], None, prev)[0]  # [T, H]
    rows = hidden[n_prompt - 1: T - 1]  # positions whose next token is an answer token
    labels = ids[n_prompt:T]
    target = labels if t2d is None else t2d[labels]
    target = torch.where(target < 0, torch.full_like(target, IGNORE), target)
    logits = model.logits(rows).float()
    loss = F.cross_entropy(logits, target, ignore_index=IGNORE)
    if model.use_features:
        loss = loss + feature_weight * F.smooth_l1_loss(ARDraftModel.state(rows.float()), g[n_prompt - 1: T - 1])
    with torch.no_grad():
        valid = target != IGNORE
        correct = int(((logits.argmax(-1) == target) & valid).sum())
    return loss, correct, int(valid.sum())


class ARTrainer:
    """Owns target, AR drafter, optimiser and checkpoints; see :meth:`train`.

    ``cfg`` is the DFlash trainer's :class:`TrainConfig`; used here: data, out, target, layers
    (``num_layers``), ``init_layers``, ``init_from`` (an AR drafter directory), steps,
    ``max_hours``, ``max_cpu_hours``, lr and schedule, ``draft_vocab``, seed, bf16, device,
    checkpoint/eval cadence, ``eval_answers``, ``heldout_root``, ``seqs_per_step``, and
    ``ar_features``.

    Raises:
        ValueError: no training sequences in ``cfg.data_dir``.
    """

    def __init__(self, cfg: TrainConfig, target: Target | None = None):
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        self.target = target or Target.load(cfg.target, device=resolve_device(cfg.device))
        if self.target.model is None:
            raise ValueError("training an AR drafter needs the target's torch model: use the torch backend")
        self.device = self.target.device
        self.data_dirs = [Path(d) for d in str(cfg.data_dir).split(",") if d]
        self.seqs = [(sid, ids, n) for d in self.data_dirs for sid, ids, n in read_shards(d)]
        if not self.seqs:
            raise ValueError(f"no training sequences in {cfg.data_dir}: run the regeneration first")
        self.embed_weight = self.target.embed_tokens.weight.detach()
        ckpt = self.out / "checkpoint.pt"
        state = torch.load(ckpt, weights_only=False) if ckpt.exists() else None
        self.model = self._build(state).to(self.device)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr,
                                     betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.step = self.tokens_seen = self.epoch = self.order_pos = 0
        self.cpu_seconds, self.best_tau = 0.0, None
        self.gen = torch.Generator().manual_seed(cfg.seed)
        if state:
            self.opt.load_state_dict(state["optimizer"])
            for key in ("step", "tokens_seen", "epoch", "order_pos", "cpu_seconds", "best_tau"):
                setattr(self, key, state[key])
            log.info("resumed from %s at step %d (%.3f CPU-hours)", ckpt, self.step, self.cpu_seconds / 3600)
        self.t2d = None
        if self.model.d2t is not None:
            self.t2d = torch.full((self.target.vocab_size,), -1, dtype=torch.long, device=self.device)
            self.t2d[self.model.d2t.to(self.device)] = torch.arange(self.model.d2t.numel(), device=self.device)
        self.last_states: dict[str, torch.Tensor] = {}  # features mode: the target's last layer, fp16

    def _build(self, state) -> ARDraftModel:
        cfg, t = self.cfg, self.target
        if state:
            model = ARDraftModel(state["config"])
            model.set_draft_vocab(state["d2t"])
            model.load_state_dict(state["model"])
            return model
        if cfg.init_from:
            model = load_ar_drafter(cfg.init_from)
            log.info("initialised from %s", cfg.init_from)
            return model
        size = 8192 if cfg.draft_vocab is None else cfg.draft_vocab
        d2t = None
        if size:
            from flashdraft.train.data import training_prompts

            texts = [p["prompt"] for p in training_prompts()]
            d2t = draft_vocabulary([(s, ids, n) for s, ids, n in self.seqs], size, t.eos_token_ids, texts, t.tokenizer)
        model = ar_from_target(t.model, cfg.num_layers or 1, cfg.ar_features, d2t, t.name)
        if cfg.init_layers:  # other target layers than the first N
            for layer, i in zip(model.body.layers, cfg.init_layers):
                layer.load_state_dict(t.model.model.layers[i].state_dict())
        return model.float()

    def _target_last(self, sid: str, ids: torch.Tensor) -> torch.Tensor:
        """The target's last-layer outputs ``[T, H]`` for one answer (one target forward, kept
        in memory as fp16; not counted in the training CPU-hours, as the DFlash trainer's stored
        features are not)."""
        f = self.last_states.get(sid)
        if f is None:
            with torch.inference_mode():
                self.target.set_feature_layers(self.model.feature_layer_ids)
                _, f = self.target.forward(ids, self.target.new_cache(ids.shape[0] + 1), ids.shape[0] - 1)
            f = f.to(torch.float16)
            self.last_states[sid] = f
        return f.float()

    def save(self) -> None:
        """Checkpoint (resume state) and the current drafter (``OUT/drafter``, fp16)."""
        state = {"config": self.model.config, "model": self.model.state_dict(), "d2t": self.model.d2t,
                 "optimizer": self.opt.state_dict(), "step": self.step, "tokens_seen": self.tokens_seen,
                 "epoch": self.epoch, "order_pos": self.order_pos, "cpu_seconds": self.cpu_seconds,
                 "best_tau": self.best_tau, "train_config": asdict(self.cfg)}
        tmp = self.out / "checkpoint.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.out / "checkpoint.pt")
        save_ar_drafter(self.out / "drafter", self.model)

    def evaluate(self) -> dict:
        """Held-out τ at T=0 by the offline walk (:mod:`flashdraft.train.walk`) at depth 7,
        the shipped DFlash drafter's, on ``eval_answers`` answers of HumanEval and ShareGPT."""
        from flashdraft.train.walk import ar_proposer, heldout_answers_dir, load_answers, walk_dataset

        layer_ids = self.model.feature_layer_ids or []
        result = {}
        self.model.eval()
        try:
            drafter = ARDrafter(self.model, self.embed_weight, self.target.vocab_size)
            for name in ("humaneval", "sharegpt-heldout"):
                directory = heldout_answers_dir(self.cfg.heldout_root, self.target.name, name, 0.0)
                if not any(directory.glob("shard-*")):
                    log.warning("no held-out answers in %s (make them with `flashdraft eval --offline`)", directory)
                    continue
                answers = load_answers(directory, self.target, layer_ids, self.cfg.eval_answers)
                r = walk_dataset(answers, ar_proposer(drafter, self.target), 7, 256, self.target.eos_token_ids)
                result[f"tau_{name}"] = r["tau"]
                result[f"accept1_{name}"] = r["per_position_acceptance"][0]
        finally:
            self.model.train().requires_grad_(True)
        return result

    def train(self) -> dict:
        """Run until ``steps``, ``max_hours`` or ``max_cpu_hours``; checkpoints every few minutes
        and on SIGTERM; resumable by running the same command again."""
        cfg = self.cfg
        if cfg.bf16 is None:
            cfg.bf16 = bf16_default(self.device)
        self.model.train().requires_grad_(True)
        deadline = time.time() + 3600 * cfg.max_hours if cfg.max_hours else math.inf
        budget = None if cfg.max_cpu_hours is None else cfg.max_cpu_hours * 3600
        stop = {"flag": False}
        old = signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
        log_file = open(self.out / "train_log.jsonl", "a")
        last_ckpt = last_eval = time.time()
        acc = loss_avg = None
        order = torch.randperm(len(self.seqs), generator=torch.Generator().manual_seed(cfg.seed + self.epoch))
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train ar", dynamic_ncols=True)
        try:
            while (self.step < cfg.steps and time.time() < deadline and not stop["flag"]
                   and (budget is None or self.cpu_seconds < budget)):
                batch = []
                while len(batch) < cfg.seqs_per_step:
                    if self.order_pos >= len(order):
                        self.epoch, self.order_pos = self.epoch + 1, 0
                        order = torch.randperm(len(self.seqs),
                                               generator=torch.Generator().manual_seed(cfg.seed + self.epoch))
                    sid, ids, n = self.seqs[int(order[self.order_pos])]
                    self.order_pos += 1
                    if ids.shape[0] > n:
                        last = self._target_last(sid, ids) if self.model.use_features else None
                        batch.append((ids.to(self.device), n, last))
                lr = (cosine_lr(self.step, cfg.steps, cfg.lr, cfg.warmup_frac) if budget is None else
                      cosine_lr(int(1000 * self.cpu_seconds), int(1000 * budget), cfg.lr, cfg.warmup_frac))
                for group in self.opt.param_groups:
                    group["lr"] = lr
                cpu0 = time.process_time()
                self.opt.zero_grad(set_to_none=True)
                total, c, k = 0.0, 0, 0
                for ids, n, last in batch:
                    with torch.autocast(autocast_device_type(self.device), dtype=torch.bfloat16, enabled=cfg.bf16):
                        loss, c_i, k_i = ar_loss(self.model, self.embed_weight, ids, n, self.t2d, last)
                    (loss / len(batch)).backward()
                    total, c, k = total + float(loss.detach()) / len(batch), c + c_i, k + k_i
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
                self.opt.step()
                self.cpu_seconds += time.process_time() - cpu0
                self.step += 1
                self.tokens_seen += sum(ids.shape[0] - n for ids, n, _ in batch)
                step_acc = c / max(1, k)
                acc = step_acc if acc is None else 0.98 * acc + 0.02 * step_acc
                loss_avg = total if loss_avg is None else 0.98 * loss_avg + 0.02 * total
                bar.update(1)
                if self.step % 10 == 0:
                    bar.set_postfix(loss=f"{loss_avg:.3f}", acc1=f"{acc:.3f}", ep=self.epoch,
                                    cpu_h=f"{self.cpu_seconds / 3600:.3f}")
                    write_log(self, log_file, {"loss": loss_avg, "acc": [round(acc, 4)], "epoch": self.epoch,
                                               "lr": lr})
                last_ckpt, last_eval = checkpoint_and_eval(self, log_file, last_ckpt, last_eval)
        finally:
            bar.close()
            self.save()
            signal.signal(signal.SIGTERM, old)
        # a stop on SIGTERM saves and leaves at once: the held-out walk takes minutes
        result = self._log_eval(log_file) if cfg.eval_minutes and not stop["flag"] else {}
        log_file.close()
        return {"step": self.step, "tokens_seen": self.tokens_seen,
                "cpu_hours": round(self.cpu_seconds / 3600, 4), "stopped": stop["flag"], **result}

    def _log_eval(self, log_file) -> dict:
        """Evaluate, log, and keep the best drafter so far in ``OUT/drafter-best``."""
        return record_eval(self, log_file, self.evaluate(), lambda d: save_ar_drafter(d, self.model))

