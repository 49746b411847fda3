"""``flashdraft eval-kv``: what each KV cache type costs in memory, quality and speed.

For every cache type, against the f32 cache on the same inputs, side by side in one run:

- memory: bytes per token of the target's K+V over all layers, and the ratio to f16;
- quality on held-out text (full held-out ShareGPT conversations, never trained on, cut
  into ``--ctx``-token contexts and fed in ``--chunk``-token blocks so every position reads
  the cache): perplexity, mean KL divergence of next-token distributions
  ``KL(p_f32 || p_type)`` in nats/token, and top-1 agreement with the f32 cache;
- greedy agreement: ``--greedy-tokens`` tokens generated greedily, spread over
  ``--greedy-prompts`` held-out prompts: the share of them produced before the output first
  differs from the f32 cache's (after a difference the texts are no longer comparable);
- DFlash: acceptance length τ with the type on the target and drafter caches;
- decode speed: target tokens/s of one-token steps after a ``--ctx``-token context.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from flashdraft.flags import WEIGHTS_CHOICES, WEIGHTS_HELP
from flashdraft.kv_cache import KVCacheSpec
from flashdraft.kv_codecs import CACHE_TYPES, make_codec

log = logging.getLogger(__name__)

DEFAULT_TYPES = ("f16", "q8_0", "q5_0", "q4_1", "q4_0", "q3_0", "turbo4", "turbo3", "q5_0/q4_1")


def parse_type(text: str, sink: int, tail: int) -> KVCacheSpec:
    """``"q4_0"`` or ``"K/V"`` (``"q5_0/q4_1"``) -> :class:`KVCacheSpec`.

    Raises:
        ValueError: an unknown type.
    """
    k, slash, v = text.partition("/")
    if slash and not v:
        raise ValueError(f"cache type {text!r}: give K/V as two types, e.g. q5_0/q4_1")
    v = v or k
    for t in (k, v):
        if t not in CACHE_TYPES:
            raise ValueError(f"unknown cache type {t!r}; choose from {', '.join(CACHE_TYPES)}")
    return KVCacheSpec(k, v, sink, tail)


def heldout_conversations(target, limit: int = 200) -> list[list[int]]:
    """Token ids of the held-out ShareGPT conversations (all turns, chat template), in the
    held-out order. Raises ``FileNotFoundError`` when the data set is missing."""
    from flashdraft.prompts import _clean_text, iter_json_array_records, sharegpt_heldout_ids, sharegpt_path

    wanted = {rid.split("#")[0]: i for i, rid in enumerate(sharegpt_heldout_ids()[:limit])}
    found: dict[int, list[dict]] = {}
    with open(sharegpt_path(), encoding="utf-8", errors="replace") as f:
        text = f.read()
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
    for record, _ in iter_json_array_records(text):
        i = wanted.get(f"sharegpt/{record.get('id')}") if isinstance(record, dict) else None
        if i is None or i in found:
            continue
        msgs = [{"role": roles[t["from"]], "content": _clean_text(t["value"])}
                for t in record.get("conversations") or []
                if isinstance(t, dict) and t.get("from") in roles and isinstance(t.get("value"), str)]
        if msgs:
            found[i] = msgs
    return [target.chat_prompt_ids(found[i], add_generation_prompt=False) for i in sorted(found)]


def make_contexts(conversations: list[list[int]], n_ctx: int, n: int) -> list[torch.Tensor]:
    """``n`` contexts of exactly ``n_ctx`` tokens from the conversations laid end to end.

    Raises:
        ValueError: not enough text.
    """
    flat = [t for conv in conversations for t in conv]
    if len(flat) < n * n_ctx:
        raise ValueError(f"held-out text has {len(flat)} tokens, need {n * n_ctx}")
    return [torch.tensor(flat[i * n_ctx:(i + 1) * n_ctx]) for i in range(n)]


@torch.inference_mode()
def score_text(target, specs: list[KVCacheSpec], contexts: list[torch.Tensor], chunk: int,
               bar: tqdm) -> dict[str, dict]:
    """Perplexity, KL to f32 and top-1 agreement of each spec, fed ``chunk`` tokens at a time.

    Returns ``{label: {"ppl", "kl", "top1"}}`` (KL in nats/token, mean over positions).
    """
    acc = {s.label(): {"nll": 0.0, "kl": 0.0, "top1": 0, "n": 0} for s in specs}
    ref_spec = KVCacheSpec()
    for ids in contexts:
        caches = {s.label(): target.new_cache(capacity=ids.shape[0], kv=s) for s in [ref_spec] + specs}
        for a in range(0, ids.shape[0] - 1, chunk):
            b = min(a + chunk, ids.shape[0] - 1)  # rows a..b-1 predict tokens a+1..b
            nxt = ids[a + 1:b + 1]
            ref = F.log_softmax(target.forward(ids[a:b], caches[ref_spec.label()])[0], dim=-1)
            ref_top = ref.argmax(-1)
            for s in specs:
                lp = F.log_softmax(target.forward(ids[a:b], caches[s.label()])[0], dim=-1)
                r = acc[s.label()]
                r["nll"] -= lp.gather(1, nxt[:, None]).sum().item()
                r["kl"] += (ref.exp() * (ref - lp)).sum().item()
                r["top1"] += int((lp.argmax(-1) == ref_top).sum())
                r["n"] += b - a
                bar.update(b - a)
    return {k: {"ppl": math.exp(r["nll"] / r["n"]), "kl": r["kl"] / r["n"], "top1": r["top1"] / r["n"]}
            for k, r in acc.items()}


def ref_perplexity(target, contexts: list[torch.Tensor], chunk: int) -> float:
    """Perplexity under the plain f32 cache (the reference row of the table)."""
    nll, n = 0.0, 0
    with torch.inference_mode():
        for ids in contexts:
            cache = target.new_cache(capacity=ids.shape[0])
            for a in range(0, ids.shape[0] - 1, chunk):
                b = min(a + chunk, ids.shape[0] - 1)
                lp = F.log_softmax(target.forward(ids[a:b], cache)[0], dim=-1)
                nll -= lp.gather(1, ids[a + 1:b + 1, None]).sum().item()
                n += b - a
    return math.exp(nll / n)


def greedy_tokens(target, spec: KVCacheSpec | None, prompt: list[int], n: int) -> list[int]:
    from flashdraft.generate import SpeculativeGenerator, generate_text
    from flashdraft.sampling import SamplingParams

    gen = SpeculativeGenerator(target, ctx_size=len(prompt) + n + 1, kv=spec)
    return generate_text(gen, prompt, n, SamplingParams(), ignore_eos=True)[1]


def dflash_tau(target, spec: KVCacheSpec | None, drafter_path: str | None, prompts: list[list[int]],
               n: int) -> float:
    """Acceptance length (tokens per verify step) of the DFlash drafter, greedy, fixed depth."""
    from flashdraft.engine import EngineConfig, load_drafter
    from flashdraft.generate import SpeculativeGenerator, generate_text
    from flashdraft.sampling import SamplingParams

    spec = spec or KVCacheSpec()
    cfg = EngineConfig(spec_type="dflash", draft_model=drafter_path, cache_type_k_draft=spec.type_k,
                       cache_type_v_draft=spec.type_v, kv_sink_tokens=spec.sink_tokens,
                       kv_tail_tokens=spec.tail_tokens)
    drafter = load_drafter(cfg, target)
    gen = SpeculativeGenerator(target, drafter, n_draft=15, kv=spec)
    produced = steps = 0
    for ids in prompts:
        t = generate_text(gen, ids, n, SamplingParams(), ignore_eos=True)[3]
        produced += t.verify_n  # the prefill's token is not a verify step's
        steps += t.n_steps - 1
    return produced / max(steps, 1)


@torch.inference_mode()
def decode_speed(target, specs: list[KVCacheSpec | None], context: torch.Tensor, n_steps: int,
                 rounds: int) -> dict[str, float]:
    """Target tokens/s of one-token steps after ``context``, types interleaved per round
    (median of rounds), so machine load hits every type alike."""
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for spec in specs:
            label = spec.label() if spec else "f32"
            cache = target.new_cache(capacity=context.shape[0] + n_steps + 1, kv=spec)
            for a in range(0, context.shape[0], 256):
                logits, _ = target.forward(context[a:a + 256], cache, logits_from=min(255, context.shape[0] - a - 1))
            tok = logits[-1].argmax()[None]
            t0 = time.perf_counter()
            for _ in range(n_steps):
                tok = target.forward(tok, cache)[0][-1].argmax()[None]
            times.setdefault(label, []).append(n_steps / (time.perf_counter() - t0))
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def evaluate_kv(target, specs: list[KVCacheSpec], *, ctx: int = 2048, n_contexts: int = 2, chunk: int = 256,
                greedy_n: int = 256, greedy_prompts: int = 4, tau_prompts: int = 2, tau_tokens: int = 96, drafter: str | None = None,
                speed_steps: int = 16, speed_rounds: int = 2) -> dict:
    """Run every measurement for ``specs`` (plus the f32 reference); returns the JSON report."""
    from flashdraft.prompts import sharegpt_heldout

    convs = heldout_conversations(target)
    contexts = make_contexts(convs, ctx, n_contexts)
    prompts = [target.chat_prompt_ids([{"role": "user", "content": p["prompt"]}])
               for p in sharegpt_heldout()[: max(tau_prompts, greedy_prompts, 1)]]
    per_prompt = greedy_n // max(greedy_prompts, 1)
    f16_bytes = 2 * target.num_layers * target.lean.n_kv_heads * target.lean.head_dim * 2
    total = n_contexts * (ctx - 1) * len(specs)
    rows = {}
    with tqdm(total=total, desc="eval-kv text", unit="tok", file=sys.stderr) as bar:
        quality = score_text(target, specs, contexts, chunk, bar)
    base_tokens = [greedy_tokens(target, None, p, per_prompt) for p in prompts[:greedy_prompts]] if greedy_n else []
    taus = {"f32": dflash_tau(target, None, drafter, prompts[:tau_prompts], tau_tokens)} if tau_prompts else {}
    for spec in tqdm(specs, desc="eval-kv greedy+tau", file=sys.stderr):
        label = spec.label()
        cache = target.new_cache(capacity=1, kv=spec)
        row = {"type_k": spec.type_k, "type_v": spec.type_v, "sink_tokens": spec.sink_tokens,
               "tail_tokens": spec.tail_tokens, "bytes_per_token": cache.bytes_per_token,
               "bits_per_value": (make_codec(spec.type_k, target.lean.head_dim).bits_per_value +
                                  make_codec(spec.type_v, target.lean.head_dim).bits_per_value) / 2,
               "less_than_f16": f16_bytes / cache.bytes_per_token, **quality[label]}
        if greedy_n:
            leads = []
            for p, base in zip(prompts[:greedy_prompts], base_tokens):
                same = [a == b for a, b in zip(greedy_tokens(target, spec, p, per_prompt), base)]
                leads.append(same.index(False) if False in same else len(same))
            row["greedy_leads"] = leads
            row["greedy_agreement"] = sum(leads) / (per_prompt * len(leads))
        if tau_prompts:
            row["tau"] = dflash_tau(target, spec, drafter, prompts[:tau_prompts], tau_tokens)
            row["tau_change"] = row["tau"] / taus["f32"] - 1
        rows[label] = row
    speed = decode_speed(target, [None] + specs, contexts[0], speed_steps, speed_rounds) if speed_steps else {}
    for label, row in rows.items():
        if speed:
            row["decode_tok_s"] = speed[label]
            row["speed_vs_f32"] = speed[label] / speed["f32"]
    ref = {"ppl": ref_perplexity(target, contexts, chunk), "bytes_per_token": 2 * f16_bytes,
           "decode_tok_s": speed.get("f32"), "tau": taus.get("f32")}
    return {"settings": {"ctx": ctx, "contexts": n_contexts, "chunk": chunk, "greedy_tokens": greedy_n,
                         "greedy_prompts": greedy_prompts,
                         "tau_prompts": tau_prompts, "tau_tokens": tau_tokens, "speed_steps": speed_steps,
                         "threads": torch.get_num_threads()},
            "machine": {"platform": platform.platform(), "processor": platform.processor(),
                        "torch": torch.__version__},
            "f32": ref, "types": rows}


def format_table(report: dict) -> str:
    """Markdown table of :func:`evaluate_kv`'s report."""
    ref = report["f32"]
    head = ("| cache K/V | bits/value | KV bytes/token | vs f16 | PPL | KL nats/tok | top-1 agree | "
            "greedy same (per prompt) | τ DFlash (Δ) | decode tok/s (vs f32) |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    f = lambda v, fmt: "–" if v is None else format(v, fmt)
    lines.append(f"| f32 (reference) | 32 | {ref['bytes_per_token']:,} | 0.50× | {ref['ppl']:.3f} | 0 | 100% | "
                 f"all | {f(ref.get('tau'), '.3f')} | {f(ref.get('decode_tok_s'), '.1f')} |")
    for label, r in report["types"].items():
        greedy = (f"{r['greedy_agreement']:.0%} ({'/'.join(map(str, r['greedy_leads']))})"
                  if "greedy_agreement" in r else "–")
        tau = f"{r['tau']:.3f} ({r['tau_change']:+.1%})" if "tau" in r else "–"
        speed = f"{r['decode_tok_s']:.1f} ({r['speed_vs_f32']:.2f}×)" if "decode_tok_s" in r else "–"
        lines.append(f"| {label} | {r['bits_per_value']:.2f} | {r['bytes_per_token']:,} | {r['less_than_f16']:.2f}× | "
                     f"{r['ppl']:.3f} | {r['kl']:.4f} | {r['top1']:.1%} | {greedy} | {tau} | {speed} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``flashdraft eval-kv``."""
    p.add_argument("-m", "--model", default=None, help="target model (default: packaged SmolLM2-135M-Instruct)")
    p.add_argument("-md", "--spec-draft-model", default=None,
                   help="DFlash drafter for the τ column (default: the shipped one for the default target)")
    p.add_argument("--types", nargs="+", default=list(DEFAULT_TYPES), metavar="TYPE",
                   help=f"cache types, or K/V pairs like q5_0/q4_1 (default: {' '.join(DEFAULT_TYPES)})")
    p.add_argument("--kv-sink-tokens", type=int, default=0, help="first positions kept exact (default: 0)")
    p.add_argument("--kv-tail-tokens", type=int, default=0, help="recent positions kept exact (default: 0)")
    p.add_argument("-c", "--ctx", type=int, default=2048, help="context length of the text (default: 2048)")
    p.add_argument("--contexts", type=int, default=2, help="held-out contexts scored (default: 2)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward while scoring (default: 256)")
    p.add_argument("--greedy-tokens", type=int, default=256, help="greedy tokens compared, 0 = skip (default: 256)")
    p.add_argument("--greedy-prompts", type=int, default=4, help="held-out prompts they are spread over (default: 4)")
    p.add_argument("--tau-prompts", type=int, default=2, help="held-out prompts for τ, 0 = skip (default: 2)")
    p.add_argument("--tau-tokens", type=int, default=96, help="tokens per τ prompt (default: 96)")
    p.add_argument("--speed-steps", type=int, default=16, help="timed decode steps per round, 0 = skip (default: 16)")
    p.add_argument("--weights", choices=WEIGHTS_CHOICES, default="fp32", help=WEIGHTS_HELP)
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--json-out", default=None, metavar="FILE", help="write the report as JSON")


def run(args) -> int:
    """``flashdraft eval-kv``: prints the Markdown table (and writes ``--json-out``)."""
    from flashdraft.engine import DEFAULT_DRAFTER_DIR
    from flashdraft.targets.torch import Target
    from flashdraft.threads import apply_threads, describe

    log.info("%s", describe(*apply_threads(args.threads)))
    if args.kv_sink_tokens < 0 or args.kv_tail_tokens < 0:
        raise ValueError("--kv-sink-tokens and --kv-tail-tokens must be >= 0")
    if args.ctx < 2 or args.contexts < 1 or args.chunk < 1:
        raise ValueError("--ctx must be >= 2, --contexts and --chunk >= 1")
    if max(args.kv_sink_tokens, args.kv_tail_tokens) > args.ctx:
        raise ValueError(f"--kv-sink-tokens / --kv-tail-tokens cannot exceed --ctx ({args.ctx})")
    specs = [parse_type(t, args.kv_sink_tokens, args.kv_tail_tokens) for t in args.types]
    drafter = args.spec_draft_model
    if drafter is None and args.model is None and (DEFAULT_DRAFTER_DIR / "config.json").exists():
        drafter = str(DEFAULT_DRAFTER_DIR)
    tau_prompts = args.tau_prompts if drafter else 0
    if drafter is None:
        log.info("no DFlash drafter for this target (-md PATH): skipping the τ column")
    target = Target.load(args.model, weights=args.weights)
    if target.lean is None:
        raise ValueError("compressed KV caches need the lean forward (llama/qwen families)")
    for s in specs:  # a type the model's head_dim cannot use fails before any work
        target.new_cache(capacity=1, kv=s)
    report = evaluate_kv(target, specs, ctx=args.ctx, n_contexts=args.contexts, chunk=args.chunk,
                         greedy_n=args.greedy_tokens, greedy_prompts=max(args.greedy_prompts, 1), tau_prompts=tau_prompts, tau_tokens=args.tau_tokens,
                         drafter=drafter, speed_steps=args.speed_steps)
    report["settings"]["model"] = args.model or "SmolLM2-135M-Instruct (packaged)"
    report["settings"]["weights"] = args.weights
    print(format_table(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0
