"""``flashdraft`` command line: serve, generate, train, eval, bench, convert."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from flashdraft.adaptive import CONTROLLERS
from flashdraft.device import add_device_argument

#: subcommand -> module with ``add_arguments(parser)`` and ``run(args) -> int``
COMMANDS = {
    "serve": ("flashdraft.server.cli", "start the OpenAI/llama-server compatible HTTP server"),
    "generate": ("flashdraft.cli", "generate text once from a prompt"),
    "train": ("flashdraft.train.cli", "train a DFlash drafter for a target model"),
    "eval": ("flashdraft.train.evaluate", "measure a drafter's acceptance length on a prompt set"),
    "eval-kv": ("flashdraft.kv_eval", "measure KV cache types: memory, perplexity/KL, greedy agreement, τ, speed"),
    "convert": ("flashdraft.train.export", "convert a DFlash drafter between SpecForge and GGUF"),
    "bench": ("flashdraft.bench.runner", "benchmark baseline vs drafters vs peer engines"),
}


WEIGHTS_CHOICES = ("fp32", "bf16", "q4")
WEIGHTS_HELP = ("target weights (default: fp32); bf16 halves the bytes a decode step reads but is "
                "fast only on a CPU with AVX512-BF16 or AMX (slower than fp32 elsewhere); q4 runs a GGUF's "
                "Q4_0/Q4_1 projections on the int4 kernel, bf16 activations (docs/performance.md)")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Model-selection flags shared by generate/eval/bench (llama-server names), ``--device`` included."""
    p.add_argument("-m", "--model", default=None,
                   help="target model: .gguf file, HF directory or hub id (default: packaged SmolLM2-135M-Instruct)")
    p.add_argument("-md", "--spec-draft-model", default=None,
                   help="drafter: DFlash SpecForge dir/GGUF (or random[:LAYERS]); draft model path (or 'target')")
    p.add_argument("--spec-type", default=None, choices=["none", "dflash", "draft", "ngram", "suffix", "hybrid"],
                   help="drafting method (default: dflash with -md, else none; dflash/hybrid without -md "
                        "use the shipped drafter of the packaged model)")
    p.add_argument("--spec-draft-n-max", type=int, default=16, help="max draft tokens per step (default: 16)")
    p.add_argument("--spec-dm-controller", choices=CONTROLLERS, default="profit",
                   help="draft length: cost = the depth with the most expected tokens per ms by the cost of a "
                        "k-row verify measured at load, each draft cut where the drafter's own confidence "
                        "stops paying; profit = the same by online step times only; both turn drafting off "
                        "when it does not pay; off = always --spec-draft-n-max (default: profit)")
    p.add_argument("--spec-dflash-cross-ctx", type=int, default=None,
                   help="DFlash drafter attends to at most N recent positions")
    add_drafter_arguments(p)
    add_suffix_arguments(p)
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default: 4096)")
    p.add_argument("--weights", choices=WEIGHTS_CHOICES, default="fp32", help=WEIGHTS_HELP)
    add_backend_argument(p)
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads for the target and drafter (default: 1 on machines with up to 2 cores, else cores - 1; printed at startup, docs/performance.md)")
    add_device_argument(p)
    add_cache_arguments(p)


BACKEND_HELP = ("engine that runs the target: llama = llama.cpp's kernels (GGUF on the CPU), torch = the "
                "PyTorch reference (GPUs, --weights, compressed KV caches, training), auto = llama for a GGUF "
                "target on the CPU when llama.cpp is installed and passes its probe, else torch; the choice "
                "and why are printed at startup (default: auto)")


def add_drafter_arguments(p) -> None:
    """The drafter network's flags, shared by serve and generate/eval/bench (``p`` a parser or group)."""
    p.add_argument("--spec-draft-p-min", "--draft-p-min", dest="spec_draft_p_min", type=float, default=0.0,
                   metavar="P", help="cut each DFlash block before the first draft the drafter gives a probability "
                                     "below P (0 = never; default: 0)")
    p.add_argument("--spec-draft-dtype", choices=("auto", "f32", "bf16"), default="auto",
                   help="dtype the drafter network and its LM head run in: auto = bf16 on a CPU where a measured "
                        "bf16 matmul beats f32 (AVX512-BF16/AMX), else f32; output is the target's either way "
                        "(default: auto; the startup log says which)")


def drafter_fields(args) -> dict:
    """EngineConfig keyword arguments of the :func:`add_drafter_arguments` flags."""
    return dict(p_min=args.spec_draft_p_min, draft_dtype=args.spec_draft_dtype)


def add_suffix_arguments(p) -> None:
    """Flags of the suffix drafter and of the hybrid's lookup source (``p`` a parser or group)."""
    p.add_argument("--spec-lookup", choices=("ngram", "suffix"), default="ngram",
                   help="the hybrid's lookup source: ngram = prompt lookup, suffix = SuffixDecoding over the "
                        "prompt, the answer so far and the client's past answers (default: ngram)")
    p.add_argument("--spec-suffix-cache", type=int, default=256, metavar="N",
                   help="suffix drafter: past answers kept over all API keys, oldest dropped first; each key "
                        "drafts from its own answers only (0 = none; default: 256)")
    p.add_argument("--spec-suffix-factor", type=float, default=4.0, metavar="F",
                   help="suffix drafter: at most F draft tokens per matched token (default: 4.0)")
    p.add_argument("--spec-suffix-min-prob", type=float, default=0.1, metavar="P",
                   help="suffix drafter: stop a draft where its estimated probability falls below P (default: 0.1)")


def suffix_fields(args) -> dict:
    """EngineConfig keyword arguments of the :func:`add_suffix_arguments` flags."""
    return dict(lookup=args.spec_lookup, suffix_cache=args.spec_suffix_cache, suffix_factor=args.spec_suffix_factor,
                suffix_min_prob=args.spec_suffix_min_prob)


def add_backend_argument(p) -> None:
    """``--backend auto|torch|llama`` (``p`` a parser or argument group)."""
    p.add_argument("--backend", choices=("auto", "torch", "llama"), default="auto", help=BACKEND_HELP)


def add_cache_arguments(p) -> None:
    """KV cache flags (llama.cpp names; ``p`` a parser or argument group)."""
    from flashdraft.kv_codecs import CACHE_TYPES

    kinds = ", ".join(CACHE_TYPES)
    p.add_argument("-ctk", "--cache-type-k", default=None, choices=CACHE_TYPES, metavar="TYPE",
                   help=f"target K cache type: {kinds} (default: f32 on the torch backend, f16 on llama, "
                        "as llama.cpp; docs/kv-cache.md)")
    p.add_argument("-ctv", "--cache-type-v", default=None, choices=CACHE_TYPES, metavar="TYPE",
                   help="target V cache type (default: as -ctk's)")
    p.add_argument("-ctkd", "--cache-type-k-draft", default="f32", choices=CACHE_TYPES, metavar="TYPE",
                   help="DFlash drafter context K cache type (default: f32)")
    p.add_argument("-ctvd", "--cache-type-v-draft", default="f32", choices=CACHE_TYPES, metavar="TYPE",
                   help="DFlash drafter context V cache type (default: f32)")
    p.add_argument("--kv-sink-tokens", type=int, default=0, metavar="N",
                   help="compressed caches keep the first N positions exact (default: 0)")
    p.add_argument("--kv-tail-tokens", type=int, default=0, metavar="N",
                   help="compressed caches keep each token's N most recent positions exact (default: 0)")


def cache_fields(args) -> dict:
    """EngineConfig keyword arguments of the :func:`add_cache_arguments` flags."""
    given = args.cache_type_k is not None or args.cache_type_v is not None
    return dict(cache_type_k=args.cache_type_k or "f32", cache_type_v=args.cache_type_v or "f32",
                cache_types_given=given,
                cache_type_k_draft=args.cache_type_k_draft, cache_type_v_draft=args.cache_type_v_draft,
                kv_sink_tokens=args.kv_sink_tokens, kv_tail_tokens=args.kv_tail_tokens)


def engine_config(args):
    from flashdraft.engine import EngineConfig
    from flashdraft.engine import resolve_spec_type
    return EngineConfig(model=args.model, spec_type=resolve_spec_type(args.spec_type, args.model, args.spec_draft_model),
                        draft_model=args.spec_draft_model,
                        n_draft=args.spec_draft_n_max, ctx_size=args.ctx_size, cross_ctx=args.spec_dflash_cross_ctx,
                        controller=args.spec_dm_controller, weights=args.weights,
                        device=getattr(args, "device", "auto"), backend=getattr(args, "backend", "auto"),
                        **(cache_fields(args) if hasattr(args, "cache_type_k") else {}),
                        **(suffix_fields(args) if hasattr(args, "spec_lookup") else {}),
                        **(drafter_fields(args) if hasattr(args, "spec_draft_dtype") else {}))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``flashdraft generate``."""
    add_model_arguments(p)
    p.add_argument("-p", "--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("-n", "--max-tokens", type=int, default=256, help="max tokens to generate (default: 256)")
    p.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="top-k at temperature > 0, 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p at temperature > 0, 1.0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p at temperature > 0, 0.0 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: None = random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, timings")


def run(args) -> int:
    """``flashdraft generate``: prints the text (or JSON with ``--json``)."""
    from flashdraft.engine import load_engine
    from flashdraft.generate import generate_text
    from flashdraft.sampling import SamplingParams
    from flashdraft.threads import apply_threads, describe

    logging.getLogger("flashdraft").info("%s", describe(*apply_threads(args.threads)))
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, seed=args.seed)
    gen = load_engine(engine_config(args))
    t = gen.target
    ids = t.chat_prompt_ids([{"role": "user", "content": args.prompt}]) if args.chat else t.encode(args.prompt)
    if args.json:
        text, token_ids, finish, timings = generate_text(gen, ids, args.max_tokens, params, stop=args.stop)
        print(json.dumps({"text": text, "token_ids": token_ids, "finish_reason": finish,
                          "timings": timings.to_dict(gen.drafting)}))
        return 0
    timings = None
    for step in gen.generate(ids, args.max_tokens, params, stop=args.stop):
        sys.stdout.write(step.text)
        sys.stdout.flush()
        timings = step.timings or timings
    d = timings.to_dict(gen.drafting)
    extra = f", draft {d['draft_n_accepted']}/{d['draft_n']} accepted, tau {d['acceptance_length']:.2f}, " \
        f"mean depth {d['draft_depth']:.1f}" if gen.drafting else ""
    print(f"\n\n[{d['predicted_n']} tokens, {d['predicted_per_second']:.1f} tokens/s{extra}]", file=sys.stderr)
    return 0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter that adds ``(default: X)`` only where the help text does
    not already say its default, and not to on/off switches (off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.nargs == 0:
            return text
        return super()._get_help_string(action)


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    """The ``flashdraft`` parser with every subcommand, and ``{command: module}``."""
    parser = argparse.ArgumentParser(prog="flashdraft", description="DFlash speculative decoding for local LLMs",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level of every command but serve (serve: -v, --log-disable, --log-format)")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module, help_text) in COMMANDS.items():
        try:
            modules[name] = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith("flashdraft"):
                raise
            continue  # command not available in this build
        modules[name].add_arguments(sub.add_parser(name, help=help_text, description=help_text,
                                                   formatter_class=HelpFormatter))
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":  # serve sets up its own (--log-file, --log-format, -v, --log-disable)
        logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return modules[args.command].run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"flashdraft {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
