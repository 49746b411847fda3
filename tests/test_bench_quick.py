"""``flashdraft bench --quick``: its preset fills only the flags the user left at their defaults."""

from __future__ import annotations

import argparse

from flashdraft.bench.runner import QUICK, add_arguments, apply_quick


def parsed(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(list(argv))
    apply_quick(args)
    return args


def test_quick_sets_its_preset():
    args = parsed("--quick")
    assert {k: getattr(args, k) for k in QUICK} == QUICK
    assert args.repeats == 1 and "default" in args.configs.split(",")


def test_flags_given_beside_quick_win():
    args = parsed("--quick", "--repeats", "2", "--configs", "none,ngram-cost", "-n", "64")
    assert (args.repeats, args.configs, args.max_tokens, args.warmup_tokens) == (2, "none,ngram-cost", 64, QUICK["warmup_tokens"])


def test_without_quick_nothing_changes():
    args = parsed()
    assert (args.repeats, args.configs, args.max_tokens) == (3, None, None)
