"""The server's request path: every generation route takes the same steps, in order, each
in its own module (parse -> validate -> jobs -> run -> render), on the tiny model in-process."""

from __future__ import annotations

import threading

import httpx
import pytest
from inproc import PROMPT, new_generator, serve

STEPS = {"flashdraft.server." + m: m for m in ("parse_openai", "parse_anthropic", "parse_responses", "validate",
                                                "jobs", "run", "render_openai", "render_llama", "render_anthropic",
                                                "render_responses")}


def visited_steps(path: str, body: dict) -> list[str]:
    """The step modules whose functions ran for one request on the threads that handled it
    (the event loop's and the prompt thread), consecutive repeats collapsed."""
    calls: list[tuple[int, str]] = []
    handlers: set[int] = set()

    def profile(frame, event, arg):
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if name == "flashdraft.server.pipeline" and frame.f_code.co_name in ("handle", "_prepare"):
            handlers.add(threading.get_ident())
        if name in STEPS:
            calls.append((threading.get_ident(), STEPS[name]))

    threading.setprofile(profile)  # before the server's threads start: they inherit it
    try:
        with serve(new_generator(ctx_size=128)) as url:
            httpx.get(url + "/health", timeout=60)
            calls.clear()
            r = httpx.post(url + path, json=body, timeout=60)
    finally:
        threading.setprofile(None)
    assert r.status_code == 200, r.text
    seq: list[str] = []
    for ident, module in calls:
        if ident in handlers and (not seq or seq[-1] != module):
            seq.append(module)
    return seq


USER = [{"role": "user", "content": "t1 t2"}]


@pytest.mark.parametrize("path,body,parse,render", [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 3}, "parse_openai", "render_openai"),
    ("/v1/completions", {"prompt": "t1 t2", "max_tokens": 3}, "parse_openai", "render_openai"),
    ("/completion", {"prompt": "t1 t2", "n_predict": 3}, "parse_openai", "render_llama"),
    ("/v1/messages", {"messages": USER, "max_tokens": 3}, "parse_anthropic", "render_anthropic"),
    ("/v1/responses", {"input": "t1 t2", "max_output_tokens": 3}, "parse_responses", "render_responses"),
])
def test_each_step_module_is_visited_once_in_order(path, body, parse, render):
    assert visited_steps(path, body) == [parse, "validate", "jobs", "run", render]


def test_a_missing_api_key_is_401_in_each_apis_error_shape():
    with serve(new_generator(ctx_size=128), api_key="k") as url:
        chat = httpx.post(url + "/v1/chat/completions", json={"messages": USER}, timeout=60)
        claude = httpx.post(url + "/v1/messages", json={"messages": USER}, timeout=60)
        # greedy on PROMPT: the server's default temperature samples, and a sampled EOS
        # after one token would end the answer early
        ok = httpx.post(url + "/v1/messages", json={"messages": [{"role": "user", "content": PROMPT}],
                                                    "max_tokens": 2, "temperature": 0},
                        headers={"x-api-key": "k"}, timeout=60)
    assert chat.status_code == claude.status_code == 401
    assert chat.json()["error"]["type"] == "authentication_error"
    assert claude.json()["type"] == "error" and claude.json()["error"]["type"] == "authentication_error"
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 2
