"""The server over real HTTP: a real ``flashdraft serve`` subprocess on the packaged SmolLM2.

Two servers at most (each loads the model, ≈ 20-30 s here):

- ``server``: ``--spec-type ngram`` (no drafter weights: fast), ``--metrics``, ``-c 512``,
  the seed guide's sampling flags and a few flags this engine ignores;
- ``auth_server``: ``--spec-type dflash -md random`` (an untrained drafter: exercises the
  DFlash path, not its quality) with ``--api-key``.

Every generation is short (``max_tokens`` 1-32) and greedy unless the test says otherwise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[1]
CTX = 512
ALIAS = "smol"
API_KEY = "test-secret"
SAMPLING_FLAGS = ["--temp", "0.7", "--top-k", "64", "--top-p", "0.95", "--min-p", "0.0"]
IGNORED = ["-ngl", "all", "--flash-attn", "on", "--no-mmap"]
CHAT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
COUNTING = "1, 2, 3, 4, 5, 6,"  # greedy output is " 7, 8, 9, ...": drafts get accepted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m flashdraft.server.cli ARGS`` on a free port, its log in a file."""

    def __init__(self, args: list[str], log_path: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.health_seen: list[tuple[int, dict]] = []
        env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("LLAMA_API_KEY", None)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "flashdraft.server.cli", "--port", str(self.port),
                                      "-t", "1", *args], cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300.0) -> "ServerProcess":
        """Poll ``/health`` (recording what it answered) until 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                self.health_seen.append((r.status_code, r.json()))
                if r.status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(["--spec-type", "ngram", "--spec-dm-controller", "off", "-c", str(CTX), "--metrics", "--alias", ALIAS, "--jinja",
                       "--reasoning", "off", *SAMPLING_FLAGS, *IGNORED],
                      tmp_path_factory.mktemp("server") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    s = ServerProcess(["--spec-type", "dflash", "-md", "random", "--spec-draft-n-max", "4", "-c", str(CTX),
                       "--api-key", API_KEY], tmp_path_factory.mktemp("auth") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, path: str, body: dict | bytes, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=120, **kw)


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an event stream, in order."""
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def metric_values(server) -> dict[str, float]:
    """``/metrics`` as ``{"name{labels}": value}``."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def assert_error_shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    assert "param" in err and "code" in err
    return err


# -- start-up, info endpoints -----------------------------------------------------------------

def test_health_is_503_while_loading_then_ok(server):
    codes = [c for c, _ in server.health_seen]
    assert 503 in codes, "the model should load after uvicorn starts"
    loading = next(body for c, body in server.health_seen if c == 503)
    assert loading["error"]["type"] == "unavailable_error"
    assert server.health_seen[-1] == (200, {"status": "ok"})


def test_ignored_flags_are_logged_once(server):
    lines = [line for line in server.log().splitlines() if "ignoring flags" in line]
    assert len(lines) == 1, lines
    for flag in ("-ngl all", "--flash-attn on", "--no-mmap"):
        assert flag in lines[0]


def test_models_lists_the_alias(server):
    body = httpx.get(server.url + "/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [ALIAS]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat/completions"])
def test_any_model_name_is_served_like_llama_server(server, path):
    """llama-server with one model ignores ``model`` (the guide's script sends "local-gemma")
    and registers chat completions with and without the /v1 prefix; text completions are
    OpenAI's under /v1 and its native ``/completion`` without (as llama.cpp routes them)."""
    r = post(server, path, chat(model="local-gemma", max_tokens=3, temperature=0))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == ALIAS and r.json()["usage"]["completion_tokens"] > 0
    oai = post(server, "/v1/completions", {"prompt": "Hello", "model": "anything", "max_tokens": 2})
    assert oai.status_code == 200 and oai.json()["object"] == "text_completion", oai.text
    native = post(server, "/completions", {"prompt": "Hello", "model": "anything", "n_predict": 2})
    assert native.status_code == 200 and native.json()["stop"] is True and "content" in native.json(), native.text


def test_props_reports_the_defaults(server):
    props = httpx.get(server.url + "/props").json()
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == CTX
    assert settings["params"]["temperature"] == 0.7
    assert settings["params"]["top_k"] == 64
    assert settings["params"]["min_p"] == 0.0
    assert props["speculative"]["type"] == "ngram"
    assert "im_start" in props["chat_template"]


def test_tokenize_detokenize_round_trip(server):
    text = "<|im_start|>user\nHéllo, wörld! 你好 def f(x): return x"
    tokens = post(server, "/tokenize", {"content": text}).json()["tokens"]
    assert tokens[0] == 1  # the special token is parsed, not spelled out
    assert post(server, "/detokenize", {"tokens": tokens}).json() == {"content": text}
    pieces = post(server, "/tokenize", {"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "Hello world"


# -- completions: shapes and consistency ------------------------------------------------------

def test_openai_chat_non_stream_and_stream_agree(client):
    kw = dict(model=ALIAS, messages=CHAT, max_tokens=24, temperature=0)
    full = client.chat.completions.create(**kw)
    text = full.choices[0].message.content
    assert text and full.choices[0].finish_reason in ("stop", "length")
    timings = full.model_extra["timings"]
    assert full.usage.completion_tokens == timings["predicted_n"] > 0
    assert full.usage.prompt_tokens == timings["prompt_n"] + timings["cache_n"]
    assert full.system_fingerprint.startswith("flashdraft-")
    for key in ("prompt_ms", "prompt_per_second", "predicted_ms", "predicted_per_token_ms",
                "predicted_per_second", "draft_n", "draft_n_accepted"):
        assert key in timings

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == full.choices[0].finish_reason
    last = chunks[-1]  # the extra chunk without choices: usage and timings
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.model_extra["timings"]["predicted_n"] == timings["predicted_n"]


def test_chat_stream_shapes_like_llama_server(server):
    """First chunk: role with ``content: null``; after the finish chunk, one with ``choices: []``
    carrying usage and timings even without ``stream_options``."""
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-1]["timings"]["predicted_n"] == 6
    assert all(c["system_fingerprint"].startswith("flashdraft-") for c in chunks)


def test_two_assistant_messages_at_the_end_are_a_400(server):
    msgs = CHAT + [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
    assert "assistant messages at the end" in assert_error_shape(r, 400)["message"]


def test_completion_tokens_only_when_asked(server):
    body = {"prompt": COUNTING, "n_predict": 3, "temperature": 0}
    assert post(server, "/completion", body).json()["tokens"] == []
    assert len(post(server, "/completion", {**body, "return_tokens": True}).json()["tokens"]) == 3


def test_predicted_per_second_counts_the_decoded_tokens(server):
    t = post(server, "/completion", {"prompt": COUNTING, "n_predict": 8, "temperature": 0}).json()["timings"]
    # the first token comes from the prefill (prompt_ms); predicted_ms covers the other n-1
    assert t["predicted_per_second"] == pytest.approx(1e3 * (t["predicted_n"] - 1) / t["predicted_ms"], rel=1e-12)


def test_props_model_path_and_tokenize_byte_pieces(server):
    from flashdraft.targets.torch import default_model_path

    assert httpx.get(server.url + "/props").json()["model_path"] == str(default_model_path())
    pieces = post(server, "/tokenize", {"content": "a 😀", "with_pieces": True}).json()["tokens"]
    as_bytes = [p["piece"] for p in pieces if isinstance(p["piece"], list)]
    assert as_bytes and bytes(sum(as_bytes, [])).decode("utf-8").strip() == "😀"


def test_openai_completions_non_stream_and_stream_agree(client):
    kw = dict(model=ALIAS, prompt=COUNTING, max_tokens=16, temperature=0)
    full = client.completions.create(**kw)
    timings = full.model_extra["timings"]
    assert full.usage.completion_tokens == timings["predicted_n"] == 16
    assert full.choices[0].finish_reason == "length"
    assert timings["draft_n"] > 0  # the counting pattern is found by prompt lookup
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 16


def test_llama_completion_non_stream_and_stream_agree(server):
    body = {"prompt": COUNTING, "n_predict": 12, "temperature": 0, "return_tokens": True}
    full = post(server, "/completion", body).json()
    assert full["stop"] is True and full["stop_type"] == "limit"
    assert full["tokens_predicted"] == full["timings"]["predicted_n"] == len(full["tokens"]) == 12
    assert full["tokens_evaluated"] == full["timings"]["prompt_n"] + full["timings"]["cache_n"]
    with httpx.stream("POST", server.url + "/completion", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(e) for e in sse_events(r)]
    assert all(not e["stop"] for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == full["content"]
    assert [t for e in events for t in e["tokens"]] == full["tokens"]
    assert events[-1]["timings"]["predicted_n"] == 12


def test_token_list_prompt_equals_text_prompt(server):
    ids = post(server, "/tokenize", {"content": COUNTING}).json()["tokens"]
    a = post(server, "/completion", {"prompt": COUNTING, "n_predict": 6, "temperature": 0}).json()
    b = post(server, "/completion", {"prompt": ids, "n_predict": 6, "temperature": 0}).json()
    assert a["content"] == b["content"]


def test_stop_string_is_never_returned_or_counted(server, client):
    base = post(server, "/completion", {"prompt": COUNTING, "n_predict": 24, "temperature": 0}).json()
    full = base["content"]
    stop = " 9,"
    assert stop in full, full
    expected = full[: full.index(stop)]

    r = post(server, "/completion", {"prompt": COUNTING, "n_predict": 24, "temperature": 0, "stop": [stop],
                                     "return_tokens": True}).json()
    assert r["content"] == expected
    assert (r["stop_type"], r["stopping_word"]) == ("word", stop)
    assert r["tokens_predicted"] == r["timings"]["predicted_n"] == len(r["tokens"]) < base["tokens_predicted"]

    out = client.completions.create(model=ALIAS, prompt=COUNTING, max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == out.model_extra["timings"]["predicted_n"] == r["tokens_predicted"]

    chunks = list(client.completions.create(model=ALIAS, prompt=COUNTING, max_tokens=24, temperature=0,
                                            stop=[stop], stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == expected and stop not in streamed
    assert chunks[-1].usage.completion_tokens == r["tokens_predicted"]


def test_sampling_with_seed_is_reproducible(server):
    body = {"prompt": "Once upon a time", "n_predict": 12, "temperature": 1.0, "seed": 1234}
    a, b = (post(server, "/completion", body).json() for _ in range(2))
    assert a["content"] == b["content"] and a["generation_settings"]["seed"] == 1234


def test_metrics_count_exactly_what_was_returned(server):
    before = metric_values(server)
    r = post(server, "/completion", {"prompt": COUNTING, "n_predict": 16, "temperature": 0}).json()
    after = metric_values(server)
    t = r["timings"]

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("llamacpp:prompt_tokens_total") == t["prompt_n"]
    assert delta("llamacpp:tokens_predicted_total") == t["predicted_n"] == 16
    assert delta("llamacpp:tokens_predicted_seconds_total") > 0
    assert delta("llamacpp:spec_decode_num_draft_tokens_total") == t["draft_n"] > 0
    assert delta("llamacpp:spec_decode_num_accepted_tokens_total") == t["draft_n_accepted"]
    assert delta("llamacpp:spec_decode_num_drafts_total") >= 1
    per_pos = sum(delta(k) for k in after if k.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos_total{"))
    assert per_pos == t["draft_n_accepted"]
    assert delta('flashdraft_requests_total{endpoint="completion",status="ok"}') == 1
    assert delta("llamacpp:prompt_tokens_cached_total") == t["cache_n"]
    assert delta("llamacpp:n_decode_total") >= 2  # the prefill, then verify steps
    assert after["llamacpp:n_tokens_max"] >= t["prompt_n"] + t["cache_n"] + 16
    assert after["llamacpp:predicted_tokens_seconds"] > 0 and after["llamacpp:n_busy_slots_per_decode"] == 1.0
    assert after["llamacpp:requests_processing"] == 0  # the answer was out: the job no longer counts
    start = int(httpx.get(server.url + "/metrics").headers["Process-Start-Time-Unix"])
    assert abs(start - time.time()) < 3600


def test_client_disconnect_frees_the_slot(server):
    body = {"prompt": "Tell me a long story about a dragon.", "n_predict": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    before = metric_values(server)
    with httpx.stream("POST", server.url + "/completion", json=body, timeout=60) as r:
        next(r.iter_lines())  # generation has started; now leave
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        m = metric_values(server)
        key = 'flashdraft_requests_total{endpoint="completion",status="cancelled"}'
        if m.get("llamacpp:requests_processing") == 0 and m.get(key, 0) > before.get(key, 0):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the disconnected request kept its slot")
    # and the server still answers
    assert post(server, "/completion", {"prompt": "Hi", "n_predict": 2}).status_code == 200


# -- bad input: 4xx in OpenAI's shape, then the server still serves ------------------------------

LONG = "hello " * 600  # > CTX tokens
MSG = [{"role": "user", "content": "hi"}]


def chat(**fields) -> bytes:
    return json.dumps({"messages": MSG, **fields}).encode()


BAD_INPUT = [
    # (id, path, body, status, param or None)
    ("malformed-json", "/v1/chat/completions", b'{"messages": [', 400, None),
    ("invalid-utf8", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    ("not-an-object", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("max-tokens-string", "/v1/chat/completions", chat(max_tokens="5"), 400, "max_tokens"),
    ("max-tokens-float", "/v1/chat/completions", chat(max_tokens=5.5), 400, "max_tokens"),
    ("messages-string", "/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("stream-string", "/v1/chat/completions", chat(stream="yes"), 400, "stream"),
    ("missing-messages", "/v1/chat/completions", b'{"max_tokens": 4}', 400, "messages"),
    ("empty-messages", "/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("unknown-role", "/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(),
     400, "messages.0.role"),
    ("max-tokens-zero", "/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", "/v1/chat/completions", chat(max_tokens=-5), 400, "max_tokens"),
    ("temperature-negative", "/v1/chat/completions", chat(temperature=-1), 400, "temperature"),
    ("temperature-nan", "/v1/chat/completions", chat(temperature=float("nan")), 400, "temperature"),
    ("top-p-zero", "/v1/chat/completions", chat(top_p=0), 400, "top_p"),
    ("top-p-above-one", "/v1/chat/completions", chat(top_p=1.5), 400, "top_p"),
    ("n-two-streamed", "/v1/chat/completions", chat(n=2, stream=True), 400, "n"),
    ("too-many-stops", "/v1/chat/completions", chat(stop=[str(i) for i in range(40)]), 400, "stop"),
    ("chat-too-long", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": LONG}]}).encode(),
     400, "messages"),
    ("chat-too-long-stream", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": LONG}], "stream": True}).encode(), 400, "messages"),
    ("completions-too-long", "/v1/completions", json.dumps({"prompt": LONG}).encode(), 400, "prompt"),
    ("completions-prompt-int", "/v1/completions", b'{"prompt": 5}', 400, "prompt"),
    ("completion-too-long", "/completion", json.dumps({"prompt": LONG, "stream": True}).encode(), 400, "prompt"),
    ("completion-n-predict-string", "/completion", b'{"prompt": "x", "n_predict": "x"}', 400, "n_predict"),
    ("completion-bad-token-id", "/completion", b'{"prompt": [1, 99999999]}', 400, "prompt"),
    ("tokenize-wrong-type", "/tokenize", b'{"content": 5}', 400, "content"),
    ("detokenize-out-of-range", "/detokenize", b'{"tokens": [-1]}', 400, "tokens"),
    ("unknown-endpoint", "/v1/nothing-here", b"{}", 404, None),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_a_4xx_json_error_and_the_server_keeps_serving(server, case):
    name, path, body, status, param = case
    err = assert_error_shape(post(server, path, body), status)
    if param is not None:
        assert err["param"] == param, err
    if "too-long" in name:
        assert err["code"] == "context_length_exceeded" and err["type"] == "exceed_context_size_error"
        assert str(CTX) in err["message"] and err["n_prompt_tokens"] > CTX
    ok = post(server, "/v1/chat/completions", chat(max_tokens=2, temperature=0))
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == ok.json()["timings"]["predicted_n"]


def test_too_long_prompt_message_has_the_numbers(server):
    err = assert_error_shape(post(server, "/v1/completions", {"prompt": LONG}), 400)
    assert err["code"] == "context_length_exceeded"
    assert f"{err['n_prompt_tokens']} tokens" in err["message"] and f"context size is {CTX}" in err["message"]


def test_metrics_is_501_without_the_flag(auth_server):
    r = httpx.get(auth_server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert_error_shape(r, 501)


# -- API key, and the DFlash path with an untrained drafter -----------------------------------

@pytest.mark.parametrize("path", ["/props", "/metrics", "/v1/chat/completions", "/completion"])
def test_api_key_is_required_except_for_health_and_models(auth_server, path):
    assert httpx.get(auth_server.url + "/health").status_code == 200
    assert httpx.get(auth_server.url + "/v1/models").status_code == 200  # llama-server's public endpoints
    method = "POST" if "completion" in path else "GET"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.request(method, auth_server.url + path, headers=headers, json={"prompt": "x"})
        err = assert_error_shape(r, 401)
        assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"


def test_api_key_accepted_and_dflash_drafts(auth_server):
    c = OpenAI(base_url=auth_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    out = c.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=CHAT, max_tokens=12,
                                    temperature=0)
    t = out.model_extra["timings"]
    assert out.usage.completion_tokens == t["predicted_n"] > 0
    assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
    r = httpx.get(auth_server.url + "/v1/models", headers={"X-Api-Key": API_KEY})
    assert r.status_code == 200


def test_prompt_cache_prefills_only_the_new_turn_and_changes_nothing(auth_server):
    """Multi-turn chat with DFlash drafting: the second turn reuses the first exchange's K/V
    (target and drafter), reports it as cached, and answers exactly as without the cache."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = auth_server.url + "/v1/chat/completions"

    def ask(messages, **extra):
        r = httpx.post(url, headers=headers, timeout=120,
                       json={"messages": messages, "max_tokens": 16, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    first = ask(CHAT)
    turn2 = CHAT + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "Now make it subtract them."}]
    cached = ask(turn2)
    t, u = cached["timings"], cached["usage"]
    assert t["cache_n"] >= first["usage"]["prompt_tokens"]  # at least the whole first prompt
    assert u["prompt_tokens_details"]["cached_tokens"] == t["cache_n"]
    assert u["prompt_tokens"] == t["prompt_n"] + t["cache_n"]
    slots = httpx.get(auth_server.url + "/slots", headers=headers).json()
    assert slots[0]["n_cached"] >= u["prompt_tokens"] and not slots[0]["is_processing"]
    fresh = ask(turn2, cache_prompt=False)
    assert fresh["timings"]["cache_n"] == 0 and fresh["timings"]["prompt_n"] == u["prompt_tokens"]
    assert fresh["choices"][0]["message"]["content"] == cached["choices"][0]["message"]["content"]


# -- flags (no server) ----------------------------------------------------------------------

GUIDE_BASELINE = ("-m /models/target.gguf --host 127.0.0.1 --port 8080 -np 1 -ngl all -b 2048 -ub 512 "
                  "--ctx-size 32768 --cache-type-k q5_0 --cache-type-v q4_1 --flash-attn on --jinja --metrics "
                  "--log-timestamps --log-prefix --reasoning off --temp 0.7 --top-k 64 --top-p 0.95 --min-p 0.0")
GUIDE_DFLASH = (GUIDE_BASELINE + " --spec-draft-model /models/drafter.gguf --spec-type dflash "
                "--spec-dflash-cross-ctx 1024 --kv-unified --spec-draft-ngl all --cache-ram 0 --no-mmap --mlock "
                "--no-host")


def test_seed_guide_command_lines_parse():
    from flashdraft.server.cli import build_parser, engine_config_from_args, ignored_flags, settings_from_args

    base = build_parser().parse_args(GUIDE_BASELINE.split())
    assert (base.host, base.port, base.ctx_size, base.parallel) == ("127.0.0.1", 8080, 32768, 1)
    s = settings_from_args(base)
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.metrics, s.reasoning) == (0.7, 64, 0.95, 0.0, True, "off")
    assert s.template_kwargs() == {"enable_thinking": False}
    assert ignored_flags(base) == ["-ngl all", "--flash-attn on"]
    # -b and -ub are real: the prefill chunk of a slot beside others, rows per llama.cpp decode
    assert s.batch_size == 2048 and engine_config_from_args(base).ubatch == 512
    kv = engine_config_from_args(base).kv_spec()
    assert (kv.type_k, kv.type_v) == ("q5_0", "q4_1")  # the guide's compressed cache is real
    # -m without a drafter decodes plainly, as llama-server does without a draft model
    assert engine_config_from_args(base).spec_type == "none" and settings_from_args(base).spec_type == "none"

    dflash = build_parser().parse_args(GUIDE_DFLASH.split())
    cfg = engine_config_from_args(dflash)
    assert (cfg.model, cfg.draft_model, cfg.spec_type, cfg.cross_ctx, cfg.ctx_size, cfg.n_draft) == (
        "/models/target.gguf", "/models/drafter.gguf", "dflash", 1024, 32768, 16)
    assert set(ignored_flags(dflash)) == set(ignored_flags(base)) | {
        "--spec-draft-ngl all", "--kv-unified", "--no-mmap", "--mlock", "--no-host"}


def test_bad_cache_flags_are_refused_before_binding_or_loading(caplog):
    from flashdraft.server.cli import main as serve_main

    for flags in (["--kv-tail-tokens", "-1"], ["-c", "256", "--kv-sink-tokens", "1000"],
                  ["-ctk", "q8_0", "--kv-tail-tokens", "8", "--spec-draft-n-max", "64"]):
        caplog.clear()
        assert serve_main(["--port", "1", *flags]) == 1  # port 1 would fail to bind: never reached
        assert any("kv-" in r.getMessage() or "spec-draft-n-max" in r.getMessage() for r in caplog.records)


def test_serve_flags_work_on_a_subparser_and_unknown_flags_exit_2(capsys):
    import argparse

    from flashdraft.server.cli import add_arguments

    parser = argparse.ArgumentParser(prog="flashdraft")
    add_arguments(parser.add_subparsers(dest="command").add_parser("serve"))
    args = parser.parse_args(["serve", "-md", "d", "--spec-type", "ngram", "-c", "128", "-fa", "--api-key", "k"])
    assert (args.spec_draft_model, args.spec_type, args.ctx_size, args.api_key) == ("d", "ngram", 128, "k")
    for bad in (["serve", "--no-such-flag"], ["serve", "--spec-type", "medusa"], ["serve", "-c", "-1"]):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(bad)
        assert e.value.code == 2
    capsys.readouterr()


def test_api_key_defaults_to_llama_api_key(monkeypatch):
    from flashdraft.server.cli import build_parser

    monkeypatch.setenv("LLAMA_API_KEY", "from-env")
    assert build_parser().parse_args([]).api_key == "from-env"


def test_drafting_only_when_asked():
    from flashdraft.server.cli import build_parser, engine_config_from_args

    def mode(line: str) -> str:
        return engine_config_from_args(build_parser().parse_args(line.split())).spec_type

    assert mode("") == "none"  # the packaged model alone: plain, like llama-server without -md
    assert mode("-m /models/target.gguf") == "none"
    assert mode("--spec-type dflash") == "dflash"  # the shipped drafter
    assert mode("-m t.gguf -md d.gguf") == "dflash"
    assert mode("-md d.gguf --spec-type hybrid") == "hybrid"
    serve_flags = next(x for x in (ROOT / "Makefile").read_text().splitlines() if x.startswith("SERVE_FLAGS"))
    assert mode(serve_flags.split(":=")[1]) != "none"  # `make serve` asks for drafting explicitly


def test_n_predict_is_the_default_for_requests_without_a_limit_not_a_cap():
    from types import SimpleNamespace

    from flashdraft.server.jobs import make_job
    from flashdraft.server.request import GenRequest
    from flashdraft.server.state import ServerSettings, ServerState

    state = ServerState(ServerSettings(n_predict=5))
    state.generator = SimpleNamespace(ctx_size=100, check_prompt=lambda n: None, context_shift=False)

    def limit(st, prompt, max_tokens):
        return make_job(st, prompt, GenRequest(api="completion", prompts=[""], max_tokens=max_tokens)).max_tokens

    assert limit(state, [1, 2, 3], None) == 5
    assert limit(state, [1, 2, 3], -1) == 5
    assert limit(state, [1, 2, 3], 20) == 20  # the request wins
    assert limit(state, [1] * 90, 20) == 10  # never past the context
    unlimited = ServerState(ServerSettings(n_predict=-1))
    unlimited.generator = state.generator
    assert limit(unlimited, [1, 2, 3], None) == 97


# -- logprobs, logit_bias, fields the engine does not implement ------------------------------

def test_chat_logprobs_stream_and_not(client):
    kw = dict(model=ALIAS, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 8
    assert "".join(e.token for e in content) == full.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token  # greedy: the answer is the most likely token
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token or "\ufffd" in e.token
    streamed = [e for c in client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-3)
    plain = client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_probabilities_are_the_same_with_and_without_drafting(server, auth_server):
    """The ngram server and the DFlash server give the same tokens and log-probabilities."""
    body = {"prompt": COUNTING, "n_predict": 10, "temperature": 0, "n_probs": 2}
    a = post(server, "/completion", body).json()
    b = httpx.post(auth_server.url + "/completion", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert a["timings"]["draft_n"] > 0 and b["timings"]["draft_n"] > 0
    pa, pb = a["completion_probabilities"], b["completion_probabilities"]
    assert len(pa) == len(pb) == 10
    # `-md random` runs on the torch backend; the ngram server on llama where it is installed:
    # the same tokens, and log-probabilities as close as the two engines' kernels allow
    backends = {httpx.get(server.url + "/props", timeout=30).json()["backend"],
                httpx.get(auth_server.url + "/props", timeout=30,
                          headers={"Authorization": f"Bearer {API_KEY}"}).json()["backend"]}
    tol = 1e-3 if len(backends) == 1 else 5e-2  # ggml quantises activations to 8 bits in its matmuls
    for x, y in zip(pa, pb):
        assert x["id"] == y["id"] and x["logprob"] == pytest.approx(y["logprob"], abs=tol)
        if len(backends) == 1:
            assert [t["id"] for t in x["top_logprobs"]] == [t["id"] for t in y["top_logprobs"]]
        else:  # across engines a near tie below the top token may order either way (ggml's AVX512 kernels)
            assert x["top_logprobs"][0]["id"] == y["top_logprobs"][0]["id"] == x["id"]
            assert x["top_logprobs"][0]["logprob"] == pytest.approx(y["top_logprobs"][0]["logprob"], abs=tol)
    oai = post(server, "/v1/completions", {"prompt": COUNTING, "max_tokens": 4, "temperature": 0, "logprobs": 2}).json()
    lp = oai["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert "".join(lp["tokens"]) == oai["choices"][0]["text"] and lp["text_offset"][0] == 0


def test_logit_bias_in_every_form(server):
    body = {"prompt": COUNTING, "n_predict": 6, "temperature": 0, "return_tokens": True}
    base = post(server, "/completion", body).json()
    first = base["tokens"][0]
    for bias in ([[first, False]], {str(first): -100}, [[base["content"][:2], False]], {base["content"][:2]: False}):
        r = post(server, "/completion", {**body, "logit_bias": bias}).json()
        assert first not in r["tokens"] and r["content"] != base["content"], bias
    boosted = post(server, "/completion", {**body, "n_predict": 3, "logit_bias": {"28": 100}}).json()
    assert boosted["tokens"] == [28, 28, 28]
    for bad in ({"99999999": 1}, [[1, "x"]], [[1]], {"a": "x"}):
        assert_error_shape(post(server, "/completion", {**body, "logit_bias": bad}), 400)


@pytest.mark.parametrize("fields,ok", [({"repeat_penalty": 1.0, "user": "me", "id_slot": 0}, True),
                                       ({"repeat_penalty": 1.1}, False), ({"frequency_penalty": 0.5}, False),
                                       ({"mirostat": 2}, False), ({"typical_p": 0.5}, False),
                                       ({"frobnicate": 1}, False), ({"tools": [], "tool_choice": "auto"}, True)])
def test_fields_that_would_change_the_answer_are_refused_by_name(server, fields, ok):
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "temperature": 0, **fields})
    if ok:
        assert r.status_code == 200, r.text
    else:
        err = assert_error_shape(r, 400)
        assert err["param"] in fields and err["code"] == "unsupported_field"


def test_a_length_stop_inside_a_character_returns_no_broken_bytes(server):
    """Token 40303 is ' ' plus the first 3 bytes of a 4-byte emoji: forced as the only answer
    token, the answer is cut inside the character, stream and not."""
    body = {"prompt": "Reply only with five emojis", "n_predict": 1, "temperature": 0,
            "logit_bias": [[40303, 100]], "return_tokens": True}
    r = post(server, "/completion", body).json()
    assert r["tokens"] == [40303] and r["stop_type"] == "limit"
    assert "\ufffd" not in r["content"]
    with httpx.stream("POST", server.url + "/completion", json={**body, "stream": True}, timeout=120) as s:
        streamed = "".join(json.loads(e)["content"] for e in sse_events(s))
    assert streamed == r["content"]
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Five emojis"}],
                                                 "max_tokens": 1, "temperature": 0,
                                                 "logit_bias": {"40303": 100}}).json()
    assert "\ufffd" not in chat["choices"][0]["message"]["content"]
