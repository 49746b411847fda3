"""``flashdraft serve``: llama-server's flags, then uvicorn with the model loading behind it.

The main CLI calls :func:`add_arguments` on its ``serve`` sub-parser and :func:`run` with
the parsed namespace; ``python -m flashdraft.server.cli ...`` does the same on its own.

Every llama-server flag is accepted (:mod:`.llama_flags`): the ones this engine implements
are defined here; those that mean nothing here (GPU layers, batch sizes, memory mapping...)
are listed once in the log; those that would change the answers (LoRA, extra samplers) stop
the start with a message naming them, unless given their neutral value. So the seed guide's
llama-server command lines start this server with only the model paths changed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from flashdraft.adaptive import CONTROLLERS
from flashdraft.argtypes import non_negative_int, positive_int
from flashdraft.device import add_device_argument
from flashdraft.engine import SPEC_TYPES, EngineConfig, resolve_ctx_size
from flashdraft.flags import (WEIGHTS_CHOICES, WEIGHTS_HELP, HelpFormatter, add_backend_argument, add_cache_arguments,
                              add_drafter_arguments, add_suffix_arguments, add_synth_arguments)
from flashdraft.server import limits, llama_flags

log = logging.getLogger("flashdraft.server")

REASONING = ("on", "off", "auto")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``flashdraft serve``'s flags (llama-server names) to ``parser``."""
    m = parser.add_argument_group("model and drafter")
    m.add_argument("-m", "--model", default=None,
                   help="target model: GGUF file, Hugging Face directory or hub id "
                        "(default: the packaged SmolLM2-135M-Instruct Q4_1)")
    m.add_argument("-md", "--spec-draft-model", "--model-draft", dest="spec_draft_model", default=None,
                   help="drafter: DFlash SpecForge dir or GGUF, 'random[:LAYERS]', or for --spec-type draft "
                        "a small causal LM ('target' = the target itself)")
    m.add_argument("--spec-type", type=spec_type_arg, default=None, metavar="|".join(SPEC_TYPES),
                   help="drafting method (default: dflash with -md, else none, like llama-server without a draft "
                        "model; dflash/hybrid without -md use the shipped drafter of the packaged model)")
    m.add_argument("--spec-draft-n-max", "--draft-max", "--draft", "--draft-n", dest="spec_draft_n_max",
                   type=positive_int, default=16, help="draft tokens per step (default: 16)")
    m.add_argument("--spec-dm-controller", choices=CONTROLLERS, default="profit",
                   help="draft length: cost = the depth with the most expected tokens per ms by the cost of a "
                        "k-row verify measured at load, each draft cut where the drafter's own confidence "
                        "stops paying; profit = the same by online step times only; both turn drafting off "
                        "when it does not pay; off = always --spec-draft-n-max (default: profit)")
    m.add_argument("--spec-dflash-cross-ctx", type=positive_int, default=None, metavar="N",
                   help="the DFlash drafter attends to at most the N most recent target positions")
    add_drafter_arguments(m)
    add_synth_arguments(m)
    add_suffix_arguments(m)
    m.add_argument("-c", "--ctx-size", type=non_negative_int, default=0,
                   help="context size in tokens, prompt + output, split across the -np slots; 0 = the model's "
                        "training context, read from its GGUF or config.json, as llama-server (default: 0; "
                        "SmolLM2: 8192)")
    m.add_argument("--weights", choices=WEIGHTS_CHOICES, default="fp32", help=WEIGHTS_HELP)
    m.add_argument("-a", "--alias", default=None,
                   help="model names, comma-separated: /v1/models lists them (its id is the first in sorted "
                        "order, as llama-server); responses name that id")
    m.add_argument("--tags", default="", help="model tags, comma-separated, listed by /v1/models (informational)")
    m.add_argument("--jinja", dest="jinja", action="store_true", default=True,
                   help="chat prompts through the model's Jinja template (default; run with transformers)")
    m.add_argument("--no-jinja", dest="jinja", action="store_false",
                   help="chat prompts through the built-in template of the model's format (chatml, llama3, "
                        "gemma, zephyr; detected from its Jinja template)")
    m.add_argument("--chat-template", default=None, metavar="NAME|JINJA",
                   help="a built-in template name (chatml, llama3, gemma, zephyr) or a Jinja template")
    m.add_argument("--chat-template-file", default=None, metavar="FILE", help="a Jinja chat template file")
    m.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="extra chat template variables for every request, a JSON object")
    m.add_argument("--reasoning", choices=REASONING, default="auto",
                   help="pass enable_thinking=true/false to the chat template (default: auto = leave it)")
    m.add_argument("-t", "--threads", type=positive_int, default=None, help="CPU threads for the target and drafter (default: 1 on machines with up to 2 cores, else cores - 1; printed at startup, docs/performance.md)")
    add_device_argument(m)
    add_backend_argument(m)

    add_cache_arguments(parser.add_argument_group("KV cache"))

    s = parser.add_argument_group("sampling defaults (request fields override them)")
    s.add_argument("--temp", "--temperature", dest="temp", type=float, default=0.8,
                   help="temperature, 0 = greedy (default: 0.8, as llama-server)")
    s.add_argument("--top-k", type=int, default=40, help="top-k, 0 = off (default: 40)")
    s.add_argument("--top-p", type=float, default=0.95, help="top-p, 1.0 = off (default: 0.95)")
    s.add_argument("--min-p", type=float, default=0.05, help="min-p, 0.0 = off (default: 0.05)")
    s.add_argument("-s", "--seed", type=int, default=-1, help="sampling seed, -1 = random (default)")
    s.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=-1,
                   help="new tokens for requests that set no limit (a request's own limit wins), "
                        "-1 = until EOS or the context end (default)")

    h = parser.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1",
                   help="bind address, or several separated by commas (default: 127.0.0.1)")
    h.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    h.add_argument("-np", "--parallel", type=positive_int, default=1,
                   help="parallel slots: up to N requests decode together, their verify steps packed "
                        "into one target forward per step (more total tokens/s, each request a bit "
                        "slower); further requests wait for a free slot (default: 1)")
    h.add_argument("-b", "--batch-size", type=positive_int, default=256,
                   help="with -np > 1, most prompt tokens one packed step prefills for a slot: a longer "
                        "prompt is prefilled over several steps and the other slots keep answering in "
                        "between (llama-server's logical batch; its default is 2048, ours is smaller "
                        "because a CPU prefills ~250 tokens/s); with one slot, the chunk a stream with "
                        "return_progress reports after (default: 256)")
    h.add_argument("-ub", "--ubatch-size", type=positive_int, default=None,
                   help="llama backend: prompt rows per llama.cpp decode. The default (48) keeps every "
                        "row computed as a one-token step is, so a cached prompt answers as the same "
                        "prompt prefilled afresh; 512 (llama-server's default) prefills long prompts "
                        "1.3-3x faster and gives that up (drafting stays lossless either way)")
    h.add_argument("--metrics", action="store_true", help="expose Prometheus metrics at /metrics")
    h.add_argument("--api-key", default=os.environ.get("LLAMA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $LLAMA_API_KEY)")
    h.add_argument("--api-key-file", default=None, metavar="FILE", help="read the API key from the file's first line")
    h.add_argument("--slots", dest="slots", action="store_true", default=True, help="serve GET /slots (default)")
    h.add_argument("--no-slots", dest="slots", action="store_false", help="answer GET /slots with 501")
    h.add_argument("--ui", "--webui", dest="webui", action="store_true", default=True,
                   help="serve the chat page at / (default)")
    h.add_argument("--no-ui", "--no-webui", dest="webui", action="store_false", help="no chat page")
    h.add_argument("--cache-prompt", dest="cache_prompt", action="store_true", default=True,
                   help="requests reuse their slot's caches for the common prompt prefix unless they send "
                        "cache_prompt: false (default)")
    h.add_argument("--no-cache-prompt", dest="cache_prompt", action="store_false",
                   help="requests prefill their whole prompt unless they send cache_prompt: true")
    h.add_argument("-cram", "--cache-ram", type=int, default=8192, metavar="MiB",
                   help="host RAM for copies of earlier prompt caches (llama-server's): a request that would "
                        "overwrite most of a slot's cache saves it first, and a later request that matches a "
                        "saved prompt better starts from it, so an agent's side request does not cost its "
                        "conversation a full prefill, with one slot too; -1 = no limit, 0 = off (default: 8192)")
    h.add_argument("--context-shift", dest="context_shift", action="store_true", default=False,
                   help="when an answer fills its slot's context, drop the older half of what follows the "
                        "first --keep tokens and go on, as llama-server (llama backend only; the answer is "
                        "then no longer what one long context would give; drafting stays lossless)")
    h.add_argument("--no-context-shift", dest="context_shift", action="store_false",
                   help="end the answer at the context's end (default)")
    h.add_argument("-k", "--keep", type=int, default=0, metavar="N",
                   help="prompt tokens a context shift keeps (-1 = the whole prompt); a request's n_keep wins "
                        "(default: 0)")
    h.add_argument("--cors-origins", default="*",
                   help="allowed CORS origins, comma-separated (default: *); 'localhost' allows http(s) origins on "
                        "localhost, 127.0.0.1 and [::1] at any port")
    h.add_argument("--cors-methods", default="GET,POST,DELETE,OPTIONS",
                   help="allowed CORS methods (default: GET,POST,DELETE,OPTIONS)")
    h.add_argument("--cors-headers", default="*", help="allowed CORS request headers (default: *)")
    h.add_argument("--cors-credentials", dest="cors_credentials", action="store_true", default=True,
                   help="allow credentials (default: on, as llama-server; with --cors-origins * the Origin is echoed)")
    h.add_argument("--no-cors-credentials", dest="cors_credentials", action="store_false",
                   help="do not allow credentials on CORS requests")
    h.add_argument("--log-timestamps", action="store_true", help="prefix log lines with the time")
    h.add_argument("--log-prefix", action="store_true", help="prefix log lines with the level")
    h.add_argument("--sse-ping-interval", type=float, default=30.0, metavar="SECONDS",
                   help="a stream still prefilling after this long gets its headers and a keep-alive ping, "
                        "then one every interval (llama-server's flag; <= 0 or -1: off) (default: 30)")
    h.add_argument("-v", "--verbose", "--log-verbose", action="store_true", help="debug logging")
    h.add_argument("--log-disable", action="store_true",
                   help="log warnings and errors only (no request log)")
    h.add_argument("--log-file", default=None, metavar="FILE", help="also write the log to FILE")
    h.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="text lines, or one JSON object per line (request and generation records carry "
                        "their figures as fields)")
    h.add_argument("--dump-requests", default=None, metavar="DIR",
                   help="record every HTTP request (method, path, headers, JSON body, status, time, the answer) "
                        "as one JSON file in DIR, credentials scrubbed: to see what a client sends, or replay it "
                        "(default: off)")
    h.add_argument("--ignore-eos", action="store_true", help="requests keep generating past EOS by default")

    limits.add_arguments(parser.add_argument_group("limits (over one: a 4xx naming the flag; 503 queue_full for the queue)"))

    llama_flags.add_arguments(parser.add_argument_group("accepted for llama-server compatibility",
                                                        llama_flags.describe()))


#: llama.cpp's ``--spec-type`` names mapped to this engine's (a comma list mixes methods:
#: a DFlash drafter with an n-gram one is the hybrid)
LLAMA_SPEC_TYPES = {"draft-simple": "draft", "draft-dflash": "dflash", "ngram-simple": "ngram",
                    "ngram-map-k": "ngram", "ngram-map-k4v": "ngram", "ngram-mod": "ngram", "ngram-cache": "ngram"}


def spec_type_arg(text: str) -> str:
    """``--spec-type``: ours or llama.cpp's names, one or a comma list. Raises ArgumentTypeError."""
    kinds = {LLAMA_SPEC_TYPES.get(t.strip(), t.strip()) for t in text.split(",") if t.strip()}
    if len(kinds) > 1:
        kinds.discard("none")
    if kinds == {"dflash", "ngram"}:
        return "hybrid"
    if len(kinds) == 1 and (kind := next(iter(kinds))) in SPEC_TYPES:
        return kind
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a drafting method here: choose from {', '.join(SPEC_TYPES)} (or llama.cpp's "
        f"{', '.join(LLAMA_SPEC_TYPES)}; draft-dflash,ngram-* = hybrid)")


def ignored_flags(args: argparse.Namespace) -> list[str]:
    """The ignored llama-server flags that were given, as ``"-ngl all"`` strings."""
    return llama_flags.ignored(args)


def settings_from_args(args: argparse.Namespace):
    """:class:`ServerSettings` from parsed flags.

    Raises:
        ValueError: an unreadable ``--api-key-file`` or ``--chat-template-file``, or
            ``--chat-template-kwargs`` that is not a JSON object (an unusable
            ``--chat-template`` falls back to the model's own with a warning).
    """
    import json

    from flashdraft.engine import resolve_spec_type
    from flashdraft.server.chat_templates import resolve_template
    from flashdraft.server.state import CorsSettings, ServerSettings

    api_key = args.api_key or None
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                api_key = f.readline().strip() or None
        except OSError as e:
            raise ValueError(f"--api-key-file {args.api_key_file}: {e.strerror or e}") from None
    kwargs = {}
    if args.chat_template_kwargs:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"--chat-template-kwargs is not JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise ValueError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return ServerSettings(
        alias=args.alias, tags=_csv(args.tags), model_path=args.model,
        spec_type=resolve_spec_type(args.spec_type, args.model, args.spec_draft_model),
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        seed=None if args.seed < 0 else args.seed, n_predict=args.n_predict, metrics=args.metrics,
        api_key=api_key, reasoning=args.reasoning, n_parallel=args.parallel,
        batch_size=args.batch_size, webui=args.webui,
        slots_endpoint=args.slots, cache_prompt=args.cache_prompt, cache_ram_mib=args.cache_ram, ignore_eos=args.ignore_eos,
        n_keep=args.keep,
        chat_template=resolve_template(args.chat_template, args.chat_template_file, args.jinja),
        chat_template_kwargs=kwargs, verbose=args.verbose, sse_ping_interval=args.sse_ping_interval,
        limits=limits.from_args(args),
        cors=CorsSettings(_csv(args.cors_origins), _csv(args.cors_methods), _csv(args.cors_headers),
                          args.cors_credentials),
    )


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """:class:`EngineConfig` from parsed flags: ``-c`` is the whole context, split across the
    ``-np`` slots (llama-server: n_ctx per slot = c / np); ``-c 0`` is first set to the
    model's training context (:func:`flashdraft.targets.load.training_context`, logged)."""
    resolve_ctx_size(args)
    return EngineConfig.from_args(args, ctx_size=max(1, args.ctx_size // args.parallel), n_parallel=args.parallel)


def run(args: argparse.Namespace) -> int:
    """Start the server and block until it stops.

    Returns:
        0 after a normal shutdown, 1 if the model failed to load or the sampling
        defaults are invalid.
    """
    from flashdraft.server.request_log import setup_logging

    try:
        setup_logging(args.log_timestamps, args.log_prefix, args.verbose, args.log_disable, args.log_file,
                      args.log_format)
    except OSError as e:
        print(f"flashdraft serve: error: --log-file {args.log_file}: {e.strerror or e}", file=sys.stderr)
        return 1
    import torch
    import uvicorn

    from flashdraft.engine import load_engine
    from flashdraft.sampling import SamplingParams
    from flashdraft.server.app import create_app
    from flashdraft.threads import apply_threads, describe

    refused = llama_flags.refused(args)
    for message in refused:
        log.error("%s", message)
    if refused:
        return 1
    try:
        settings = settings_from_args(args)
    except ValueError as e:
        log.error("%s", e)
        return 1
    try:  # refuse bad defaults now rather than on every request
        SamplingParams(settings.temperature, settings.top_k, settings.top_p, settings.min_p, settings.seed)
    except ValueError as e:
        log.error("invalid sampling defaults: %s", e)
        return 1
    ignored = ignored_flags(args)
    if ignored:
        log.info("ignoring flags that mean nothing on this engine: %s", ", ".join(ignored))
    log.info("%s", describe(*apply_threads(args.threads)))

    cfg = engine_config_from_args(args)
    if args.parallel > 1:
        log.info("-np %d: up to %d requests decode together, %d context tokens each (-c %d split across them)",
                 args.parallel, args.parallel, args.ctx_size // args.parallel, args.ctx_size)
    try:  # bad flags are refused before the port is bound or the model loads
        cfg.validate()
    except ValueError as e:
        log.error("%s", e)
        return 1
    if cfg.spec_type == "none":
        log.info("mode: plain decoding, no drafting (pass -md PATH or --spec-type dflash|hybrid|ngram to draft)")
    else:
        log.info("mode: speculative decoding, --spec-type %s, drafter %s, up to %d draft tokens per step",
                 cfg.spec_type, cfg.draft_model or ("prompt lookup" if cfg.spec_type == "ngram" else "(shipped)"),
                 cfg.n_draft)
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def load():
        log.info("loading target %s with --spec-type %s, --weights %s, %d thread(s) ...",
                 cfg.model or "(packaged SmolLM2-135M-Instruct)", cfg.spec_type, cfg.weights, torch.get_num_threads())
        gen = load_engine(cfg)
        if args.context_shift:
            gen.enable_context_shift()
            log.info("context shift on: a full context drops half of what follows the first %s token(s) and "
                     "the answer goes on", "prompt" if args.keep < 0 else args.keep)
        return gen

    def on_load_failed(e: BaseException) -> None:
        failed.append(e)
        if server is not None:
            server.should_exit = True  # llama-server exits when the model does not load

    hosts = _csv(args.host) or ["127.0.0.1"]
    try:  # bind before loading: a taken port or a bad address fails at once
        sockets = [_bind(host, args.port) for host in hosts]
    except OSError as e:
        log.error("cannot listen on %s port %d: %s", args.host, args.port, e.strerror or e)
        return 1
    if args.dump_requests:
        try:  # a directory that cannot be made stops the start, not the first request
            os.makedirs(args.dump_requests, exist_ok=True)
        except OSError as e:
            log.error("--dump-requests %s: %s", args.dump_requests, e.strerror or e)
            return 1
        log.info("--dump-requests: recording every request in %s", args.dump_requests)
    app = create_app(load, settings, on_load_failed=on_load_failed, dump_requests=args.dump_requests)
    # log_config=None: uvicorn's lines go through our handlers (--log-file, --log-format) too
    config = uvicorn.Config(app, log_level="warning" if args.log_disable else "info", access_log=False,
                            timeout_graceful_shutdown=5, log_config=None)
    server = uvicorn.Server(config)
    _exit_cleanly_on_sigterm(server)
    for host in hosts:
        log.info("listening on http://%s:%d (model loads in the background; /health is 503 until ready)",
                 f"[{host}]" if ":" in host else host, args.port)
    server.run(sockets=sockets)
    return 1 if failed else 0


def _bind(host: str, port: int):
    """A listening TCP socket on ``host`` (IPv4 or IPv6 literal or name) and ``port``.

    Raises:
        OSError: the address is unknown, taken, or not on this machine.
    """
    import socket

    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # "127.0.0.1,::1": each socket serves its own family
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def _exit_cleanly_on_sigterm(server) -> None:
    """Make SIGTERM a normal stop (exit 0). uvicorn drains on SIGTERM, then raises the
    signal again under the handler that was there before it; with the default one the
    process would die by the signal (exit -15) after a clean drain."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda _sig, _frame: setattr(server, "should_exit", True))


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser with the ``serve`` flags (for ``python -m`` and tests)."""
    parser = argparse.ArgumentParser(prog="flashdraft serve", allow_abbrev=False, formatter_class=HelpFormatter,
                                     description="llama-server-compatible HTTP server with speculative decoding")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and :func:`run`."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
