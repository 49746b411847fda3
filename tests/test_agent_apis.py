"""The APIs coding agents speak, over real HTTP with the official clients, on the packaged
SmolLM2: Anthropic Messages (``anthropic`` package) and OpenAI Responses (``openai``).

Servers (each loads the model, ≈ 20-30 s): one per drafter for the greedy-identity test
(``none``, ``ngram``, ``dflash`` with the shipped drafter, ``hybrid``; the controller off,
so every step drafts), started lazily and shared; the SDK tests run on the ``dflash`` one.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from openai import OpenAI
from test_server import ServerProcess

from flashdraft.constraints import Constraint, TokenizerInfo, compile_grammar
from flashdraft.server.tools import tool_grammar
from flashdraft.targets.torch import Target

pytestmark = pytest.mark.real

DRAFTERS = ["none", "ngram", "dflash", "hybrid"]
ASK = "Write a Python function that adds two numbers."
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}
RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
                     "parameters": WEATHER_SCHEMA}
PARIS = "What's the weather like in Paris today?"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """``servers(spec) -> ServerProcess``: started on first use, stopped with the module."""
    started: dict[str, ServerProcess] = {}

    def get(spec: str) -> ServerProcess:
        if spec not in started:
            args = ["--spec-type", spec, "--spec-dm-controller", "off", "-c", "1024", "--jinja", "--reasoning", "off"]
            started[spec] = ServerProcess(args, tmp_path_factory.mktemp(spec) / "server.log").wait_ready()
        return started[spec]

    try:
        yield get
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers("dflash")


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy_texts(s: ServerProcess, max_tokens: int = 40) -> dict[str, str]:
    """The same chat, greedy, through the three chat-like APIs."""
    user = [{"role": "user", "content": ASK}]
    chat = httpx.post(s.url + "/v1/chat/completions", json={"messages": user, "max_tokens": max_tokens,
                                                             "temperature": 0}, timeout=120).json()
    msg = httpx.post(s.url + "/v1/messages", json={"messages": user, "max_tokens": max_tokens, "temperature": 0},
                     timeout=120).json()
    resp = httpx.post(s.url + "/v1/responses", json={"input": ASK, "max_output_tokens": max_tokens,
                                                     "temperature": 0}, timeout=120).json()
    return {"chat": chat["choices"][0]["message"]["content"], "messages": msg["content"][0]["text"],
            "responses": resp["output"][0]["content"][0]["text"], "draft_n": resp["timings"].get("draft_n", 0)}


_PLAIN: dict[str, str] = {}


@pytest.mark.parametrize("spec", DRAFTERS)
def test_greedy_text_is_plain_decodings_through_every_api(servers, spec):
    """Lossless through every API: the three APIs agree, and each drafter's text equals
    plain decoding's (the ``none`` server, run first)."""
    texts = greedy_texts(servers(spec))
    assert texts["chat"] == texts["messages"] == texts["responses"], texts
    if "plain" not in _PLAIN:
        _PLAIN["plain"] = greedy_texts(servers("none"))["chat"]
    assert texts["chat"] == _PLAIN["plain"]
    if spec in ("none", "dflash", "hybrid"):  # the drafter really drafted (prompt lookup may find no match)
        assert (texts["draft_n"] > 0) == (spec != "none"), texts


# -- Anthropic Messages ----------------------------------------------------------------------

def test_messages_plain_answer_and_stream_with_the_anthropic_client(claude):
    # this SDK release has no temperature argument (newer Claude models fix it); extra_body sends it
    kw = dict(model="any", max_tokens=24, extra_body={"temperature": 0}, system="You are terse.",
              messages=[{"role": "user", "content": ASK}])
    out = claude.messages.create(**kw)
    assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_")
    assert out.content[0].type == "text" and out.content[0].text
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 24
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens > 10
    with claude.messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == out.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 24
    counted = claude.messages.count_tokens(model="any", system=kw["system"], messages=kw["messages"])
    assert counted.input_tokens == out.usage.input_tokens + out.usage.cache_read_input_tokens


def test_messages_stop_sequence(claude):
    out = claude.messages.create(model="any", max_tokens=40, extra_body={"temperature": 0}, stop_sequences=["("],
                                 messages=[{"role": "user", "content": ASK}])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == "(" and "(" not in out.content[0].text


def test_messages_forced_tool_call_and_round_trip(claude):
    ask = [{"role": "user", "content": PARIS}]
    # one call (SmolLM2 asks for the same weather twice when it may call in parallel)
    out = claude.messages.create(model="any", max_tokens=120, messages=ask, tools=[ANTHROPIC_WEATHER],
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert out.stop_reason == "tool_use"
    calls = [b for b in out.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    assert set(calls[0].input) == {"city"}, calls[0].input  # only the schema's keys
    # streamed: the call arrives as a tool_use block with its input as JSON deltas
    with claude.messages.stream(model="any", max_tokens=120, messages=ask, tools=[ANTHROPIC_WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(streamed) == 1 and set(streamed[0].input) == {"city"}
    # the round trip: tool_use -> tool_result -> an answer in text
    turn2 = ask + [{"role": "assistant", "content": [b.model_dump() for b in calls]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                                 "content": "Sunny, 21 °C"}]}]
    reply = claude.messages.create(model="any", max_tokens=30, messages=turn2, tools=[ANTHROPIC_WEATHER],
                                   tool_choice={"type": "none"})
    assert reply.content[0].type == "text" and reply.content[0].text and reply.stop_reason in ("end_turn",
                                                                                                "max_tokens")


@pytest.mark.parametrize("body,words", [
    ({"messages": [{"role": "user", "content": [{"type": "video", "data": "x"}]}]}, "content blocks of type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]},
     "no earlier assistant message has a tool_use"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [ANTHROPIC_WEATHER],
      "tool_choice": {"type": "tool", "name": "get_time"}}, "not among the tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f", "input_schema": "object"}]},
     "input_schema"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "Show me the file."},  # an image inside a tool's result
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read",
                                                      "input": {"file": "a.png"}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                       {"type": "text", "text": "File: a.png"},
                       {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                    "data": "iVBORw0KGgo="}},
                   ]}]}]}, "image input is not supported"),
])
def test_bad_messages_requests_are_400_in_anthropics_shape(server, claude, body, words):
    r = httpx.post(server.url + "/v1/messages", json={"max_tokens": 8, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert words in err["error"]["message"], err
    with pytest.raises(anthropic.BadRequestError):  # the SDK reads the shape as its own error
        claude.messages.create(model="any", **{"max_tokens": 8, **body})
    ok = claude.messages.create(model="any", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert ok.usage.output_tokens == 2  # and the server keeps serving


def test_tool_arguments_take_only_the_properties_the_tool_lists():
    """A called tool gets only the arguments its schema lists, as llama-server constrains a
    call: an object with ``properties`` and no ``additionalProperties`` takes no others (a
    small model otherwise invents keys, e.g. ``"type": "function"`` beside ``code``, and can
    loop on them until ``max_tokens`` cuts the call). Checked on the real tokenizer's grammar."""
    params = {"type": "object", "properties": {"code": {"type": "string"},
                                               "opts": {"type": "object", "properties": {"n": {"type": "integer"}}},
                                               "env": {"type": "object", "additionalProperties": {"type": "string"}}},
              "required": ["code"]}
    target = Target.load()
    info = TokenizerInfo.for_target(target)
    grammar = compile_grammar(*tool_grammar([{"name": "python", "description": "", "parameters": params}],
                                            must_call=True, parallel=False))

    def accepted(arguments: str) -> bool:
        ids = target.tokenizer('{"tool_calls": [{"name": "python", "arguments": ' + arguments + "}]}",
                               add_special_tokens=False)["input_ids"]
        return Constraint(info, grammar).valid_prefix(ids) == len(ids)

    assert accepted('{"code": "print(1)", "opts": {"n": 2}, "env": {"HOME": "/tmp"}}')  # open where it says so
    assert not accepted('{"code": "print(1)", "type": "function"}')
    assert not accepted('{"code": "print(1)", "opts": {"n": 2, "m": 3}}')


# -- OpenAI Responses ------------------------------------------------------------------------

def test_responses_plain_answer_and_stream_with_the_openai_client(server, oai):
    kw = dict(model="any", instructions="You are terse.", input=[{"role": "user", "content": ASK}],
              max_output_tokens=24, temperature=0)
    out = oai.responses.create(**kw)
    assert out.id.startswith("resp_") and out.output[0].id.startswith("msg_") and out.output_text
    assert out.usage.output_tokens == 24 and out.status == "incomplete"
    gathered, completed, types = "", None, []
    for event in oai.responses.create(**kw, stream=True):
        types.append(event.type)
        if event.type == "response.output_text.delta":
            gathered += event.delta
        if event.type == "response.completed":
            completed = event.response
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert gathered == completed.output_text == out.output_text
    raw = httpx.post(server.url + "/v1/responses", json={"input": "1, 2, 3, 4, 5, 6,", "max_output_tokens": 16,
                                                         "temperature": 0}, timeout=120).json()
    t = raw["timings"]  # llama-server's timings beside the Responses usage: the speed check works here too
    assert t["predicted_n"] == raw["usage"]["output_tokens"] == 16 and t["draft_n"] > 0 and t["draft_n_accepted"] > 0


def test_responses_forced_tool_call_and_round_trip(oai):
    out = oai.responses.create(model="any", input=PARIS, tools=[RESPONSES_WEATHER], tool_choice="required",
                               parallel_tool_calls=False, max_output_tokens=120)
    calls = [o for o in out.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and set(json.loads(calls[0].arguments)) == {"city"}
    items = [{"role": "user", "content": PARIS},
             {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
              "arguments": calls[0].arguments},
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 °C"}]
    reply = oai.responses.create(model="any", input=items, tools=[RESPONSES_WEATHER], tool_choice="none",
                                 max_output_tokens=30)
    assert reply.output[0].type == "message" and reply.output_text


def test_responses_json_schema_answer(oai):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    out = oai.responses.create(model="any", input="Invent a person: name and age, as JSON.", max_output_tokens=60,
                               text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    person = json.loads(out.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}, "input.0.call_id"),
    ({"input": "hi", "tools": [RESPONSES_WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
])
def test_bad_responses_requests_are_400(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"max_output_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, "temperature": 0}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 2
