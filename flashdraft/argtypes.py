"""argparse ``type=`` callables shared by every subcommand's parser.

Each raises :class:`argparse.ArgumentTypeError`, which argparse turns into exit code 2 and
``argument --flag: must be ...`` on stderr, so a bad value never reaches the code.
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An int >= 1. Raises ArgumentTypeError (and ValueError on non-numbers, which argparse reports too)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0 (0 usually means "no limit"). Raises ArgumentTypeError."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """A float > 0 (NaN is refused: ``not nan > 0``). Raises ArgumentTypeError."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
