"""A stream whose prompt is still prefilling gets its headers and keep-alive pings
(``--sse-ping-interval``), so an agent's client sees a live connection: Claude Code resends a
request after 300 s without a byte. The prefill is held by the test, not timed."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from anthropic import Anthropic
from inproc import PacedGenerator, chat_target, serve
from openai import OpenAI

from flashdraft.drafters.ngram import NgramDrafter

PROMPT = "t5 t9 t17 t3"


class HeldPrefill(PacedGenerator):
    """Produces no step until ``release`` is set (at most 30 s): a prefill that takes as long
    as the test wants."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.release = threading.Event()

    def generate(self, *a, **kw):
        self.release.wait(30)
        yield from super().generate(*a, **kw)


@pytest.fixture(scope="module")
def server():
    gen = HeldPrefill(chat_target(), NgramDrafter(), ctx_size=128, n_draft=4)
    with serve(gen, sse_ping_interval=0.05) as url:
        yield gen, url


def _chat_body(stream: bool) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
            "temperature": 0, "stream": stream}


def test_headers_and_pings_come_before_the_first_token(server):
    gen, url = server
    gen.release.clear()
    with httpx.stream("POST", url + "/v1/chat/completions", json=_chat_body(True), timeout=20) as r:
        # the headers are here although the generator has produced nothing yet
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = r.iter_bytes()
        assert next(chunks).startswith(b": ping\n\n")
        assert not gen.release.is_set()
        gen.release.set()
        body = b"".join(chunks).decode()
    data = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    text = "".join(c["delta"].get("content") or "" for d in data[:-1] for c in json.loads(d)["choices"])
    full = httpx.post(url + "/v1/chat/completions", json=_chat_body(False), timeout=20).json()
    assert text == full["choices"][0]["message"]["content"] and text


def test_the_official_clients_skip_the_pings(server):
    gen, url = server
    gen.release.clear()
    timer = threading.Timer(0.4, gen.release.set)  # ~8 pings first
    timer.start()
    oai = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=20)
    text = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=6, temperature=0, stream=True)
        if c.choices)
    timer.join()
    gen.release.set()
    full = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=6, temperature=0)
    assert text == full.choices[0].message.content and text

    gen.release.clear()
    timer = threading.Timer(0.4, gen.release.set)
    timer.start()
    ant = Anthropic(base_url=url, api_key="none", max_retries=0, timeout=20)
    with ant.messages.stream(model="tiny", max_tokens=6, extra_body={"temperature": 0},
                             messages=[{"role": "user", "content": PROMPT}]) as s:
        streamed = "".join(s.text_stream)
    timer.join()
    assert streamed == text


def test_anthropic_pings_are_anthropic_ping_events(server):
    gen, url = server
    gen.release.clear()
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": PROMPT}]}
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=20) as r:
        chunks = r.iter_bytes()
        first = next(chunks)
        gen.release.set()
        rest = b"".join(chunks)
    event, data = first.decode().split("\n\n")[0].split("\n")
    assert event == "event: ping" and json.loads(data[6:]) == {"type": "ping"}
    assert b"event: message_start" in rest and b"event: message_stop" in rest
