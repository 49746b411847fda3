#!/usr/bin/env python3
"""Bounded soak test of a flashdraft (or any llama-server-compatible) server on loopback.

N concurrent clients send M chat requests in all, greedy (temperature 0) so that every
answer to the same prompt must be identical: streamed and non-streamed answers are both
compared with a reference taken before the load. Some streaming clients disconnect after
a few events on purpose. The report counts:

- errors: transport failures and non-200 answers;
- lost: requests that got no complete answer within ``--timeout``;
- corrupted: 200 answers whose text, token count or event stream differ from the
  reference (missing ``[DONE]``, two finish chunks, an ``error`` event...);
- latency p50 / p99 of the complete answers; the server's RSS before (after a warm-up)
  and after the load, and whether the slot was free again right after it.

Exit status 0 only with zero errors, lost and corrupted, a server that still answers the
reference afterwards, and RSS growth under ``--max-rss-growth-mb`` when that is given.

    scripts/soak.py --serve "--spec-type ngram -c 1024" --clients 4 --requests 24
    scripts/soak.py --url http://127.0.0.1:8080 --clients 8 --requests 100 --json-out soak.json
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

DEFAULT_PROMPTS = [
    "Write a Python function that reverses a string.",
    "Explain in two sentences what a hash map is.",
    "List three prime numbers and say why each is prime.",
]


@dataclass
class Outcome:
    """One request's result. ``kind``: ``full`` | ``stream`` | ``disconnect``;
    ``status``: ``ok`` | ``error`` | ``lost`` | ``corrupted``."""

    kind: str
    prompt: int
    status: str = "ok"
    latency_s: float | None = None
    detail: str = ""


@dataclass
class Reference:
    """The greedy answer to one prompt, before any load."""

    text: str
    completion_tokens: int


@dataclass
class Report:
    url: str
    clients: int
    requests: int
    max_tokens: int
    counts: dict = field(default_factory=dict)
    latency_s: dict = field(default_factory=dict)
    wall_s: float = 0.0
    rss_mb: dict = field(default_factory=dict)
    slot_freed_s: float | None = None
    still_serving: bool = False
    server_exit_code: int | None = None
    rss_limit_mb: float | None = None
    failures: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        c, growth = self.counts, self.rss_mb.get("growth")
        return (c.get("error", 0) == 0 and c.get("lost", 0) == 0 and c.get("corrupted", 0) == 0
                and self.still_serving and self.server_exit_code in (None, 0)
                and (self.rss_limit_mb is None or growth is None or growth <= self.rss_limit_mb))


# -- the server's memory -------------------------------------------------------------------

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


# -- one request -----------------------------------------------------------------------------

class Client:
    """Sends chat requests and checks every answer against the references."""

    def __init__(self, url: str, prompts: list[str], max_tokens: int, api_key: str | None, timeout: float):
        self.url, self.prompts, self.max_tokens, self.timeout = url, prompts, max_tokens, timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.refs: list[Reference] = []
        self._local = threading.local()

    def http(self) -> httpx.Client:
        """One keep-alive client per thread, as N real clients would have."""
        if not hasattr(self._local, "client"):
            self._local.client = httpx.Client(base_url=self.url, headers=self.headers, timeout=self.timeout)
        return self._local.client

    def body(self, prompt: int, stream: bool) -> dict:
        return {"messages": [{"role": "user", "content": self.prompts[prompt]}], "temperature": 0,
                "max_tokens": self.max_tokens, "stream": stream}

    def reference(self, prompt: int) -> Reference:
        r = self.http().post("/v1/chat/completions", json=self.body(prompt, False))
        r.raise_for_status()
        body = r.json()
        return Reference(body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"])

    def run(self, kind: str, prompt: int, keep_events: int) -> Outcome:
        out = Outcome(kind, prompt)
        t0 = time.perf_counter()
        try:
            if kind == "full":
                self._full(out)
            else:
                self._stream(out, keep_events if kind == "disconnect" else None)
        except httpx.TimeoutException as e:
            out.status, out.detail = "lost", f"timeout: {e!r}"
        except httpx.HTTPError as e:
            out.status, out.detail = "error", f"{type(e).__name__}: {e}"
        except (ValueError, KeyError, IndexError, TypeError) as e:  # unparsable answer
            out.status, out.detail = "corrupted", f"{type(e).__name__}: {e}"
        if out.status == "ok" and kind != "disconnect":
            out.latency_s = time.perf_counter() - t0
        return out

    def _check(self, out: Outcome, text: str, tokens: int, timings_n: int) -> None:
        ref = self.refs[out.prompt]
        if text != ref.text:
            out.status, out.detail = "corrupted", f"text differs from the reference: {text[:80]!r}"
        elif tokens != ref.completion_tokens or timings_n != tokens:
            out.status, out.detail = "corrupted", (f"token counts differ: usage {tokens}, timings {timings_n}, "
                                                   f"reference {ref.completion_tokens}")

    def _full(self, out: Outcome) -> None:
        r = self.http().post("/v1/chat/completions", json=self.body(out.prompt, False))
        if r.status_code != 200:
            out.status, out.detail = "error", f"HTTP {r.status_code}: {r.text[:200]}"
            return
        body = r.json()
        self._check(out, body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"],
                    body["timings"]["predicted_n"])

    def _stream(self, out: Outcome, keep_events: int | None) -> None:
        parts, finishes, done, events, usage_n, timings_n = [], 0, False, 0, -1, -1
        with self.http().stream("POST", "/v1/chat/completions", json=self.body(out.prompt, True)) as r:
            if r.status_code != 200:
                r.read()
                out.status, out.detail = "error", f"HTTP {r.status_code}: {r.text[:200]}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if done:
                    out.status, out.detail = "corrupted", "data after [DONE]"
                    return
                if data == "[DONE]":
                    done = True
                    continue
                ev = json.loads(data)
                if "error" in ev:
                    out.status, out.detail = "error", f"error event: {ev['error']}"
                    return
                events += 1
                if not ev["choices"]:  # the last chunk (after the finish chunk): usage and timings
                    usage_n, timings_n = ev["usage"]["completion_tokens"], ev["timings"]["predicted_n"]
                    continue
                choice = ev["choices"][0]
                parts.append(choice["delta"].get("content") or "")
                if choice["finish_reason"] is not None:
                    finishes += 1
                if keep_events is not None and events >= keep_events:
                    return  # leaving mid-stream on purpose: closing the response drops the connection
        if keep_events is not None:
            return  # the answer was shorter than the events we meant to keep: fine
        if not done or finishes != 1:
            out.status, out.detail = "corrupted", f"stream ended badly: [DONE] {done}, finish chunks {finishes}"
            return
        self._check(out, "".join(parts), usage_n, timings_n)


# -- the run -------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def server_idle(client: Client, timeout: float) -> float | None:
    """Seconds until ``/metrics`` shows no running or queued request (None without metrics)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        r = client.http().get("/metrics")
        if r.status_code != 200:
            return None
        values = dict(line.rsplit(" ", 1) for line in r.text.splitlines() if line and not line.startswith("#"))
        if float(values.get("llamacpp:requests_processing", 0)) == 0 and \
                float(values.get("llamacpp:requests_deferred", 0)) == 0:
            return time.perf_counter() - t0
        time.sleep(0.05)
    return float("inf")


def soak(url: str, clients: int, requests: int, prompts: list[str], max_tokens: int = 32,
         disconnect: float = 0.2, seed: int = 0, api_key: str | None = None, pid: int | None = None,
         timeout: float = 300.0) -> Report:
    """Run the soak against ``url``; see the module docstring. Returns the report."""
    rng = random.Random(seed)
    client = Client(url, prompts, max_tokens, api_key, timeout)
    report = Report(url, clients, requests, max_tokens)
    rss_start = rss_mb(pid)
    client.refs = [client.reference(i) for i in range(len(prompts))]  # also the warm-up
    rss_before = rss_mb(pid)

    plan = []
    for i in range(requests):
        kind = "disconnect" if rng.random() < disconnect else ("stream" if i % 2 else "full")
        plan.append((kind, i % len(prompts), rng.randint(1, 3)))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients, thread_name_prefix="soak") as pool:
        outcomes = list(pool.map(lambda p: client.run(*p), plan))
    report.wall_s = round(time.perf_counter() - t0, 2)

    idle = server_idle(client, 5.0)
    report.slot_freed_s = None if idle is None else round(idle, 3)
    rss_after = rss_mb(pid)
    try:
        final = client.reference(0)
        report.still_serving = final == client.refs[0]
    except httpx.HTTPError:
        report.still_serving = False

    kinds = ("full", "stream", "disconnect")
    report.counts = {k: sum(o.kind == k for o in outcomes) for k in kinds}
    for status in ("ok", "error", "lost", "corrupted"):
        report.counts[status] = sum(o.status == status for o in outcomes)
    lat = [o.latency_s for o in outcomes if o.latency_s is not None]
    report.latency_s = {"n": len(lat), "p50": _r(percentile(lat, 50)), "p99": _r(percentile(lat, 99)),
                        "max": _r(max(lat) if lat else None)}
    report.rss_mb = {"start": _r(rss_start), "before": _r(rss_before), "after": _r(rss_after),
                     "growth": _r(rss_after - rss_before) if rss_after is not None and rss_before else None}
    report.failures = [asdict(o) for o in outcomes if o.status != "ok"][:20]
    return report


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


# -- a server of our own ---------------------------------------------------------------------

def start_server(args: str, ready_timeout: float = 600.0) -> tuple[subprocess.Popen, str]:
    """``python -m flashdraft.server.cli --metrics ARGS`` on a free loopback port, ready."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "flashdraft.server.cli", "--host", "127.0.0.1", "--port", str(port), "--metrics",
           *shlex.split(args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TQDM_DISABLE": "1"})
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server not ready after {ready_timeout} s")


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """SIGTERM, then wait; returns the exit code (SIGKILL after ``timeout`` s)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def render(report: Report) -> str:
    """The report as a short text for people."""
    c, lat, rss = report.counts, report.latency_s, report.rss_mb
    lines = [
        (f"soak: {report.requests} requests from {report.clients} clients on {report.url} "
         f"(max_tokens {report.max_tokens}) in {report.wall_s} s"),
        f"  kinds: {c['full']} full, {c['stream']} streamed, {c['disconnect']} disconnected on purpose",
        f"  outcome: {c['ok']} ok, {c['error']} errors, {c['lost']} lost, {c['corrupted']} corrupted",
        f"  latency (complete answers, n={lat['n']}): p50 {lat['p50']} s, p99 {lat['p99']} s, max {lat['max']} s",
        (f"  server RSS MiB: start {rss['start']}, after warm-up {rss['before']}, after load {rss['after']} "
         f"(growth {rss['growth']}" + (f", limit {report.rss_limit_mb})" if report.rss_limit_mb is not None else ")")),
        f"  slot free {report.slot_freed_s} s after the load; still serving the reference: {report.still_serving}",
    ]
    if report.server_exit_code is not None:
        lines.append(f"  server exit code after SIGTERM: {report.server_exit_code}")
    for f in report.failures:
        lines.append(f"  FAIL {f['kind']} prompt {f['prompt']}: {f['status']}: {f['detail']}")
    lines.append("PASS" if report.passed else "FAIL")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="base URL of a running server (loopback)")
    where.add_argument("--serve", metavar="ARGS", help="start `flashdraft serve ARGS` and soak it")
    p.add_argument("--clients", "-n", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--requests", "-m", type=int, default=24, help="requests in all (default 24)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (default 32)")
    p.add_argument("--disconnect", type=float, default=0.2,
                   help="share of requests that disconnect mid-stream (default 0.2)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: three short ones)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--pid", type=int, default=None, help="server pid for RSS (default: found by port)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, s (default 300)")
    p.add_argument("--seed", type=int, default=0, help="which requests disconnect (default 0)")
    p.add_argument("--max-rss-growth-mb", type=float, default=None, help="fail above this RSS growth")
    p.add_argument("--json-out", default=None, help="also write the report as JSON here")
    a = p.parse_args(argv)

    proc = None
    url, pid = a.url, a.pid
    if a.serve is not None:
        proc, url = start_server(a.serve)
        pid = proc.pid
    elif pid is None and urlparse(url).hostname in ("127.0.0.1", "localhost", "::1"):
        pid = listening_pid(url)
    try:
        report = soak(url.rstrip("/"), a.clients, a.requests, a.prompt or DEFAULT_PROMPTS, a.max_tokens,
                      a.disconnect, a.seed, a.api_key, pid, a.timeout)
    finally:
        if proc is not None:
            code = stop_server(proc)
    if proc is not None:
        report.server_exit_code = code
    report.rss_limit_mb = a.max_rss_growth_mb
    print(render(report))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({**asdict(report), "passed": report.passed}, indent=2) + "\n")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
