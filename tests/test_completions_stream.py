"""``/v1/completions`` streamed through the official ``openai`` client, iterated the way
llama.cpp's ``test_completion_stream_with_openai_library`` does (``chunk.choices[0]`` on every
chunk): as llama-server, the last chunk carries the finish reason with usage and timings."""

from __future__ import annotations

import pytest
from inproc import new_generator, serve
from openai import OpenAI


@pytest.fixture(scope="module")
def client():
    with serve(new_generator(ctx_size=128)) as url:
        yield OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_every_completions_chunk_has_a_choice_and_the_last_one_the_usage(client):
    kw = dict(model="any", prompt="t5 t9 t17 t3", max_tokens=8, temperature=0)
    full = client.completions.create(**kw)
    text, finishes, chunks = "", [], list(client.completions.create(**kw, stream=True))
    for chunk in chunks:
        choice = chunk.choices[0]  # llama.cpp's test reads it on each chunk
        if choice.finish_reason is None:
            text += choice.text
        else:
            finishes.append(choice.finish_reason)
    assert text == full.choices[0].text and finishes == [full.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices[0].finish_reason is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens > 0
    assert last.model_extra["timings"]["predicted_n"] == full.usage.completion_tokens
