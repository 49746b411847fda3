"""The server under bad input, fuzzing, disconnects, a queue, SIGTERM and a small soak.

Everything goes over real HTTP. Most tests use our server in a thread on the tiny random
target (``inproc.py``): they test the HTTP layer, the queue and cancellation, which do not
depend on the model. The SIGTERM test starts a real ``flashdraft serve`` subprocess on the
packaged SmolLM2 (``real`` mark) and also checks the chat page there.

The bad-input cases here are those ``tests/test_server.py`` does not already cover on the
real model (malformed JSON, wrong types, empty messages, unknown roles, max_tokens <= 0 or
huge, temperature < 0 or NaN, top_p out of range, too many stops, a too-long prompt,
n > 1, unknown endpoint and model, invalid UTF-8 bytes, API key).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inproc import PROMPT, metric_values, new_generator, serve, wait_for

from flashdraft.server.limits import Limits

ROOT = Path(__file__).resolve().parents[1]
BODY_LIMIT = 64 * 1024
CTX = 256
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fast():
    """No pause between steps: bad input and fuzzing."""
    generator = new_generator(ctx_size=CTX)
    with serve(generator, metrics=True, limits=Limits(body_bytes=BODY_LIMIT)) as url:
        yield url, reference(url)


@pytest.fixture(scope="module")
def paced():
    """50 ms between steps, so requests are still running when the test acts."""
    generator = new_generator(delay=0.05, ctx_size=CTX)
    with serve(generator, metrics=True) as url:
        yield url, generator


def reference(url: str) -> str:
    """A greedy answer: the same before and after anything the tests throw at the server."""
    r = httpx.post(url + CHAT, timeout=60, json={"messages": [{"role": "user", "content": PROMPT}],
                                                 "temperature": 0, "max_tokens": 8})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def assert_clean(url: str, ref: str) -> None:
    """Nothing half-applied: no request left running or queued, and the next request gets
    exactly the answer it got before."""
    m = metric_values(url)
    assert m["llamacpp:requests_processing"] == 0 and m["llamacpp:requests_deferred"] == 0, m
    assert reference(url) == ref


def assert_error_shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert "param" in err and "code" in err
    return err


def chat(**fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "t1 t2"}], **fields}).encode()


def chunked(data: bytes, size: int = 16 * 1024):
    """A body without Content-Length (chunked transfer): the limit must hold while reading."""
    for i in range(0, len(data), size):
        yield data[i:i + size]


# -- bad input ---------------------------------------------------------------------------------

BIG = b'{"messages": [{"role": "user", "content": "' + b"t1 " * (BODY_LIMIT // 3 + 10) + b'"}]}'
BAD_INPUT = [
    # (id, method, path, body, status, param or None)
    ("body-over-limit", "POST", CHAT, BIG, 413, None),
    ("body-over-limit-chunked", "POST", CHAT, "chunked", 413, None),
    ("empty-body", "POST", CHAT, b"", 400, None),
    ("json-null", "POST", CHAT, b"null", 400, None),
    ("nested-too-deep", "POST", CHAT, b"[" * 50_000, 400, None),
    ("huge-number-literal", "POST", CHAT, b'{"max_tokens": ' + b"9" * 5000 + b"}", 400, None),
    ("lone-surrogate", "POST", CHAT, rb'{"messages": [{"role": "user", "content": "a\ud800b"}]}', 400, None),
    ("lone-surrogate-tokenize", "POST", "/tokenize", rb'{"content": "\udfff"}', 400, None),
    ("utf8-overlong", "POST", CHAT, b'{"messages": [{"role": "user", "content": "\xc0\xaf"}]}', 400, None),
    ("stop-string-too-long", "POST", CHAT, chat(stop=["x" * 600]), 400, "stop"),
    ("temperature-infinity", "POST", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": Infinity}',
     400, "temperature"),
    ("top-p-nan", "POST", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}', 400, "top_p"),
    ("top-k-negative", "POST", CHAT, chat(top_k=-1), 400, "top_k"),
    ("min-p-above-one", "POST", CHAT, chat(min_p=2), 400, "min_p"),
    ("seed-beyond-uint64", "POST", CHAT, chat(seed=2**64), 400, "seed"),
    ("message-not-an-object", "POST", CHAT, b'{"messages": ["hi"]}', 400, "messages.0"),
    ("content-image-part", "POST", CHAT,
     json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}).encode(),
     400, "messages.0.content.0.type"),
    ("stream-options-not-object", "POST", CHAT, chat(stream=True, stream_options=True), 400, "stream_options"),
    ("top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("top-logprobs-over-limit", "POST", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("unsupported-field", "POST", CHAT, chat(repeat_penalty=1.3), 400, "repeat_penalty"),
    ("template-kwargs-not-object", "POST", CHAT, chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    ("completions-empty-prompt", "POST", "/v1/completions", b'{"prompt": ""}', 400, "prompt"),
    ("completions-stream-two-prompts", "POST", "/v1/completions", b'{"prompt": ["a", "b"], "stream": true}', 400,
     "prompt"),
    ("completion-n-predict-zero", "POST", "/completion", b'{"prompt": "t1", "n_predict": 0}', 400, "n_predict"),
    ("detokenize-huge-id", "POST", "/detokenize", json.dumps({"tokens": [2**70]}).encode(), 400, "tokens"),
    ("unknown-endpoint-get", "GET", "/v1/nothing-here", None, 404, None),
    ("wrong-method", "GET", CHAT, None, 405, None),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_a_4xx_json_error_and_nothing_is_half_applied(fast, case):
    url, ref = fast
    _, method, path, body, status, param = case
    content = chunked(BIG) if body == "chunked" else body
    r = httpx.request(method, url + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json"} if body is not None else {})
    err = assert_error_shape(r, status)
    if param is not None:
        assert err["param"] == param, err
    if status == 413:
        assert str(BODY_LIMIT) in err["message"]
    assert_clean(url, ref)


API_ROUTES = [("GET", "/props"), ("GET", "/metrics"), ("GET", "/slots"), ("POST", "/tokenize"), ("POST", "/detokenize"),
              ("POST", CHAT), ("POST", "/chat/completions"), ("POST", "/v1/completions"), ("POST", "/completion"),
              ("POST", "/completions"), ("POST", "/apply-template"), ("POST", "/v1/chat/completions/input_tokens"),
              ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/v1/nothing-here")]


def test_api_key_guards_every_api_route_but_health_models_and_the_page():
    with serve(new_generator(), api_key="sesame", metrics=True) as url:
        for method, path in API_ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "nope"}):
                r = httpx.request(method, url + path, headers=headers, json={"content": "t1"})
                assert assert_error_shape(r, 401)["code"] == "invalid_api_key", (method, path)
        # llama-server's public endpoints (/health, /models) and the chat page's files
        for path in ("/health", "/v1/health", "/models", "/v1/models", "/", "/index.html", "/static/chat.js",
                     "/static/chat.css"):
            assert httpx.get(url + path).status_code == 200, path
        ok = httpx.post(url + "/tokenize", json={"content": "t1"}, headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200


def test_default_bind_is_loopback():
    from flashdraft.server.cli import build_parser

    assert build_parser().parse_args([]).host == "127.0.0.1"


# -- fuzz: random request bodies, never a 5xx ------------------------------------------------------

WORDS = st.lists(st.integers(0, 63).map(lambda i: f"t{i}"), max_size=10).map(" ".join)
SOME_WORDS = WORDS.filter(bool)
TEXT = st.one_of(WORDS, WORDS, st.text(max_size=12))
JSON_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
#: values at and just past the edges of the numeric fields
EDGES = st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, 1e308, -0.0, 0.5, 1.0000001, "", [], {}, None])

# valid values for every field; the fuzz then breaks a few of them (see REQUESTS)
SAMPLING = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 100),
    "min_p": st.floats(0, 1), "seed": st.integers(-1, 2**64 - 1), "stream": st.booleans(),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)), "ignore_eos": st.booleans(), "model": st.just("tiny"),
}
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
     "content": st.one_of(SOME_WORDS, SOME_WORDS, SOME_WORDS, TEXT, st.none(), st.lists(TEXT_PART, max_size=2))},
    optional={"name": WORDS})
OPENAI = {"max_tokens": st.integers(1, 24), "n": st.integers(1, 3), "verbose": st.booleans(),
          "timings_per_token": st.booleans(), "post_sampling_probs": st.booleans(),
          "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
          "logit_bias": st.dictionaries(st.integers(0, 63).map(str), st.floats(-100, 100), max_size=3),
          "cache_prompt": st.booleans(),
          "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                              {"type": "json_schema", "json_schema": {"schema": {"type": "string"}}}])}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}
LLAMA = {"n_probs": st.integers(0, 3), "return_tokens": st.booleans(), "cache_prompt": st.booleans(),
         "timings_per_token": st.booleans(), "post_sampling_probs": st.booleans(),
         "response_fields": st.lists(st.sampled_from(["content", "prompt", "generation_settings/n_predict", "x/y"]),
                                     max_size=3),
         "logit_bias": st.lists(st.tuples(st.integers(0, 63), st.one_of(st.floats(-5, 5), st.just(False))).map(list),
                                max_size=3),
         "grammar": st.sampled_from(['root ::= "t1" | "t2"', "root ::= [a-z]+"]),
         "json_schema": st.just({"type": "object"})}
VALID = {
    CHAT: st.fixed_dictionaries({"messages": st.lists(MESSAGE, min_size=1, max_size=3)}, optional={
        **SAMPLING, **OPENAI, "max_completion_tokens": st.integers(1, 24), "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 3), "tools": st.just([TOOL]),
        "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
        "chat_template_kwargs": st.dictionaries(st.text(max_size=6), JSON_ANY, max_size=2),
        "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans()}),
    "/apply-template": st.fixed_dictionaries({"messages": st.lists(MESSAGE, min_size=1, max_size=3)}, optional={
        "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(), "tools": st.just([TOOL])}),
    "/v1/chat/completions/input_tokens": st.fixed_dictionaries({"messages": st.lists(MESSAGE, min_size=1, max_size=3)},
                                                               optional={"tools": st.just([TOOL])}),
    "/v1/completions": st.fixed_dictionaries({"prompt": st.one_of(
        SOME_WORDS, st.lists(st.integers(0, 63), min_size=1, max_size=8), st.lists(SOME_WORDS, min_size=1, max_size=3))},
        optional={**SAMPLING, **OPENAI, "echo": st.just(False), "logprobs": st.integers(0, 3)}),
    "/completion": st.fixed_dictionaries({"prompt": st.one_of(
        SOME_WORDS, st.lists(st.integers(0, 63), min_size=1, max_size=8), st.lists(SOME_WORDS, min_size=1, max_size=3),
        st.fixed_dictionaries({"prompt_string": SOME_WORDS}))},
        optional={"n_predict": st.integers(1, 24), **SAMPLING, **LLAMA}),
    "/tokenize": st.fixed_dictionaries({"content": TEXT},
                                       optional={"add_special": st.booleans(), "with_pieces": st.booleans()}),
    "/detokenize": st.fixed_dictionaries({"tokens": st.lists(st.integers(0, 63), max_size=8)}),
}
FIELDS = {CHAT: ["messages", *SAMPLING, *OPENAI, "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                 "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "add_generation_prompt",
                 "continue_final_message"],
          "/apply-template": ["messages", "add_generation_prompt", "continue_final_message", "tools"],
          "/v1/chat/completions/input_tokens": ["messages", "tools", "max_tokens"],
          "/v1/completions": ["prompt", *SAMPLING, *OPENAI, "echo", "suffix", "best_of", "logprobs"],
          "/completion": ["prompt", "n_predict", *SAMPLING, *LLAMA],
          "/tokenize": ["content", "add_special", "with_pieces"], "/detokenize": ["tokens"]}


@st.composite
def request_body(draw, path: str) -> bytes:
    """A valid body with 0-2 fields replaced by edge values or any JSON at all, or dropped."""
    body = draw(VALID[path])
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from(FIELDS[path]))
        action = draw(st.sampled_from(["any", "edge", "drop"]))
        if action == "drop":
            body.pop(name, None)
        else:
            body[name] = draw(JSON_ANY if action == "any" else EDGES)
    return json.dumps(body).encode()


REQUESTS = st.one_of(
    *[request_body(path).map(lambda b, p=path: (p, b)) for path in VALID],
    st.tuples(st.sampled_from(sorted(VALID)), st.binary(max_size=40)),  # not even JSON
)
FUZZ_EXAMPLES = int(os.environ.get("FLASHDRAFT_FUZZ_EXAMPLES", "150"))


def check_answer(path: str, body: bytes, r: httpx.Response) -> None:
    """No 5xx; 4xx in OpenAI's error shape; a 200 stream ends properly, without an error event."""
    assert r.status_code < 500, (path, body[:300], r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert_error_shape(r, r.status_code)
        return
    if not r.headers["content-type"].startswith("text/event-stream"):
        assert isinstance(r.json(), (dict, list))  # a list: one result per prompt of a batch
        return
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events and all('"error"' not in e[:12] for e in events), events[-3:]
    if path == "/completion":
        assert json.loads(events[-1])["stop"] is True
    else:
        assert events[-1] == "[DONE]"


@pytest.fixture(scope="module")
def fuzz_server():
    """A short context bounds every generation (the tiny model still answers in ms)."""
    with serve(new_generator(ctx_size=48), metrics=True, limits=Limits(body_bytes=BODY_LIMIT)) as url:
        yield url, reference(url)


def test_fuzzed_requests_never_get_a_5xx(fuzz_server):
    url, ref = fuzz_server
    client = httpx.Client(base_url=url, timeout=60, headers={"Content-Type": "application/json"})

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              derandomize=bool(os.environ.get("CI")),  # CI: the same cases every run
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(REQUESTS)
    def one(request):
        path, body = request
        check_answer(path, body, client.post(path, content=body))

    try:
        one()
    finally:
        client.close()
    assert httpx.get(url + "/health").status_code == 200
    assert_clean(url, ref)


# -- disconnects and the queue -------------------------------------------------------------------

def raw_post(url: str, path: str, body: dict) -> socket.socket:
    """Send a request on a bare socket and return it unread: closing it is a client that
    vanished (no FIN handshake niceties, no reading of the answer)."""
    u = urlparse(url)
    data = json.dumps(body).encode()
    s = socket.create_connection((u.hostname, u.port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def read_response(s: socket.socket, timeout: float = 5.0) -> str:
    """One HTTP answer (head and a Content-Length body) read off a raw socket, which is closed."""
    s.settimeout(timeout)
    data = b""
    while chunk := s.recv(4096):
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        if sep and length and len(body) >= int(length.group(1)):
            break
    s.close()
    return data.decode()


def counter(url: str, endpoint: str, status: str) -> float:
    return metric_values(url).get(f'flashdraft_requests_total{{endpoint="{endpoint}",status="{status}"}}', 0.0)


def idle(url: str) -> bool:
    m = metric_values(url)
    return m["llamacpp:requests_processing"] == 0 and m["llamacpp:requests_deferred"] == 0


STREAMS = [("chat", CHAT, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 200}),
           ("completions", "/v1/completions", {"prompt": PROMPT, "max_tokens": 200}),
           ("completion", "/completion", {"prompt": PROMPT, "n_predict": 200})]


@pytest.mark.parametrize("endpoint,path,body", STREAMS, ids=[s[0] for s in STREAMS])
def test_disconnect_mid_stream_frees_the_slot_within_a_second(paced, endpoint, path, body):
    url, _ = paced
    before = counter(url, endpoint, "cancelled")
    with httpx.stream("POST", url + path, json={**body, "stream": True, "ignore_eos": True, "temperature": 0},
                      timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert metric_values(url)["llamacpp:requests_processing"] == 1
    took = wait_for(lambda: idle(url) and counter(url, endpoint, "cancelled") > before, timeout=5)
    assert took < 1.0, f"slot freed after {took:.2f} s"
    assert httpx.post(url + "/completion", json={"prompt": "t1", "n_predict": 2}).status_code == 200


def test_disconnect_of_a_non_streamed_request_frees_the_slot(paced):
    url, _ = paced
    s = raw_post(url, CHAT, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 200,
                             "ignore_eos": True})
    wait_for(lambda: metric_values(url)["llamacpp:requests_processing"] == 1, timeout=10)
    s.close()
    took = wait_for(lambda: idle(url), timeout=5)
    assert took < 1.0, f"slot freed after {took:.2f} s"


def test_request_cancelled_while_queued_never_runs(paced):
    url, generator = paced
    before = counter(url, "chat", "cancelled")
    n_started = len(generator.started)
    markers = {"t60 t61 t62 t63": False, "t50 t51 t52 t53": True}  # prompt -> stream?
    with httpx.stream("POST", url + CHAT, timeout=60, json={
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 200, "ignore_eos": True,
            "stream": True}) as running:
        lines = running.iter_lines()  # kept: a dropped, half-read iterator closes the connection
        next(lines)  # generating now; the next two requests must queue
        sockets = []
        for prompt, stream in markers.items():
            sockets.append(raw_post(url, CHAT, {"messages": [{"role": "user", "content": prompt}],
                                                "max_tokens": 4, "stream": stream}))
            wait_for(lambda n=len(sockets): metric_values(url)["llamacpp:requests_deferred"] == n, timeout=10)
        for s in sockets:  # both clients give up while waiting
            s.close()
        time.sleep(0.3)  # the server notices (disconnect) while the first request still runs
        assert metric_values(url)["llamacpp:requests_processing"] == 1
    # the running one is left too; the queue then drains without running the cancelled ones
    wait_for(lambda: idle(url) and counter(url, "chat", "cancelled") >= before + 3, timeout=10)
    ran = [generator.target.decode(p) for p in generator.started[n_started:]]
    assert len(ran) == 1 and not any(m in text for m in markers for text in ran), ran


def test_shutdown_rejects_the_queue_and_ends_the_running_stream_with_an_error_event():
    """What SIGTERM triggers (``ServerState.begin_shutdown``), in-process and deterministic;
    the real signal is tested on a subprocess below."""
    apps: list = []
    with serve(new_generator(delay=0.05, ctx_size=CTX), apps=apps, metrics=True, shutdown_grace_s=0.3) as url:
        state = apps[0].state.flashdraft
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 200, "ignore_eos": True}
        with httpx.stream("POST", url + CHAT, json={**body, "stream": True}, timeout=60) as running:
            lines = running.iter_lines()
            next(lines)
            waiting = raw_post(url, CHAT, {**body, "max_tokens": 4})
            wait_for(lambda: metric_values(url)["llamacpp:requests_deferred"] == 1, timeout=10)
            t0 = time.monotonic()
            state.begin_shutdown()
            # the queued request: 503 at once
            answer = read_response(waiting)
            assert answer.startswith("HTTP/1.1 503") and "server_shutting_down" in answer, answer
            # new requests and /health: 503 too
            assert assert_error_shape(httpx.post(url + CHAT, json=body), 503)["code"] == "server_shutting_down"
            assert httpx.get(url + "/health").status_code == 503
            # the running stream: goes on for the grace period, then ends with an error event
            events = [line[6:] for line in lines if line.startswith("data: ")]
            took = time.monotonic() - t0
        assert json.loads(events[-1])["error"]["code"] == "server_shutting_down", events[-2:]
        assert any('"content"' in e for e in events[:-1])
        assert 0.25 < took < 2.0, took
        wait_for(lambda: metric_values(url)["llamacpp:requests_processing"] == 0, timeout=5)


# -- the soak script, small -----------------------------------------------------------------------

def load_soak():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_soak_script_small_run_loses_and_corrupts_nothing(fast, tmp_path, capsys):
    url, _ = fast
    soak = load_soak()
    out = tmp_path / "soak.json"
    rc = soak.main(["--url", url, "--clients", "3", "--requests", "40", "--max-tokens", "12",
                    "--prompt", PROMPT, "--prompt", "t1 t2 t3 t4", "--disconnect", "0.2", "--cancel", "0.2",
                    "--burst", "6", "--no-structured", "--pid", str(os.getpid()), "--max-rss-growth-mb", "64",
                    "--json-out", str(out)])
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert rc == 0, text
    phase = report["phases"][0]
    assert report["passed"] and phase["counts"]["ok"] == 46 and phase["burst"]["ok"] == 6, text
    kinds = {k.split(":")[0] for k in phase["kinds"]}
    assert kinds == {"full", "stream", "disconnect", "cancel", "burst"}, phase["kinds"]
    assert {k.split(":")[1] for k in phase["kinds"]} == {"chat", "cmpl", "turn"}, phase["kinds"]
    assert phase["latency_s"]["p50"] is not None and phase["latency_s"]["p99"] >= phase["latency_s"]["p50"]
    assert phase["rss_mb"]["before"] and phase["rss_mb"]["after"]
    assert phase["slot_freed_s"] is not None and phase["slot_freed_s"] < 1.0
    assert "0 errors, 0 lost, 0 corrupted" in text


def test_soak_percentiles():
    soak = load_soak()
    values = [float(i) for i in range(1, 101)]
    assert soak.percentile(values, 50) == 50.0 and soak.percentile(values, 99) == 99.0
    assert soak.percentile([3.0], 99) == 3.0 and soak.percentile([], 50) is None


# -- SIGTERM on a real `flashdraft serve` ---------------------------------------------------------

@pytest.mark.real
def test_sigterm_rejects_the_queue_ends_the_stream_cleanly_and_exits_0(tmp_path):
    from test_server import ServerProcess

    s = ServerProcess(["--spec-type", "ngram", "-c", "512", "--metrics"], tmp_path / "server.log")
    try:
        s.wait_ready()
        # the chat page, from the real default server
        page = httpx.get(s.url + "/")
        assert page.status_code == 200 and "chat.js" in page.text
        assert httpx.get(s.url + "/static/chat.js").status_code == 200

        events: list[str] = []
        stream_error: list[BaseException] = []
        queued: list[httpx.Response] = []
        started = threading.Event()

        def stream() -> None:
            try:
                with httpx.stream("POST", s.url + CHAT, timeout=60, json={
                        "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
                        "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            started.set()
            except BaseException as e:  # a cut connection shows up here
                stream_error.append(e)
            finally:
                started.set()

        def waiter() -> None:
            queued.append(httpx.post(s.url + CHAT, timeout=60, json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}))

        threads = [threading.Thread(target=stream)]
        threads[0].start()
        assert started.wait(120) and not stream_error, stream_error
        threads.append(threading.Thread(target=waiter))
        threads[1].start()
        wait_for(lambda: metric_values(s.url)["llamacpp:requests_deferred"] == 1, timeout=30)

        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        threads[1].join(10)
        assert queued, "the queued request got no answer"
        assert assert_error_shape(queued[0], 503)["code"] == "server_shutting_down"
        assert time.monotonic() - t0 < 3, "the queued request should be rejected at once"

        threads[0].join(30)
        assert not stream_error, f"the stream was cut: {stream_error!r}"
        last = events[-1]
        if last != "[DONE]":  # the grace period ran out: a clean error event ends the stream
            assert json.loads(last)["error"]["code"] == "server_shutting_down", events[-3:]
        code = s.proc.wait(20)
        took = time.monotonic() - t0
        assert code == 0, s.log()[-3000:]
        assert took < 15, f"exit took {took:.1f} s"
        assert "Traceback" not in s.log(), s.log()[-3000:]
    finally:
        s.stop()


# -- soak v2 on the real server, bounded (≈ 1-2 min) ----------------------------------------------

@pytest.mark.real
def test_soak_v2_real_server_np4_mixed_load_loses_and_corrupts_nothing(tmp_path):
    """``scripts/soak.py`` against a real ``flashdraft serve -np 4 --max-queue 4`` with the
    hybrid drafter and the prompt cache: every kind of request, a burst beyond the queue
    (some 503 queue_full, no other 5xx), each answer equal to its greedy reference."""
    soak = load_soak()
    out = tmp_path / "soak.json"
    rc = soak.main(["--serve", "-np 4 --max-queue 4 --spec-type hybrid -t 1 -c 2048", "--clients", "4",
                    "--duration", os.environ.get("FLASHDRAFT_SOAK_S", "60"), "--max-tokens", "12",
                    "--burst", "12", "--json-out", str(out)])
    report = json.loads(out.read_text())
    phase = report["phases"][0]
    assert rc == 0 and report["passed"], json.dumps(phase, indent=1)
    c = phase["counts"]
    assert c["error"] == c["lost"] == c["corrupted"] == phase["server_5xx"] == 0, c
    assert phase["burst"]["rejected"] > 0 and phase["burst"]["ok"] > 0, phase["burst"]
    assert {k.split(":")[0] for k in phase["kinds"]} >= {"full", "stream", "disconnect", "cancel", "burst"}
    assert phase["validated"].get("tool_call", 0) + phase["validated"].get("json_schema", 0) > 0, phase["validated"]
    assert phase["cache_hits"] > 0 and phase["server_exit_code"] == 0 and phase["still_serving"]
