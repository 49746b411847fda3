"""llama-server's ``return_progress``: a stream reports how far the prefill has come
(``prompt_progress``: total, cache, processed, time_ms), and a prefill cancelled between its
chunks leaves what it did as the prompt cache."""

from __future__ import annotations

import json

import httpx
import pytest
from inproc import PacedGenerator, chat_target, serve
from openai import OpenAI

from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.generate import Cancelled, GenerationRequest, SpeculativeGenerator
from flashdraft.sampling import SamplingParams

PROMPT = [5, 9, 17, 3, 22, 41, 5, 9, 17, 3, 22, 41, 8, 12, 30, 7, 5, 9, 17, 3, 22, 41, 11, 6, 2, 19, 27, 5, 9, 17]


def _gen() -> SpeculativeGenerator:
    return SpeculativeGenerator(chat_target(), NgramDrafter(), ctx_size=128, n_draft=4)


def test_progress_reports_each_chunk_and_leaves_the_answer_unchanged():
    plain = [t for s in _gen().generate(GenerationRequest(PROMPT, 12, SamplingParams(temperature=0.0)))
             for t in s.token_ids]
    gen = _gen()
    steps = list(gen.generate(GenerationRequest(PROMPT, 12, SamplingParams(temperature=0.0), return_progress=True),
                              prefill_chunk=8))
    assert [t for s in steps for t in s.token_ids] == plain
    reports = [s.prompt_progress for s in steps if s.prompt_progress is not None]
    # 0% before any forward, one report per chunk of 8 (8, 16, 24), then 30 with the first token
    assert [(p.total, p.cache, p.processed) for p in reports] == [(30, 0, 0), (30, 0, 8), (30, 0, 16), (30, 0, 24),
                                                                   (30, 0, 30)]
    assert reports[0].time_ms == 0 and all(a.time_ms <= b.time_ms for a, b in zip(reports, reports[1:]))
    assert all(s.only_progress for s in steps[:4]) and steps[4].token_ids and not steps[4].only_progress
    # the timings streamed with each report count what was prefilled so far
    assert [s.progress.prompt_n for s in steps[:4]] == [0, 8, 16, 24] and steps[0].progress.prompt_ms == 0.0
    # the same prompt again: the cache is reported from the first report on
    steps = list(gen.generate(GenerationRequest(PROMPT, 12, SamplingParams(temperature=0.0), cache_prompt=True,
                                                return_progress=True), prefill_chunk=8))
    reports = [s.prompt_progress for s in steps if s.prompt_progress is not None]
    assert reports[0].cache == reports[0].processed == 29 and reports[-1].processed == 30 and len(reports) == 2
    assert [t for s in steps for t in s.token_ids] == plain


def test_a_prefill_cancelled_between_chunks_keeps_its_chunks_as_the_prompt_cache():
    gen = _gen()
    forwards = []
    inner = gen.target.forward
    gen.target.forward = lambda *a: forwards.append(a[0].shape[0]) or inner(*a)
    with pytest.raises(Cancelled):
        for _ in gen.generate(GenerationRequest(PROMPT, 12, SamplingParams(temperature=0.0)), prefill_chunk=8,
                              cancelled=lambda: len(forwards) >= 2):
            pass
    assert forwards == [8, 8] and gen.prompt_cache.tokens == PROMPT[:16]
    steps = list(gen.generate(GenerationRequest(PROMPT, 12, SamplingParams(temperature=0.0), cache_prompt=True)))
    assert steps[-1].timings.cache_n == 16 and forwards[2] == 14
    fresh = [t for s in _gen().generate(GenerationRequest(PROMPT, 12, SamplingParams(temperature=0.0)))
             for t in s.token_ids]
    assert [t for s in steps for t in s.token_ids] == fresh


def _events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


WORDS = " ".join(f"t{t}" for t in PROMPT)


@pytest.fixture(scope="module", params=[1, 2], ids=["np1", "np2"])
def server(request):
    gen = PacedGenerator(chat_target(), NgramDrafter(), ctx_size=128, n_draft=4)
    with serve(gen, batch_size=8, n_parallel=request.param) as url:
        yield url


@pytest.mark.parametrize("path,body", [
    ("/completion", {"prompt": WORDS, "n_predict": 4}),
    ("/v1/completions", {"prompt": WORDS, "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": WORDS}], "max_tokens": 4}),
])
def test_streams_carry_prompt_progress_as_llama_server(server, path, body):
    body = {**body, "stream": True, "return_progress": True, "timings_per_token": True, "temperature": 0,
            "cache_prompt": False}
    with httpx.stream("POST", server + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        events = _events(r)
    reports = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    total = reports[0]["total"]
    assert total >= 30 and reports[0]["cache"] == reports[0]["processed"] == 0
    assert [p["processed"] for p in reports] == list(range(0, total, 8)) + [total]
    assert all(p["total"] == total and p["cache"] == 0 for p in reports)
    # the reports come before any text, and say nothing themselves
    first_text = next(i for i, e in enumerate(events) if (e.get("content") or (e.get("choices") or [{}])[0].get(
        "text") or ((e.get("choices") or [{}])[0].get("delta") or {}).get("content")))
    assert max(i for i, e in enumerate(events) if "prompt_progress" in e) < first_text
    timings = [e["timings"] for e in events if "prompt_progress" in e]
    assert timings[0]["prompt_n"] == 0 and timings[0]["prompt_ms"] == 0.0
    assert all(a["prompt_ms"] <= b["prompt_ms"] for a, b in zip(timings, timings[1:]))
    # without the field: no reports
    with httpx.stream("POST", server + path, json={**body, "return_progress": False}, timeout=30) as r:
        assert not any("prompt_progress" in e for e in _events(r))


def test_responses_progress_is_an_in_progress_event(server):
    body = {"input": WORDS, "max_output_tokens": 4, "stream": True, "return_progress": True,
            "timings_per_token": True, "temperature": 0}
    with httpx.stream("POST", server + "/v1/responses", json=body, timeout=30) as r:
        events = _events(r)
    reports = [e for e in events if "prompt_progress" in e]
    assert reports and all(e["type"] == "response.in_progress" for e in reports)
    assert reports[-1]["prompt_progress"]["processed"] == reports[-1]["prompt_progress"]["total"]
    assert events[-1]["type"] == "response.completed"


def test_the_openai_client_reads_a_stream_with_progress(server):
    client = OpenAI(base_url=server + "/v1", api_key="x")
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": WORDS}],
                                                 max_tokens=4, temperature=0, stream=True,
                                                 extra_body={"return_progress": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": WORDS}],
                                           max_tokens=4, temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
