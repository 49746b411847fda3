"""The tool preamble is one compact line per tool and the same bytes for every
``tool_choice`` that offers tools, so a client that varies it keeps its prompt cache."""

from __future__ import annotations

import json

import httpx
import pytest
from inproc import new_generator, serve

TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} things",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "string"}},
                                                          "required": ["x"]}}}
         for name in ("read", "write")]


@pytest.fixture(scope="module")
def url():
    with serve(new_generator()) as u:
        yield u


def prompt(url: str, **extra) -> str:
    body = {"messages": [{"role": "user", "content": "t5 t9"}], "tools": TOOLS, **extra}
    r = httpx.post(url + "/apply-template", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_the_preamble_is_the_same_for_auto_required_and_a_named_tool(url):
    auto = prompt(url)
    assert prompt(url, tool_choice="auto") == auto
    assert prompt(url, tool_choice="required") == auto
    assert prompt(url, tool_choice={"type": "function", "function": {"name": "write"}}) == auto
    # every tool listed, one compact JSON object per line
    for tool in TOOLS:
        fn = tool["function"]
        line = json.dumps({"name": fn["name"], "description": fn["description"], "parameters": fn["parameters"]},
                          separators=(",", ":"))
        assert f"\n{line}\n" in auto
    assert "tool_calls" not in prompt(url, tool_choice="none")
