"""Adaptive draft length: draft the depth that gives the most tokens per second.

The best draft depth is not a constant: it depends on the prompt (code is easier to draft
than prose), on the context length and on what a verify step costs on this machine (on
the 2-core CPU of DESIGN.md §5 verifying 16 tokens costs about two single steps, so a
drafter with τ ≈ 1.1 makes decoding *slower* than plain). beellama.cpp ships an adaptive
controller that can turn drafting off for this reason (issue 5); this module is our own
take on that idea, built on the expected-tokens-per-step model of speculative decoding
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", §3.3-3.4).

Glossary (units in brackets):

- depth ``d``: draft tokens asked for in one step, 0..``n_max``; ``d = 0`` is plain
  decoding (the verify step carries only the anchor).
- ``α_k``: conditional acceptance of draft position k (1-based): P(k accepted | positions
  1..k-1 accepted). Verification accepts a prefix, so position k is *tested* only when the
  positions before it were accepted; each position counts only its own tests.
- ``s_k = α_1 · … · α_k``: P(the first k drafts are all accepted), the issue's
  "P(k accepted)".
- ``E(d) = 1 + Σ_{k=1..d} s_k`` [tokens/step]: expected accepted drafts plus the bonus
  token. With a position-independent α this is Leviathan et al.'s (1 - α^(d+1)) / (1 - α);
  a block drafter's acceptance changes with the position, so each position has its own α_k.
- ``c(d)`` [s/step]: measured wall time of one step at depth d (draft + verify + rollback).
- ``v(d) = E(d) / c(d)`` [tokens/s]: the quantity maximised. ``v(0) = 1 / c(0)`` is plain
  decoding, so drafting turns off when no depth beats it.

Estimators (why each choice):

- ``α_k`` are exponentially weighted counts, shrunk towards ``α_{k-1}`` with
  ``prior_weight`` pseudo-tests. Old outcomes lose ``acceptance_decay`` of their weight
  per *step* elapsed, not per test (memory ≈ 1/0.02 = 50 steps): otherwise the estimate
  that turned drafting off (often a low, noisy one) would outvote every later probe for a
  long time. For positions k ≥ 2 the ageing also shows between tests, so a position past
  the standing depth (tested only by probes) drifts towards its neighbour's rate: an
  optimistic guess that makes the controller try one deeper now and then instead of
  staying on a stale low value. Position 1 holds its value between tests: while drafting
  is off, a probe, not the passing of time, decides to turn it back on.
- ``c(d)`` is a per-depth exponentially weighted mean, linearly interpolated between
  measured depths (and extended with the slope of the nearest segment). Not one affine
  fit ``a + b·d``: on CPU the verify cost is concave in d (DESIGN.md §5: 1 token 60 ms,
  4 tokens 86 ms, 16 tokens 115 ms), and a line through 4 and 16 predicts 76 ms for plain
  decoding, 27% too high, which would keep drafting on when it loses. The first step
  ever seen at a depth is not used: it may carry one-time work (kernel selection, a
  ``torch.compile`` recompilation for a new shape). A step slower than 4× the mean
  (another process, a GC pause) is clipped to 4× so one stall cannot move the estimate far.

Decisions:

- warm-up: the first ``WARMUP_STEPS`` (6) steps alternate ``n_max`` and 0, so both ends of
  the cost curve and every position's acceptance have data before the first decision.
- hysteresis: the standing depth changes only when another depth's ``v`` beats it by
  more than ``margin`` (relative), so two nearly equal depths do not flap.
- probes: every ``probe_every`` steps one step runs at another depth to refresh what the
  standing depth cannot measure. While drafting it alternates 0 (plain cost) and ``n_max``
  (tail acceptance and cost); while off it drafts ``off_probe_depth`` tokens, and the
  interval doubles after each probe that leaves drafting off (up to ``max_backoff`` ×),
  so a useless drafter costs almost nothing and a prompt that becomes easy is noticed.
  A new request may be different text (code after prose), so while drafting is off its
  first verify step probes at once (:meth:`start_request`).

Defaults come from a simulation (the CPU cost curve above plus 15 ms per draft; code-like,
prose-like, weak and useless acceptance profiles; 1,500 steps, 10 seeds): acceptance
decay 0.02, probes every 64 steps and back-off up to 4× reached on average 98.6% (code),
98.8% (prose: only depth 2 pays, +19%) and 99.2–99.4% (weak, useless drafter: plain
speed) of the best fixed depth, worst seed 95%; decay 0.03 or more was noisy enough to
turn drafting off on prose now and then (92%).

The controller only chooses how many tokens to draft; verification is unchanged, so the
output stays the target's (lossless). One instance per engine: estimates persist across
requests (a server learns its machine and its traffic); :meth:`reset` forgets them.
Not thread-safe: the engine's single worker owns it.
"""

from __future__ import annotations

import math

#: ``--spec-dm-controller`` values: ``cost`` = :class:`ProfitController` on the measured cost
#: table with per-draft cuts by the drafter's confidence, ``profit`` = the same controller on
#: online step times only, ``off`` = fixed depth
CONTROLLERS = ("cost", "profit", "off")


class ProfitController:
    """Chooses the draft depth maximising expected tokens per second (module docstring).

    Usage: :meth:`start_request` once per request, then once per verify step::

        d = controller.choose()                # depth to draft (0 = plain decoding)
        ...draft min(d, room) tokens, verify...
        controller.update(n_drafted, n_accepted, seconds)

    Args:
        n_max: deepest draft allowed (``--spec-draft-n-max`` capped by the drafter's block).
        margin: relative speed gain a new depth needs before the standing depth changes.
        probe_every: steps between probes [steps].
        max_backoff: while off, the probe interval grows up to ``probe_every * max_backoff``.
        off_probe_depth: depth of a probe while drafting is off (capped by ``n_max``).
        acceptance_decay: weight lost per step by older acceptance outcomes (memory ≈ 1/decay steps).
        cost_decay: same for step times (memory ≈ 1/decay steps at that depth).
        prior_acceptance: α_1 before any data.
        prior_weight: pseudo-tests of each position's prior (its neighbour's rate).
        verify_costs: ``[c_v(0), ..., c_v(n_max)]`` [s]: the measured cost of a target call of
            d + 1 rows (:meth:`flashdraft.costs.CostTable.verify_seconds`). With it the cost
            curve is that table plus what a step adds on top (drafter, loop), measured online
            as one offset for plain steps and one for drafted steps; no warm-up is needed for
            costs. Without it, costs are measured per depth and interpolated.

    Raises:
        ValueError: ``n_max < 1`` or a setting out of range.
    """

    name = "profit"
    #: warm-up steps: n_max, 0, n_max, 0, ... (two used step times at each end; see module docstring)
    WARMUP_STEPS = 6

    def __init__(self, n_max: int, *, margin: float = 0.03, probe_every: int = 64, max_backoff: int = 4,
                 off_probe_depth: int = 4, acceptance_decay: float = 0.02, cost_decay: float = 0.1,
                 prior_acceptance: float = 0.5, prior_weight: float = 1.0,
                 verify_costs: list[float] | None = None):
        if n_max < 1:
            raise ValueError(f"n_max must be >= 1, got {n_max}")
        if not (0 <= margin < 1 and probe_every >= 1 and max_backoff >= 1 and off_probe_depth >= 1
                and 0 < acceptance_decay < 1 and 0 < cost_decay < 1 and 0 <= prior_acceptance <= 1
                and prior_weight > 0):
            raise ValueError("controller setting out of range")
        self.n_max = n_max
        self.margin, self.probe_every, self.max_backoff = margin, probe_every, max_backoff
        self.off_probe_depth = min(off_probe_depth, n_max)
        self.acceptance_decay, self.cost_decay = acceptance_decay, cost_decay
        self.prior_acceptance, self.prior_weight = prior_acceptance, prior_weight
        if verify_costs is not None and len(verify_costs) < n_max + 1:
            raise ValueError(f"verify_costs needs {n_max + 1} entries (depths 0..{n_max}), got {len(verify_costs)}")
        self.verify_costs = None if verify_costs is None else list(verify_costs[: n_max + 1])
        #: with ``verify_costs``: how far past its cut a probe verifies a draft (None = the
        #: whole draft). A free draft (prompt lookup) is asked for its longest copy every step,
        #: so a whole-draft probe verifies up to n_max + 1 rows, ≈ 9 steps at 16 on Q4_1, and a
        #: failed one costs ~6% of a short answer; a few positions past the cut still test the
        #: confidence bins the cut stops at (engine.drafter_controller sets it for such drafters)
        self.probe_extra: int | None = None
        self.reset()

    def reset(self) -> None:
        """Forget every estimate; the next steps warm up again."""
        self.tested = [0.0] * self.n_max  # EW count of tests of position k+1
        self.passed = [0.0] * self.n_max  # EW count of acceptances of position k+1
        self._last_test = [0] * self.n_max  # step of the last test of position k+1
        self.cost_mean = [0.0] * (self.n_max + 1)  # [s] EW mean step time at depth d
        self.cost_n = [0] * (self.n_max + 1)  # step times used at depth d (first one skipped)
        self._seen = [False] * (self.n_max + 1)
        self.depth = self.n_max  # the standing choice (probes aside); fixed-depth behaviour until data
        self.steps = 0  # update() calls since reset
        self._since_probe = 0
        self._n_probes = 0
        self._backoff = 1
        self._probing = False
        self.overhead = [0.0, 0.0]  # [s] EW mean of (step time - verify_costs) at d = 0 and d >= 1
        self._overhead_n = [0, 0]
        self.calib_tested = [0.0] * self.CONF_BINS  # confidence calibration (cut())
        self.calib_passed = [0.0] * self.CONF_BINS
        self._conf: list[float] | None = None  # the confidences of the draft cut last
        self.cuts = 0  # steps whose draft cut() shortened
        self.predicted_tokens = 0.0  # Σ E(d) of the steps cut() chose, and their measured tokens
        self.measured_tokens = 0

    # ---- estimates ---------------------------------------------------------------------

    def acceptance(self) -> list[float]:
        """``[α_1, …, α_n_max]``: conditional acceptance per position (probabilities)."""
        out, prior, keep = [], self.prior_acceptance, 1.0 - self.acceptance_decay
        for k in range(self.n_max):
            # positions past the standing depth age towards the neighbour's rate (module
            # docstring); position 1 holds its value, so only a probe turns drafting back on
            f = 1.0 if k == 0 else keep ** (self.steps - self._last_test[k])
            a = (f * self.passed[k] + self.prior_weight * prior) / (f * self.tested[k] + self.prior_weight)
            out.append(a)
            prior = a
        return out

    def expected_tokens_curve(self) -> list[float]:
        """``[E(0), …, E(n_max)]`` with ``E(d) = 1 + Σ_{k≤d} s_k`` [tokens per step]."""
        out, s = [1.0], 1.0
        for a in self.acceptance():
            s *= a  # s_k = P(the first k drafts are all accepted)
            out.append(out[-1] + s)
        return out

    def expected_tokens(self, depth: int) -> float:
        """``E(depth)`` [tokens per step], ``depth`` in 0..n_max."""
        return self.expected_tokens_curve()[depth]

    def cost_curve(self) -> list[float] | None:
        """``[c(0), …, c(n_max)]`` [s per step]; None before any step time is known.

        Measured depths give their mean; the others are interpolated linearly between the
        nearest measured depths, or extended with the slope of the nearest segment (flat
        when only one depth is measured: optimistic, it invites exploring).
        """
        if self.verify_costs is not None:
            return [c + self.overhead[min(d, 1)] for d, c in enumerate(self.verify_costs)]
        known = [d for d in range(self.n_max + 1) if self.cost_n[d]]
        if not known:
            return None
        m = self.cost_mean
        if len(known) == 1:
            return [m[known[0]]] * (self.n_max + 1)
        out, seg = [], 0  # seg: index in ``known`` of the segment's left end
        for d in range(self.n_max + 1):
            while seg < len(known) - 2 and d > known[seg + 1]:
                seg += 1
            a, b = known[seg], known[seg + 1]
            out.append(m[d] if self.cost_n[d] else max(m[a] + (m[b] - m[a]) * (d - a) / (b - a), 1e-9))
        return out

    def cost(self, depth: int) -> float | None:
        """``c(depth)`` [s per step]; None before any step time is known."""
        curve = self.cost_curve()
        return None if curve is None else curve[depth]

    def speeds(self) -> list[float] | None:
        """``[v(0), …, v(n_max)]`` with ``v(d) = E(d) / c(d)`` [tokens/s]; None before any step time."""
        costs = self.cost_curve()
        if costs is None:
            return None
        return [e / c for e, c in zip(self.expected_tokens_curve(), costs)]

    @property
    def probing(self) -> bool:
        """True between a :meth:`choose` that returned a probe depth and its :meth:`update`."""
        return self._probing

    # ---- the calls of the loop ---------------------------------------------------------

    def start_request(self) -> None:
        """A new request begins: while drafting is off, its first step probes (one step's cost)."""
        if self.steps < self.WARMUP_STEPS:
            return
        self._decide()  # first, so a probe is forced only if drafting really is off
        if self.depth == 0:
            self._since_probe = max(self._since_probe, self.probe_every * self._backoff)

    def choose(self) -> int:
        """Depth to draft in the next step (0 = plain decoding). Deterministic given the state."""
        if self.steps < self.WARMUP_STEPS:
            return 0 if self.steps % 2 else self.n_max
        self._decide()
        probe = self._probe_depth()
        self._probing = probe is not None
        return self.depth if probe is None else probe

    def update(self, depth: int, n_accepted: int, seconds: float) -> None:
        """Record one step: ``depth`` tokens drafted, ``n_accepted`` accepted, ``seconds`` of wall time.

        ``depth`` is what was actually drafted (it may be less than :meth:`choose` said,
        near ``max_tokens`` or when a drafter finds nothing to propose).

        Raises:
            ValueError: counts out of range or a negative / non-finite time.
        """
        if not 0 <= n_accepted <= depth <= self.n_max:
            raise ValueError(f"need 0 <= n_accepted ({n_accepted}) <= depth ({depth}) <= n_max ({self.n_max})")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"step time must be a finite number of seconds >= 0, got {seconds!r}")
        # acceptance: positions 1..n_accepted passed; position n_accepted+1 (if drafted) failed
        keep = 1.0 - self.acceptance_decay
        for k in range(min(depth, n_accepted + 1)):
            # old evidence decays by the steps since this position was last tested, so the
            # first probe after a long time off is not outvoted by counts from long ago
            f = keep ** (self.steps - self._last_test[k])
            self.tested[k] = f * self.tested[k] + 1.0
            self.passed[k] = f * self.passed[k] + float(k < n_accepted)
            self._last_test[k] = self.steps
        if self._conf is not None:  # calibration: each tested position's confidence bin
            for k, c in enumerate(self._conf[: min(depth, n_accepted + 1)]):
                b = self._bin(c)
                self.calib_tested[b] = keep * self.calib_tested[b] + 1.0
                self.calib_passed[b] = keep * self.calib_passed[b] + float(k < n_accepted)
            self.measured_tokens += n_accepted + 1
            self._conf = None
        if self.verify_costs is not None and self._seen[depth]:  # what a step adds to the table
            i, extra = min(depth, 1), seconds - self.verify_costs[depth]
            n, mean = self._overhead_n[i], self.overhead[i]
            x = min(extra, 4.0 * abs(mean) + 1e-3) if n >= 3 else extra
            self.overhead[i] = mean + max(self.cost_decay, 1.0 / (n + 1)) * (x - mean)
            self._overhead_n[i] = n + 1
        # cost: skip the first step at a depth (one-time work), clip stalls, then EW mean
        if self._seen[depth]:
            n, mean = self.cost_n[depth], self.cost_mean[depth]
            x = min(seconds, 4.0 * mean) if n >= 3 else seconds
            self.cost_mean[depth] = mean + max(self.cost_decay, 1.0 / (n + 1)) * (x - mean)
            self.cost_n[depth] = n + 1
        self._seen[depth] = True
        self.steps += 1
        if self._probing:
            self._probing = False
            self._since_probe = 0
            self._n_probes += 1
            if self.depth == 0:  # still off after this probe: wait longer before the next
                self._backoff = min(2 * self._backoff, self.max_backoff)
        else:
            self._since_probe += 1

    #: confidence bins of the calibration (cut())
    CONF_BINS = 10
    #: pseudo-tests of each bin's prior (its own centre: a calibrated drafter)
    CONF_PRIOR_WEIGHT = 2.0

    def _bin(self, confidence: float) -> int:
        return min(self.CONF_BINS - 1, max(0, int(confidence * self.CONF_BINS)))

    def calibrated(self, confidence: float) -> float:
        """P(a draft token is accepted | the ones before it were, the drafter gave it
        ``confidence``): the measured acceptance of that confidence bin, shrunk towards the
        bin's centre (a calibrated drafter's rate) with :data:`CONF_PRIOR_WEIGHT` tests."""
        b = self._bin(confidence)
        prior = (b + 0.5) / self.CONF_BINS
        w = self.CONF_PRIOR_WEIGHT
        return (self.calib_passed[b] + w * prior) / (self.calib_tested[b] + w)

    def cut(self, confidence: list[float]) -> int:
        """How many of a draft's tokens to verify: the prefix length d maximising expected
        tokens per second, ``E(d) / c(d)``, with this draft's own acceptance chances
        (:meth:`calibrated` of the drafter's confidence per position) in ``E(d)``.

        The draft is already paid for, so every length is charged the drafted steps' online
        overhead. 0 means verify the anchor alone. Only with ``verify_costs`` (the ``cost``
        controller); without, the draft is kept whole.
        """
        if self.verify_costs is None:  # the ``profit`` controller: depth by position only
            return len(confidence)
        if not confidence:
            return 0
        if self._probing and self.probe_extra is None:  # a probe verifies the whole draft:
            self._conf = list(confidence)  # it refreshes bins a cut never tests
            return len(confidence)
        costs = self.cost_curve()
        sunk = self.overhead[1] - self.overhead[0]  # the draft's own cost, paid already
        best, best_v, e, s, curve = 0, 1.0 / (costs[0] + max(sunk, 0.0)), 1.0, 1.0, [1.0]
        for d, c in enumerate(confidence[: self.n_max], start=1):
            s *= self.calibrated(c)
            e += s
            curve.append(e)
            v = e / costs[d]
            if v > best_v:
                best, best_v = d, v
        if self._probing:  # a short probe: a few positions past the cut test the bins there
            best = min(len(confidence), best + self.probe_extra)
        if best < len(confidence):
            self.cuts += 1
        self._conf = list(confidence[:best])
        self.predicted_tokens += curve[best]
        return best

    # ---- decisions ---------------------------------------------------------------------

    def _decide(self) -> None:
        """Move the standing depth to the fastest one when it wins by more than ``margin``."""
        speeds = self.speeds()
        if speeds is None:
            return  # no step time yet: keep drafting at the standing depth
        best = max(range(self.n_max + 1), key=lambda d: speeds[d])  # ties: the smaller depth
        if speeds[best] > speeds[self.depth] * (1.0 + self.margin):
            if self.depth == 0:
                self._backoff = 1  # drafting pays again: probe at the normal rate
            self.depth = best

    def _probe_depth(self) -> int | None:
        """The probe depth when a probe is due, else None."""
        if self.depth == 0:
            due, probe = self._since_probe >= self.probe_every * self._backoff, self.off_probe_depth
        else:
            due = self._since_probe >= self.probe_every
            # alternate plain-decoding cost and the full depth (tail acceptance, cost)
            probe = 0 if self._n_probes % 2 == 0 or self.depth == self.n_max else self.n_max
        return probe if due else None

    def snapshot(self) -> dict:
        """Current estimates, for logs and docs: depth, α_k, E(d), c(d) [ms], v(d) [tokens/s]."""
        costs, speeds = self.cost_curve(), self.speeds()
        return {
            "depth": self.depth, "steps": self.steps,
            "acceptance": [round(a, 4) for a in self.acceptance()],
            "expected_tokens": [round(e, 4) for e in self.expected_tokens_curve()],
            "cost_ms": None if costs is None else [round(1e3 * c, 3) for c in costs],
            "tokens_per_second": None if speeds is None else [round(v, 3) for v in speeds],
            "overhead_ms": [round(1e3 * x, 3) for x in self.overhead] if self.verify_costs is not None else None,
            "calibration": [round(self.calibrated((b + 0.5) / self.CONF_BINS), 3) for b in range(self.CONF_BINS)],
            "cuts": self.cuts,
            "cut_tokens_predicted_vs_measured": [round(self.predicted_tokens, 1), self.measured_tokens],
        }


class SourcedController:
    """One :class:`ProfitController` per draft source, for drafters that mix sources.

    The hybrid drafter (:class:`~flashdraft.drafters.hybrid.HybridDrafter`) drafts from
    prompt lookup in one step and from DFlash in the next. One controller would pool their
    acceptance: DFlash failing at the start of an answer turned drafting off before prompt
    lookup had anything to copy, and it then stayed off (measured: hybrid-adaptive drafted
    48 tokens on the seed prompts where ngram-adaptive drafted 1,274). Here each source has
    its own acceptance and cost estimates (a prompt-lookup step has no drafter forward to pay
    for), and the step's source is known before its depth (:meth:`Drafter.next_source`).

    Usage: as a ProfitController, with :meth:`for_source` picking the one to ask::

        c = controller.for_source(drafter.next_source(tokens, controller.pick))
        d = c.choose(); ...; c.update(n_drafted, n_accepted, seconds)
    """

    name = "profit"

    def __init__(self, n_max: int, sources: tuple[str, ...], caps: dict[str, int] | None = None,
                 verify_costs: list[float] | None = None, **kw):
        if not sources:
            raise ValueError("SourcedController needs at least one source")
        self.n_max = n_max
        caps = caps or {}
        # a source that cannot draft past its own limit (a DFlash block) is controlled up to there only
        self.controllers = {}
        for s in sources:
            n = max(1, min(n_max, caps.get(s, n_max)))
            self.controllers[s] = ProfitController(n, verify_costs=None if verify_costs is None else verify_costs[: n + 1],
                                                   **kw)
        self._last = self.controllers[sources[0]]

    def pick(self, candidates: tuple[str, ...]) -> str:
        """The candidate source whose best depth gains most over plain decoding,
        ``max_d v(d) / v(0)`` by its own controller (each measures its own plain-step cost, so
        the ratio leaves out the noise between two cost estimates); one without step times
        yet is tried first."""
        best, best_gain = candidates[0], -1.0
        for source in candidates:
            speeds = self.controllers[source].speeds()
            if speeds is None:
                return source
            gain = max(speeds) / speeds[0]
            if gain > best_gain:
                best, best_gain = source, gain
        return best

    def for_source(self, source: str | None) -> ProfitController:
        """The controller of ``source`` (the first source's for None). Raises KeyError for an unknown one."""
        self._last = self.controllers[source] if source is not None else next(iter(self.controllers.values()))
        return self._last

    @property
    def depth(self) -> int:
        """Standing depth of the source asked last."""
        return self._last.depth

    @property
    def steps(self) -> int:
        return sum(c.steps for c in self.controllers.values())

    def reset(self) -> None:
        for c in self.controllers.values():
            c.reset()

    def start_request(self) -> None:
        for c in self.controllers.values():
            c.start_request()

    def choose(self) -> int:
        return self._last.choose()

    def update(self, depth: int, n_accepted: int, seconds: float) -> None:
        self._last.update(depth, n_accepted, seconds)

    def snapshot(self) -> dict:
        return {s: c.snapshot() for s, c in self.controllers.items()}


def make_controller(kind: str, n_max: int, sources: tuple[str, ...] = (),
                    caps: dict[str, int] | None = None,
                    verify_costs: list[float] | None = None) -> ProfitController | SourcedController | None:
    """The controller ``--spec-dm-controller kind`` asks for; None for ``off`` (fixed depth).

    Args:
        sources: the drafter's sources when it has several (the hybrid): one controller each.
        caps: per source, its longest draft when shorter than ``n_max`` (the hybrid's DFlash block).
        verify_costs: for ``cost``: ``[c(0), ..., c(n_max)]`` [s], a verify call of d + 1 rows
            (:meth:`flashdraft.costs.CostTable.verify_seconds`); ignored by ``profit``.
    Raises:
        ValueError: unknown ``kind``, or ``cost`` without ``verify_costs``.
    """
    if kind == "off":
        return None
    if kind in ("profit", "cost"):
        if kind == "cost" and verify_costs is None:
            raise ValueError("the cost controller needs the measured verify costs")
        vc = verify_costs if kind == "cost" else None
        return (SourcedController(n_max, sources, caps, verify_costs=vc) if len(sources) > 1
                else ProfitController(n_max, verify_costs=vc))
    raise ValueError(f"unknown --spec-dm-controller {kind!r}; choose from {', '.join(CONTROLLERS)}")
