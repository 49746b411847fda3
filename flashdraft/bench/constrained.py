"""Prompts whose answers are held to a JSON schema: the timed constraint our engine runs with.

The mask cost the bench reports is not estimated apart from the run: every call the
speculative loop and the drafters make on the request's
:class:`~flashdraft.constraints.Constraint` is timed while the run is being measured
(:class:`TimedConstraint`), and the sum is divided by the tokens generated.
"""

from __future__ import annotations

import time

from flashdraft.bench.measure import GRAMMAR_ROLES, GrammarCost
from flashdraft.constraints import Constraint, TokenizerInfo, compile_grammar


def schema_grammar(schema: dict) -> str:
    """The grammar of a JSON schema, compiled as the server compiles ``response_format``.

    Raises:
        flashdraft.constraints.GrammarError: the schema does not compile.
    """
    return compile_grammar("json_schema", schema)


def _timed(method: str):
    inner = getattr(Constraint, method)

    def call(self, *args, **kwargs):
        if self._inside:  # called from another timed method: already on the clock
            return inner(self, *args, **kwargs)
        self._inside = True
        t0 = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            self.cost.add(method, time.perf_counter() - t0)
            self._inside = False

    call.__name__, call.__doc__ = method, inner.__doc__
    return call


class TimedConstraint(Constraint):
    """A :class:`~flashdraft.constraints.Constraint` that times its own public calls.

    Behaves exactly as the plain constraint (same masks, same matcher); ``cost`` collects
    the time per method (:class:`~flashdraft.bench.measure.GrammarCost`) and ``cost.setup_ms``
    the matcher's construction.

    Args / Raises: as :class:`~flashdraft.constraints.Constraint`.
    """

    def __init__(self, info: TokenizerInfo, grammar: str):
        self.cost = GrammarCost()
        self._inside = False
        t0 = time.perf_counter()
        super().__init__(info, grammar)
        self.cost.setup_ms = 1e3 * (time.perf_counter() - t0)


for _method in GRAMMAR_ROLES:
    setattr(TimedConstraint, _method, _timed(_method))
