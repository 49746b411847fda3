#!/usr/bin/env python3
"""Soak test of a flashdraft (or any llama-server-compatible) server on loopback.

Each phase: the server (one we start with ``--serve ARGS``, or ``--url``) first answers
every request body alone, one at a time: those greedy answers are the references. Then
``--clients`` threads send requests for ``--duration`` seconds or ``--requests`` requests,
mixing chat and text completions, streamed and not, second chat turns that hit the prompt
cache, tool calls and JSON-schema answers (``--no-structured`` leaves those out),
streams left mid-way (``--disconnect``) and non-streamed requests cancelled by closing the
socket (``--cancel``); half-way, ``--burst`` more requests arrive at once, more than the
slots and queue hold. Request kinds and checks: ``soak_kinds.py``. The report counts:

- errors: transport failures and non-200 answers other than the 503 ``queue_full``
  overload answer (``rejected``, expected only when the queue is full);
- lost: requests that got no complete answer within ``--timeout``;
- corrupted: answers that differ from the reference (text, token count, tool calls), break
  the stream protocol, or fail their schema;
- latency p50 / p99 of the complete answers; the server's RSS after a warm-up (the
  references) and after the load, and the time until no request was left running.

Each ``--serve`` is a phase with a server of its own (drafting methods are server-wide,
so mixing drafters means one phase per ``--spec-type``). Exit status 0 only with zero
errors, lost and corrupted in every phase, a server that still answers the reference
afterwards and exits 0 on SIGTERM, and RSS growth under ``--max-rss-growth-mb`` if given.

    scripts/soak.py --serve "-np 4 --max-queue 4 --spec-type dflash -t 1" \\
                    --serve "-np 4 --max-queue 4 --spec-type hybrid -t 1" --duration 420 --json-out soak.json
    scripts/soak.py --url http://127.0.0.1:8080 --clients 8 --requests 100 --no-structured
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_kinds import Kinds, Outcome, Specs  # noqa: E402

DEFAULT_PROMPTS = [
    "Write a Python function that reverses a string.",
    "Explain in two sentences what a hash map is.",
    "List three prime numbers and say why each is prime.",
]
STATUSES = ("ok", "rejected", "error", "lost", "corrupted")


@dataclass
class Report:
    """One phase's figures (see the module docstring)."""

    url: str
    server_args: str | None
    clients: int
    max_tokens: int
    requests: int = 0
    wall_s: float = 0.0
    kinds: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    errors_by_kind: dict = field(default_factory=dict)
    http_status: dict = field(default_factory=dict)
    server_5xx: int = 0
    burst: dict = field(default_factory=dict)
    validated: dict = field(default_factory=dict)
    cache_hits: int = 0
    latency_s: dict = field(default_factory=dict)
    rss_mb: dict = field(default_factory=dict)
    slot_freed_s: float | None = None
    still_serving: bool = False
    server_exit_code: int | None = None
    rss_limit_mb: float | None = None
    failures: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        c, growth = self.counts, self.rss_mb.get("growth")
        return (all(c.get(s, 0) == 0 for s in ("error", "lost", "corrupted")) and self.server_5xx == 0
                and self.still_serving and self.server_exit_code in (None, 0)
                and (self.rss_limit_mb is None or growth is None or growth <= self.rss_limit_mb))


# -- the server's memory and state ---------------------------------------------------------

def rss_mb(pid: int | None) -> float | None:
    """Resident set size of ``pid`` in MiB (Linux /proc, else psutil), or None."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        import psutil
        return psutil.Process(pid).memory_info().rss / 2**20
    except Exception:
        return None


def listening_pid(url: str) -> int | None:
    """The pid listening on ``url``'s port on this machine (needs psutil), or None."""
    port = urlparse(url).port
    try:
        import psutil
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except Exception:
        return None
    return None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def server_idle(client: httpx.Client, timeout: float) -> float | None:
    """Seconds until ``/metrics`` shows no running or queued request (None without metrics)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        r = client.get("/metrics")
        if r.status_code != 200:
            return None
        values = dict(line.rsplit(" ", 1) for line in r.text.splitlines() if line and not line.startswith("#"))
        if float(values.get("llamacpp:requests_processing", 0)) == 0 and \
                float(values.get("llamacpp:requests_deferred", 0)) == 0:
            return time.perf_counter() - t0
        time.sleep(0.05)
    return float("inf")


# -- the load --------------------------------------------------------------------------------

@dataclass
class Load:
    """What one phase sends."""

    clients: int = 4
    requests: int | None = None
    duration_s: float | None = None
    max_tokens: int = 32
    disconnect: float = 0.15
    cancel: float = 0.1
    burst: int = 0
    structured: bool = True
    seed: int = 0
    timeout: float = 300.0


class Plan:
    """Hands out (kind, key, rng) to the client threads until the load is done; thread-safe.

    Kinds come from a shuffled deck of 20 with the shares of ``--disconnect`` and
    ``--cancel`` (the rest half streamed, half not), keys from a deck of every body (the
    tool and JSON-schema bodies first in each round of non-streamed keys): so even a short
    run sends every kind and every body, and a long one keeps the shares exactly."""

    DECK = 20

    def __init__(self, load: Load, specs: Specs):
        self.load, self.rng, self.lock = load, random.Random(load.seed), threading.Lock()
        n_disc, n_cancel = round(load.disconnect * self.DECK), round(load.cancel * self.DECK)
        n_stream = (self.DECK - n_disc - n_cancel) // 2
        self.kind_deck = (["disconnect"] * n_disc + ["cancel"] * n_cancel + ["stream"] * n_stream
                          + ["full"] * (self.DECK - n_disc - n_cancel - n_stream))
        self.constrained = sorted(specs.constrained)
        self.plain = sorted(k for k in specs.bodies if k not in specs.constrained)
        self.decks: dict[str, list] = {}
        self.issued, self.t0 = 0, time.perf_counter()

    def _draw(self, name: str, cards: list, first: list | None = None) -> str:
        deck = self.decks.setdefault(name, [])
        if not deck:
            rest = list(cards)
            self.rng.shuffle(rest)
            deck.extend(reversed((first or []) + rest))  # popped from the end
        return deck.pop()

    def next(self) -> tuple[str, str, random.Random] | None:
        with self.lock:
            if self.done():
                return None
            self.issued += 1
            kind = self._draw("kinds", self.kind_deck)
            if kind in ("full", "cancel"):
                key = self._draw(f"keys-{kind}", self.plain, self.constrained)
            else:
                key = self._draw(f"keys-{kind}", self.plain)
            return kind, key, random.Random(self.rng.random())

    def done(self) -> bool:
        if self.load.requests is not None and self.issued >= self.load.requests:
            return True
        return self.load.duration_s is not None and time.perf_counter() - self.t0 >= self.load.duration_s

    def halfway(self) -> bool:
        with self.lock:
            if self.load.requests is not None and self.issued >= self.load.requests / 2:
                return True
            return self.load.duration_s is not None and time.perf_counter() - self.t0 >= self.load.duration_s / 2


def soak(url: str, load: Load, prompts: list[str], api_key: str | None = None, pid: int | None = None,
         server_args: str | None = None) -> Report:
    """Run one phase against ``url``; see the module docstring. Returns its report."""
    if load.requests is None and load.duration_s is None:
        load.requests = 60
    specs = Specs.build(prompts, load.max_tokens, load.structured)
    kinds = Kinds(url, specs, api_key, load.timeout)
    report = Report(url, server_args, load.clients, load.max_tokens)
    rss_start = rss_mb(pid)
    for key in sorted(specs.bodies):  # one at a time: the references (and the warm-up)
        kinds.refs[key] = kinds.reference(key)
    specs.add_second_turns(prompts, kinds.refs, load.max_tokens)
    for key in (k for k in sorted(specs.bodies) if k not in kinds.refs):
        kinds.refs[key] = kinds.reference(key)
    rss_before = rss_mb(pid)

    plan = Plan(load, specs)
    outcomes: list[Outcome] = []
    burst_out: list[Outcome] = []
    bursts: list[threading.Thread] = []

    def client(first: bool) -> None:
        while (item := plan.next()) is not None:
            outcomes.append(kinds.run(*item))
            if first and load.burst and not bursts and plan.halfway():  # fired once, by one client
                bursts.append(threading.Thread(target=burst, name="soak-burst", daemon=True))
                bursts[0].start()

    def burst() -> None:
        with ThreadPoolExecutor(max_workers=load.burst, thread_name_prefix="burst") as pool:
            burst_out.extend(pool.map(lambda i: kinds.run("burst", "chat0", random.Random(i)), range(load.burst)))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=load.clients, thread_name_prefix="soak") as pool:
        for f in [pool.submit(client, i == 0) for i in range(load.clients)]:
            f.result()
    for t in bursts:
        t.join(load.timeout + 30)
    report.wall_s = round(time.perf_counter() - t0, 2)

    with httpx.Client(base_url=url, headers=kinds.headers, timeout=load.timeout) as http:
        idle = server_idle(http, 10.0)
    report.slot_freed_s = None if idle is None else round(idle, 3)
    rss_after = rss_mb(pid)
    try:
        report.still_serving = kinds.reference("chat0") == kinds.refs["chat0"]
    except httpx.HTTPError:
        report.still_serving = False
    summarise(report, outcomes + burst_out, burst_out, rss_start, rss_before, rss_after)
    return report


def summarise(report: Report, outcomes: list[Outcome], burst_out: list[Outcome], rss_start, rss_before,
              rss_after) -> None:
    """Fill ``report``'s counts, latencies and memory from the outcomes."""
    report.requests = len(outcomes)
    report.kinds = dict(Counter(f"{o.kind}:{o.key.rstrip('0123456789')}" for o in outcomes))
    report.counts = {s: sum(o.status == s for o in outcomes) for s in STATUSES}
    report.errors_by_kind = dict(Counter(f"{o.status}: {o.detail.split(':')[0]}" for o in outcomes
                                         if o.status in ("error", "lost", "corrupted")))
    report.http_status = {str(k): v for k, v in Counter(o.http_status for o in outcomes if o.http_status).items()}
    report.server_5xx = sum(1 for o in outcomes if o.http_status and o.http_status >= 500 and o.status != "rejected")
    report.burst = {"size": len(burst_out), **{s: sum(o.status == s for o in burst_out) for s in STATUSES}}
    report.validated = dict(Counter(o.validated for o in outcomes if o.validated))
    report.cache_hits = sum(o.cache_n > 0 for o in outcomes)
    lat = [o.latency_s for o in outcomes if o.latency_s is not None]
    report.latency_s = {"n": len(lat), "p50": _r(percentile(lat, 50)), "p99": _r(percentile(lat, 99)),
                        "max": _r(max(lat) if lat else None)}
    report.rss_mb = {"start": _r(rss_start), "before": _r(rss_before), "after": _r(rss_after),
                     "growth": _r(rss_after - rss_before) if rss_after is not None and rss_before else None}
    report.failures = [asdict(o) for o in outcomes if o.status in ("error", "lost", "corrupted")][:20]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


# -- a server of our own ---------------------------------------------------------------------

def start_server(args: str, ready_timeout: float = 600.0) -> tuple[subprocess.Popen, str]:
    """``python -m flashdraft.server.cli --metrics ARGS`` (``flashdraft serve``) on a free
    loopback port, ready."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "flashdraft.server.cli", "--host", "127.0.0.1", "--port", str(port), "--metrics",
           *shlex.split(args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TQDM_DISABLE": "1"})
    threading.Thread(target=_drain, args=(proc,), daemon=True).start()  # a full stderr pipe would block it
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {''.join(proc.log[-40:])}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server not ready after {ready_timeout} s")


def _drain(proc: subprocess.Popen) -> None:
    proc.log = []
    for line in proc.stderr:
        proc.log.append(line)


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM, then wait; returns the exit code (SIGKILL after ``timeout`` s)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def render(report: Report) -> str:
    """One phase's report as a short text for people."""
    c, lat, rss, b = report.counts, report.latency_s, report.rss_mb, report.burst
    lines = [
        f"soak phase: {report.server_args or report.url}",
        (f"  {report.requests} requests ({report.requests - b.get('size', 0)} from {report.clients} clients, "
         f"a burst of {b.get('size', 0)}), "
         f"max_tokens {report.max_tokens}, {report.wall_s} s"),
        f"  kinds: {', '.join(f'{k} {v}' for k, v in sorted(report.kinds.items()))}",
        (f"  outcome: {c['ok']} ok, {c['rejected']} rejected (503 queue_full), {c['error']} errors, "
         f"{c['lost']} lost, {c['corrupted']} corrupted; other 5xx {report.server_5xx}"),
        f"  burst: {b.get('ok', 0)} ok, {b.get('rejected', 0)} rejected, of {b.get('size', 0)}",
        f"  validated: {report.validated}; answers with prompt-cache hits: {report.cache_hits}",
        f"  latency (complete answers, n={lat['n']}): p50 {lat['p50']} s, p99 {lat['p99']} s, max {lat['max']} s",
        (f"  server RSS MiB: start {rss['start']}, after warm-up {rss['before']}, after load {rss['after']} "
         f"(growth {rss['growth']}" + (f", limit {report.rss_limit_mb})" if report.rss_limit_mb is not None else ")")),
        f"  idle {report.slot_freed_s} s after the load; still serving the reference: {report.still_serving}",
    ]
    if report.server_exit_code is not None:
        lines.append(f"  server exit code after SIGTERM: {report.server_exit_code}")
    for f in report.failures:
        lines.append(f"  FAIL {f['kind']} {f['key']}: {f['status']}: {f['detail']}")
    lines.append("PASS" if report.passed else "FAIL")
    return "\n".join(lines)


def totals(reports: list[Report]) -> dict:
    """Figures over every phase (latency percentiles are per phase only)."""
    sums = Counter()
    for r in reports:
        sums.update({s: r.counts.get(s, 0) for s in STATUSES})
    return {"phases": len(reports), "requests": sum(r.requests for r in reports), **sums,
            "server_5xx": sum(r.server_5xx for r in reports), "passed": all(r.passed for r in reports)}


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run every phase, print and optionally write the reports."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server to soak (ignored with --serve)")
    p.add_argument("--serve", action="append", default=None, metavar="ARGS",
                   help="start `flashdraft serve ARGS` for a phase (repeatable: one phase each)")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--requests", type=int, default=None, help="requests per phase (default 60 without --duration)")
    p.add_argument("--duration", type=float, default=None, help="seconds of load per phase")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (default 32)")
    p.add_argument("--disconnect", type=float, default=0.15, help="share of streams left mid-way (default 0.15)")
    p.add_argument("--cancel", type=float, default=0.1, help="share of requests cancelled by the client (default 0.1)")
    p.add_argument("--burst", type=int, default=0, help="requests sent at once half-way (default 0: none)")
    p.add_argument("--no-structured", dest="structured", action="store_false",
                   help="no tool-call or JSON-schema requests (for servers without grammar support)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: three short ones)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--pid", type=int, default=None, help="server pid for RSS (default: found by port)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, s (default 300)")
    p.add_argument("--seed", type=int, default=0, help="the request mix (default 0)")
    p.add_argument("--max-rss-growth-mb", type=float, default=None, help="fail above this RSS growth")
    p.add_argument("--json-out", default=None, help="also write the reports as JSON here")
    a = p.parse_args(argv)

    load = Load(a.clients, a.requests, a.duration, a.max_tokens, a.disconnect, a.cancel, a.burst, a.structured,
                a.seed, a.timeout)
    reports = []
    for args in a.serve or [None]:
        proc, url, pid = None, a.url, a.pid
        if args is not None:
            proc, url = start_server(args)
            pid = proc.pid
        elif pid is None and urlparse(url).hostname in ("127.0.0.1", "localhost", "::1"):
            pid = listening_pid(url)
        try:
            report = soak(url.rstrip("/"), Load(**asdict(load)), a.prompt or DEFAULT_PROMPTS, a.api_key, pid, args)
        finally:
            code = stop_server(proc) if proc is not None else None
        report.server_exit_code, report.rss_limit_mb = code, a.max_rss_growth_mb
        print(render(report), flush=True)
        reports.append(report)
        if a.json_out:  # after every phase: a long run that is stopped keeps what it measured
            write_json(a.json_out, reports, load)
    total = totals(reports)
    print(f"total: {total}")
    return 0 if total["passed"] else 1


def write_json(path: str, reports: list[Report], load: Load) -> None:
    """The phases so far, their totals and the load settings, as JSON."""
    total = totals(reports)
    out = {"passed": total["passed"], "totals": total, "load": asdict(load),
           "phases": [{**asdict(r), "passed": r.passed} for r in reports]}
    Path(path).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
