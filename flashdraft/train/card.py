"""``MODEL_CARD.md`` beside a trained drafter: target, data, recipe, steps, CPU-hours, and
the offline walk's τ beside prompt lookup on the held-out sets (``flashdraft train`` writes
it at the end of a run; the shipped drafters' cards start from it)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

#: held-out sets the card walks (``flashdraft eval --offline`` makes their answers)
CARD_SETS = ("humaneval", "sharegpt-heldout")


def walk_table(target, model, heldout_root: str | Path, answers: int) -> list[dict]:
    """Per held-out set with stored answers: the DFlash drafter's and prompt lookup's τ and
    position-1 acceptance at the drafter's depth (:func:`~flashdraft.train.walk.offline_eval`)."""
    from flashdraft.train.walk import heldout_answers_dir, offline_eval

    rows = []
    for name in CARD_SETS:
        directory = heldout_answers_dir(heldout_root, target.name, name, 0.0)
        if not any(directory.glob("shard-*")):
            continue
        # the walk's length cap is the one the answers were generated with
        cap = json.loads((directory / "manifest.json").read_text())["settings"]["max_new_tokens"]
        r = offline_eval(target, model, directory, model.block_size - 1, cap, limit=answers, progress=False)
        rows.append({"set": name, "answers": r["dflash"]["prompts"],
                     "dflash_tau": r["dflash"]["tau"], "dflash_accept1": r["dflash"]["per_position_acceptance"][0],
                     "ngram_tau": r["ngram"]["tau"], "hybrid_tau": r["hybrid (ngram, else dflash)"]["tau"]})
    return rows


def model_card(target, drafter_dir: Path, cfg, result: dict, data: dict, rows: list[dict]) -> str:
    """The card's Markdown text (see the module docstring)."""
    config = json.loads((drafter_dir / "config.json").read_text())
    dc = config.get("dflash_config", {})
    d2t = data.get("draft_vocab", "full")
    # no -m: the packaged default target (the card names it; its command needs no -m)
    target_row = f"`{cfg.target}`" if cfg.target else f"the packaged default, {target.name}"
    m_flag = f" -m {cfg.target}" if cfg.target else ""
    extras = ""
    if cfg.selector_top_k:
        extras += (f", DFlash2 path selection top-{cfg.selector_top_k} (selector rank {cfg.selector_rank}, "
                   f"lr {cfg.selector_peak_lr})")
    if cfg.mask_after_miss:
        extras += ", loss masked after the first miss (GRIFFIN)"
    if cfg.loss_gamma:
        extras += f", loss decay gamma {cfg.loss_gamma}"
    lines = [f"# DFlash drafter for {target.name}", "",
             f"A block-diffusion drafter (DFlash) trained by `flashdraft train` for **{target.name}** "
             f"({target.num_layers} layers, hidden {target.hidden_size}, vocabulary {target.vocab_size}).", "",
             "| | |", "| --- | --- |",
             f"| target | {target_row} |",
             f"| shape | {config['num_hidden_layers']} layer(s), block size {config['block_size']}, context features of "
             f"target layers {dc.get('target_layer_ids')}, mask token id {dc.get('mask_token_id')}, draft vocabulary "
             f"{d2t}, n-gram-seeded: {bool(dc.get('ngram_seeded'))} |",
             f"| data | {data['answers']} regenerated answers ({data['tokens']} answer tokens) in "
             f"{', '.join(f'`{d}`' for d in data['dirs'])} |",
             f"| training | {result.get('step')} steps, {result.get('cpu_hours', 0):.3f} CPU-hours of training steps, "
             f"lr {cfg.lr}, {cfg.seqs_per_step} answers x {cfg.blocks_per_step} blocks per step, soft weight "
             f"{cfg.soft_weight}, bf16 {cfg.bf16}{extras} |", ""]
    if rows:
        lines += ["Offline walk at T=0 (held-out answers by the target; `flashdraft eval --offline`):", "",
                  "| set | answers | DFlash τ | P(accept) k=1 | prompt lookup τ | hybrid τ |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['set']} | {r['answers']} | {r['dflash_tau']:.3f} | {r['dflash_accept1']:.3f} | "
                  f"{r['ngram_tau']:.3f} | {r['hybrid_tau']:.3f} |" for r in rows]
    else:
        lines += ["No held-out answers were found for the walk: make them with "
                  f"`flashdraft eval --offline{m_flag} --dataset humaneval,sharegpt-heldout --limit 60`."]
    return "\n".join(lines) + "\n"


def write_model_card(trainer, result: dict) -> Path | None:
    """Write ``MODEL_CARD.md`` into ``OUT/drafter-best`` (or ``OUT/drafter``). Returns its path."""
    from flashdraft.drafters.dflash import load_dflash_model

    out = Path(trainer.cfg.out_dir)
    drafter_dir = out / "drafter-best" if (out / "drafter-best" / "config.json").exists() else out / "drafter"
    if not (drafter_dir / "config.json").exists():
        return None
    model = load_dflash_model(str(drafter_dir)).to(trainer.device)
    rows = walk_table(trainer.target, model, trainer.cfg.heldout_root, trainer.cfg.eval_answers)
    seqs = trainer.seqs
    data = {"answers": len(seqs), "tokens": sum(int(s[1].shape[0]) - int(s[2]) for s in seqs),
            "dirs": [str(d) for d in trainer.data_dirs],
            "draft_vocab": "full" if model.d2t is None else int(model.d2t.numel())}
    card = drafter_dir / "MODEL_CARD.md"
    card.write_text(model_card(trainer.target, drafter_dir, trainer.cfg,
                               {**result, "cpu_hours": trainer.cpu_seconds / 3600}, data, rows))
    log.info("model card: %s", card)
    return card
