"""Structured output on the real model over HTTP: JSON schema, json_object, GBNF, on every
endpoint, streaming and not; the same greedy answer with and without drafting."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from flashdraft.constraints import Constraint, TokenizerInfo, compile_grammar
from flashdraft.engine import DEFAULT_DRAFTER_DIR, EngineConfig, load_drafter
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from flashdraft.targets.torch import Target
from test_server import ServerProcess, assert_error_shape, sse_events

pytestmark = pytest.mark.real

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Return this person as JSON: Ada Lovelace, 36 years old."}]


@pytest.fixture(scope="module")
def target():
    return Target.load()


def test_constrained_greedy_is_identical_for_every_drafter(target):
    ids = target.chat_prompt_ids(ASK)
    grammar = compile_grammar("json_schema", SCHEMA)
    info = TokenizerInfo.for_target(target)
    dflash = str(DEFAULT_DRAFTER_DIR) if (DEFAULT_DRAFTER_DIR / "config.json").exists() else "random"
    outs = {}
    for spec, draft_model in [("none", None), ("ngram", None), ("dflash", dflash)]:
        drafter = load_drafter(EngineConfig(spec_type=spec, draft_model=draft_model), target)
        gen = SpeculativeGenerator(target, drafter, n_draft=8)
        outs[spec] = generate_text(gen, ids, 40, SamplingParams(), constraint=Constraint(info, grammar))
    base = outs["none"]
    record = json.loads(base[0])
    assert set(record) == {"name", "age"} and isinstance(record["age"], int)
    for spec, out in outs.items():
        assert out[1] == base[1], spec
    assert outs["dflash"][3].draft_n > 0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(["--spec-type", "dflash", "--spec-dm-controller", "off", "-c", "1024", "--temp", "0"],
                      tmp_path_factory.mktemp("structured") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_json_schema_through_the_openai_client_stream_and_not(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(model="any", messages=ASK, max_tokens=60, response_format=fmt)
    record = json.loads(out.choices[0].message.content)
    assert set(record) == {"name", "age"} and out.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model="any", messages=ASK, max_tokens=60, response_format=fmt,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content


@pytest.mark.parametrize("path,field", [("/completion", {"json_schema": SCHEMA}),
                                        ("/v1/completions", {"response_format": {
                                            "type": "json_schema", "json_schema": {"schema": SCHEMA}}}),
                                        ("/completion", {"grammar": 'root ::= ("yes" | "no") "."'})])
def test_constraints_on_every_endpoint(server, path, field):
    prompt = "Is the sky blue? Answer:" if "grammar" in field else "A person as JSON:"
    limit = {"n_predict": 40} if path == "/completion" else {"max_tokens": 40}
    r = httpx.post(server.url + path, json={"prompt": prompt, **limit, **field}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    text = body["content"] if path == "/completion" else body["choices"][0]["text"]
    if "grammar" in field:
        assert text in ("yes.", "no.")
    else:
        assert isinstance(json.loads(text), dict)
    with httpx.stream("POST", server.url + path, json={"prompt": prompt, **limit, **field, "stream": True},
                      timeout=120) as s:
        events = [json.loads(e) for e in sse_events(s) if e != "[DONE]"]
    streamed = "".join(e.get("content", "") if path == "/completion" else
                       (e["choices"][0]["text"] if e["choices"] else "") for e in events)
    assert streamed == text


@pytest.mark.parametrize("field,words", [({"grammar": "root ::= this is (not valid"}, "Expected ')'"),
                                         ({"json_schema": {"type": "nonsense"}}, "nonsense"),
                                         ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
                                         ({"response_format": {"type": "xml"}}, "not one of"),
                                         ({"grammar": "x", "json_schema": {}}, "one constraint")])
def test_bad_constraints_are_400_before_decoding(server, field, words):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **field}, timeout=60)
    assert words in assert_error_shape(r, 400)["message"]
    assert httpx.post(server.url + "/completion", json={"prompt": "hi", "n_predict": 2}, timeout=60).status_code == 200


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_tool_calls_with_the_openai_client(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    out = client.chat.completions.create(model="any", messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                         max_tokens=60)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    # a named function is always the one called; streamed as a tool-call delta
    named = {"type": "function", "function": {"name": "get_weather"}}
    with client.beta.chat.completions.stream(model="any", messages=ask, tools=[WEATHER, TIME], tool_choice=named,
                                             max_tokens=60) as s:
        final = s.get_final_completion()
    streamed = final.choices[0].message.tool_calls[0]
    assert streamed.function.name == "get_weather" and final.choices[0].finish_reason == "tool_calls"
    assert set(json.loads(streamed.function.arguments)) == {"city", "unit"}
    # the next turn: the call and its result go back in; tool_choice none answers in text
    turn2 = ask + [{"role": "assistant", "content": None, "tool_calls": [streamed.model_dump()]},
                   {"role": "tool", "tool_call_id": streamed.id, "content": '{"temp": 21}'}]
    reply = client.chat.completions.create(model="any", messages=turn2, tools=[WEATHER], tool_choice="none",
                                           max_tokens=20)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content
    auto = client.chat.completions.create(model="any", messages=turn2, tools=[WEATHER], max_tokens=60)
    msg = auto.choices[0].message
    assert msg.tool_calls or (msg.content and not msg.content.lstrip().startswith("{"))


@pytest.mark.parametrize("body,param", [({"tools": [{"type": "function"}]}, "tools"),
                                        ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                              "function": {"name": "nope"}}},
                                         "tool_choice"),
                                        ({"tool_choice": "required"}, "tool_choice"),
                                        ({"tools": [WEATHER] * 65}, "tools"),
                                        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools")])
def test_bad_tool_requests_are_400(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=60)
    assert assert_error_shape(r, 400)["param"] == param
