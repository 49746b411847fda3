"""Real coding agents' traffic, replayed: the requests Claude Code, Codex CLI, aider and opencode
sent to ``flashdraft serve`` (recorded by ``scripts/agents_check.sh`` with ``--dump-requests``,
credentials scrubbed, in ``tests/data/agents/<agent>/``) are sent again, verbatim, to a real
server on the packaged SmolLM2-135M-Instruct, and each answer must be a 2xx whose body or
event stream is well formed as its API specifies (every event validated by the official
``openai`` / ``anthropic`` SDK's types, in the order the API gives). No network, no npm.

What is changed before sending, to keep the file within its budget (≤ 120 s on 2 CPU cores):

- the answer's length: ``max_tokens`` (Chat Completions, Messages; also added where the agent
  sent none, as aider does) and ``max_output_tokens`` (Responses) are set to
  :data:`REPLAY_TOKENS`. The agents asked for 512-64000; the server caps those at what the
  context holds, which is not what this file tests.
- prompts longer than :data:`FULL_PROMPT_TOKENS` (1500; as the recording's own ``timings`` counted
  them) are not prefilled: the 135M model prefills about 100-200 tokens/s here, so opencode's
  7.4k-token first prompt alone would take most of the budget. Such a body goes, verbatim but
  for the fields the counting route does not take, through the API's token-counting route
  (``/v1/messages/count_tokens``, ``/v1/chat/completions/input_tokens``): the same parsing,
  validation, tool preamble and chat template as a generation, without the prefill, and the
  count must equal the recorded prompt's. (A later turn counts too: its history holds the
  recorded answer, not the replay's 4 tokens, so the prompt cache would not cover it.) Codex
  CLI's one Responses body (Responses has no
  counting route here) is replayed in full, as it is the only request of its API.

The bodies are the agents' own, not hand-written: a server change that refuses a field one of
them sends, breaks a stream event's shape or order, or changes how their tools are rendered
(the token count) fails here. The middleware that recorded them and ``HEAD`` on ``GET`` routes
(Claude Code probes ``HEAD /`` first) are tested on the tiny model at the end.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from pydantic import TypeAdapter

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data" / "agents"
REPLAY_TOKENS = 4
FULL_PROMPT_TOKENS = 1500
#: the server as the check ran it, with one slot: each slot holds 8192 tokens
SERVER_ARGS = ["--spec-type", "ngram", "-c", "8192", "-np", "1", "-t", "2"]
GENERATION = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/messages": "messages",
              "/v1/responses": "responses", "/responses": "responses"}
COUNT_ROUTES = {"messages": "/v1/messages/count_tokens", "chat": "/v1/chat/completions/input_tokens"}
#: fields a counting route does not take (Anthropic's count_tokens has no answer to size)
NOT_COUNTED = {"messages": {"max_tokens", "stream", "temperature", "top_p", "top_k", "stop_sequences", "metadata",
                            "service_tier", "context_management", "output_config"},
               "chat": {"stream", "stream_options"}}


def recordings() -> list[tuple[str, dict]]:
    out = []
    for folder in sorted(p for p in DATA.iterdir() if p.is_dir()):
        for path in sorted(folder.glob("*.json")):
            out.append((f"{folder.name}/{path.stem}", json.loads(path.read_text(encoding="utf-8"))))
    return out


RECORDINGS = recordings()


def recorded_prompt_tokens(record: dict) -> int | None:
    """The prompt's length as the recorded answer's ``timings`` / ``usage`` gave it."""
    response = record.get("response") or {}
    events = [response["json"]] if "json" in response else [
        json.loads(line[5:]) for line in response.get("text", "").splitlines()
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]")]
    for event in reversed(events):
        for holder in (event, event.get("response") or {}):
            t = holder.get("timings")
            if isinstance(t, dict) and "prompt_n" in t:
                return t["prompt_n"] + t.get("cache_n", 0)
            u = holder.get("usage")
            if isinstance(u, dict) and "prompt_tokens" in u:
                return u["prompt_tokens"]
    return None


def replay_kind(record: dict) -> str:
    """``full`` (sent as recorded, shorter answer), ``count`` (through the counting route) or
    ``plain`` (a GET / HEAD)."""
    if record["method"] != "POST":
        return "plain"
    api = GENERATION[record["path"]]
    n = recorded_prompt_tokens(record)
    return "count" if api in COUNT_ROUTES and n is not None and n > FULL_PROMPT_TOKENS else "full"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("replay") / "server.log", "wb")
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("LLAMA_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "flashdraft.server.cli", "--port", str(port), *SERVER_ARGS],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server not ready after 120 s"
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def shortened(api: str, body: dict) -> dict:
    body = dict(body)
    if api == "responses":
        body["max_output_tokens"] = REPLAY_TOKENS
    else:
        body["max_tokens"] = REPLAY_TOKENS
        body.pop("max_completion_tokens", None)
    return body


def sse(text: str) -> list[tuple[str | None, str]]:
    """An event stream's events as ``(event name or None, data)``; comments (``: ping``) skipped."""
    events, name, data = [], None, []
    for line in text.splitlines() + [""]:
        if not line:
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    return events


def check_chat(body: dict, r: httpx.Response) -> int:
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    if not body.get("stream"):
        out = ChatCompletion.model_validate(r.json())
        assert out.choices and out.choices[0].finish_reason in ("stop", "length", "tool_calls")
        return out.usage.completion_tokens
    events = sse(r.text)
    assert events[-1][1] == "[DONE]", events[-3:]
    chunks = [ChatCompletionChunk.model_validate(json.loads(d)) for _, d in events[:-1]]
    assert any(c.choices and c.choices[0].finish_reason for c in chunks), "no chunk ends the choice"
    usage = [c.usage for c in chunks if c.usage is not None]
    if (body.get("stream_options") or {}).get("include_usage"):
        assert len(usage) == 1 and not chunks[-1].choices and chunks[-1].usage is not None
    return usage[-1].completion_tokens if usage else sum(1 for c in chunks if c.choices and c.choices[0].delta.content)


def check_messages(body: dict, r: httpx.Response) -> int:
    from anthropic.types import Message, RawMessageStreamEvent

    if not body.get("stream"):
        return Message.model_validate(r.json()).usage.output_tokens
    events = [(name, json.loads(d)) for name, d in sse(r.text)]
    events = [(name, e) for name, e in events if e.get("type") != "ping"]  # the SDK skips pings
    adapter = TypeAdapter(RawMessageStreamEvent)
    parsed = [adapter.validate_python(e) for _, e in events]
    assert all(name == e["type"] for name, e in events), "event: name differs from its data's type"
    types = [e.type for e in parsed]
    assert types[0] == "message_start" and types[-1] == "message_stop" and types[-2] == "message_delta", types
    open_blocks: set[int] = set()
    for e in parsed:  # every delta inside its block's start and stop
        if e.type == "content_block_start":
            assert e.index not in open_blocks
            open_blocks.add(e.index)
        elif e.type == "content_block_delta":
            assert e.index in open_blocks
        elif e.type == "content_block_stop":
            open_blocks.remove(e.index)
    assert not open_blocks
    delta = parsed[-2]
    assert delta.delta.stop_reason in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    assert parsed[0].message.usage.input_tokens == delta.usage.input_tokens
    return delta.usage.output_tokens


def _as_llama_server_usage(value):
    """``usage.input_tokens_details`` with ``cache_write_tokens: 0`` added where missing: the
    ``openai`` SDK's type requires the field (OpenAI's API added it), llama-server's Responses
    answers leave it out and so do ours (no client reads it; Codex CLI does not)."""
    if isinstance(value, dict):
        details = (value.get("usage") or {}).get("input_tokens_details") if isinstance(value.get("usage"), dict) else None
        if isinstance(details, dict):
            details.setdefault("cache_write_tokens", 0)
        for v in value.values():
            _as_llama_server_usage(v)
    return value


def check_responses(body: dict, r: httpx.Response) -> int:
    from openai.types.responses import Response, ResponseStreamEvent

    if not body.get("stream"):
        return Response.model_validate(_as_llama_server_usage(r.json())).usage.output_tokens
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [(name, _as_llama_server_usage(json.loads(d))) for name, d in sse(r.text)]
    parsed = [adapter.validate_python(e) for _, e in events]
    assert all(name in (None, e["type"]) for name, e in events), "event: name differs from its data's type"
    types = [e.type for e in parsed]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete"), types
    seqs = [e.sequence_number for e in parsed]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    final = parsed[-1].response
    assert final.status in ("completed", "incomplete") and final.output
    added = [e.item.id for e in parsed if e.type == "response.output_item.added"]
    done = [e.item.id for e in parsed if e.type == "response.output_item.done"]
    assert added == done == [item.id for item in final.output]
    return final.usage.output_tokens


CHECKS = {"chat": check_chat, "messages": check_messages, "responses": check_responses}


@pytest.mark.real
@pytest.mark.parametrize("name,record", RECORDINGS, ids=[n for n, _ in RECORDINGS])
def test_an_agents_request_is_answered_as_its_api_says(server, name, record):
    kind = replay_kind(record)
    if kind == "plain":
        r = httpx.request(record["method"], server + record["path"], timeout=30)
        assert 200 <= r.status_code < 300, (r.status_code, r.text[:300])
        if record["method"] == "HEAD":
            assert r.content == b""
        return
    api = GENERATION[record["path"]]
    body = record["body"]
    if kind == "count":
        counted = {k: v for k, v in body.items() if k not in NOT_COUNTED[api]}
        r = httpx.post(server + COUNT_ROUTES[api], json=counted, timeout=120)
        assert r.status_code == 200, r.text[:500]
        assert r.json()["input_tokens"] == recorded_prompt_tokens(record)
        return
    r = httpx.post(server + record["path"], json=shortened(api, body), timeout=300,
                   headers={"accept": "text/event-stream" if body.get("stream") else "application/json"})
    assert 200 <= r.status_code < 300, r.text[:500]
    assert r.headers["content-type"].startswith("text/event-stream" if body.get("stream") else "application/json")
    assert 0 < CHECKS[api](body, r) <= REPLAY_TOKENS


def test_every_agent_has_recordings_and_they_hold_no_credentials():
    agents = {name.split("/")[0] for name, _ in RECORDINGS}
    assert agents == {"claude", "codex", "aider", "opencode"}, agents
    for name, record in RECORDINGS:
        text = json.dumps(record)
        assert "authorization" not in record["headers"] and "x-api-key" not in record["headers"], name
        assert "sk-ant-" not in text and "ghp_" not in text, name
        if record["method"] == "POST":
            assert record["status"] == 200 and isinstance(record["body"], dict), name
    kinds = {replay_kind(r) for _, r in RECORDINGS}
    assert kinds == {"full", "count", "plain"}, kinds


# --- the recording middleware and HEAD, on the tiny model ---------------------------------------


def _serve_tiny(tmp_path: Path):
    from inproc import free_port, new_generator

    from flashdraft.server.app import create_app
    from flashdraft.server.state import ServerSettings

    app = create_app(new_generator(), ServerSettings(alias="tiny", spec_type="ngram"), dump_requests=str(tmp_path))
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        assert thread.is_alive()
        time.sleep(0.02)
    return srv, thread, f"http://127.0.0.1:{port}"


def test_dump_requests_writes_one_scrubbed_file_per_request(tmp_path):
    from inproc import PROMPT

    srv, thread, url = _serve_tiny(tmp_path)
    secret = "sk-ant-api03-" + "A" * 40
    try:
        headers = {"Authorization": f"Bearer {secret}", "x-api-key": secret, "Cookie": "session=abc",
                   "X-Trace": "t1"}
        body = {"messages": [{"role": "user", "content": f"{PROMPT} key {secret}"}], "max_tokens": 3,
                "metadata": {"api_key": "plain-secret"}}
        ok = httpx.post(url + "/v1/messages", json=body, headers=headers, timeout=60)
        assert ok.status_code == 200, ok.text
        stream = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "stream": True})
        assert stream.status_code == 200
        bad = httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=60)
        assert bad.status_code == 400
        assert httpx.get(url + "/health?x=1", timeout=60).status_code == 200
        for _ in range(100):  # each file is written once its response has ended
            if len(list(tmp_path.glob("*.json"))) == 4:
                break
            time.sleep(0.05)
    finally:
        srv.should_exit = True
        thread.join(10)
    files = sorted(tmp_path.glob("*.json"))
    assert [f.name for f in files] == ["000001-POST-v1_messages.json", "000002-POST-v1_chat_completions.json",
                                       "000003-POST-v1_chat_completions.json", "000004-GET-health.json"]
    msg, chat, refused, health = (json.loads(f.read_text()) for f in files)
    everything = "".join(f.read_text() for f in files)
    assert secret not in everything and "plain-secret" not in everything and "session=abc" not in everything
    assert "authorization" not in msg["headers"] and "x-api-key" not in msg["headers"]
    assert "cookie" not in msg["headers"] and msg["headers"]["x-trace"] == "t1"
    assert msg["body"]["messages"][0]["content"] == f"{PROMPT} key [scrubbed]"
    assert msg["body"]["metadata"] == {"api_key": "[scrubbed]"} and msg["body"]["max_tokens"] == 3
    assert msg["status"] == 200 and msg["elapsed_ms"] >= msg["ttfb_ms"] > 0
    assert msg["response"]["json"]["type"] == "message"
    assert chat["response"]["content_type"].startswith("text/event-stream")
    assert chat["response"]["text"].rstrip().endswith("data: [DONE]") and not chat["response"]["truncated"]
    assert refused["status"] == 400 and refused["body_text"] == "{not json" and "body" not in refused
    assert health["method"] == "GET" and health["query"] == "x=1" and "body" not in health
    assert [r["seq"] for r in (msg, chat, refused, health)] == [1, 2, 3, 4]


def test_scrub_keeps_token_counts_and_replaces_credentials():
    from flashdraft.server.request_dump import scrub

    value = {"max_tokens": 5, "input_tokens": 3, "prompt_cache_key": "abc", "apiKey": "x", "password": "y",
             "nested": [{"access_token": "z", "text": "use ghp_" + "b" * 30 + " here"}]}
    assert scrub(value) == {"max_tokens": 5, "input_tokens": 3, "prompt_cache_key": "abc", "apiKey": "[scrubbed]",
                            "password": "[scrubbed]",
                            "nested": [{"access_token": "[scrubbed]", "text": "use [scrubbed] here"}]}


def test_head_is_answered_on_every_get_route(tmp_path):
    srv, thread, url = _serve_tiny(tmp_path)
    try:
        for path in ("/", "/health", "/v1/models", "/props"):
            r = httpx.head(url + path, timeout=30)
            assert r.status_code == 200, (path, r.status_code)
            assert r.content == b""
        assert httpx.head(url + "/v1/chat/completions", timeout=30).status_code == 405  # POST only
    finally:
        srv.should_exit = True
        thread.join(10)


def test_dump_requests_flag_is_documented():
    from flashdraft.server.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["--dump-requests", "d"]).dump_requests == "d"
    assert parser.parse_args([]).dump_requests is None
    assert "--dump-requests DIR" in parser.format_help()


def test_a_prefilling_responses_stream_keeps_codex_alive_with_events(tmp_path):
    """Codex CLI drops a Responses stream after 300 s without an *event* (SSE comments do not
    count) and sends the request again: the check saw it twice on a 5.4k-token first prompt.
    While the prompt prefills, the keep-alives are ``response.created``, ``response.in_progress``
    and more ``response.in_progress`` events, numbered in order, which the SDK reads as usual."""
    from inproc import chat_target, serve
    from openai import OpenAI
    from test_sse_ping import HeldPrefill

    from flashdraft.drafters.ngram import NgramDrafter

    gen = HeldPrefill(chat_target(), NgramDrafter(), ctx_size=128, n_draft=4)
    body = {"model": "tiny", "input": "t5 t9 t17 t3", "max_output_tokens": 6, "temperature": 0, "stream": True}
    with serve(gen, sse_ping_interval=0.05) as url:
        timer = threading.Timer(0.4, gen.release.set)
        timer.start()
        r = httpx.post(url + "/v1/responses", json=body, timeout=20)
        timer.join()
        assert r.status_code == 200 and ": ping" not in r.text
        events = [(name, json.loads(d)) for name, d in sse(r.text)]
        types = [e["type"] for _, e in events]
        assert types[:3] == ["response.created", "response.in_progress", "response.in_progress"], types[:5]
        assert types.count("response.created") == 1 and types[-1] == "response.completed"
        assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
        assert 0 < check_responses(body, r) <= 6
        gen.release.clear()
        timer = threading.Timer(0.3, gen.release.set)
        timer.start()
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=20)
        streamed = "".join(e.delta for e in client.responses.create(**{**body, "stream": True})
                           if e.type == "response.output_text.delta")
        timer.join()
        full = client.responses.create(**{**body, "stream": False})
        assert streamed == full.output_text and streamed
