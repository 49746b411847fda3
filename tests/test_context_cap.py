"""A limit on new tokens beyond what the context holds is capped to the context, as
llama-server does (llama.cpp's server tests ``test_slot_ctx_not_exceeded``); a prompt that
does not fit stays a 400. On the tiny model in-process (context 128)."""

from __future__ import annotations

import httpx
import pytest
from inproc import new_generator, serve

CTX = 128
PROMPT = "t5 t9 t17 t3"  # 4 tokens on the pass-through template


@pytest.fixture(scope="module")
def url():
    with serve(new_generator(ctx_size=CTX)) as base:
        yield base


#: the APIs that take llama-server's ``ignore_eos`` (so the answer runs to the context's end)
UNTIL_THE_END = {"ignore_eos": True}


@pytest.mark.parametrize("path,body,used", [
    ("/completion", {"prompt": PROMPT, "n_predict": 100000, **UNTIL_THE_END}, lambda b: b["tokens_predicted"]),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 100000, **UNTIL_THE_END},
     lambda b: b["usage"]["completion_tokens"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_completion_tokens": 100000,
                              **UNTIL_THE_END}, lambda b: b["usage"]["completion_tokens"]),
    ("/v1/messages", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32000},
     lambda b: b["usage"]["output_tokens"]),
    ("/v1/responses", {"input": PROMPT, "max_output_tokens": 32000}, lambda b: b["usage"]["output_tokens"]),
])
def test_a_limit_beyond_the_context_is_capped_to_it(url, path, body, used):
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    n = used(r.json())
    assert 0 < n <= CTX - 4, n
    if body.get("ignore_eos"):
        assert n >= CTX - 8, n  # ran to the context's end (the chat template may add a token or two)


def test_a_prompt_beyond_the_context_is_still_a_400(url):
    r = httpx.post(url + "/completion", json={"prompt": "t1 " * (CTX + 1), "n_predict": 4}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["n_ctx"] == CTX, err


def test_the_context_size_is_in_models_and_props_as_llama_server_says_it(url):
    """``/v1/models`` ``data[].meta`` (``n_ctx_train``, ``n_ctx``, ``n_embd``...) and
    ``/props`` ``default_generation_settings.n_ctx``, as llama-server reports them."""
    meta = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["meta"]
    assert meta["n_ctx"] == CTX and meta["n_ctx_train"] == 512 and meta["n_embd"] == 64 and meta["n_vocab"] == 64
    props = httpx.get(url + "/props", timeout=30).json()
    assert props["default_generation_settings"]["n_ctx"] == CTX
