"""``flashdraft serve``: llama-server's flags, then uvicorn with the model loading behind it.

The main CLI calls :func:`add_arguments` on its ``serve`` sub-parser and :func:`run` with
the parsed namespace; ``python -m flashdraft.server.cli ...`` does the same on its own.

Flags that mean nothing on this engine (GPU layers, batch sizes, KV cache types, memory
mapping...) are accepted with their values, so the seed guide's llama-server command lines
start this server with only the model paths changed; they are listed once in the log.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from flashdraft.cli import add_cache_arguments

log = logging.getLogger("flashdraft.server")

#: llama-server flags accepted and ignored: (names, takes a value; ``"?"`` = optional value).
#: The first name is the one the log shows (the seed guide's spelling where it has one).
IGNORED_FLAGS: list[tuple[tuple[str, ...], bool | str]] = [
    (("-ngl", "--gpu-layers", "--n-gpu-layers"), True),
    (("--spec-draft-ngl", "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"), True),
    (("-b", "--batch-size"), True),
    (("-ub", "--ubatch-size"), True),
    (("--flash-attn", "-fa"), "?"),  # newer llama.cpp: on|off|auto; older: a bare switch
    (("--kv-unified", "-kvu"), False),
    (("--cache-ram", "-cram"), True),
    (("--no-mmap",), False),
    (("--mlock",), False),
    (("--no-host",), False),
    (("--cont-batching", "-cb"), False),
    (("--no-cont-batching", "-nocb"), False),
    (("--no-warmup",), False),
    (("--threads-batch", "-tb"), True),
    (("--ctx-size-draft", "-cd"), True),
    (("--spec-draft-n-min", "--draft-min", "--draft-n-min"), True),
    (("--device", "-dev"), True),
    (("--device-draft", "-devd"), True),
    (("--split-mode", "-sm"), True),
    (("--tensor-split", "-ts"), True),
    (("--main-gpu", "-mg"), True),
    (("--no-kv-offload", "-nkvo"), False),
    (("--numa",), True),
    (("--cache-reuse",), True),
    (("--slots",), False),
    (("--no-webui",), False),
    (("--log-colors",), "?"),
]

REASONING = ("on", "off", "auto")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``flashdraft serve``'s flags (llama-server names) to ``parser``."""
    from flashdraft.cli import WEIGHTS_CHOICES, WEIGHTS_HELP
    from flashdraft.engine import SPEC_TYPES

    m = parser.add_argument_group("model and drafter")
    m.add_argument("-m", "--model", default=None,
                   help="target model: GGUF file, Hugging Face directory or hub id "
                        "(default: the packaged SmolLM2-135M-Instruct Q4_1)")
    m.add_argument("-md", "--spec-draft-model", "--model-draft", dest="spec_draft_model", default=None,
                   help="drafter: DFlash SpecForge dir or GGUF, 'random[:LAYERS]', or for --spec-type draft "
                        "a small causal LM ('target' = the target itself)")
    m.add_argument("--spec-type", choices=SPEC_TYPES, default=None,
                   help="drafting method (default: dflash when a drafter is at hand - -md, or the shipped one for "
                        "the default model - else none, like llama-server without a draft model)")
    m.add_argument("--spec-draft-n-max", "--draft-max", "--draft", "--draft-n", dest="spec_draft_n_max",
                   type=_positive_int, default=16, help="draft tokens per step (default: 16)")
    m.add_argument("--spec-dm-controller", choices=("profit", "off"), default="profit",
                   help="draft length: profit = adaptive depth for the most tokens/s, drafting off when it "
                        "does not pay; off = always --spec-draft-n-max (default: profit)")
    m.add_argument("--spec-dflash-cross-ctx", type=_positive_int, default=None, metavar="N",
                   help="the DFlash drafter attends to at most the N most recent target positions")
    m.add_argument("-c", "--ctx-size", type=_positive_int, default=4096,
                   help="context size in tokens, prompt + output (default: 4096)")
    m.add_argument("--weights", choices=WEIGHTS_CHOICES, default="fp32", help=WEIGHTS_HELP)
    m.add_argument("-a", "--alias", default=None, help="model id reported by /v1/models and in responses")
    m.add_argument("--jinja", action="store_true",
                   help="use the model's Jinja chat template (always on: templates run with transformers)")
    m.add_argument("--reasoning", choices=REASONING, default="auto",
                   help="pass enable_thinking=true/false to the chat template (default: auto = leave it)")
    m.add_argument("-t", "--threads", type=_positive_int, default=None, help="torch CPU threads")

    add_cache_arguments(parser.add_argument_group("KV cache"))

    s = parser.add_argument_group("sampling defaults (request fields override them)")
    s.add_argument("--temp", "--temperature", dest="temp", type=float, default=0.8,
                   help="temperature, 0 = greedy (default: 0.8, as llama-server)")
    s.add_argument("--top-k", type=int, default=40, help="top-k, 0 = off (default: 40)")
    s.add_argument("--top-p", type=float, default=0.95, help="top-p, 1.0 = off (default: 0.95)")
    s.add_argument("--min-p", type=float, default=0.05, help="min-p, 0.0 = off (default: 0.05)")
    s.add_argument("-s", "--seed", type=int, default=-1, help="sampling seed, -1 = random (default)")
    s.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=-1,
                   help="cap on new tokens per request, -1 = none (default)")

    h = parser.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    h.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    h.add_argument("-np", "--parallel", type=_positive_int, default=1,
                   help="parallel slots: up to N requests decode together, their verify steps packed "
                        "into one target forward per step (more total tokens/s, each request a bit "
                        "slower); further requests wait for a free slot (default: 1)")
    h.add_argument("--metrics", action="store_true", help="expose Prometheus metrics at /metrics")
    h.add_argument("--api-key", default=os.environ.get("LLAMA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $LLAMA_API_KEY)")
    h.add_argument("--log-timestamps", action="store_true", help="prefix log lines with the time")
    h.add_argument("--log-prefix", action="store_true", help="prefix log lines with the level")

    ig = parser.add_argument_group("accepted for llama-server compatibility, ignored")
    for names, value in IGNORED_FLAGS:
        dest = _ignored_dest(names)
        if value is True:
            ig.add_argument(*names, dest=dest, default=None, metavar="V", help=argparse.SUPPRESS)
        elif value == "?":
            ig.add_argument(*names, dest=dest, nargs="?", const="", default=None, metavar="V",
                            help=argparse.SUPPRESS)
        else:
            ig.add_argument(*names, dest=dest, action="store_const", const="", default=None,
                            help=argparse.SUPPRESS)


def ignored_flags(args: argparse.Namespace) -> list[str]:
    """The ignored flags that were given, as ``"-ngl all"`` strings (first name of each)."""
    out = []
    for names, _ in IGNORED_FLAGS:
        value = getattr(args, _ignored_dest(names), None)
        if value is not None:
            out.append(f"{names[0]} {value}".strip())
    return out


def _ignored_dest(names: tuple[str, ...]) -> str:
    return "ignored_" + names[0].lstrip("-").replace("-", "_")


def settings_from_args(args: argparse.Namespace):
    """:class:`ServerSettings` from parsed flags."""
    from flashdraft.engine import resolve_spec_type
    from flashdraft.server.state import ServerSettings

    return ServerSettings(
        alias=args.alias, model_path=args.model,
        spec_type=resolve_spec_type(args.spec_type, args.model, args.spec_draft_model),
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        seed=None if args.seed < 0 else args.seed, n_predict=args.n_predict, metrics=args.metrics,
        api_key=args.api_key or None, reasoning=args.reasoning, n_parallel=args.parallel,
    )


def engine_config_from_args(args: argparse.Namespace):
    """:class:`EngineConfig` from parsed flags."""
    from flashdraft.cli import cache_fields
    from flashdraft.engine import EngineConfig

    from flashdraft.engine import resolve_spec_type

    return EngineConfig(model=args.model, spec_type=resolve_spec_type(args.spec_type, args.model, args.spec_draft_model),
                        draft_model=args.spec_draft_model,
                        n_draft=args.spec_draft_n_max, ctx_size=args.ctx_size, cross_ctx=args.spec_dflash_cross_ctx,
                        controller=args.spec_dm_controller, weights=args.weights, **cache_fields(args))


def run(args: argparse.Namespace) -> int:
    """Start the server and block until it stops.

    Returns:
        0 after a normal shutdown, 1 if the model failed to load or the sampling
        defaults are invalid.
    """
    _setup_logging(args.log_timestamps, args.log_prefix)
    import torch
    import uvicorn

    from flashdraft.engine import load_engine
    from flashdraft.sampling import SamplingParams
    from flashdraft.server.app import create_app

    settings = settings_from_args(args)
    try:  # refuse bad defaults now rather than on every request
        SamplingParams(settings.temperature, settings.top_k, settings.top_p, settings.min_p, settings.seed)
    except ValueError as e:
        log.error("invalid sampling defaults: %s", e)
        return 1
    ignored = ignored_flags(args)
    if ignored:
        log.info("ignoring flags that mean nothing on this engine: %s", ", ".join(ignored))
    if args.parallel > 1:
        log.info("-np %d: up to %d requests decode together", args.parallel, args.parallel)
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = engine_config_from_args(args)
    try:  # bad flags are refused before the port is bound or the model loads
        cfg.validate()
    except ValueError as e:
        log.error("%s", e)
        return 1
    if args.spec_type is None and cfg.spec_type == "none":
        log.info("no drafter for -m %s: plain decoding (pass -md PATH to draft with DFlash)", args.model)
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def load():
        log.info("loading target %s with --spec-type %s, --weights %s, %d thread(s) ...",
                 cfg.model or "(packaged SmolLM2-135M-Instruct)", cfg.spec_type, cfg.weights, torch.get_num_threads())
        return load_engine(cfg)

    def on_load_failed(e: BaseException) -> None:
        failed.append(e)
        if server is not None:
            server.should_exit = True  # llama-server exits when the model does not load

    app = create_app(load, settings, on_load_failed=on_load_failed)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    _exit_cleanly_on_sigterm(server)
    log.info("listening on http://%s:%d (model loads in the background; /health is 503 until ready)",
             args.host, args.port)
    server.run()
    return 1 if failed else 0


def _exit_cleanly_on_sigterm(server) -> None:
    """Make SIGTERM a normal stop (exit 0). uvicorn drains on SIGTERM, then raises the
    signal again under the handler that was there before it; with the default one the
    process would die by the signal (exit -15) after a clean drain."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda _sig, _frame: setattr(server, "should_exit", True))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _setup_logging(timestamps: bool, prefix: bool) -> None:
    fmt = ("%(asctime)s " if timestamps else "") + ("%(levelname).1s " if prefix else "") + "%(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser with the ``serve`` flags (for ``python -m`` and tests)."""
    parser = argparse.ArgumentParser(prog="flashdraft serve", allow_abbrev=False,
                                     description="llama-server-compatible HTTP server with speculative decoding")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and :func:`run`."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
