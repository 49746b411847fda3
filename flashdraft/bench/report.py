"""The benchmark's outputs: Markdown tables (stdout) and the JSON document (``--json-out``).

JSON schema ``flashdraft.bench/1`` (all times in ms, speeds in tokens/s):

- ``schema``, ``created`` (UTC ISO time), ``command`` (argv)
- ``machine``: ``platform``, ``cpu``, ``cpu_count``, ``cpus_usable``, ``memory_gb``,
  ``torch_threads``, ``python``
- ``versions``: ``flashdraft``, ``torch``, ``transformers``, ``llama_cpp_python`` (None if not
  installed), ``numpy``; ``git``: ``commit``, ``branch`` (None outside a checkout)
- ``settings``: what was asked (prompt sets, temperatures, repeats, max tokens, model, ...)
- ``baseline``: the configuration speedups and equality refer to
- ``configs``: ``[{name, kind, description, available, reason}]``
- ``prompts``: ``[{prompt_set, id, prompt_tokens, max_tokens, schema}]`` (``schema``: the
  JSON schema the answer is held to, or None)
- ``runs``: one per generation: ``config, prompt_set, prompt_id, temperature, repeat,
  prompt_tokens, completion_tokens, ttft_ms, total_ms, decode_ms, decode_tokens,
  decode_tokens_per_s, decode_source, finish_reason, spec{...} | None, same_as_baseline,
  error, constrained, schema_violation, grammar``; ``grammar`` (constrained runs of our
  engine, else None): ``ms``/``calls`` per constraint method, ``setup_ms``, ``total_ms``,
  ``ms_per_token``, ``by_role`` (``verify``/``draft``/``advance`` ms)
- ``summary`` / ``per_prompt``: see :func:`flashdraft.bench.stats.aggregate` (constraint
  numbers: :func:`flashdraft.bench.stats._grammar_summary`)
- ``skipped``: ``[{config, prompt_sets, reason}]``, configurations that cannot take a
  constraint and skipped the constrained sets
- ``outputs``: first repeat's text per (config, prompt set, temperature, prompt)
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

from flashdraft.bench.contender import Contender, Unavailable
from flashdraft.bench.stats import RunRecord, same_output

SCHEMA = "flashdraft.bench/1"
#: columns of per-position acceptance shown in the table (the JSON keeps all)
SHOWN_POSITIONS = 8


# ---------------------------------------------------------------- machine and versions


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine_info() -> dict:
    import torch
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
            "cpus_usable": usable, "memory_gb": _memory_gb(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version()}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    import flashdraft
    return {"flashdraft": flashdraft.__version__, "torch": _version("torch"),
            "transformers": _version("transformers"), "llama_cpp_python": _version("llama_cpp_python"),
            "numpy": _version("numpy")}


def git_info(start: Path | None = None) -> dict:
    """Commit and branch of the checkout holding this package, read from ``.git`` files.

    Reads ``HEAD``, the loose ref and ``packed-refs``; never runs git. Returns Nones outside a
    checkout.
    """
    here = (start or Path(__file__)).resolve()
    for d in [here, *here.parents]:
        git = d / ".git"
        if git.is_dir():
            break
    else:
        return {"commit": None, "branch": None}
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return {"commit": head, "branch": None}
        ref = head[4:].strip()
        branch = ref.removeprefix("refs/heads/")
        loose = git / ref
        if loose.exists():
            return {"commit": loose.read_text().strip(), "branch": branch}
        packed = git / "packed-refs"
        if packed.exists():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return {"commit": line.split()[0], "branch": branch}
        return {"commit": None, "branch": branch}
    except OSError:
        return {"commit": None, "branch": None}


# ---------------------------------------------------------------- JSON


def _grammar_dict(g) -> dict | None:
    cost = g.grammar
    if cost is None:
        return None
    return {"ms": cost.ms, "calls": cost.calls, "setup_ms": cost.setup_ms, "total_ms": cost.total_ms,
            "ms_per_token": cost.total_ms / g.completion_tokens if g.completion_tokens else None,
            "by_role": cost.by_role()}


def run_to_dict(r: RunRecord, baseline: RunRecord | None) -> dict:
    g = r.generation
    d = {"config": r.config, "prompt_set": r.prompt_set, "prompt_id": r.prompt_id, "temperature": r.temperature,
         "repeat": r.repeat, "error": r.error, "constrained": r.constrained, "schema_violation": r.violation}
    if g is None:
        return d
    d.update(prompt_tokens=g.prompt_tokens, completion_tokens=g.completion_tokens, ttft_ms=g.ttft_ms,
             total_ms=g.total_ms, decode_ms=g.decode_ms, decode_tokens=g.decode_tokens,
             decode_tokens_per_s=g.decode_tokens_per_s, decode_source=g.decode_source,
             finish_reason=g.finish_reason, cached_tokens=g.cached_tokens,
             spec=None if g.spec is None else {**asdict(g.spec), "acceptance_length": g.spec.tau()},
             same_as_baseline=None, grammar=_grammar_dict(g))
    if r.temperature == 0 and baseline is not None and baseline.ok and baseline is not r:
        d["same_as_baseline"] = same_output(g, baseline.generation)
    return d


def build_document(*, argv: list[str], settings: dict, baseline: str | None,
                   contenders: list[Contender | Unavailable], prompts: list[dict], records: list[RunRecord],
                   summary: list[dict], per_prompt: list[dict], skipped: list[dict] | None = None) -> dict:
    """The ``--json-out`` document (schema in the module docstring)."""
    base = {(r.prompt_set, r.prompt_id, r.temperature, r.repeat): r for r in records if r.config == baseline}
    outputs = [{"config": r.config, "prompt_set": r.prompt_set, "temperature": r.temperature,
                "prompt_id": r.prompt_id, "text": r.generation.text}
               for r in records if r.ok and r.repeat == 0]
    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": argv,
        "machine": machine_info(),
        "versions": versions(),
        "git": git_info(),
        "settings": settings,
        "baseline": baseline,
        "configs": [config_entry(c) for c in contenders],
        "prompts": prompts,
        "runs": [run_to_dict(r, base.get((r.prompt_set, r.prompt_id, r.temperature, r.repeat))) for r in records],
        "summary": summary,
        "per_prompt": per_prompt,
        "skipped": skipped or [],
        "outputs": outputs,
    }


def config_entry(c: Contender | Unavailable) -> dict:
    if isinstance(c, Unavailable):
        return {"name": c.name, "kind": c.kind, "description": None, "available": False, "reason": c.reason}
    return {"name": c.name, "kind": c.kind, "description": c.description, "available": True, "reason": None}


def write_json(doc: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n")


# ---------------------------------------------------------------- Markdown


def _num(x, fmt: str = ".1f") -> str:
    return "–" if x is None else format(x, fmt)


def _spread(s: dict | None, fmt: str = ".1f") -> str:
    if s is None:
        return "–"
    if s["n"] == 1 or s["min"] == s["max"]:
        return format(s["median"], fmt)
    return f"{format(s['median'], fmt)} [{format(s['min'], fmt)}–{format(s['max'], fmt)}]"


def _same(e: dict | None) -> str:
    if e is None:
        return "–"
    if e["equal"] == e["compared"]:
        return "yes"
    return "no" if e["equal"] == 0 else f"{e['equal']}/{e['compared']}"


def _positions(p: list | None) -> str:
    if not p:
        return "–"
    return " ".join("–" if v is None else f"{100 * v:.0f}" for v in p[:SHOWN_POSITIONS])


SUMMARY_HEADER = ("config", "prompt tok", "completion tok", "decode tok/s", "speedup", "TTFT ms", "τ",
                  "drafted", "accepted", "accept %", f"per-position accept % (1..{SHOWN_POSITIONS})",
                  "same as baseline", "same as own plain", "draft ms / drafted", "draft ms / token")


def summary_header(rows: list[dict]) -> tuple[str, ...]:
    """:data:`SUMMARY_HEADER` with the per-position column naming the positions its rows show
    (``1..7`` for a block-8 drafter, at most :data:`SHOWN_POSITIONS`)."""
    shown = min(SHOWN_POSITIONS, max((len(r.get("per_position_acceptance") or []) for r in rows), default=0))
    column = f"per-position accept % (1..{shown})" if shown else "per-position accept %"
    return SUMMARY_HEADER[:10] + (column,) + SUMMARY_HEADER[11:]  # keeps "same as own plain"


def _row(s: dict, first: str) -> list[str]:
    rate = None if s["acceptance_rate"] is None else 100 * s["acceptance_rate"]
    return [first, str(s["prompt_tokens"]), _num(s["completion_tokens"], "d"), _spread(s["decode_tokens_per_s"]),
            _spread(s["speedup"], ".2f"), _spread(s["ttft_ms"], ".0f"), _num(s["acceptance_length"], ".2f"),
            _num(s["draft_n"], ".0f"), _num(s["draft_n_accepted"], ".0f"), _num(rate, ".0f"),
            _positions(s["per_position_acceptance"]), _same(s["same_as_baseline"]), _same(s.get("same_as_own_plain")),
            _num(s.get("draft_ms_per_drafted"), ".2f"), _num(s.get("draft_ms_per_token"), ".2f")]


GRAMMAR_HEADER = ("config", "decode tok/s", "speedup", "τ", "mask ms/token", "mask % of time",
                  "verify / draft / advance ms/token", "schema violations")


def _grammar_row(s: dict, first: str) -> list[str]:
    roles = s["grammar_ms_per_token_by_role"]
    split = "–" if roles is None else " / ".join(f"{roles[k]:.3f}" for k in ("verify", "draft", "advance"))
    share = s["grammar_share"]
    share = None if share is None else {**share, **{k: 100 * share[k] for k in ("median", "min", "max")}}
    return [first, _spread(s["decode_tokens_per_s"]), _spread(s["speedup"], ".2f"), _num(s["acceptance_length"], ".2f"),
            _spread(s["grammar_ms_per_token"], ".3f"), _spread(share, ".1f"), split,
            f"{s['schema_violations']} of {s['runs'] - s['errors']}"]


def _table(header, rows) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def markdown(summary: list[dict], per_prompt: list[dict], contenders: list[Contender | Unavailable],
             baseline: str | None, repeats: int, show_per_prompt: bool, skipped: list[dict] | None = None) -> str:
    """The report printed on stdout: one summary table per (prompt set, temperature), for
    a constrained set a second one with the grammar's cost and the schema violations,
    optionally one per-prompt table each, then the configurations that did not run
    (``skipped``: those that skipped the constrained sets, see ``build_document``)."""
    out = [f"Decode tok/s: median [min–max] over {repeats} pass(es); speedup vs `{baseline}` paired per pass; "
           "token counts per pass; drafted/accepted per pass.", ""]
    groups: dict[tuple, list[dict]] = {}
    for s in summary:
        groups.setdefault((s["prompt_set"], s["temperature"]), []).append(s)
    # a configuration that could not run is still a row of every table, with its reason
    missing_rows = [[f"{c.name}: not run ({c.reason})"] + ["–"] * (len(SUMMARY_HEADER) - 1)
                    for c in contenders if isinstance(c, Unavailable)]
    for (pset, temp), rows in groups.items():
        out += [f"### {pset}, temperature {temp:g}", ""]
        out += _table(summary_header(rows), [_row(s, s["config"]) for s in rows] + missing_rows)
        errors = [f"{s['config']}: {s['errors']} of {s['runs']} runs failed" for s in rows if s["errors"]]
        out += [""] + [f"- {e}" for e in errors] + ([""] if errors else [])
        held = [s for s in rows if s["constrained"]]
        if held:
            out += ["Under the JSON schema: mask = time inside the grammar constraint per generated token "
                    "(median [min–max] over passes); violations = answers that do not parse or break "
                    "their schema, all passes.", ""]
            out += _table(GRAMMAR_HEADER, [_grammar_row(s, s["config"]) for s in held]) + [""]
        if show_per_prompt:
            mine = [p for p in per_prompt if p["prompt_set"] == pset and p["temperature"] == temp]
            header = ("prompt / config",) + summary_header(mine)[1:]
            out += _table(header, [_row(p, f"{p['prompt_id']} / {p['config']}") for p in mine]) + [""]
    ran = [c for c in contenders if not isinstance(c, Unavailable)]
    out += ["Configurations:", ""] + [f"- `{c.name}`: {c.description}" for c in ran] + [""]
    missing = [c for c in contenders if isinstance(c, Unavailable)]
    if missing:
        out += ["Not run:", ""] + [f"- `{c.name}`: {c.reason}" for c in missing] + [""]
    if skipped:
        out += ["Not run on constrained sets:", ""]
        out += [f"- `{k['config']}` on {', '.join(k['prompt_sets'])}: {k['reason']}" for k in skipped] + [""]
    return "\n".join(out)


def print_markdown(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
