"""Measure a drafter's acceptance on a prompt set: ``flashdraft eval``.

Glossary (DESIGN.md §1; vLLM spec_decode metrics conventions):

- verify step: one target forward over [anchor, drafts]. The prefill's first token is *not*
  a verify step and is left out of τ and the histogram.
- τ (``tau``): tokens produced by verify steps / verify steps, bonus included (paper
  convention; a drafter that is never right gives 1.0). The step that ends a sequence counts
  its tokens through the one that ended it: an end-of-sequence token counts though it is not
  returned, tokens after a stop string or ``max_tokens`` do not (``Timings.verify_n``: the
  server's ``timings.acceptance_length``, the bench and the offline walk count the same way),
  so every step counts at least 1 and plain decoding reads exactly 1.0. τ is the histogram's
  mean.
- ``tau_drafted``: 1 + accepted drafts / verify steps that carried a draft (vLLM's
  "mean acceptance length"); differs from τ when the drafter sometimes proposes nothing
  (n-gram misses, the last step before ``max_tokens``).
- per-position acceptance: P(draft k accepted | a draft at position k was proposed), k = 1..B-1,
  from the engine's ``Timings`` counters, which count a draft as accepted only if it was
  produced by the rule above: drafts after the end inside the last step count as rejected.
- histogram: ``histogram[j]`` = verify steps that produced ``j + 1`` tokens, j = 0..B-1;
  ``sum(histogram) == verify_steps``.

    flashdraft eval --dataset humaneval --limit 20                 # packaged target + drafter
    flashdraft eval --target m.gguf --drafter d/ --dataset seed --temperature 0 --json
    flashdraft eval --dataset sharegpt-heldout --spec-type ngram   # baseline to compare with
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time

from flashdraft.flags import add_model_arguments
from flashdraft.generate import ContextOverflowError, SpeculativeGenerator
from flashdraft.sampling import SamplingParams
from flashdraft.train.stats import AcceptanceStats

log = logging.getLogger(__name__)


def prompt_ids(generator: SpeculativeGenerator, item: dict | str, chat: bool) -> list[int]:
    """Token ids of one prompt-set item (``{"prompt": str, ...}`` or a plain string).

    ``chat=True`` applies the target's chat template when it has one; a model without one (a
    base model) gets the plain text, and ``raw_prompt`` (HumanEval's bare function) if the
    item has it, since a completion model continues code better than an instruction.
    """
    item = {"prompt": item} if isinstance(item, str) else item
    target = generator.target
    if not chat:
        return target.encode(item.get("raw_prompt") or item["prompt"])
    return target.user_prompt_ids(item["prompt"], item.get("raw_prompt"))


def evaluate(generator: SpeculativeGenerator, prompts: list[dict | str], max_tokens: int,
             params: SamplingParams, chat: bool = True, progress: bool = True,
             ignore_eos: bool = False) -> dict:
    """Run every prompt through the speculative loop; aggregate acceptance (see module glossary).

    Args:
        generator: a ready target + drafter (``flashdraft.engine.load_engine``).
        prompts: prompt-set items (``flashdraft.prompts.load_prompt_set``) or strings.
        max_tokens: tokens to generate per prompt at most.
        params: sampling settings. At T > 0 prompt i is sampled with seed ``params.seed + i``
            (``params.seed`` None counts as 0), so a rerun draws the same samples.
        chat: wrap prompts with the chat template (when the target has one).
        progress: show a tqdm bar (stderr) with the running τ.
        ignore_eos: generate through EOS (fixed-length runs).
    Returns:
        A dict of :meth:`AcceptanceStats.to_dict` plus ``temperature``, ``max_tokens``,
        ``block_size`` (1 + the longest draft a step may carry) and ``wall_s``. Token
        counts are tokens, times ms (``wall_s`` in seconds), speed tokens/s.
    Raises:
        ValueError: ``max_tokens < 1``. A prompt too long for the context is skipped with a
            warning and counted in ``skipped_prompts``.
    """
    from tqdm import tqdm

    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    max_draft = generator.drafter.max_draft
    n_draft = generator.n_draft if max_draft is None else min(generator.n_draft, max_draft)
    block_size = 1 + (n_draft if generator.drafting else 0)
    stats = AcceptanceStats()
    t0 = time.perf_counter()
    bar = tqdm(prompts, disable=not progress, unit="prompt", dynamic_ncols=True,
               desc=f"T={params.temperature:g}")
    for i, item in enumerate(bar):
        seeded = dataclasses.replace(params, seed=(params.seed or 0) + i) if not params.greedy else params
        ids = prompt_ids(generator, item, chat)
        try:
            _run_one(generator, ids, max_tokens, seeded, ignore_eos, stats)
        except ContextOverflowError as e:
            log.warning("skipping prompt %s: %s", item.get("id", i) if isinstance(item, dict) else i, e)
            stats.skipped_prompts += 1
            continue
        bar.set_postfix(tau=f"{stats.tau:.2f}", refresh=False)
    return {"temperature": params.temperature, "max_tokens": max_tokens, "block_size": block_size,
            **stats.to_dict(block_size), "wall_s": round(time.perf_counter() - t0, 3)}


def _run_one(generator: SpeculativeGenerator, ids: list[int], max_tokens: int, params: SamplingParams,
             ignore_eos: bool, stats: AcceptanceStats) -> None:
    """One prompt: step lengths go to the histogram, the final Timings to the counters."""
    steps = list(generator.generate(ids, max_tokens, params, ignore_eos=ignore_eos))
    stats.add(steps[-1].timings, steps[-1].finish_reason)


# ---------------------------------------------------------------- report


def format_report(result: dict) -> str:
    """A readable block for one temperature: summary line, per-position row, histogram."""
    r = result
    tau_d = f"{r['tau_drafted']:.2f}" if r["tau_drafted"] is not None else "-"
    lines = [
        f"T={r['temperature']:g}  tau {r['tau']:.2f} (over drafted steps {tau_d})  "
        f"prompts {r['prompts']}" + (f" (+{r['skipped_prompts']} skipped)" if r["skipped_prompts"] else "")
        + f"  tokens {r['tokens']}  verify steps {r['verify_steps']}  "
        f"drafts accepted {r['draft_n_accepted']}/{r['draft_n']} ({100 * r['acceptance_rate']:.1f}%)  "
        f"decode {r['decode_tokens_per_second']:.1f} tokens/s",
    ]
    accept = r["per_position_acceptance"]
    if accept:
        lines.append("  position k      " + "".join(f"{k:>6}" for k in range(1, len(accept) + 1)))
        lines.append("  P(accept k)     " + "".join(f"{a:>6.2f}" if a is not None else f"{'-':>6}" for a in accept))
    hist = r["histogram"]
    lines.append("  tokens/step     " + "".join(f"{n:>6}" for n in range(1, len(hist) + 1)))
    lines.append("  verify steps    " + "".join(f"{c:>6}" for c in hist))
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``flashdraft eval`` (model flags shared with generate/bench, plus aliases)."""
    add_model_arguments(p)
    # aliases writing the same dest as -m / -md (argparse allows several options per dest)
    p.add_argument("--target", dest="model", default=argparse.SUPPRESS,
                   help="target model (same as -m/--model; default: packaged SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", dest="spec_draft_model", default=argparse.SUPPRESS,
                   help="drafter (same as -md/--spec-draft-model; default with the packaged target: "
                        "the shipped DFlash drafter; with --offline also an AR drafter directory or self:N)")
    p.add_argument("--block-size", type=int, default=None,
                   help="DFlash block size B: draft B-1 tokens per step (overrides --spec-draft-n-max)")
    p.add_argument("--dataset", default="humaneval",
                   help="prompt set: humaneval, sharegpt-heldout, seed, or a .jsonl file (default: humaneval)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("-n", "--max-tokens", type=int, default=None,
                   help="tokens per prompt at most (default: 128 online, 256 with --offline)")
    p.add_argument("--temperature", "--temp", type=float, nargs="+", default=[0.0, 0.7],
                   help="temperatures to run (default: 0 0.7)")
    p.add_argument("--seed", type=int, default=0, help="base seed at T>0: prompt i uses seed+i (default: 0)")
    p.add_argument("--no-chat", action="store_true", help="send prompts as plain text, without the chat template")
    p.add_argument("--ignore-eos", action="store_true", help="generate max-tokens tokens even past EOS")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--offline", action="store_true",
                   help="regenerate the held-out answers once (kept under --heldout-root), then walk them as "
                        "decoding would: exact online τ at T=0 in minutes; also walks prompt lookup and a bigram "
                        "table. --dataset takes a comma-separated list")
    p.add_argument("--heldout-root", default="datasets/heldout",
                   help="where --offline keeps the regenerated held-out answers (default: datasets/heldout)")
    p.add_argument("--bigram-data", nargs="*", default=None,
                   help="training answer directories for the bigram reference (default: datasets/* of the repo)")
    p.add_argument("--json-out", default=None, help="--offline: also write the full report to this file")


def run(args) -> int:
    """``flashdraft eval``: load once, evaluate each temperature, print a table or JSON."""
    from flashdraft.engine import CACHE_FIELDS, EngineConfig, load_engine
    from flashdraft.prompts import load_prompt_set
    from flashdraft.threads import apply_threads, describe

    log.info("%s", describe(*apply_threads(args.threads)))
    if args.max_tokens is None:
        args.max_tokens = 256 if args.offline else 128
    if args.offline:
        from flashdraft.train.walk import run_offline

        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        return run_offline(args)
    if args.block_size is not None:
        if args.block_size < 2:
            raise ValueError(f"--block-size must be >= 2 (an anchor and at least one draft), got {args.block_size}")
        args.spec_draft_n_max = args.block_size - 1
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    params = [SamplingParams(temperature=t, seed=args.seed) for t in args.temperature]  # validates T
    prompts = load_prompt_set(args.dataset, args.limit)
    if args.spec_type is None and not args.model:  # eval measures a drafter: the shipped one by default
        args.spec_type = "dflash"
    cfg = EngineConfig.from_args(args)
    if cfg.spec_type == "none":
        raise ValueError("flashdraft eval measures a drafter: pass -md PATH (a DFlash drafter for this target) "
                         "or --spec-type ngram/draft")
    cfg.controller = "off"  # τ of the drafter itself: a fixed draft length
    generator = load_engine(cfg)
    drafter = args.spec_draft_model or ("(shipped default)" if cfg.spec_type == "dflash" and not args.model else None)
    header = {"target": generator.target.name, "spec_type": cfg.spec_type, "drafter": drafter,
              "dataset": args.dataset, "n_prompts": len(prompts), "max_tokens": args.max_tokens,
              "weights": args.weights, **cfg.report(CACHE_FIELDS)}
    if not args.json:
        print(f"flashdraft eval: target {header['target']}, --spec-type {cfg.spec_type}"
              + (f" ({drafter})" if drafter else "") + f", {args.dataset} x {len(prompts)} prompts, "
              f"max {args.max_tokens} tokens")
    results = []
    for p in params:
        result = evaluate(generator, prompts, args.max_tokens, p, chat=not args.no_chat,
                          ignore_eos=args.ignore_eos)
        results.append(result)
        if not args.json:
            print(format_report(result), flush=True)
    if args.json:
        print(json.dumps({**header, "results": results}))
    return 0
