"""llama-server's context shift (``--context-shift``, ``--keep``, ``n_keep`` / ``n_discard``): an
answer that fills its context drops the older half and goes on; every drafter still gives
plain decoding's tokens, because drafts never cross the length where plain decoding shifts."""

from __future__ import annotations

import httpx
import pytest
from inproc import serve
from test_llama_backend import _need_binding
from tiny import tiny_target

from flashdraft.engine import EngineConfig, load_drafter
from flashdraft.generate import GenerationRequest, SpeculativeGenerator
from flashdraft.sampling import SamplingParams

CTX = 96  # per sequence: a 35-token prompt fills it after ~60 tokens of answer
N = 200   # tokens asked for: two shifts or more


@pytest.fixture(scope="module")
def real_llama():
    _need_binding()  # skipped without llama.cpp, but where CI requires it
    from flashdraft.targets.llama import LlamaTarget
    from flashdraft.targets.torch import default_model_path

    return LlamaTarget(default_model_path(), n_ctx=1024, n_seq=2, threads=2)


def _run(gen, ids, n=N, **kw):
    out, last = [], None
    for step in gen.generate(GenerationRequest(ids, n, SamplingParams(), ignore_eos=True, **kw)):
        out.extend(step.token_ids)
        last = step
    return out, last.timings, last.finish_reason


def _generator(target, spec, shift=True):
    drafter = None if spec == "none" else load_drafter(EngineConfig(spec_type=spec), target)
    gen = SpeculativeGenerator(target, drafter, ctx_size=CTX, n_draft=7)
    if shift:
        gen.enable_context_shift()
    return gen


@pytest.mark.real
def test_a_full_context_shifts_and_every_drafter_keeps_plain_decodings_tokens(real_llama):
    ids = real_llama.chat_prompt_ids([{"role": "user", "content": "Count from one to one hundred in words."}])
    assert 20 < len(ids) < CTX // 2
    # without the shift the answer ends where the context does, marked truncated
    short, t, finish = _run(_generator(real_llama, "none", shift=False), ids)
    assert finish == "length" and len(short) == CTX - len(ids) and t.truncated
    plain, t, finish = _run(_generator(real_llama, "none"), ids)
    assert finish == "length" and len(plain) == N and t.truncated
    assert plain[: len(short) - 1] == short[: len(short) - 1]  # the same answer until the first shift
    for spec in ("ngram", "dflash", "hybrid"):
        got, t, _ = _run(_generator(real_llama, spec), ids)
        assert got == plain, spec
        assert t.draft_n > 0 and t.truncated, spec
    # n_keep: the prompt stays whole through every shift (another answer, the same for a drafter)
    keep, _, _ = _run(_generator(real_llama, "none"), ids, n_keep=-1)
    assert keep != plain and len(keep) == N
    assert _run(_generator(real_llama, "ngram"), ids, n_keep=-1)[0] == keep


@pytest.mark.real
def test_the_next_request_reuses_only_what_the_shift_kept(real_llama):
    ids = real_llama.chat_prompt_ids([{"role": "user", "content": "List the months of the year, twice."}])
    gen = _generator(real_llama, "dflash")
    first, _, _ = _run(gen, ids, n=120, cache_prompt=True, n_keep=-1)
    again, t, _ = _run(gen, ids, n=20, cache_prompt=True)
    assert t.cache_n == len(ids) - 1  # the prompt survived the shifts (n_keep -1); the answer did not
    assert again == _run(_generator(real_llama, "dflash", shift=False), ids, n=20)[0]


def test_a_target_that_cannot_move_positions_refuses_the_flag():
    gen = SpeculativeGenerator(tiny_target("llama", seed=1, layers=2, hidden=32), ctx_size=64)
    with pytest.raises(ValueError, match="--context-shift needs .*llama backend"):
        gen.enable_context_shift()
    assert not gen.context_shift


@pytest.mark.real
def test_over_http_a_long_answer_shifts_and_says_truncated(real_llama):
    """llama.cpp's own ``test_with_ctx_shift``, on the packaged model: n_predict beyond the context."""
    gen = _generator(real_llama, "ngram")
    body = {"prompt": "Hello " * 60, "temperature": 0, "n_predict": N, "ignore_eos": True}
    with serve(gen) as url:
        shifted = httpx.post(url + "/completion", json=body, timeout=120).json()
        bad = httpx.post(url + "/completion", json={**body, "n_keep": -2}, timeout=30)
        health = httpx.get(url + "/health").status_code
    assert shifted["tokens_predicted"] == N and shifted["truncated"] is True
    assert bad.status_code == 400 and "n_keep" in bad.text and health == 200
    gen = _generator(real_llama, "ngram", shift=False)
    with serve(gen) as url:
        ended = httpx.post(url + "/completion", json=body, timeout=120).json()
    assert ended["truncated"] is True and ended["tokens_predicted"] < N
    assert shifted["content"].startswith(ended["content"][:-20])
