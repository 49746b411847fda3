"""From timed runs to the numbers in the report: medians, spreads, speedups, τ, equality.

A *pass* is one repeat of one configuration over a prompt set. Decode tokens/s of a pass is
``Σ decode_tokens / Σ decode_ms`` over its prompts (long answers weigh more, as in a
real session); the median and the min–max spread are over passes. Speedup is paired: each
pass is divided by the baseline's pass with the same repeat index (run right next to it),
so slow drift of the machine cancels; its median and spread are over those ratios.

Constrained runs (a prompt with a JSON schema) add the grammar's cost: milliseconds inside
the constraint per generated token, ``Σ grammar ms / Σ completion tokens`` per pass, and
the share of the run's wall time it took; and the answers that broke their schema.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from flashdraft.bench.measure import Generation, SpecCounts


@dataclass
class RunRecord:
    """One configuration on one prompt at one temperature in one repeat.

    ``constrained``: the answer was held to the prompt's JSON schema; ``violation``: why the
    answer does not parse or satisfy it (None when it does, or when unconstrained).
    """

    config: str
    prompt_set: str
    prompt_id: str
    temperature: float
    repeat: int
    generation: Generation | None = None
    error: str | None = None
    constrained: bool = False
    violation: str | None = None

    @property
    def ok(self) -> bool:
        return self.generation is not None


def spread(values: list[float]) -> dict | None:
    """``{"median", "min", "max", "n"}`` of ``values`` (None when empty)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def same_output(a: Generation, b: Generation) -> bool:
    """Token ids when both have them, else the text."""
    if a.token_ids is not None and b.token_ids is not None:
        return a.token_ids == b.token_ids
    return a.text == b.text


def merge_counts(counts: list[SpecCounts]) -> SpecCounts:
    """Sum counters of several generations (steps stay None if any is unknown)."""
    total = SpecCounts(steps=0, draft_ms=0.0)
    for c in counts:
        total.steps = None if total.steps is None or c.steps is None else total.steps + c.steps
        total.draft_ms = None if total.draft_ms is None or c.draft_ms is None else total.draft_ms + c.draft_ms
        total.draft_n += c.draft_n
        total.draft_n_accepted += c.draft_n_accepted
        for mine, theirs in ((total.accepted_per_position, c.accepted_per_position),
                             (total.drafted_per_position, c.drafted_per_position),
                             (total.accepted_hist, c.accepted_hist)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for k, v in enumerate(theirs):
                mine[k] += v
    return total


def _pass_speed(runs: list[RunRecord]) -> float | None:
    tokens = sum(r.generation.decode_tokens or 0 for r in runs if r.ok)
    ms = sum(r.generation.decode_ms or 0.0 for r in runs if r.ok)
    return 1e3 * tokens / ms if tokens and ms > 0 else None


def aggregate(runs: list[RunRecord], baseline_runs: list[RunRecord], is_baseline: bool,
              plain_runs: list[RunRecord] | None = None) -> dict:
    """Numbers for one group of runs (one configuration on a prompt set, or on one prompt).

    Args:
        runs: the group's runs, all repeats.
        baseline_runs: the baseline configuration's runs on the same prompts/temperature.
        is_baseline: this group *is* the baseline (equality is then checked against its
            own first repeat: a determinism check).
        plain_runs: a peer's own plain decoding on the same prompts (``OWN_PLAIN``), whose
            greedy output its drafting mode should reproduce; ``same_as_own_plain`` is None
            without them.
    """
    ok = [r for r in runs if r.ok]
    by_repeat, base_by_repeat = defaultdict(list), defaultdict(list)
    for r in runs:
        by_repeat[r.repeat].append(r)
    for r in baseline_runs:
        base_by_repeat[r.repeat].append(r)
    speeds = {rep: _pass_speed(rs) for rep, rs in by_repeat.items()}
    base_speeds = {rep: _pass_speed(rs) for rep, rs in base_by_repeat.items()}
    ratios = [speeds[rep] / base_speeds[rep] for rep in speeds
              if speeds[rep] and base_speeds.get(rep)]

    first_per_prompt = {}
    for r in sorted(ok, key=lambda r: r.repeat):
        first_per_prompt.setdefault(r.prompt_id, r)
    out = {
        "runs": len(runs),
        "errors": len(runs) - len(ok),
        "prompt_tokens": sum(r.generation.prompt_tokens for r in first_per_prompt.values()),
        "completion_tokens": _median_int([sum(r.generation.completion_tokens for r in rs if r.ok)
                                          for rs in by_repeat.values()]),
        "decode_tokens_per_s": spread(list(speeds.values())),
        "speedup": spread(ratios),
        "ttft_ms": spread([r.generation.ttft_ms for r in ok]),
        "decode_source": ok[0].generation.decode_source if ok else None,
    }
    out.update(_spec_summary(ok, len(by_repeat)))
    out.update(_grammar_summary(ok, by_repeat))
    out["same_as_baseline"] = _equality(ok, baseline_runs, is_baseline)
    out["same_as_own_plain"] = _equality(ok, plain_runs, False) if plain_runs else None
    return out


def _median_int(values: list[int]) -> int | None:
    return int(statistics.median(values)) if values else None


def _spec_summary(ok: list[RunRecord], n_repeats: int) -> dict:
    specs = [r for r in ok if r.generation.spec is not None]
    if not specs:
        return {"acceptance_length": None, "draft_n": None, "draft_n_accepted": None, "acceptance_rate": None,
                "per_position_acceptance": None, "accepted_hist": None, "draft_ms_per_drafted": None,
                "draft_ms_per_token": None}
    c = merge_counts([r.generation.spec for r in specs])
    tau = c.tau()
    if tau is None:  # a server that reports τ itself (flashdraft) or not at all (llama-server)
        reported = [r.generation.spec.acceptance_length for r in specs if r.generation.spec.acceptance_length]
        tau = statistics.mean(reported) if reported else None
    per_pass = max(n_repeats, 1)
    return {
        "acceptance_length": tau,
        "draft_n": c.draft_n / per_pass,
        "draft_n_accepted": c.draft_n_accepted / per_pass,
        "acceptance_rate": c.draft_n_accepted / c.draft_n if c.draft_n else None,
        "per_position_acceptance": [a / d if d else None
                                    for a, d in zip(c.accepted_per_position, c.drafted_per_position)] or None,
        "accepted_hist": c.accepted_hist or None,
        # the draft cost: ms per proposed draft token, and per generated token (what it adds to decoding)
        "draft_ms_per_drafted": c.draft_ms / c.draft_n if c.draft_ms is not None and c.draft_n else None,
        "draft_ms_per_token": (c.draft_ms / tokens if c.draft_ms is not None
                               and (tokens := sum(r.generation.completion_tokens for r in specs)) else None),
    }


def _grammar_summary(ok: list[RunRecord], by_repeat: dict[int, list[RunRecord]]) -> dict:
    """Constraint numbers of a group: all None when no run was constrained.

    ``grammar_ms_per_token`` / ``grammar_share``: spreads over passes of ms inside the
    grammar per generated token and of the fraction of wall time (prefill included) it took;
    ``grammar_ms_per_token_by_role``: the same ms per token split into verify masks, the
    drafting side and advancing the matcher, over all runs; ``schema_violations``: answers
    that do not parse or break their schema.
    """
    constrained = [r for r in ok if r.constrained]
    if not constrained:
        return {"constrained": False, "schema_violations": None, "grammar_ms_per_token": None,
                "grammar_share": None, "grammar_ms_per_token_by_role": None}
    per_tok, share = [], []
    for runs in by_repeat.values():
        timed = [r.generation for r in runs if r.ok and r.generation.grammar is not None]
        tokens = sum(g.completion_tokens for g in timed)
        wall = sum(g.total_ms for g in timed)
        ms = sum(g.grammar.total_ms for g in timed)
        if tokens:
            per_tok.append(ms / tokens)
        if wall > 0:
            share.append(ms / wall)
    timed = [r.generation for r in constrained if r.generation.grammar is not None]
    tokens = sum(g.completion_tokens for g in timed)
    roles = None
    if timed and tokens:
        roles = {role: 0.0 for role in ("verify", "draft", "advance")}
        for g in timed:
            for role, ms in g.grammar.by_role().items():
                roles[role] += ms / tokens
    return {"constrained": True, "schema_violations": sum(r.violation is not None for r in constrained),
            "grammar_ms_per_token": spread(per_tok), "grammar_share": spread(share),
            "grammar_ms_per_token_by_role": roles}


def _equality(ok: list[RunRecord], baseline_runs: list[RunRecord], is_baseline: bool) -> dict | None:
    """``{"equal", "compared"}`` at temperature 0; None when sampling (outputs may differ)."""
    if not ok or ok[0].temperature != 0:
        return None
    base = {(r.prompt_id, r.repeat): r for r in baseline_runs if r.ok}
    equal = compared = 0
    for r in ok:
        ref = base.get((r.prompt_id, 0 if is_baseline else r.repeat))
        if ref is None or (is_baseline and r.repeat == 0):
            continue
        compared += 1
        equal += same_output(r.generation, ref.generation)
    return {"equal": equal, "compared": compared} if compared else None


def summarize(records: list[RunRecord], configs: list[str], baseline: str | None) -> tuple[list[dict], list[dict]]:
    """Per (prompt set, temperature, configuration) and per prompt summaries.

    Returns ``(summary, per_prompt)``: lists of dicts with the keys of :func:`aggregate` plus
    ``prompt_set``, ``temperature``, ``config`` (and ``prompt_id`` in ``per_prompt``), in
    prompt-set, temperature and ``configs`` order.
    """
    groups: dict[tuple, list[RunRecord]] = defaultdict(list)
    order_sets, order_temps, order_prompts = [], [], defaultdict(list)
    for r in records:
        groups[(r.prompt_set, r.temperature, r.config)].append(r)
        for seq, item in ((order_sets, r.prompt_set), (order_temps, r.temperature),
                          (order_prompts[r.prompt_set], r.prompt_id)):
            if item not in seq:
                seq.append(item)
    from flashdraft.bench.contender import OWN_PLAIN

    summary, per_prompt = [], []
    for s in order_sets:
        for t in order_temps:
            base_all = groups.get((s, t, baseline), [])
            for c in configs:
                runs = groups.get((s, t, c))
                if not runs:
                    continue
                head, sep, tn = c.rpartition(" -t")  # a peer at --peer-threads N: its own plain at N
                own = (OWN_PLAIN.get(head) + sep + tn) if sep and OWN_PLAIN.get(head) else OWN_PLAIN.get(c)
                plain_all = groups.get((s, t, own), [])
                key = {"prompt_set": s, "temperature": t, "config": c}
                summary.append({**key, **aggregate(runs, base_all, c == baseline, plain_all)})
                for p in order_prompts[s]:
                    mine = [r for r in runs if r.prompt_id == p]
                    theirs = [r for r in base_all if r.prompt_id == p]
                    plain = [r for r in plain_all if r.prompt_id == p]
                    per_prompt.append({**key, "prompt_id": p, **aggregate(mine, theirs, c == baseline, plain)})
    return summary, per_prompt
