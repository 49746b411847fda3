"""Regenerate training answers with the target through the packed multi-sequence forward.

The server's parallel slots pack the rows of several sequences into one target forward
(:meth:`flashdraft.targets.torch.Target.forward_packed`): each weight is read once per step for
all of them. Regeneration is the same problem with many more sequences, so it uses the
same forward with *continuous batching*: ``batch_size`` sequences decode together; when
one ends (EOS or ``max_new_tokens``) the next prompt is prefilled in the same packed
forward and takes its place, so no row ever waits for the longest answer of a batch
(left-padded ``generate()`` batches do).

Greedy answers are what the target would produce alone, up to float32 summation order in
the packed matmuls (bit-identical with bf16 weights). Sampled answers
(``temperature > 0``) use the server's sampling filters and one generator per prompt,
seeded from the prompt id, so a restarted run draws the same answer again.

    python -m flashdraft.train.regen --out datasets/smollm2-135m-instruct-t07 \\
        --temperature 0.7 --batch-size 32 --threads 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from flashdraft.flags import HelpFormatter, add_backend_argument
from flashdraft.sampling import SamplingParams, choose_token
from flashdraft.train.features import DEFAULT_STORED_LAYERS, FeatureWriter, storable_layers
from flashdraft.train.data import CODE_SHARE, model_fingerprint, resolve_model_location, training_prompts
from flashdraft.train.shards import SHARD_FORMAT, ShardWriter, scan_shards, write_json_atomic

log = logging.getLogger(__name__)


def prompt_seed(prompt_id: str, seed: int) -> int:
    """A stable 63-bit seed for one prompt's sampling generator."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def default_stored_layers(n_layers: int) -> list[int]:
    """Decoder layers whose outputs regeneration stores: :data:`DEFAULT_STORED_LAYERS` for a
    30-layer target (SmolLM2-135M), else six layers spread from layer 1 to the last."""
    if n_layers == 30:
        return list(DEFAULT_STORED_LAYERS)
    return sorted({min(n_layers - 1, round(1 + i * (n_layers - 2) / 5)) for i in range(6)})


def generate_packed(target, prompts: Sequence[tuple[str, list[int]]], max_new_tokens: int,
                    params: SamplingParams, batch_size: int = 32, seed: int = 0, layer_ids=(),
                    ) -> Iterator[tuple[str, list[int], str, torch.Tensor | None, torch.Tensor]]:
    """Continuous-batched generation; yields answers as they end.

    Args:
        target: a :class:`~flashdraft.targets.torch.Target` on the lean path.
        prompts: ``(id, prompt token ids)`` in the order to start them.
        max_new_tokens: most tokens per answer.
        params: greedy (temperature 0) or the sampling filters to sample with.
        batch_size: sequences decoding together (rows of one :class:`BatchKV`).
        seed: mixed into each prompt's sampling seed.
        layer_ids: decoder layers whose outputs to return as features.
    Yields:
        ``(id, response_ids, finish, features [T, k*H] or None, logits_top)`` where
        ``T = len(prompt) + len(response) - 1`` rows (every position whose next token is
        known), ``logits_top = (ids [T, k], logp [T, k])`` the target's top-k next-token
        log-probabilities per row, and ``response_ids`` end with the EOS token when
        ``finish == "eos"``. Answers come out in the order they end.
    Raises:
        ValueError: the target has no lean forward.
    """
    from flashdraft.fast_forward import BatchKV
    from flashdraft.train.features import top_logprobs

    lean = target.lean
    if lean is None:
        raise ValueError("packed regeneration needs the lean target forward (llama/qwen families)")
    eos = target.eos_token_ids
    longest = max((len(ids) for _, ids in prompts), default=1)
    kv = BatchKV(lean, batch_size, longest + max_new_tokens + 1)
    pending = iter(prompts)
    slots: list[dict | None] = [None] * batch_size
    tokens = torch.zeros(batch_size, dtype=torch.long)

    def start(row: int) -> None:
        # prefill a new prompt into a free row; its last logits give the first token
        nxt = next(pending, None)
        slots[row] = None
        if nxt is None:
            return
        pid, ids = nxt
        s = {"id": pid, "response": [], "gen": torch.Generator(lean.device).manual_seed(prompt_seed(pid, seed)),
             "feats": [], "top": []}
        logits, feats = lean.prefill_row(torch.tensor(ids, dtype=torch.long), kv, row, layer_ids)
        slots[row] = s
        step(row, s, logits, feats)

    def step(row: int, s: dict, logits: torch.Tensor, feats) -> None:
        if feats is not None:
            s["feats"].append(feats.to(torch.float16).cpu())  # written to disk from the host
        s["top"].append(top_logprobs(logits))
        tok = choose_token(logits[-1], params, s["gen"])
        s["response"].append(tok)
        tokens[row] = tok
        if tok in eos or len(s["response"]) >= max_new_tokens:
            s["finish"] = "eos" if tok in eos else "length"

    for row in range(batch_size):
        start(row)
    while any(s is not None for s in slots):
        for row, s in enumerate(slots):
            while s is not None and "finish" in s:  # an answer ended: hand it out, refill the row
                yield _answer(s, s["finish"])
                start(row)
                s = slots[row]
        if all(s is None for s in slots):
            return
        # one decode step for every row; idle rows (only at the very end) restart at
        # position 0 every step, so they never outgrow the cache
        for row, s in enumerate(slots):
            if s is None:
                kv.lengths[row] = 0
        logits, feats = lean.decode_rows(tokens, kv, layer_ids)
        for row, s in enumerate(slots):
            if s is not None:
                step(row, s, logits[row:row + 1], None if feats is None else feats[row:row + 1])


def _answer(s: dict, finish: str) -> tuple:
    """What :func:`generate_packed` yields for a finished row state ``s``."""
    top = np.concatenate([t[0] for t in s["top"]]), np.concatenate([t[1] for t in s["top"]])
    return s["id"], s["response"], finish, torch.cat(s["feats"]) if s["feats"] else None, top


def generate_packed_llama(target, prompts: Sequence[tuple[str, list[int]]], max_new_tokens: int,
                          params: SamplingParams, batch_size: int = 32, seed: int = 0,
                          layer_ids: Sequence[int] | None = ()):
    """:func:`generate_packed` on the llama backend (a :class:`~flashdraft.targets.llama.LlamaTarget`):
    ``batch_size`` llama.cpp sequences step together, one ``llama_decode`` per step (a new
    prompt's prefill rides in the same batch). Same yields, same per-prompt seeds; features
    are llama.cpp's layer inputs (the last layer's output has none: ``layer_ids`` must be
    ``< num_layers - 1``).

    Also the path of a torch target without the lean forward (Gemma):
    :meth:`~flashdraft.targets.torch.Target.forward_packed` then runs one forward per sequence."""
    from flashdraft.train.features import top_logprobs

    target.ensure_sequences(batch_size + 1)  # one llama.cpp sequence per row, none evicted
    target.set_feature_layers(list(layer_ids or []) or None)
    eos = target.eos_token_ids
    pending = iter(prompts)
    active: list[dict] = []
    while True:
        while len(active) < batch_size:  # admit new prompts: their prefill is their first input
            nxt = next(pending, None)
            if nxt is None:
                break
            pid, ids = nxt
            active.append({"id": pid, "response": [], "cache": target.new_cache(), "input": list(ids),
                           "gen": torch.Generator().manual_seed(prompt_seed(pid, seed)), "feats": [], "top": []})
        if not active:
            return
        outs = target.forward_packed([(torch.tensor(s["input"]), s["cache"], 0) for s in active])
        still = []
        for s, (logits, feats) in zip(active, outs):
            if feats is not None:
                s["feats"].append(feats.to(torch.float16))
            s["top"].append(top_logprobs(logits))
            tok = choose_token(logits[-1], params, s["gen"])
            s["response"].append(tok)
            s["input"] = [tok]
            if tok in eos or len(s["response"]) >= max_new_tokens:
                yield _answer(s, "eos" if tok in eos else "length")
            else:
                still.append(s)
        active = still


def regenerate_packed(out_dir: str | Path, prompts: Sequence[dict], target=None, model: str | None = None,
                      max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 64, top_p: float = 0.95,
                      batch_size: int = 32, weights: str = "fp32", seed: int = 0, shard_size: int = 256,
                      layer_ids=None, progress: bool = True, device="cpu", backend: str = "torch") -> dict:
    """Regenerate answers for ``prompts`` into resumable shards (format of :mod:`flashdraft.train.data`).

    Prompts already in ``out_dir`` are skipped, so a killed run resumes by rerunning the same
    command. ``manifest.json`` records the model fingerprint, settings and token counts.

    Args:
        prompts: ``[{"id", "prompt"}, ...]``; each prompt is one user message in the chat template
            (a base model without one gets the text, or the item's ``raw_prompt``:
            :meth:`~flashdraft.targets.torch.TokenizerSide.user_prompt_ids`).
        target: a loaded Target (tests); else loaded from ``model`` (None = packaged default).
        temperature / top_k / top_p: 0 = greedy; otherwise the sampling filters.
        weights: ``fp32`` or ``bf16`` (the answers of bf16 weights are bf16 greedy answers).
        device: where a target loaded from ``model`` runs (a resolved torch device).
        layer_ids: decoder layers whose outputs are stored as context features beside the
            shards (:mod:`flashdraft.train.features`); None = :func:`default_stored_layers`,
            ``()`` = none.
    Returns:
        The manifest dict.
    Raises:
        ValueError: duplicate prompt ids, or ``out_dir`` holds a run with other settings.
    """
    from tqdm import tqdm

    from flashdraft.targets.torch import Target

    ids = [p["id"] for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError("prompt ids must be unique")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    greedy = temperature == 0
    # chat_template: prompts rendered by TokenizerSide.user_prompt_ids, the target's chat template
    # where its tokenizer has one, else BOS + plain text (a base model such as Gemma 3 270M)
    settings = {"max_new_tokens": max_new_tokens, "weights": weights, "greedy": greedy, "chat_template": True,
                "temperature": temperature, "top_k": top_k if not greedy else None,
                "top_p": top_p if not greedy else None, "seed": seed, "engine": "packed"}
    if model is None and target is None:
        model_dir, gguf = resolve_model_location(None, None)
        fingerprint = model_fingerprint(model_dir, gguf)
    elif model is not None:
        model_dir, gguf = resolve_model_location(model, None)
        fingerprint = model_fingerprint(model_dir, gguf)
    else:
        fingerprint = {"injected": target.name}
    manifest_path = out / "manifest.json"
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text(encoding="utf-8"))
        for key, new_val in [("fingerprint", fingerprint), *settings.items()]:
            old_val = old.get("fingerprint") if key == "fingerprint" else old.get("settings", {}).get(key)
            if old_val != new_val:
                raise ValueError(f"{out} holds a run with a different {key} ({old_val!r} != {new_val!r}); "
                                 "use another --out directory")
    done, next_index = scan_shards(out)
    todo = [p for p in prompts if p["id"] not in done]
    counts = {"prompts": len(prompts), "done": len(done), "eos": 0, "length": 0,
              "prompt_tokens": 0, "response_tokens": 0}
    for rec in done.values():
        counts[rec["finish"]] += 1
        counts["prompt_tokens"] += rec["n_prompt"]
        counts["response_tokens"] += rec["n_response"]

    def manifest(state: str) -> dict:
        return {"format": SHARD_FORMAT, "state": state, "fingerprint": fingerprint, "settings": settings,
                "eos_token_ids": sorted(target.eos_token_ids) if target is not None else None,
                "versions": {"torch": torch.__version__}, "counts": dict(counts),
                "updated_unix": round(time.time(), 1)}

    if not todo:  # nothing to add: the manifest of the run that wrote the shards stands
        if manifest_path.exists():
            return json.loads(manifest_path.read_text(encoding="utf-8"))
        m = manifest("complete")
        write_json_atomic(manifest_path, m)
        return m
    if target is None:
        from flashdraft.engine import EngineConfig, load_engine_target

        target = load_engine_target(EngineConfig(model=model, weights=weights, device=str(device), backend=backend,
                                                 spec_type="none", n_parallel=batch_size,
                                                 ctx_size=1024))  # per sequence: short prompts + answers
    target.set_feature_layers(None)
    params = SamplingParams() if greedy else SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    by_id = {p["id"]: p for p in todo}
    encoded = [(p["id"], target.user_prompt_ids(p["prompt"], p.get("raw_prompt"))) for p in todo]
    prompt_ids = dict(encoded)
    write_json_atomic(manifest_path, manifest("running"))
    writer = ShardWriter(out, next_index, shard_size)
    if layer_ids is None:
        layer_ids = default_stored_layers(target.num_layers)
    packed = generate_packed if target.lean is not None else generate_packed_llama
    if target.backend == "llama":
        packed = generate_packed_llama
        layer_ids = storable_layers(target, layer_ids)
    feature_writers: dict[int, FeatureWriter] = {}
    t0, new_tokens, last_manifest = time.perf_counter(), 0, time.time()
    bar = tqdm(total=len(todo), unit="answer", disable=not progress, mininterval=5.0, dynamic_ncols=True)
    try:
        for pid, response, finish, feats, (top_ids, top_logp) in packed(
                target, encoded, max_new_tokens, params, batch_size, seed, layer_ids):
            writer.write({"id": pid, "prompt": by_id[pid]["prompt"], "prompt_ids": prompt_ids[pid],
                          "response_ids": response, "finish": finish})
            if layer_ids:
                shard = writer.next_index - 1  # the shard the record just went to
                if shard not in feature_writers:
                    feature_writers[shard] = FeatureWriter(out, shard, layer_ids, target.hidden_size,
                                                           backend=target.backend)
                feature_writers[shard].write(pid, feats, top_ids, top_logp)
            counts["done"] += 1
            counts[finish] += 1
            counts["prompt_tokens"] += len(prompt_ids[pid])
            counts["response_tokens"] += len(response)
            new_tokens += len(response)
            bar.update(1)
            bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - t0):.0f} tok/s, "
                                f"{counts['response_tokens']} tokens", refresh=False)
            if time.time() - last_manifest > 30:
                write_json_atomic(manifest_path, manifest("running"))
                last_manifest = time.time()
    finally:
        writer.close()
        for fw in feature_writers.values():
            fw.close()
        bar.close()
        write_json_atomic(manifest_path, manifest("complete" if counts["done"] >= len(prompts) else "interrupted"))
    log.info("generated %d tokens in %.0f s (%.1f tokens/s)", new_tokens, time.perf_counter() - t0,
             new_tokens / max(time.perf_counter() - t0, 1e-9))
    return manifest("complete")


def build_arg_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m flashdraft.train.regen``."""
    ap = argparse.ArgumentParser(prog="python -m flashdraft.train.regen", formatter_class=HelpFormatter,
                                 description="Regenerate training answers with the target (packed, resumable).")
    ap.add_argument("--out", required=True, help="output directory for shards and manifest.json")
    ap.add_argument("--model", default=None, help="target (default: packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap in tokens")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=64, help="top-k at temperature > 0")
    ap.add_argument("--top-p", type=float, default=0.95, help="top-p at temperature > 0")
    ap.add_argument("--batch-size", type=int, default=32, help="sequences decoding together")
    ap.add_argument("--weights", choices=["fp32", "bf16"], default="fp32", help="target weights")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for torch")
    add_backend_argument(ap)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--limit", type=int, default=None, help="only the first N training prompts")
    ap.add_argument("--offset", type=int, default=0, help="skip the first N training prompts")
    ap.add_argument("--code-share", type=float, default=CODE_SHARE,
                    help="share of coding prompts among the training prompts")
    ap.add_argument("--no-features", action="store_true", help="do not store context features beside the shards")
    return ap


def main(argv: Iterable[str] | None = None) -> int:
    args = build_arg_parser().parse_args(None if argv is None else list(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    prompts = training_prompts(args.code_share)[args.offset:]
    if args.limit is not None:
        prompts = prompts[: args.limit]
    regenerate_packed(args.out, prompts, model=args.model, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      batch_size=args.batch_size, weights=args.weights, seed=args.seed, backend=args.backend,
                      layer_ids=() if args.no_features else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
