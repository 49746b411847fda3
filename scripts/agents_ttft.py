"""An agent's second turn against its first: time to first token with the slot's prompt cache.

Replays Claude Code's recorded conversation (``tests/data/agents/claude/``: its first
``/v1/messages`` body, then what its second turn adds) against ``flashdraft serve`` as
``make serve`` runs it and against llama-server on the same GGUF (``make llama-peer``), one
server at a time, as an agent does: turn 1 is sent, its streamed answer is sent back as the
assistant message with the recorded turn-2 user message after it, and the two times to
first token are compared (issue target: turn 2 ≤ 15% of turn 1).

    .venv/bin/python scripts/agents_ttft.py [--tokens 64] [--repeats 2] [--ubatch 512] [--out FILE]

Both servers: one slot, T = 0, the answer capped at ``--tokens``; the first token is the
first ``content_block_delta`` event's arrival at the client. Each server is warmed with one
unrelated request first; ``--repeats`` runs the pair again after a different first request
(so the cache does not already hold turn 1).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "agents" / "claude"
#: the fields of the recorded bodies that only change a hosted model's behaviour
DROP = ("thinking", "context_management", "output_config", "metadata")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not become healthy")


def turn(url: str, body: dict) -> dict:
    """Stream one Messages request; ``{ttft_ms, total_ms, text, usage}``."""
    t0, first, text, usage = time.perf_counter(), None, [], {}
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=1800,
                      headers={"anthropic-version": "2023-06-01"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if event.get("type") == "content_block_delta":
                first = first or time.perf_counter()
                text.append(event["delta"].get("text", ""))
            if event.get("type") == "message_start":  # llama-server counts the prompt here only
                usage.update(event.get("message", {}).get("usage", {}))
            if event.get("type") == "message_delta":
                usage.update(event.get("usage", {}), **({"timings": event["timings"]} if "timings" in event else {}))
    end = time.perf_counter()
    return {"ttft_ms": 1e3 * ((first or end) - t0), "total_ms": 1e3 * (end - t0), "text": "".join(text),
            "usage": usage}


def conversation(tokens: int) -> tuple[dict, dict]:
    """Turn 1 as recorded (answer capped, greedy) and the user message turn 2 adds."""
    first = json.loads((DATA / "000009-POST-v1_messages.json").read_text())["body"]
    second = json.loads((DATA / "000010-POST-v1_messages.json").read_text())["body"]
    body = {k: v for k, v in first.items() if k not in DROP}
    body.update(max_tokens=tokens, temperature=0, stream=True)
    return body, second["messages"][-1]


def run_pair(url: str, body: dict, follow_up: dict) -> dict:
    one = turn(url, body)
    two_body = dict(body, messages=body["messages"] + [{"role": "assistant", "content": one["text"]}, follow_up])
    two = turn(url, two_body)
    return {"turn1": one, "turn2": two, "ratio": two["ttft_ms"] / one["ttft_ms"]}


def start_ours(port: int, ubatch: int | None = None) -> subprocess.Popen:
    flags = ["--spec-type", "ngram", "--spec-dm-controller", "cost", "-t", "2", "-c", "8192", "-np", "1"]
    flags += ["-ub", str(ubatch)] if ubatch else []
    return subprocess.Popen([sys.executable, "-m", "flashdraft.server.cli", "--port", str(port), *flags],
                            cwd=ROOT, env={**os.environ, "TQDM_DISABLE": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)


def start_llama_server(port: int) -> subprocess.Popen:
    from flashdraft.bench.llama_server import find_binary
    from flashdraft.targets.binding import child_env
    from flashdraft.targets.torch import default_model_path

    binary = find_binary()
    if binary is None:
        raise SystemExit("llama-server is not built: make llama-peer")
    return subprocess.Popen([str(binary), "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(port),
                             "-t", "2", "-tb", "2", "-c", "8192", "-np", "1", "--jinja"], env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="answer tokens per turn (default: 64)")
    ap.add_argument("--repeats", type=int, default=2, help="conversation pairs per server (default: 2)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--ubatch", default="", help="also run ours with these -ub values, e.g. 512 (comma-separated)")
    args = ap.parse_args()
    body, follow_up = conversation(args.tokens)
    results = {}
    servers = [("flashdraft (make serve, -c 8192 -np 1)", start_ours)]
    for ub in (int(x) for x in args.ubatch.split(",") if x):
        servers.append((f"flashdraft (make serve, -c 8192 -np 1 -ub {ub})",
                        lambda port, ub=ub: start_ours(port, ub)))
    servers.append(("llama-server (-c 8192 -np 1 --jinja)", start_llama_server))
    for name, start in servers:
        port = free_port()
        proc = start(port)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            runs = []
            for i in range(args.repeats):
                # an unrelated request first: the pair starts from a cache that does not hold it
                turn(url, {"model": "x", "max_tokens": 4, "temperature": 0, "stream": True,
                           "messages": [{"role": "user", "content": f"Say hello, number {i}."}]})
                runs.append(run_pair(url, body, follow_up))
            results[name] = runs
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print("| server | pass | turn 1 prompt tokens | turn 1 TTFT ms | turn 2 TTFT ms | turn 2 / turn 1 | "
          "turn 2 prompt: cached + new tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, runs in results.items():
        for i, r in enumerate(runs, 1):
            u = r["turn2"]["usage"]
            cached = u.get("cache_read_input_tokens", "?")
            u1 = r["turn1"]["usage"]
            n1 = u1.get("input_tokens", 0) + u1.get("cache_read_input_tokens", 0)
            print(f"| {name} | {i} | {n1} | {r['turn1']['ttft_ms']:.0f} | {r['turn2']['ttft_ms']:.0f} | "
                  f"{100 * r['ratio']:.1f}% | {cached} + {u.get('input_tokens', '?')} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
