"""The report of ``scripts/agents_check.sh``: per agent, from the requests the server recorded
(``--dump-requests``, one JSON file each) and the agent's exit status.

    python scripts/agents_report.py OUT [AGENT ...]     # markdown on stdout
    python scripts/agents_report.py --keep DEST OUT [AGENT ...]   # copy a replay set to DEST/<agent>/

Per agent: connected (a generation request answered 2xx), requests by path, statuses, the
prompt tokens of each generation (the first prompt, the largest, the sum), cache reuse (the
tokens the prompt cache served, ``timings.cache_n``, over all prompt tokens), and time per
turn (a turn = one generation request: time to the first byte and to the end, median and max).
Figures come from each answer's ``timings`` (llama-server's fields) where it has them, else its
``usage``; nothing is measured twice.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path

GENERATION_PATHS = {"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completion", "/completions",
                    "/v1/messages", "/v1/responses", "/responses"}


def _find(value, key: str):
    """Every value under ``key`` anywhere in a JSON value, in document order."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == key:
                yield v
            yield from _find(v, key)
    elif isinstance(value, list):
        for v in value:
            yield from _find(v, key)


def answer_events(response: dict) -> list:
    """The JSON payloads of a recorded answer: its body, or each ``data:`` line of a stream."""
    if "json" in response:
        return [response["json"]]
    out = []
    for line in response.get("text", "").splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                try:
                    out.append(json.loads(data))
                except ValueError:
                    pass
    return out


def prompt_figures(record: dict) -> dict | None:
    """``{"prompt", "cached", "predicted"}`` tokens of one generation's answer, or None when
    the answer says nothing about them (an error, an aborted stream)."""
    events = answer_events(record.get("response") or {})
    timings = [t for e in events for t in _find(e, "timings") if isinstance(t, dict)]
    if timings:
        t = timings[-1]
        return {"prompt": t.get("prompt_n", 0) + t.get("cache_n", 0), "cached": t.get("cache_n", 0),
                "predicted": t.get("predicted_n", 0), "prompt_ms": t.get("prompt_ms")}
    usages = [u for e in events for u in _find(e, "usage") if isinstance(u, dict)]
    if not usages:
        return None
    u = usages[-1]
    if "input_tokens" in u and "prompt_tokens" not in u:  # Messages (input excludes cached) / Responses
        cached = u.get("cache_read_input_tokens") or (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
        prompt = u["input_tokens"] + (u.get("cache_read_input_tokens") or 0)
        return {"prompt": prompt, "cached": cached, "predicted": u.get("output_tokens", 0), "prompt_ms": None}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"prompt": u.get("prompt_tokens", 0), "cached": cached, "predicted": u.get("completion_tokens", 0),
            "prompt_ms": None}


#: the event that ends a stream, per API (a stream without one was cut: the client left first)
STREAM_ENDS = ("data: [DONE]", "event: message_stop", "event: response.completed", "event: response.incomplete",
               "event: response.failed", '"type": "response.completed"', '"type": "response.incomplete"')


def stream_cut(record: dict) -> bool:
    """Whether a recorded event stream ended without its API's closing event."""
    response = record.get("response") or {}
    if not response.get("content_type", "").startswith("text/event-stream") or response.get("truncated"):
        return False
    text = response.get("text", "")
    return not any(end in text for end in STREAM_ENDS)


def load(folder: Path) -> list[dict]:
    """The agent's recorded requests, without the check script's own ``/health`` polls (curl)."""
    records = [json.loads(p.read_text(encoding="utf-8")) for p in sorted((folder / "requests").glob("*.json"))]
    return [r for r in records if not r.get("headers", {}).get("user-agent", "").startswith("curl/")]


def summarize(folder: Path) -> dict:
    records = load(folder)
    run = json.loads((folder / "run.json").read_text()) if (folder / "run.json").exists() else {}
    gens = [r for r in records if r["method"] == "POST" and r["path"] in GENERATION_PATHS]
    figures = [f for f in (prompt_figures(r) for r in gens if 200 <= r["status"] < 300) if f]
    turns = [r["elapsed_ms"] / 1e3 for r in gens]
    ttfb = [r["ttfb_ms"] / 1e3 for r in gens if r.get("ttfb_ms") is not None]
    prompt_sum = sum(f["prompt"] for f in figures)
    cached_sum = sum(f["cached"] for f in figures)
    failed = [r for r in records if r["status"] >= 400 or r["status"] == 0]
    return {
        "agent": folder.name, "rc": run.get("rc"), "wall_s": run.get("wall_s"), "limit_s": run.get("limit_s"),
        "connected": any(200 <= r["status"] < 300 for r in gens),
        "requests": len(records), "paths": Counter(f"{r['method']} {r['path']}" for r in records),
        "statuses": Counter(r["status"] for r in records), "generations": len(gens),
        "first_prompt": figures[0]["prompt"] if figures else None,
        "max_prompt": max((f["prompt"] for f in figures), default=None),
        "prompt_sum": prompt_sum, "cached_sum": cached_sum,
        "reuse": cached_sum / prompt_sum if prompt_sum else 0.0,
        "predicted_sum": sum(f["predicted"] for f in figures),
        "turn_median_s": statistics.median(turns) if turns else None, "turn_max_s": max(turns, default=None),
        "ttfb_median_s": statistics.median(ttfb) if ttfb else None,
        "failed": [(r["seq"], r["method"], r["path"], r["status"], _reason(r)) for r in failed],
        "cut": [(r["seq"], r["path"], r["elapsed_ms"]) for r in gens if stream_cut(r)],
        "per_turn": [(r["seq"], r["path"], r["status"], (f := prompt_figures(r)) and f["prompt"], f and f["cached"],
                      f and f["predicted"], r.get("ttfb_ms"), r["elapsed_ms"]) for r in gens],
    }


def _reason(record: dict) -> str:
    events = answer_events(record.get("response") or {})
    for e in events:
        for err in _find(e, "error"):
            if isinstance(err, dict) and err.get("message"):
                return str(err["message"])[:200]
    return "no answer (the client left first)" if record["status"] == 0 else ""


def _s(x) -> str:
    return "–" if x is None else f"{x:.1f}"


def markdown(summaries: list[dict]) -> str:
    lines = ["| agent | exit | wall s | connected | requests | statuses | generations | first prompt | "
             "largest prompt | prompt tokens (cached) | cache reuse | turn s median / max | first byte s median | cut streams |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in summaries:
        statuses = ", ".join(f"{k}×{v}" for k, v in sorted(s["statuses"].items()))
        lines.append(f"| {s['agent']} | {s['rc']} | {_s(s['wall_s'])} | {'yes' if s['connected'] else 'no'} | "
                     f"{s['requests']} | {statuses} | {s['generations']} | {s['first_prompt']} | {s['max_prompt']} | "
                     f"{s['prompt_sum']} ({s['cached_sum']}) | {100 * s['reuse']:.0f}% | "
                     f"{_s(s['turn_median_s'])} / {_s(s['turn_max_s'])} | {_s(s['ttfb_median_s'])} | {len(s['cut'])} |")
    for s in summaries:
        lines += ["", f"### {s['agent']}", "",
                  "requests: " + ", ".join(f"`{k}` ×{v}" for k, v in s["paths"].most_common()), ""]
        if s["failed"]:
            lines += ["not answered 2xx:", ""] + [f"- #{seq} {m} {p} → {st}: {why}" for seq, m, p, st, why in s["failed"]]
            lines.append("")
        if s["cut"]:
            lines += ["streams the client left before their end (a cancelled side request, or a time-out):", ""]
            lines += [f"- #{seq} {p} after {el / 1e3:.1f} s" for seq, p, el in s["cut"]] + [""]
        lines += ["| # | path | status | prompt tokens | cached | answer tokens | first byte ms | total ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {seq} | {p} | {st} | {pr} | {c} | {pd} | {tb} | {el} |" for seq, p, st, pr, c, pd, tb, el in s["per_turn"]]
    return "\n".join(lines) + "\n"


#: answer text kept per recorded request in a replay set (its end: the final events carry usage and timings)
KEEP_ANSWER_CHARS = 6000


def keep(out: Path, agent: str, dest: Path, first: int = 3, last: int = 2) -> list[str]:
    """Copy a representative replay set of ``agent``'s requests to ``dest/agent/``: every
    request that is not a generation (the agent's probes, ``/v1/models``), and of the
    generations answered 200 the first ``first`` and the last ``last``, each answer cut to its
    last :data:`KEEP_ANSWER_CHARS` characters at an event boundary. Returns the file names."""
    records = load(out / agent)
    gens = [r for r in records if r["method"] == "POST" and r["path"] in GENERATION_PATHS and r["status"] == 200]
    picked = {r["seq"] for r in gens[:first] + gens[-last:]}
    picked |= {r["seq"] for r in records if not (r["method"] == "POST" and r["path"] in GENERATION_PATHS)
               and 200 <= r["status"] < 300}
    folder = dest / agent
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for r in records:
        if r["seq"] not in picked:
            continue
        response = dict(r.get("response") or {})
        text = response.get("text", "")
        if len(text) > KEEP_ANSWER_CHARS:
            cut = text.find("\n\n", len(text) - KEEP_ANSWER_CHARS)
            response["text"] = text[cut + 2:] if cut >= 0 else text[-KEEP_ANSWER_CHARS:]
            response["head_dropped"] = True
        name = f"{r['seq']:06d}-{r['method']}-{r['path'].strip('/').replace('/', '_') or 'root'}.json"
        (folder / name).write_text(json.dumps({**r, "response": response}, ensure_ascii=False, indent=1) + "\n",
                                   encoding="utf-8")
        names.append(name)
    return names


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "--keep":
        dest, out = Path(argv[1]), Path(argv[2])
        for agent in argv[3:] or sorted(p.name for p in out.iterdir() if (p / "requests").is_dir()):
            print(agent, " ".join(keep(out, agent, dest)))
        return 0
    out = Path(argv[0])
    agents = argv[1:] or sorted(p.name for p in out.iterdir() if (p / "requests").is_dir())
    print(markdown([summarize(out / a) for a in agents if (out / a / "requests").is_dir()]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
