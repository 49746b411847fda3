"""What coding agents send on their first request (Claude Code's Messages bodies, Codex CLI's
Responses bodies) is answered, not refused: on the tiny model in-process, over real HTTP.

Fields that change nothing for a local model are accepted and named once in the log.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from inproc import new_generator, serve

from flashdraft.server import ignored, parse_anthropic

USER = {"role": "user", "content": "t1 t2"}


@pytest.fixture(scope="module")
def url():
    with serve(new_generator(ctx_size=128)) as base:
        yield base


@pytest.fixture
def warnings(caplog):
    """The server's warnings naming ignored fields, from a fresh start."""
    ignored.forget()
    caplog.set_level(logging.WARNING, logger="flashdraft.server")
    return lambda: [r.getMessage() for r in caplog.records if "accepted and ignored" in r.getMessage()]


def test_a_system_message_inside_messages_stays_at_its_place():
    body = {"system": "t9", "max_tokens": 4,
            "messages": [USER, {"role": "system", "content": [{"type": "text", "text": "t7"}]},
                         {"role": "assistant", "content": "t3"}, {"role": "user", "content": "t4"}]}
    req = parse_anthropic.messages(json.dumps(body).encode())
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "t9"), ("user", "t1 t2"), ("system", "t7"), ("assistant", "t3"), ("user", "t4")]


def test_messages_with_claude_codes_fields_are_answered_and_named_once(url, warnings):
    body = {"max_tokens": 3, "messages": [{"role": "system", "content": "t5"}, USER],
            "output_config": {"effort": "high"}, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": "u1"}}
    for _ in range(2):  # an agent sends them every turn: named once
        r = httpx.post(url + "/v1/messages", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["output_tokens"] == 3
    named = warnings()
    assert len(named) == 1, named
    for field in ("context_management", "metadata", "output_config.effort", "thinking.budget_tokens"):
        assert field in named[0], named


def test_count_tokens_counts_a_system_message_inside_messages(url):
    def count(messages):
        r = httpx.post(url + "/v1/messages/count_tokens", json={"messages": messages}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]

    assert count([{"role": "system", "content": "t5 t6 t7"}, USER]) == count([USER]) + 3


@pytest.mark.parametrize("body,words", [
    ({"output_config": {"verbosity": "low"}}, "output_config: verbosity not supported"),
    ({"messages": [{"role": "system", "content": [{"type": "image"}]}, USER]}, "messages.0.content.0"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "'user', 'assistant' or 'system'"),
])
def test_what_would_change_the_answer_is_still_a_400(url, body, words):
    r = httpx.post(url + "/v1/messages", json={"max_tokens": 3, "messages": [USER], **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.json()
