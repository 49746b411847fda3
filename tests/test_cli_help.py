"""Every flag of every ``flashdraft`` subcommand (and of ``python -m flashdraft.train.regen``)
has a help text that shows its default; ``train``'s default block size is the shipped
drafter's."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from flashdraft.cli import build_parser
from flashdraft.engine import DEFAULT_DRAFTER_DIR


def _parsers() -> dict[str, argparse.ArgumentParser]:
    from flashdraft.train import regen

    root, _ = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    out = {"flashdraft": root, **{f"flashdraft {name}": p for name, p in sub.choices.items()}}
    out["python -m flashdraft.train.regen"] = regen.build_arg_parser()
    return out


PARSERS = _parsers()


def _named_in_a_group(parser: argparse.ArgumentParser, option: str) -> bool:
    pattern = rf"(^|[\s,:]){re.escape(option)}([,.\s]|$)"
    return any(re.search(pattern, g.description or "") for g in parser._action_groups)


def _gaps(parser: argparse.ArgumentParser) -> list[str]:
    gaps = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        if action.help == argparse.SUPPRESS and _named_in_a_group(parser, action.option_strings[0]):
            continue  # hidden on purpose, named in its group's text (llama-server compatibility flags)
        if not action.help or action.help == argparse.SUPPRESS:
            gaps.append(f"{name}: no help text")
            continue
        text = parser._get_formatter()._expand_help(action)
        takes_value = action.nargs != 0
        if takes_value and action.option_strings and not action.required and action.default is not argparse.SUPPRESS \
                and "default" not in text:
            gaps.append(f"{name}: default not shown")
    return gaps


@pytest.mark.parametrize("name", PARSERS)
def test_every_flag_has_help_and_shows_its_default(name):
    parser = PARSERS[name]
    assert _gaps(parser) == []
    assert "the guide" not in parser.format_help()


def test_train_default_block_size_is_the_shipped_drafters():
    from flashdraft.train.loop import shipped_block_size

    shipped = json.loads((DEFAULT_DRAFTER_DIR / "config.json").read_text())["block_size"]
    assert shipped_block_size() == shipped  # what a new drafter gets without --block-size
    assert f"default: {shipped}, the shipped drafter's" in " ".join(PARSERS["flashdraft train"].format_help().split())


def test_serve_help_names_the_compatibility_flags():
    from flashdraft.server.cli import build_parser as serve_parser

    text = serve_parser().format_help()
    assert "-ngl" in text and "--lora" in text and "(default: 8080)" in text
