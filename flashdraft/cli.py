"""``flashdraft`` command line: serve, generate, train, eval, bench, convert."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from flashdraft.flags import HelpFormatter

#: subcommand -> module with ``add_arguments(parser)`` and ``run(args) -> int``
COMMANDS = {
    "serve": ("flashdraft.server.cli", "start the OpenAI/llama-server compatible HTTP server"),
    "generate": ("flashdraft.generate_cli", "generate text once from a prompt"),
    "train": ("flashdraft.train.cli", "train a DFlash drafter for a target model"),
    "eval": ("flashdraft.train.evaluate", "measure a drafter's acceptance length on a prompt set"),
    "eval-kv": ("flashdraft.kv_eval", "measure KV cache types: memory, perplexity/KL, greedy agreement, τ, speed"),
    "convert": ("flashdraft.train.export", "convert a DFlash drafter between SpecForge and GGUF"),
    "bench": ("flashdraft.bench.runner", "benchmark baseline vs drafters vs peer engines"),
}


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
