"""The reason of a refused request is in the server's log line for that request, whatever
the route and the error shape (on the tiny model in-process)."""

from __future__ import annotations

import logging

import httpx
import pytest
from inproc import new_generator, serve, wait_for

from flashdraft.server.request_log import error_reason


@pytest.fixture(scope="module")
def url():
    with serve(new_generator(ctx_size=64)) as base:
        yield base


def logged(caplog, where: str) -> list[logging.LogRecord]:
    """The request log's lines containing ``where`` (written once the response has ended,
    which may be just after the client has read it)."""
    def lines():
        return [r for r in caplog.records if r.name == "flashdraft.request" and r.getMessage().startswith("request:")
                and where in r.getMessage()]

    wait_for(lambda: lines(), timeout=5)
    return lines()


@pytest.mark.parametrize("method,path,body,reason", [
    ("POST", "/v1/chat/completions", {"messages": [{"role": "nobody", "content": "t1"}]}, "messages"),
    ("POST", "/v1/messages", {"messages": [{"role": "user", "content": "t1"}], "max_tokens": 0}, "max_tokens"),
    ("POST", "/completion", {"prompt": "t1 " * 80}, "the context size is 64"),
    ("POST", "/v1/responses", {"input": "t1", "previous_response_id": "r1"}, "previous_response_id"),
    ("GET", "/v1/nothing", None, "Not Found"),
])
def test_a_4xx_log_line_says_why(url, caplog, method, path, body, reason):
    caplog.set_level(logging.INFO, logger="flashdraft.request")
    r = httpx.request(method, url + path, json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    line = logged(caplog, f" {path} {r.status_code} ")
    assert len(line) == 1, [rec.getMessage() for rec in line]
    assert reason in line[0].getMessage(), line[0].getMessage()
    assert line[0].fields["reason"] == error_reason(r.content)


def test_a_200_log_line_has_no_reason(url, caplog):
    caplog.set_level(logging.INFO, logger="flashdraft.request")
    assert httpx.post(url + "/completion", json={"prompt": "t1", "n_predict": 2}, timeout=60).status_code == 200
    line = logged(caplog, " /completion 200 ")
    assert len(line) == 1 and line[0].getMessage().endswith(" ms") and "reason" not in line[0].fields


def test_error_reason_reads_every_shape():
    assert error_reason(b'{"error": {"message": "bad", "type": "x"}}') == "bad"
    assert error_reason(b'{"type": "error", "error": {"type": "x", "message": "worse"}}') == "worse"
    assert error_reason(b"plain text\n") == "plain text"
    assert error_reason(b"") is None
