"""What coding agents send on their first request (Claude Code's Messages bodies, Codex CLI's
Responses bodies) is answered, not refused: on the tiny model in-process, over real HTTP.

Fields that change nothing for a local model are accepted and named once in the log.
"""

from __future__ import annotations

import json
import logging

import httpx
import llguidance
import pytest
from inproc import CHAT_TEMPLATE, PacedGenerator, new_generator, serve
from tiny import byte_tokenizer, tiny_model

from flashdraft.constraints import compile_grammar
from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.server import ignored, parse_anthropic, parse_responses
from flashdraft.server.render_responses import call_item
from flashdraft.targets.torch import Target

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
        assert 0 < r.json()["usage"]["output_tokens"] <= 3
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


# -- propertyNames in tool and JSON schemas --------------------------------------------------

class _Bytes:
    """llguidance's view of a byte-level tokenizer: any JSON text is a token sequence."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]

    def __call__(self, s: bytes) -> list[int]:
        return list(s)


def _accepts(schema: dict, text: str) -> bool:
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
    matcher = llguidance.LLMatcher(tokenizer, compile_grammar("json_schema", schema))
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def _record(names) -> dict:
    return {"type": "object", "propertyNames": names, "additionalProperties": {"type": "integer"}}


@pytest.mark.parametrize("names,good,bad", [
    ({"type": "string"}, '{"Any Key": 1}', '{"k": "x"}'),  # no constraint on keys; values still checked
    ({"enum": ["a", "b"]}, '{"a": 1, "b": 2}', '{"c": 1}'),
    ({"const": "a"}, '{"a": 1}', '{"b": 1}'),
    ({"pattern": "^[a-z]+$"}, '{"ab": 1}', '{"aB": 1}'),
    ({"maxLength": 2}, '{"long key": 1}', '{"k": "x"}'),  # relaxed: keys unconstrained, values checked
])
def test_property_names_are_compiled_or_relaxed(names, good, bad):
    assert _accepts(_record(names), good)
    assert not _accepts(_record(names), bad)


@pytest.fixture(scope="module")
def byte_url():
    """A server on a tiny target with a byte-level tokenizer: grammars run on it."""
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    gen = PacedGenerator(Target(tiny_model(), tok, name="tiny-bytes"), NgramDrafter(), ctx_size=512, n_draft=4)
    with serve(gen) as base:
        yield base


#: short: the byte-level tokenizer spends a token per character of the tool preamble
TODOS = {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": {"type": "string"}}


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "tools": [{"type": "function", "function": {"name": "todo", "parameters": TODOS}}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "response_format": {"type": "json_schema", "json_schema": {"schema": TODOS}}}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                      "tools": [{"name": "todo", "input_schema": TODOS}]}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2,
                       "tools": [{"type": "function", "name": "todo", "parameters": TODOS}]}),
])
def test_a_schema_with_property_names_is_answered_on_every_api(byte_url, path, body):
    r = httpx.post(byte_url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text


# -- Responses: what Codex CLI sends ----------------------------------------------------------

EXEC = {"type": "function", "name": "exec_command", "description": "Run a command", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
CODEX_TOOLS = [
    {"type": "namespace", "name": "functions", "description": "", "tools": [EXEC]},
    {"type": "namespace", "name": "mcp__docs", "description": "The docs server.",
     "tools": [{**EXEC, "name": "search", "description": "Search the docs"}, {"type": "custom", "name": "patch"}]},
    {"type": "web_search", "external_web_access": False},
    {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark", "definition": "x"}},
]


def test_namespace_tools_offer_their_functions_and_the_rest_is_dropped():
    body = {"input": [{"role": "user", "content": "t1"},
                      {"type": "function_call", "namespace": "mcp__docs", "name": "search", "call_id": "c1",
                       "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "t2"}],
            "tools": CODEX_TOOLS, "tool_choice": {"type": "function", "namespace": "mcp__docs", "name": "search"}}
    req = parse_responses.responses(json.dumps(body).encode())
    assert [t["name"] for t in req.tools.active] == ["mcp__docs__search"]  # tool_choice picked it
    assert req.tools.active[0]["description"] == "The docs server.\n\nSearch the docs"
    assert req.tools.namespaced == {"mcp__docs__search": ("mcp__docs", "search")}
    assert req.messages[1].tool_calls[0]["function"]["name"] == "mcp__docs__search"  # the history names it alike
    every = parse_responses.responses(json.dumps({**body, "tool_choice": "auto"}).encode())
    assert [t["name"] for t in every.tools.active] == ["exec_command", "mcp__docs__search"]


def test_a_namespaced_call_is_answered_with_its_namespace_and_name():
    call = {"id": "c1", "type": "function", "function": {"name": "mcp__docs__search", "arguments": "{}"}}
    item = call_item(call, {"mcp__docs__search": ("mcp__docs", "search")})
    assert (item["namespace"], item["name"], item["call_id"]) == ("mcp__docs", "search", "c1")
    plain = call_item({**call, "function": {"name": "exec_command", "arguments": "{}"}}, {})
    assert plain["name"] == "exec_command" and "namespace" not in plain

#: their shape, short (the byte-level tokenizer spends a token per character of the preamble)
SHORT_CODEX_TOOLS = [{"type": "namespace", "name": "functions", "tools": [{"type": "function", "name": "ls"}]},
                     {"type": "namespace", "name": "mcp", "tools": [{"type": "custom", "name": "patch"}]},
                     {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}]


def test_codexs_first_request_is_answered_and_what_is_dropped_named_once(byte_url, warnings):
    body = {"model": "any", "instructions": "be brief", "input": [{"role": "user", "content": "hi"}],
            "tools": SHORT_CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": False, "store": False,
            "stream": False, "include": [], "prompt_cache_key": "k", "max_output_tokens": 2,
            "client_metadata": {"originator": "codex_cli_rs"}}
    for _ in range(2):
        r = httpx.post(byte_url + "/v1/responses", json=body, timeout=60)
        assert r.status_code == 200, r.text
    named = warnings()
    assert len(named) == 2, named  # the ignored fields, the dropped tools: each said once
    assert "client_metadata" in named[0] and "prompt_cache_key" in named[0], named
    for kind in ("web_search", "custom (in namespace 'mcp')", "tools of type custom"):
        assert kind in named[1], named


def test_an_unknown_responses_field_is_still_a_400(url):
    r = httpx.post(url + "/v1/responses", json={"input": "t1", "max_output_tokens": 2, "conversation": "c1"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "conversation", r.text


# -- usage and timings in the streams ---------------------------------------------------------

def sse_events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:") and line[5:].strip()
            != "[DONE]"]


def test_messages_stream_usage_agrees_and_message_delta_carries_timings(url):
    body = {"max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "t4 t5 t6 t7 t8 t9"}]}
    for turn in range(2):  # the second prompt comes from the prompt cache: the split changes
        events = sse_events(httpx.post(url + "/v1/messages", json=body, timeout=60))
        start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
        delta = next(e for e in events if e["type"] == "message_delta")
        for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
            assert start[key] == delta["usage"][key], (turn, start, delta["usage"])
        assert start["output_tokens"] == 0 and 0 < delta["usage"]["output_tokens"] <= 3
        t = delta["timings"]
        assert (t["prompt_n"], t["cache_n"], t["predicted_n"]) == (
            start["input_tokens"], start["cache_read_input_tokens"], delta["usage"]["output_tokens"])
        assert {"prompt_ms", "predicted_ms", "predicted_per_second", "draft_n", "draft_n_accepted"} <= set(t)
        assert "timings" not in events[-1] and events[-1]["type"] == "message_stop"  # as llama-server's tests ask
    assert start["cache_read_input_tokens"] > 0  # the second turn reused the first's prompt


def test_responses_carry_timings_in_the_body_and_the_completed_event(url):
    body = {"input": "t4 t5 t6", "max_output_tokens": 3}
    plain = httpx.post(url + "/v1/responses", json=body, timeout=60).json()
    assert 0 < plain["timings"]["predicted_n"] == plain["usage"]["output_tokens"] <= 3
    events = sse_events(httpx.post(url + "/v1/responses", json={**body, "stream": True}, timeout=60))
    done = events[-1]
    assert done["type"] == "response.completed"
    assert 0 < done["timings"]["predicted_n"] == done["response"]["usage"]["output_tokens"] <= 3
