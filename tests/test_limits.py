"""The ``--max-*`` limits over real HTTP: each over-limit request is a 4xx naming its flag.

The server runs in a thread on the tiny target (``inproc.py``) with every limit set low,
so each case is one small request; a request exactly at the limit must still pass the
check (a 200, or for a grammar on the tiny word-level tokenizer the 400
``grammar_unsupported`` that comes after the limits). The flags themselves are checked
through the real parser.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from inproc import PROMPT, metric_values, new_generator, serve, wait_for

from flashdraft.server.cli import build_parser, settings_from_args
from flashdraft.server.limits import Limits, flag

CHAT = "/v1/chat/completions"
LOW = Limits(body_bytes=4096, prompt_tokens=80, batch_prompts=2, n_probs=3, logit_bias=2, tools=1,
             grammar_chars=40, stop_strings=2, stop_length=5, queue=1)
USER = [{"role": "user", "content": "t1 t2"}]


def tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}


# (limit, path, body at the limit, body over it, param)
CASES = [
    ("prompt_tokens", "/completion", {"prompt": "t1 " * 80}, {"prompt": "t1 " * 81}, "prompt"),
    ("batch_prompts", "/v1/completions", {"prompt": ["t1", "t2"]}, {"prompt": ["t1", "t2", "t3"]}, "prompt"),
    ("n_probs", "/completion", {"prompt": "t1", "n_probs": 3}, {"prompt": "t1", "n_probs": 4}, "n_probs"),
    ("n_probs", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 3},
     {"messages": USER, "logprobs": True, "top_logprobs": 4}, "top_logprobs"),
    ("n_probs", "/v1/completions", {"prompt": "t1", "logprobs": 3}, {"prompt": "t1", "logprobs": 4}, "logprobs"),
    ("logit_bias", CHAT, {"messages": USER, "logit_bias": {"5": 1, "6": 1}},
     {"messages": USER, "logit_bias": {"5": 1, "6": 1, "7": 1}}, "logit_bias"),
    ("stop_strings", CHAT, {"messages": USER, "stop": ["a", "b"]}, {"messages": USER, "stop": ["a", "b", "c"]}, "stop"),
    ("stop_length", "/completion", {"prompt": "t1", "stop": "abcde"}, {"prompt": "t1", "stop": "abcdef"}, "stop"),
    ("tools", CHAT, {"messages": USER, "tools": [tool(0)]}, {"messages": USER, "tools": [tool(0), tool(1)]}, "tools"),
    ("grammar_chars", "/completion", {"prompt": "t1", "grammar": "root ::= " + '"x"' * 10},
     {"prompt": "t1", "grammar": "root ::= " + '"x"' * 11}, "grammar"),
    ("grammar_chars", CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "title": "x" * 9}}}},  # 40 characters of JSON
     {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
         "schema": {"type": "object", "title": "x" * 30}}}}, "response_format"),
]


@pytest.fixture(scope="module")
def low():
    generator = new_generator(delay=0.05, ctx_size=128)
    with serve(generator, metrics=True, limits=LOW) as url:
        yield url


def post(url: str, path: str, body: dict) -> httpx.Response:
    """A short greedy request (``n_predict`` on llama-server's route, ``max_tokens`` on OpenAI's)."""
    length = {"n_predict": 2} if path == "/completion" else {"max_tokens": 2}
    return httpx.post(url + path, json={**length, "temperature": 0, **body}, timeout=60)


def assert_limit_error(r: httpx.Response, name: str, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["limit"] == flag(name) and err["limit_value"] == getattr(LOW, name), err
    assert flag(name) in err["message"] and str(getattr(LOW, name)) in err["message"], err
    return err


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_over_a_limit_is_a_4xx_naming_it_and_at_the_limit_passes(low, case):
    name, path, at, over, param = case
    ok = post(low, path, at)
    assert ok.status_code == 200 or ok.json()["error"]["code"] == "grammar_unsupported", ok.text
    err = assert_limit_error(post(low, path, over), name)
    assert err["param"] == param and err["code"] == "limit_exceeded", err


def test_body_over_max_body_bytes_is_a_413_naming_the_flag(low):
    body = json.dumps({"messages": [{"role": "user", "content": "t1 " * 2000}]}).encode()
    r = httpx.post(low + CHAT, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert_limit_error(r, "body_bytes", 413)
    r = httpx.post(low + "/tokenize", content=b'{"content": "' + b"t1 " * 2000 + b'"}', timeout=60)
    assert_limit_error(r, "body_bytes", 413)


def test_a_request_beyond_max_queue_is_a_503_queue_full_and_the_queue_still_drains(low):
    long = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    answers: list[httpx.Response] = []
    with httpx.stream("POST", low + CHAT, json={**long, "stream": True}, timeout=60) as running:
        lines = running.iter_lines()
        next(lines)  # running now: the next request waits in the queue
        waiter = threading.Thread(target=lambda: answers.append(post(low, CHAT, {"messages": USER})))
        waiter.start()
        wait_for(lambda: metric_values(low)["llamacpp:requests_deferred"] == 1, timeout=10)
        err = assert_limit_error(post(low, CHAT, {"messages": USER}), "queue", 503)
        assert err["code"] == "queue_full" and err["type"] == "unavailable_error", err
        batch = post(low, "/v1/completions", {"prompt": ["t1", "t2"]})  # all or nothing: none queued
        assert batch.status_code == 503 and metric_values(low)["llamacpp:requests_deferred"] == 1
        for _ in lines:
            pass
    waiter.join(60)
    assert answers and answers[0].status_code == 200, answers
    assert post(low, "/v1/completions", {"prompt": ["t1", "t2"]}).status_code == 200


def test_every_limit_has_a_flag_that_sets_it():
    args = build_parser().parse_args([])
    assert settings_from_args(args).limits == Limits()
    argv = []
    for i, name in enumerate(Limits.__dataclass_fields__, start=1):
        argv += [flag(name), str(i)]
    got = settings_from_args(build_parser().parse_args(argv)).limits
    assert got == Limits(*range(1, len(Limits.__dataclass_fields__) + 1))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-tools", "-1"])


def test_a_queued_request_whose_client_left_holds_no_place_in_the_queue(low):
    long = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", low + CHAT, json={**long, "stream": True}, timeout=60) as running:
        lines = running.iter_lines()
        next(lines)
        body = json.dumps({"messages": USER, "max_tokens": 2}).encode()
        s = socket.create_connection(("127.0.0.1", int(low.rsplit(":", 1)[1])))
        s.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_for(lambda: metric_values(low)["llamacpp:requests_deferred"] == 1, timeout=10)
        s.close()  # gone while queued: its ticket is cancelled but still in the queue
        time.sleep(0.3)
        answers: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: answers.append(post(low, CHAT, {"messages": USER})))
        waiter.start()  # takes the place, instead of a 503 queue_full
        for _ in lines:
            pass
    waiter.join(60)
    assert answers and answers[0].status_code == 200, answers[0].text if answers else answers
