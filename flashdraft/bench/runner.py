"""``flashdraft bench``: baseline vs drafters vs peer engines, one process, one run.

Method (why each rule is there):

1. Everything runs in this process on one loaded target, with the same prompt token ids,
   so configurations differ only in how they decode.
2. Every configuration first generates a few tokens that are not measured (warm-up): the
   first forwards of a process are several times slower on CPU.
3. Each repeat (*pass*) runs every prompt through every configuration before the next
   repeat starts, and the configuration order rotates between passes: slow drift of the
   machine (heat, a background job) then hits all configurations alike.
4. Greedy runs are compared token by token with the baseline (``none``; in ``--url`` mode
   the first server), which checks losslessness on the way.
5. A prompt with a JSON schema (the ``json-schema`` set) is answered under that schema by
   every configuration that can take a constraint, each answer is checked against the
   schema, and the time inside the grammar is measured per token (:mod:`.constrained`);
   configurations that cannot take one skip those prompts, saying why.

``--url`` benchmarks running servers instead of loading anything (see :mod:`.remote`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from flashdraft.bench.contender import ALL_CONFIGS, BenchPrompt, Contender, Unavailable
from flashdraft.bench.stats import RunRecord, summarize
from flashdraft.engine import CACHE_FIELDS, DRAFTER_FIELDS, EngineConfig
from flashdraft.flags import add_model_arguments
from flashdraft.sampling import SamplingParams

log = logging.getLogger(__name__)

#: prompt sets whose default ``--max-tokens`` is the seed guide's 1200
LONG_SETS = ("seed",)
LONG_MAX_TOKENS, DEFAULT_MAX_TOKENS = 1200, 256
#: the per-prompt table is printed by default up to this many prompts per set
PER_PROMPT_AUTO = 10
DEFAULT_REPEATS, DEFAULT_WARMUP = 3, 8
#: ``--quick``: plain decoding against what ``make serve`` runs and DFlash under the cost
#: controller, one pass over the seed prompts at 256 tokens (about 2 minutes on 2 cores)
QUICK = {"configs": "none,default,dflash-cost", "repeats": 1, "max_tokens": 256, "warmup_tokens": 4}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``flashdraft bench``."""
    add_model_arguments(p)
    # bench runs every drafting method side by side; --spec-type would mean nothing here
    p._option_string_actions["--spec-type"].help = "not used by bench: --configs picks the drafting methods"
    p._option_string_actions["-md"].help = ("DFlash drafter for `dflash` and `hf-dflash`: SpecForge dir, GGUF or "
                                            "random[:LAYERS] (default: the shipped one for the default target)")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="autoregressive draft model (same tokenizer) for the `draft` and `hf-draft` configurations: "
                        "an AR drafter from `flashdraft train --kind ar` or a transformers model (default for "
                        "`draft`: the shipped AR drafter of the default target)")
    p.add_argument("--self-draft-layers", type=int, default=4, metavar="N",
                   help="target layers of the `self-draft` configurations (-md self:N)")
    p.add_argument("--quant", default=None, metavar="TYPE",
                   help="bench a requantisation of the target GGUF (llama.cpp's quantiser, --allow-requantize: "
                        "Q4_0, Q4_K_M, Q8_0, BF16, ...) instead of the file itself, the same file for every engine; "
                        "for measuring what a weight type costs (the copy is another model than the original)")
    p.add_argument("--peer-threads", default=None, metavar="1,2",
                   help="run the llama-server peers once per thread count listed (rows `llama-server -tN`); "
                        "default: the bench's -t")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated configurations (default: all that can run here): {','.join(ALL_CONFIGS)}; "
                        "dflash@N = DFlash at a fixed depth of N drafts (several allowed)")
    p.add_argument("--peers", default=None, metavar="llama,hf",
                   help="add peer engines on the same target to --configs: llama = llamacpp + llamacpp-lookup "
                        "(llama-cpp-python; `make setup` builds it, `make llama` alone), llama-server = llama-server "
                        "plain, -lookup and -dflash (`make llama-peer` builds it), hf = transformers generate() and its "
                        "assisted modes, zlab = z-lab's dflash_generate with and without our drafter; same threads and prompts")
    p.add_argument("--prompts", default="seed",
                   help="comma-separated prompt sets: seed, humaneval, sharegpt-heldout, random (random letters, "
                        "a worst case for drafting), json-schema (answers held to a JSON schema) or FILE.jsonl "
                        "(default: seed)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    p.add_argument("-n", "--max-tokens", type=int, default=None,
                   help=f"tokens to generate per prompt "
                        f"(default: {LONG_MAX_TOKENS} for seed, {DEFAULT_MAX_TOKENS} otherwise)")
    p.add_argument("--temperature", "--temp", default="0",
                   help="comma-separated temperatures, 0 = greedy (default: 0; the seed article, Gemma-4-31B "
                        "DFlash on an RTX 4090 with beellama.cpp, also uses 0.7)")
    p.add_argument("--top-k", type=int, default=64, help="top-k at temperature > 0 (default: 64, the seed article's)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p at temperature > 0 (default: 0.95)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p at temperature > 0 (default: 0)")
    p.add_argument("--seed", type=int, default=0, help="base seed of sampled runs (default: 0)")
    p.add_argument("--quick", action="store_true",
                   help="a first look in a few minutes: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
                        + " (flags given beside it win)")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help=f"passes over the prompts per configuration (default: {DEFAULT_REPEATS})")
    p.add_argument("--warmup-tokens", type=int, default=DEFAULT_WARMUP,
                   help=f"tokens each configuration generates, unmeasured, before the first pass (default: {DEFAULT_WARMUP})")
    p.add_argument("--json-out", default=None, metavar="FILE", help="write every run and the summary as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="tokens/s per configuration + acceptance histogram")
    p.add_argument("--per-prompt", action=argparse.BooleanOptionalAction, default=None,
                   help=f"print a per-prompt table (default: when a set has at most {PER_PROMPT_AUTO} prompts)")
    r = p.add_argument_group("remote servers (--url)")
    r.add_argument("--url", action="append", default=[], metavar="http://HOST:PORT",
                   help="benchmark a running OpenAI-compatible server instead (repeatable; the first is the baseline)")
    r.add_argument("--api-key", default=None, help="Bearer key for --url servers")
    r.add_argument("--url-model", default=None, help="model id to request (default: the first of /v1/models)")
    r.add_argument("--no-stream", action="store_true", help="plain requests: no time to first token")


# ---------------------------------------------------------------- parsing helpers


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


#: ``--peers`` names -> the peer configurations they add
PEER_GROUPS = {"llama": ("llamacpp", "llamacpp-lookup"), "hf": ("hf", "hf-lookup", "hf-dflash", "hf-draft"),
               "llama-server": ("llama-server", "llama-server-lookup", "llama-server-dflash"),
               "zlab": ("zlab", "zlab-dflash")}


def parse_configs(text: str | None, peers: str | None = None) -> list[str]:
    """``--configs`` (plus the ``--peers`` groups) -> names in report order.
    Raises ValueError for unknown names."""
    unknown_peers = [p for p in _split(peers or "") if p not in PEER_GROUPS]
    if unknown_peers:
        raise ValueError(f"unknown --peers {', '.join(unknown_peers)}; choose from {', '.join(PEER_GROUPS)}")
    if text is None:
        return list(ALL_CONFIGS)
    from flashdraft.bench.contender import fixed_depth

    names = _split(text) + [c for p in _split(peers or "") for c in PEER_GROUPS[p]]
    unknown = [n for n in names if n not in ALL_CONFIGS and fixed_depth(n) is None]
    if unknown or not names:
        raise ValueError(f"unknown configuration(s) {', '.join(unknown) or '(none)'}; "
                         f"choose from {', '.join(ALL_CONFIGS)}, or dflash@N (fixed depth N >= 1)")
    depths = sorted({n for n in names if fixed_depth(n) is not None}, key=fixed_depth)
    ordered = [c for c in ALL_CONFIGS if c in names]
    at = ordered.index("dflash") + 1 if "dflash" in ordered else sum(c == "none" for c in ordered)
    return ordered[:at] + depths + ordered[at:]


def parse_temperatures(text: str) -> list[float]:
    """``--temperature 0,0.7`` -> ``[0.0, 0.7]``. Raises ValueError for bad values."""
    try:
        temps = [float(t) for t in _split(text)]
    except ValueError:
        raise ValueError(f"--temperature expects comma-separated numbers, got {text!r}") from None
    if not temps or any(t < 0 for t in temps):
        raise ValueError(f"--temperature needs numbers >= 0, got {text!r}")
    return temps


def max_tokens_for(prompt_set: str, given: int | None) -> int:
    if given is not None:
        if given < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {given}")
        return given
    return LONG_MAX_TOKENS if prompt_set in LONG_SETS else DEFAULT_MAX_TOKENS


def load_prompts(sets: list[str], limit: int | None, max_tokens: int | None, target=None) -> list[BenchPrompt]:
    """Every prompt of ``sets``; with a target, tokenized as a chat (plain text without a template).

    A prompt with a ``schema`` gets it compiled (``BenchPrompt.grammar``). Raises ValueError
    for a schema that does not compile or that uses keywords the answer checker cannot judge.
    """
    from flashdraft.bench.constrained import schema_grammar
    from flashdraft.bench.schema_check import unsupported_keywords
    from flashdraft.prompts import load_prompt_set

    out = []
    for s in sets:
        n = max_tokens_for(s, max_tokens)
        for item in load_prompt_set(s, limit):
            ids = None
            if target is not None:
                # a base model: the raw text (HumanEval's bare function header when there is one)
                ids = (target.chat_prompt_ids(item["messages"]) if "messages" in item
                       else target.user_prompt_ids(item["prompt"], item.get("raw_prompt")))
            schema = item.get("schema")
            grammar = None
            if schema is not None:
                unknown = unsupported_keywords(schema) if isinstance(schema, dict) else {"(not an object)"}
                if unknown:
                    raise ValueError(f"{item['id']}: the answer checker cannot judge schema keyword(s) "
                                     f"{', '.join(sorted(unknown))}")
                grammar = schema_grammar(schema)  # GrammarError is a ValueError naming the fault
            out.append(BenchPrompt(id=item["id"], set=s, text=item["prompt"], ids=ids, max_tokens=n,
                                   schema=schema, grammar=grammar, turn=item.get("turn"),
                                   messages=item.get("messages")))
    if not out:
        raise ValueError("no prompts to run (check --prompts and --limit)")
    return out


# ---------------------------------------------------------------- building configurations


def build_local(names: list[str], args, target, explicit: bool) -> list[Contender | Unavailable]:
    """Configurations ``names`` on ``target``.

    A configuration that cannot run here becomes :class:`Unavailable` with the reason. One
    that fails while loading raises when it was asked for by name (``explicit``), else is
    reported as unavailable too.
    """
    import tempfile
    from pathlib import Path

    import torch

    from flashdraft.bench.llama_server import LLAMA_SERVER_PEERS, build_llama_server
    from flashdraft.bench.ours import build_ours, dflash_drafter_path, is_ours
    from flashdraft.bench.peers import HF_PEERS, LLAMACPP_PEERS, build_hf, build_llamacpp
    from flashdraft.bench.zlab import ZLAB_PEERS, build_zlab
    base = EngineConfig.from_args(args)
    dflash_path = dflash_drafter_path(args.model, args.spec_draft_model, target)
    threads = torch.get_num_threads()  # set by run(): -t or the default, the same for every configuration
    out = []
    for name in names:
        try:
            if is_ours(name):
                built = build_ours(name, base, target, args.draft_model, args.self_draft_layers)
            elif name in HF_PEERS:
                built = build_hf(name, target, base, args.draft_model, dflash_path)
            elif name in LLAMACPP_PEERS:
                built = build_llamacpp(name, target, args.model, base, threads)
            elif name in LLAMA_SERVER_PEERS:  # failures come back as Unavailable with the error
                peer_threads = [int(x) for x in _split(args.peer_threads)] if args.peer_threads else [threads]
                for n in peer_threads[:-1]:
                    out.append(_renamed(build_llama_server(name, target, args.model, n, base.ctx_size, dflash_path),
                                        f"{name} -t{n}"))
                n = peer_threads[-1]
                built = build_llama_server(name, target, args.model, n, base.ctx_size, dflash_path)
                if args.peer_threads:
                    built = _renamed(built, f"{name} -t{n}")
            elif name in ZLAB_PEERS:
                built = build_zlab(name, target, args.model, dflash_path, Path(tempfile.mkdtemp(prefix="flashdraft-zlab-")))
            else:
                raise ValueError(f"unknown configuration {name}")
        except Exception as e:  # noqa: BLE001 - one peer failing to load must not hide the others
            if explicit:
                raise
            log.warning("%s cannot run: %s", name, e)
            built = Unavailable(name, "ours" if is_ours(name) else "peer", f"failed to load: {type(e).__name__}: {e}")
        out.append(built)
    return out


def _renamed(c, name: str):
    c.name = name
    return c


def apply_quick(args) -> None:
    """``--quick``: :data:`QUICK`'s values for the flags still at their defaults."""
    if not args.quick:
        return
    defaults = {"configs": None, "repeats": DEFAULT_REPEATS, "max_tokens": None, "warmup_tokens": DEFAULT_WARMUP}
    for name, value in QUICK.items():
        if getattr(args, name) == defaults[name]:
            setattr(args, name, value)


def apply_quant(args) -> None:
    """``--quant TYPE``: point ``-m`` at the requantised GGUF (made once, cached) and keep the
    default target's shipped DFlash drafter for it. Raises ValueError for a bad type or file."""
    if not args.quant:
        return
    from flashdraft.engine import DEFAULT_DRAFTER_DIR
    from flashdraft.targets.torch import default_model_path
    from flashdraft.targets.requantize import requantize

    src = args.model or str(default_model_path())
    if not str(src).endswith(".gguf"):
        raise ValueError("--quant requantises a GGUF target (-m FILE.gguf)")
    if args.model is None and args.spec_draft_model is None:
        args.spec_draft_model = str(DEFAULT_DRAFTER_DIR)  # same weights' drafter, another file
    args.model = str(requantize(src, args.quant))
    log.info("--quant %s: benchmarking %s", args.quant, args.model)


def build_remote(args) -> list[Contender]:
    """One :class:`RemoteServer` per ``--url``. Raises ValueError when a server cannot be reached
    or refuses the key (asked once, for its model list)."""
    from flashdraft.bench.remote import RemoteServer, ServerError

    out = []
    for u in args.url:
        try:
            out.append(RemoteServer(u, api_key=args.api_key, model=args.url_model, stream=not args.no_stream))
        except ServerError as e:
            raise ValueError(str(e)) from None
    return out


# ---------------------------------------------------------------- running


def sampling_for(temperature: float, args, prompt_index: int, repeat: int) -> SamplingParams:
    """Sampling settings of one run; the seed depends only on the prompt and the repeat, so
    every configuration gets the same seed for the same run."""
    if temperature == 0:
        return SamplingParams()
    return SamplingParams(temperature=temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          seed=args.seed + 1000 * repeat + prompt_index)


def runs_on(c: Contender, prompt: BenchPrompt) -> bool:
    """Whether ``c`` answers ``prompt``: a constrained prompt needs a configuration that takes a constraint."""
    return prompt.schema is None or c.takes_constraint


def warm_up(contenders: list, prompts: list[BenchPrompt], tokens: int) -> list:
    """Run each configuration once, unmeasured, on the first prompt it will answer (so a
    constrained set also warms the grammar engine up); one that fails becomes :class:`Unavailable`."""
    if tokens <= 0:
        return contenders
    out = []
    for c in contenders:
        first = None if isinstance(c, Unavailable) else next((p for p in prompts if runs_on(c, p)), None)
        if first is None:
            out.append(c)
            continue
        short = dataclasses.replace(first, max_tokens=min(tokens, first.max_tokens))
        try:
            c.activate()
            c.run(short, SamplingParams())
            out.append(c)
        except Exception as e:  # noqa: BLE001 - report it and benchmark the rest
            log.warning("%s failed in warm-up: %s", c.name, e)
            out.append(Unavailable(c.name, c.kind, f"failed in warm-up: {type(e).__name__}: {e}"))
    return out


def run_all(contenders: list[Contender], prompts: list[BenchPrompt], temperatures: list[float], repeats: int,
            args) -> list[RunRecord]:
    """Every (temperature, repeat, prompt, configuration), configurations innermost and
    rotated per repeat. A failing run is recorded with its error and the rest go on.
    Configurations that cannot take a constraint skip constrained prompts (no record);
    every constrained answer is checked against its schema (``RunRecord.violation``)."""
    from tqdm import tqdm

    from flashdraft.bench.schema_check import check_answer

    records = []
    total = len(temperatures) * repeats * sum(runs_on(c, p) for p in prompts for c in contenders)
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr, dynamic_ncols=True,
              mininterval=1.0) as bar:
        for temp in temperatures:
            for rep in range(repeats):
                k = rep % len(contenders)
                order = contenders[k:] + contenders[:k]
                for i, prompt in enumerate(prompts):
                    params = sampling_for(temp, args, i, rep)
                    for c in order:
                        if not runs_on(c, prompt):
                            continue
                        bar.set_postfix_str(f"T={temp:g} pass {rep + 1} {prompt.id} {c.name}")
                        rec = RunRecord(c.name, prompt.set, prompt.id, temp, rep, constrained=prompt.schema is not None)
                        try:
                            c.activate()
                            rec.generation = c.run(prompt, params)
                            if rec.constrained:
                                rec.violation = check_answer(rec.generation.text, prompt.schema)
                        except Exception as e:  # noqa: BLE001 - keep benchmarking the others
                            log.warning("%s on %s failed: %s", c.name, prompt.id, e)
                            rec.error = f"{type(e).__name__}: {e}"
                        records.append(rec)
                        bar.update()
    return records


def run(args, target=None) -> int:
    """``flashdraft bench``: prints the report; writes ``--json-out`` / ``--plot`` if asked.

    Args:
        target: an already loaded :class:`flashdraft.targets.torch.Target` to use instead of
            loading ``-m`` (tests, notebooks).
    Raises:
        ValueError: bad flags, unknown configurations or prompt sets, nothing to run.
    """
    from flashdraft.threads import apply_threads, describe

    apply_quick(args)
    args.threads_used, why = apply_threads(args.threads)
    apply_quant(args)
    log.info("%s", describe(args.threads_used, why))
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    temperatures = parse_temperatures(args.temperature)
    sets = _split(args.prompts)
    names = parse_configs(args.configs, args.peers)

    if args.url:
        if args.configs:
            raise ValueError("--configs does not apply to --url (the servers are the configurations)")
        contenders = build_remote(args)
        prompts = load_prompts(sets, args.limit, args.max_tokens)
    else:
        import transformers

        transformers.logging.set_verbosity_error()  # generate()'s per-call advice would drown the progress bar
        if target is None:
            from flashdraft.engine import load_engine_target

            cfg = EngineConfig.from_args(args)
            if cfg.spec_type == "none" and any(n.startswith(("dflash", "hybrid")) for n in names):
                cfg.spec_type = "dflash"  # its drafters read context features: a backend that gives them
            target = load_engine_target(cfg)
        prompts = load_prompts(sets, args.limit, args.max_tokens, target)
        contenders = build_local(names, args, target, explicit=args.configs is not None)
        if any(p.cache_prompt for p in prompts):
            # each of our configurations keeps its own prompt cache between a conversation's
            # turns: room for all of them (and a running one) in the llama context
            target.ensure_sequences(sum(isinstance(c, Contender) and c.kind == "ours" for c in contenders) + 1)
        asked = {c for p in _split(args.peers or "") for c in PEER_GROUPS[p]}
        missing = [f"{c.name}: {c.reason}" for c in contenders if c.name in asked and isinstance(c, Unavailable)
                   and c.name not in REPORTED_IF_MISSING]
        if missing:  # a peer asked for by --peers must run (or say why it cannot)
            close_all(contenders)
            raise ValueError("--peers: " + "; ".join(missing))
    try:
        return _run_contenders(args, contenders, prompts, temperatures, sets)
    finally:
        close_all(contenders)


#: peers that, asked for by ``--peers`` and unable to run (no binary, a server that does not
#: start, a drafter that does not load), become a table row with their error instead of
#: stopping the bench: the rest of the comparison still stands and the row says what failed
REPORTED_IF_MISSING = ("llama-server", "llama-server-lookup", "llama-server-dflash", "zlab", "zlab-dflash")


def close_all(contenders: list) -> None:
    """Stop what configurations hold outside this process (llama-server children)."""
    for c in contenders:
        close = getattr(c, "close", None)
        if close is not None:
            close()


def _run_contenders(args, contenders: list, prompts: list[BenchPrompt], temperatures: list[float],
                    sets: list[str]) -> int:
    """Warm up, run and report ``contenders`` (the body of :func:`run`, whose caller stops them)."""
    from flashdraft.bench import report

    contenders = warm_up(contenders, prompts, args.warmup_tokens)
    active = [c for c in contenders if not isinstance(c, Unavailable)]
    if not active:
        reasons = "; ".join(f"{c.name}: {c.reason}" for c in contenders)
        raise ValueError(f"no configuration can run here ({reasons})")
    if not any(runs_on(c, p) for c in active for p in prompts):
        reasons = "; ".join(f"{c.name}: {c.constraint_note}" for c in active)
        raise ValueError(f"every prompt is constrained and no configuration here takes a constraint ({reasons})")
    baseline = "none" if any(c.name == "none" for c in active) else active[0].name

    records = run_all(active, prompts, temperatures, args.repeats, args)
    order = [c.name for c in contenders]
    summary, per_prompt = summarize(records, order, baseline)

    show = args.per_prompt
    if show is None:
        show = max(sum(p.set == s for p in prompts) for s in sets) <= PER_PROMPT_AUTO
    skipped = skipped_on_constrained(active, prompts)
    report.print_markdown(report.markdown(summary, per_prompt, contenders, baseline, args.repeats, show, skipped))

    if args.json_out:
        settings = _settings(args, sets, temperatures, prompts)
        prompt_list = [{"prompt_set": p.set, "id": p.id, "prompt_tokens": len(p.ids) if p.ids else None,
                        "max_tokens": p.max_tokens, "schema": p.schema} for p in prompts]
        doc = report.build_document(argv=sys.argv, settings=settings, baseline=baseline, contenders=contenders,
                                    prompts=prompt_list, records=records, summary=summary, per_prompt=per_prompt,
                                    skipped=skipped)
        report.write_json(doc, args.json_out)
        log.info("wrote %s", args.json_out)
    if args.plot:
        from flashdraft.bench.plot import plot

        plot(summary, args.plot, title=_title(args))
        log.info("wrote %s", args.plot)
    return 0


def skipped_on_constrained(contenders: list[Contender], prompts: list[BenchPrompt]) -> list[dict]:
    """``[{config, prompt_sets, reason}]``: configurations left out of constrained prompts."""
    sets = sorted({p.set for p in prompts if p.schema is not None})
    return [{"config": c.name, "prompt_sets": sets, "reason": c.constraint_note}
            for c in contenders if sets and not c.takes_constraint]


def _settings(args, sets, temperatures, prompts) -> dict:
    from flashdraft.device import resolve_device, resolve_draft_dtype

    return {
        "mode": "url" if args.url else "local",
        "prompt_sets": sets, "limit": args.limit,
        "max_tokens": {s: max_tokens_for(s, args.max_tokens) for s in sets},
        "temperatures": temperatures, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
        "seed": args.seed, "repeats": args.repeats, "warmup_tokens": args.warmup_tokens,
        "model": args.model, "drafter": args.spec_draft_model, "draft_model": args.draft_model,
        "n_draft": args.spec_draft_n_max, "ctx_size": args.ctx_size, "cross_ctx": args.spec_dflash_cross_ctx,
        "threads": getattr(args, "threads_used", args.threads), "threads_flag": args.threads,
        "quant": getattr(args, "quant", None), "peer_threads": getattr(args, "peer_threads", None),
        "urls": list(args.url), "n_prompts": len(prompts),
        "weights": args.weights, **EngineConfig.from_args(args).report(CACHE_FIELDS + DRAFTER_FIELDS),
        "draft_dtype_used": None if args.url else
        str(resolve_draft_dtype(args.spec_draft_dtype, resolve_device(args.device))).removeprefix("torch."),
    }


def _title(args) -> str:
    model = args.model or "SmolLM2-135M-Instruct Q4_1 (default)"
    if args.weights != "fp32":
        model += f", {args.weights} weights"
    if args.cache_type_k or args.cache_type_v:
        model += f", KV cache {args.cache_type_k or 'f32'}/{args.cache_type_v or 'f32'}"
    return f"flashdraft bench: {model}, {args.prompts}" if not args.url else f"flashdraft bench: {', '.join(args.url)}"
