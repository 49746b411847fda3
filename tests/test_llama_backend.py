"""The llama backend (`--backend llama`): parity with torch, rollback, losslessness, errors.

Skipped with the reason when llama-cpp-python is not installed, except where
``FLASHDRAFT_REQUIRE_LLAMA=1`` (CI sets it): there a missing or broken build fails.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
from tiny import byte_tokenizer, tiny_model
from tiny_gguf import write_tiny_gguf

from flashdraft.targets import binding as binding_mod
from flashdraft.targets.binding import BindingUnavailableError


def _need_binding():
    try:
        binding_mod.binding()
    except BindingUnavailableError as e:
        if os.environ.get("FLASHDRAFT_REQUIRE_LLAMA") == "1":
            raise
        pytest.skip(f"llama backend unavailable: {e}")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    _need_binding()
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_pair(tiny_gguf):
    """The same random model on both backends (the GGUF holds its F32 weights)."""
    from flashdraft.targets.torch import Target
    from flashdraft.targets.llama import LlamaTarget

    llama = LlamaTarget(tiny_gguf, n_ctx=256, n_seq=4, tokenizer=byte_tokenizer())
    ref = Target(tiny_model("llama", 0), byte_tokenizer(), name="tiny-llama")
    return llama, ref


def test_both_backends_meet_the_target_contract(tiny_pair):
    """Every member of :class:`flashdraft.targets.base.Target` is there on both backends, and the
    declared capabilities hold: the llama target has no torch model and sizes its context for
    its sequences; the torch target's thread and sequence calls do nothing and report no drift."""
    from flashdraft.targets.base import Target as Contract

    members = {n for n in vars(Contract) if not n.startswith("_")} | set(Contract.__annotations__)
    llama, ref = tiny_pair
    for t in (llama, ref):
        missing = [n for n in members if not hasattr(type(t), n) and n not in vars(t)]
        assert not missing, (type(t).__name__, missing)
    assert (llama.backend, ref.backend) == ("llama", "torch")
    assert llama.model is None and llama.lean is None and ref.model is not None
    before = ref.new_cache()
    ref.set_step_threads(4)
    ref.ensure_sequences(64)
    assert ref.verify_drift() == 0.0 and before.length == 0
    assert llama.n_seq_max == 2 * 4 + 1  # each slot's sequence and prompt cache, one spare


def test_tiny_gguf_logits_and_features_match_torch(tiny_pair):
    """Same weights, two engines: logits within 1e-2 (of logits up to ~5), the same argmax,
    and the layer outputs (llama.cpp's inputs of the next layer) within 1e-3."""
    llama, ref = tiny_pair
    ids = torch.tensor(llama.encode("the quick brown fox jumps over the lazy dog"))
    for t in (llama, ref):
        t.set_feature_layers([0, 2])
    l1, f1 = llama.forward(ids, llama.new_cache())
    l1 = l1.clone()  # a view of llama.cpp's buffer: the next forward overwrites it
    l2, f2 = ref.forward(ids, ref.new_cache())
    assert l1.shape == l2.shape == (len(ids), llama.vocab_size)
    assert f1.shape == f2.shape == (len(ids), 2 * llama.hidden_size)
    assert (l1 - l2).abs().max() < 1e-2 and l2.abs().max() > 1.0
    assert torch.equal(l1.argmax(-1), l2.argmax(-1))
    assert (f1 - f2).abs().max() < 1e-3
    # the prefill asks only for the last row's logits; the features still cover every row
    l3, f3 = llama.forward(ids, llama.new_cache(), logits_from=len(ids) - 1)
    # (F32 weights take another matmul kernel for one row than for a batch: ~1e-5 apart)
    assert l3.shape[0] == 1 and torch.allclose(l3[0], l1[-1], atol=1e-4) and torch.equal(f3, f1)
    llama.set_feature_layers(None)


def test_rollback_equals_a_fresh_prefill(tiny_pair):
    """After a rejected block the sequence is a fresh prefill of the accepted tokens: the next
    step's logits agree (to 1e-4 on this F32-weight model, whose one-row and batched matmul
    kernels round differently; bit-identical on the real Q4_1 model, tested below)."""
    llama, _ = tiny_pair
    prompt = llama.encode("hello world this is")
    block = llama.encode("abcdefgh")
    cache = llama.new_cache()
    llama.forward(torch.tensor(prompt), cache)
    llama.forward(torch.tensor(block), cache)  # verify 8 rows ...
    cache.rollback(len(prompt) + 3)  # ... keep the anchor and 2 accepted drafts
    after, _ = llama.forward(torch.tensor(llama.encode("z")), cache)
    after = after.clone()
    fresh = llama.new_cache()
    llama.forward(torch.tensor(prompt + block[:3]), fresh)
    expect, _ = llama.forward(torch.tensor(llama.encode("z")), fresh)
    assert torch.allclose(after, expect, atol=1e-4)
    assert cache.length == fresh.length == len(prompt) + 4
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.rollback(cache.length + 1)


def test_packed_sequences_equal_their_own_forwards(tiny_pair):
    """`-np` slots: several sequences in one llama_decode give each the logits it gets alone."""
    llama, _ = tiny_pair
    a, b = llama.encode("one two three"), llama.encode("four five")
    ca, cb = llama.new_cache(), llama.new_cache()
    (la, _), (lb, _) = llama.forward_packed([(torch.tensor(a), ca, 0), (torch.tensor(b), cb, 0)])
    la, lb = la.clone(), lb.clone()
    ra, _ = llama.forward(torch.tensor(a), llama.new_cache())
    ra = ra.clone()
    rb, _ = llama.forward(torch.tensor(b), llama.new_cache())
    assert torch.allclose(la, ra, atol=1e-4) and torch.allclose(lb, rb, atol=1e-4)


def test_more_sequences_than_ubatch_rows(tiny_gguf):
    """`-np 32` holds 65 sequences (a slot and a prompt cache each, plus one): more than the
    48-row ubatch, which llama.cpp's output buffer must still fit (it aborted the process)."""
    from flashdraft.targets.llama import LlamaTarget

    t = LlamaTarget(tiny_gguf, n_ctx=64, n_seq=32, tokenizer=byte_tokenizer())
    assert t.n_seq_max == 65 > t.ubatch
    caches = [t.new_cache() for _ in range(60)]
    outs = t.forward_packed([(torch.tensor(t.encode("ab")), c, 1) for c in caches])
    assert len(outs) == 60 and all(lg.shape == (1, t.vocab_size) for lg, _ in outs)


def test_a_large_ubatch_decodes_a_prefill_alone_and_drafting_stays_exact(tiny_gguf):
    """-ub 256: a 100-row prefill runs in a decode of its own (over 64 rows ggml's attention
    takes its tiled kernel), never packed with another slot's verify block, which keeps its
    own logits bit for bit; greedy drafting still equals plain decoding on that target."""
    from flashdraft.drafters.ngram import NgramDrafter
    from flashdraft.generate import SpeculativeGenerator, generate_text
    from flashdraft.sampling import SamplingParams
    from flashdraft.targets.llama import PACK_ROWS, LlamaTarget

    t = LlamaTarget(tiny_gguf, n_ctx=256, n_seq=2, ubatch=256, tokenizer=byte_tokenizer())
    long, short = torch.tensor(t.encode("abcdefghij" * 10)), torch.tensor(t.encode("xyz"))
    decodes = []
    real = t._decode
    t._decode = lambda items: decodes.append([len(ids) for ids, _, _ in items]) or real(items)
    c = t.new_cache()
    t.forward(torch.tensor(t.encode("hello")), c)
    outs = t.forward_packed([(short, c, 0), (long, t.new_cache(), 99), (short, t.new_cache(), 0)])
    assert decodes[1:] == [[3], [100], [3]] and 100 > PACK_ROWS
    alone = t.forward(short, t.new_cache())[0]
    assert torch.equal(outs[2][0], alone)
    t._decode = real
    ids = t.encode("abcabcabd abcabcab" * 3)
    want = generate_text(SpeculativeGenerator(t, ctx_size=256), ids, 40, SamplingParams(), ignore_eos=True)[1]
    got = generate_text(SpeculativeGenerator(t, NgramDrafter(), ctx_size=256, n_draft=6), ids, 40, SamplingParams(),
                        ignore_eos=True)
    assert got[1] == want and got[3].draft_n > 0


def test_long_prefill_runs_in_ubatch_chunks(tiny_gguf):
    from flashdraft.targets.llama import LlamaTarget

    small = LlamaTarget(tiny_gguf, n_ctx=256, ubatch=16, tokenizer=byte_tokenizer())
    big = LlamaTarget(tiny_gguf, n_ctx=256, tokenizer=byte_tokenizer())
    ids = torch.tensor(small.encode("abcdefghij" * 5))  # 50 tokens: 4 chunks of <= 16
    for t in (small, big):
        t.set_feature_layers([1])
    l1, f1 = small.forward(ids, small.new_cache())
    l2, f2 = big.forward(ids, big.new_cache())
    assert l1.shape == l2.shape and f1.shape == f2.shape == (50, small.hidden_size)
    assert torch.allclose(l1, l2, atol=1e-4) and torch.allclose(f1, f2, atol=1e-5)
    # a chunk of a longer prompt (-b): no row asks for logits, the K/V and features still come
    cache = small.new_cache()
    lg, ft = small.forward(ids, cache, len(ids))
    assert lg.shape == (0, small.vocab_size) and ft.shape == (50, small.hidden_size) and cache.length == 50


def test_sampling_on_the_llama_backend_keeps_the_target_distribution(tiny_pair):
    """T = 1: the first token (the prefill's) follows the llama target's softmax
    (chi-square), and the later ones, accepted or rejected by speculative sampling over
    prompt-lookup drafts, have the distribution plain decoding gives them (two-sample
    chi-square, 400 runs per mode)."""
    from scipy.stats import chi2_contingency, chisquare

    from flashdraft.drafters.base import NoDrafter
    from flashdraft.drafters.ngram import NgramDrafter
    from flashdraft.generate import SpeculativeGenerator, generate_text
    from flashdraft.sampling import SamplingParams

    llama, _ = tiny_pair
    # every token but <eos> occurs in the prompt: prompt lookup has a continuation to draft
    prompt = llama.encode("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ab")
    logits, _ = llama.forward(torch.tensor(prompt), llama.new_cache(), logits_from=len(prompt) - 1)
    p = torch.softmax(logits[-1].clone(), -1)
    keep = p * 400 >= 5
    first, later, drafted = {}, {}, 0
    for name, drafter in (("none", NoDrafter()), ("ngram", NgramDrafter(3, 1))):
        gen = SpeculativeGenerator(llama, drafter, ctx_size=128, n_draft=4)
        first[name], later[name] = torch.zeros_like(p), torch.zeros(2, llama.vocab_size)
        for seed in range(400):
            _, ids, _, t = generate_text(gen, prompt, 3, SamplingParams(temperature=1.0, seed=seed), ignore_eos=True)
            first[name][ids[0]] += 1
            later[name][0, ids[1]] += 1
            later[name][1, ids[2]] += 1
            drafted += t.draft_n
        observed = torch.cat([first[name][keep], first[name][~keep].sum()[None]])
        expected = torch.cat([p[keep], p[~keep].sum()[None]]) * 400
        assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3, name
    assert drafted > 360  # nearly every ngram run drafted its second token (verified by rejection sampling)
    for k in range(2):
        table = torch.stack([later["none"][k], later["ngram"][k]])
        table = table[:, table.sum(0) >= 10]
        assert chi2_contingency(table.numpy()).pvalue > 1e-3, k


def test_missing_binding_names_the_fix(monkeypatch):
    binding_mod.binding.cache_clear()
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as when not installed
    try:
        with pytest.raises(BindingUnavailableError, match="make llama"):
            binding_mod.binding()
        from flashdraft.targets.load import choose_backend

        with pytest.raises(BindingUnavailableError, match="llama-cpp-python"):
            choose_backend("llama", None, None, torch.device("cpu"))
        choice = choose_backend("auto", None, None, torch.device("cpu"))
        assert choice.backend == "torch" and "llama.cpp unavailable" in choice.why
    finally:
        binding_mod.binding.cache_clear()


def test_a_probe_that_crashes_leaves_auto_on_torch(monkeypatch, tmp_path, caplog):
    """A build that dies on this CPU (illegal instruction, llama.cpp #20824's segfault) kills
    the probe's child process only; auto then runs the target on torch and says why."""
    _need_binding()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(binding_mod, "_PROBE_CODE", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    ok, detail = binding_mod.probe("/nonexistent.gguf")
    assert not ok and "signal 11" in detail
    from flashdraft.targets.load import choose_backend

    choice = choose_backend("auto", None, None, torch.device("cpu"))
    assert choice.backend == "torch" and "probe decode failed" in choice.why and "signal 11" in choice.why


def test_backend_choice_rules():
    from flashdraft.kv_cache import KVCacheSpec
    from flashdraft.targets.load import choose_backend, torch_only_reason

    cpu = torch.device("cpu")
    assert torch_only_reason("model_dir", None, cpu) == "model_dir is not a GGUF file"
    assert "--weights q4" in torch_only_reason(None, "q4", cpu)
    assert "turbo3" in torch_only_reason(None, None, cpu, kv=KVCacheSpec("f32", "turbo3"))
    assert torch_only_reason(None, None, cpu, kv=KVCacheSpec("q8_0", "q8_0")) is None
    assert choose_backend("torch", None, None, cpu).backend == "torch"
    with pytest.raises(ValueError, match="--backend llama cannot run this"):
        choose_backend("llama", None, "bf16", cpu)
    with pytest.raises(ValueError, match="unknown --backend"):
        choose_backend("vulkan", None, None, cpu)


def test_backend_flag_on_every_command():
    from flashdraft.flags import add_model_arguments
    from flashdraft.server.cli import build_parser
    import argparse

    p = argparse.ArgumentParser()
    add_model_arguments(p)
    assert p.parse_args([]).backend == "auto" and p.parse_args(["--backend", "torch"]).backend == "torch"
    assert build_parser().parse_args(["--backend", "llama"]).backend == "llama"
    from flashdraft.train.regen import build_arg_parser as regen_parser

    assert regen_parser().parse_args(["--out", "x", "--backend", "llama"]).backend == "llama"


def test_engine_logs_the_backend_and_why(tiny_gguf, caplog):
    from flashdraft.engine import EngineConfig, load_engine_target

    caplog.set_level(logging.INFO, logger="flashdraft")
    with pytest.raises(ValueError, match="cannot run this: .*not a GGUF"):
        load_engine_target(EngineConfig(model=str(tiny_gguf.parent), backend="llama"))
    t = load_engine_target(EngineConfig(spec_type="none", backend="torch"))
    assert t.__class__.__name__ == "Target"
    assert "target backend: torch (asked for)" in caplog.text


# ---------------------------------------------------------------- the real model (SmolLM2 Q4_1)
@pytest.fixture(scope="module")
def real_llama():
    _need_binding()
    from flashdraft.targets.torch import default_model_path
    from flashdraft.targets.llama import LlamaTarget

    return LlamaTarget(default_model_path(), n_ctx=1024, n_seq=4, threads=2)  # make serve runs -t 2


REAL_PROMPTS = ["Write a Python class for a stack with push, pop and peek, and explain each method.",
                "Tell me a short story about a lighthouse keeper and a storm."]
#: tokens of the plain-decoding baseline the real-model drafting tests compare against
REAL_TOKENS = 256


@pytest.fixture(scope="module")
def real_plain(real_llama):
    """``(prompt ids, plain greedy answers of REAL_TOKENS tokens)`` of :data:`REAL_PROMPTS` on
    the llama backend, decoded once for every drafting test (a shorter greedy answer is a prefix)."""
    from flashdraft.generate import SpeculativeGenerator, generate_text
    from flashdraft.sampling import SamplingParams

    prompts = [real_llama.chat_prompt_ids([{"role": "user", "content": p}]) for p in REAL_PROMPTS]
    plain = SpeculativeGenerator(real_llama, ctx_size=1024)
    return prompts, [generate_text(plain, ids, REAL_TOKENS, SamplingParams())[1] for ids in prompts]


@pytest.mark.real
def test_real_model_verify_rows_equal_one_token_steps(real_llama):
    """ggml's batched matmuls on the Q4_1/Q8_0 GGUF give a 16-row verify the same logits and
    features, bit for bit, as 16 one-token steps: the precondition of lossless drafting."""
    t = real_llama
    t.set_feature_layers([1, 14, 27])
    ids = t.chat_prompt_ids([{"role": "user", "content": REAL_PROMPTS[0]}])
    block = ids[3:19]
    cache = t.new_cache()
    t.forward(torch.tensor(ids), cache, len(ids) - 1)
    start = cache.length
    lb, fb = t.forward(torch.tensor(block), cache)
    lb = lb.clone()
    cache.rollback(start)
    rows_l, rows_f = [], []
    for x in block:
        l, f = t.forward(torch.tensor([x]), cache)
        rows_l.append(l.clone())
        rows_f.append(f)
    assert torch.equal(lb, torch.cat(rows_l)) and torch.equal(fb, torch.cat(rows_f))
    t.set_feature_layers(None)
    # a long prefill (100 rows: ggml's tiled attention starts at 64 query rows, so it runs in
    # chunks under that) leaves the cache a prompt-cache reuse would get from steps: the next
    # logits equal those after stepping the same tokens one by one
    text = t.encode("Explain how a hash map resolves collisions, with an example in Python. " * 8)[:100]
    a, b = t.new_cache(), t.new_cache()
    t.forward(torch.tensor(text), a, 99)
    t.forward(torch.tensor(text[:1]), b)
    for x in text[1:]:
        t.forward(torch.tensor([x]), b)
    la = t.forward(torch.tensor([text[0]]), a)[0].clone()
    assert torch.equal(la, t.forward(torch.tensor([text[0]]), b)[0])


#: a child process: one-token steps forced onto 2 threads at a cache of ~600 cells (stock ggml
#: splits such a row's attention across threads from 512 cells on) against a 16-row verify
_THREAD_DRIFT = """
import json, torch
from flashdraft.targets import binding
from flashdraft.targets.llama import LlamaTarget
from flashdraft.targets.torch import default_model_path
t = LlamaTarget(default_model_path(), n_ctx=1024, threads=2, warn=False)
ids = t.encode("Explain how a hash map resolves collisions, with an example in Python. " * 60)[:616]
cache = t.new_cache()
t.forward(torch.tensor(ids[:600]), cache, 599)
start = cache.length
t.set_step_threads(2)
rows = t.forward(torch.tensor(ids[600:616]), cache)[0].clone()
cache.rollback(start)
steps = torch.cat([t.forward(torch.tensor([x]), cache)[0].clone() for x in ids[600:616]])
print(json.dumps({"switch": binding.has_fa_split_kv_switch(t._b.cpu.path), "exact_step_threads": t.exact_step_threads,
                  "drift": float((rows - steps).abs().max())}))
"""


def _thread_drift(split_kv: str) -> dict:
    import json
    import subprocess

    env = {**binding_mod.child_env(), binding_mod.FA_SPLIT_KV_ENV: split_kv}
    out = subprocess.run([sys.executable, "-c", _THREAD_DRIFT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.real
def test_real_model_steps_on_every_thread_equal_verify_rows():
    """The ggml `make llama` builds (scripts/llama-patches/fa-split-kv-env.patch) keeps one query
    row's flash attention on one thread, so one-token steps on 2 threads equal a 16-row verify
    block bit for bit at a 600-cell cache, and the backend runs steps on every ``-t`` thread.
    With the switch at 1 (stock ggml's split over the KV cache) the same steps drift: the
    switch is what keeps them equal."""
    _need_binding()
    exact = _thread_drift("0")
    if not exact["switch"]:
        if os.environ.get("FLASHDRAFT_REQUIRE_LLAMA") == "1":
            pytest.fail("the installed llama.cpp lacks scripts/llama-patches/fa-split-kv-env.patch: run make llama")
        pytest.skip("the installed llama.cpp is not the patched build of make llama")
    assert exact["exact_step_threads"] == 2 and exact["drift"] == 0.0, exact
    stock = _thread_drift("1")
    assert stock["exact_step_threads"] == 1 and stock["drift"] > 0.0, stock


def _decode_together(gen, prompts, n_tokens):
    """Greedy answers to ``prompts``, one slot each, every step one batched forward
    (the server's -np N); fails on any slot's error."""
    from flashdraft import batch
    from flashdraft.generate import GenerationRequest
    from flashdraft.sampling import SamplingParams

    slots = batch.make_slots(gen, len(prompts))
    for slot, ids in zip(slots, prompts):
        batch.start(gen, slot, GenerationRequest(ids, n_tokens, SamplingParams()))
    out = [[] for _ in slots]
    while any(s.seq is not None and not s.seq.done for s in slots):
        live = [s for s in slots if s.seq is not None and not s.seq.done]
        for s, step in zip(live, batch.step_together(gen.target, [s.seq for s in live])):
            assert not isinstance(step, Exception), step
            out[s.index].extend(step.token_ids)
    return out


@pytest.mark.real
def test_real_model_every_drafter_is_greedy_identical(real_llama, real_plain):
    """8 configurations x 512 tokens (2 prompts x 256) on the llama backend: dflash, ngram,
    hybrid, an autoregressive draft model and `make serve`'s ngram under the cost controller
    one request at a time, and dflash, ngram,
    hybrid with 4 sequences in one batch (the server's -np 4), all token-identical to the
    backend's own plain decoding."""
    from flashdraft.engine import EngineConfig, load_drafter
    from flashdraft.generate import SpeculativeGenerator, generate_text
    from flashdraft.sampling import SamplingParams
    from flashdraft.targets.torch import default_model_path

    t = real_llama
    prompts, base = real_plain
    assert all(len(b) > 100 for b in base)
    configs = [("dflash", None), ("ngram", None), ("hybrid", None), ("draft", str(default_model_path()))]
    for spec, md in configs:
        gen = SpeculativeGenerator(t, load_drafter(EngineConfig(spec_type=spec, draft_model=md), t),
                                   ctx_size=1024, n_draft=3 if spec == "draft" else 7)
        drafted = 0
        for ids, want in zip(prompts, base):
            _, got, _, timings = generate_text(gen, ids, REAL_TOKENS, SamplingParams())
            assert got == want, spec
            drafted += timings.draft_n
        assert drafted > 0, spec
    # what `make serve` runs: prompt lookup under the cost controller (a draft every step, cut
    # by the measured cost table and the match length)
    from flashdraft.engine import load_engine

    gen = load_engine(EngineConfig(spec_type="ngram", controller="cost", n_draft=7, ctx_size=1024), target=t,
                      warmup=False)
    drafted = 0
    for ids, want in zip(prompts, base):
        _, got, _, timings = generate_text(gen, ids, REAL_TOKENS, SamplingParams())
        assert got == want, "ngram-cost"
        drafted += timings.draft_n
    assert drafted > 0, "ngram-cost"
    # -np 4: four sequences (both prompts twice) stepped together, one llama_decode per step
    for spec in ("dflash", "ngram", "hybrid"):
        gen = SpeculativeGenerator(t, load_drafter(EngineConfig(spec_type=spec), t), ctx_size=1024, n_draft=7)
        out = _decode_together(gen, [prompts[i % 2] for i in range(4)], REAL_TOKENS)
        for i in range(4):
            assert out[i] == base[i % 2], (spec, i)


@pytest.mark.real
def test_real_model_dflash2_path_selection_is_greedy_identical(real_llama, real_plain):
    """The shipped DFlash2 drafter (top-16 candidates, the selector's path verified as one
    block) on the real model: fixed depth, the profit controller with the confidence gate
    (`--spec-draft-p-min 0.3`), the hybrid, and 2 sequences stepped together are all
    token-identical to plain decoding, and each had drafts the target accepted; the drafter
    in float32 and in bf16 (`--spec-draft-dtype`) alike."""
    from flashdraft.engine import DEFAULT_DRAFTER_DIR, EngineConfig, drafter_controller, load_drafter
    from flashdraft.generate import SpeculativeGenerator, generate_text
    from flashdraft.sampling import SamplingParams

    shipped = str(DEFAULT_DRAFTER_DIR)
    t = real_llama
    prompts, full = real_plain
    base = [b[:192] for b in full]  # greedy: the 192-token answer is the 256-token one's prefix
    settings = [("dflash", "off", 0.0, "f32"), ("dflash", "off", 0.0, "bf16"), ("dflash", "profit", 0.3, "auto"),
                ("hybrid", "profit", 0.0, "auto")]
    for spec, controller, p_min, dtype in settings:
        drafter = load_drafter(EngineConfig(spec_type=spec, draft_model=shipped, p_min=p_min, draft_dtype=dtype), t)
        d2 = getattr(drafter, "dflash", drafter)  # the hybrid wraps a DFlash drafter
        assert d2.model.candidate_selector is not None and d2.model.candidate_selector.top_k == 16
        if dtype != "auto":
            assert d2.model.fc.weight.dtype == d2.head_weight.dtype == {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
        gen = SpeculativeGenerator(t, drafter, ctx_size=1024, n_draft=7,
                                   controller=drafter_controller(controller, drafter, 7))
        accepted = 0
        for ids, want in zip(prompts, base):
            _, got, _, timings = generate_text(gen, ids, 192, SamplingParams())
            assert got == want, (spec, controller, p_min, dtype)
            accepted += timings.draft_n_accepted
        assert accepted > 0, (spec, controller, p_min, dtype)
    gen = SpeculativeGenerator(t, load_drafter(EngineConfig(spec_type="dflash", draft_model=shipped), t),
                               ctx_size=1024, n_draft=7)
    assert _decode_together(gen, prompts, 192) == base


def test_a_drafter_for_another_target_is_refused():
    """The shipped SmolLM2 drafter on a target of another shape (Gemma 3 270M's: hidden 640,
    vocabulary 262,144, 18 layers) is refused before anything runs, naming the mismatch."""
    from types import SimpleNamespace

    from flashdraft.engine import DEFAULT_DRAFTER_DIR, check_drafter_fits

    config = {"hidden_size": 576, "vocab_size": 49152, "num_target_layers": 30}
    gemma = SimpleNamespace(name="gemma3-270m", hidden_size=640, vocab_size=262144, num_layers=18)
    with pytest.raises(ValueError, match="trained for another target: its hidden_size is 576.*640"):
        check_drafter_fits(config, gemma, str(DEFAULT_DRAFTER_DIR))
    same_width = SimpleNamespace(name="x", hidden_size=576, vocab_size=32000, num_layers=30)
    with pytest.raises(ValueError, match="vocab_size is 49152"):
        check_drafter_fits(config, same_width, "d")
    check_drafter_fits({**config, "vocab_size": 0}, SimpleNamespace(name="s", hidden_size=576, vocab_size=49152,
                                                                    num_layers=30), "d")  # 0 = the target's


def test_packed_regeneration_on_llama_equals_plain_decoding(tiny_pair):
    """`regen --backend llama`: 5 prompts through 2 rows (new prefills join running rows)
    give each prompt the greedy answer plain decoding gives it alone, with one feature row
    and one top-k row per position whose next token is known."""
    from flashdraft.generate import SpeculativeGenerator, generate_text
    from flashdraft.sampling import SamplingParams
    from flashdraft.train.regen import generate_packed_llama

    llama, _ = tiny_pair
    prompts = [(f"p{i}", llama.encode(text)) for i, text in enumerate(["abc", "hello world", "xyz xyz", "q", "t1 t2"])]
    out = {pid: (resp, finish, feats, top) for pid, resp, finish, feats, top in
           generate_packed_llama(llama, prompts, 6, SamplingParams(), batch_size=2, layer_ids=[1])}
    plain = SpeculativeGenerator(llama, ctx_size=64)
    for pid, ids in prompts:
        resp, finish, feats, top = out[pid]
        _, want, _, _ = generate_text(plain, ids, 6, SamplingParams(), ignore_eos=False)
        assert resp[:len(want)] == want and finish in ("eos", "length"), pid
        rows = len(ids) + len(resp) - 1
        assert feats.shape == (rows, llama.hidden_size) and top[0].shape[0] == rows, pid
    llama.set_feature_layers(None)


def test_chunked_prefill_between_slots_on_llama(tiny_gguf):
    """-np 2 -b 64 on the llama backend: a 150-token prompt prefilled 64 tokens a step (each
    chunk over the 48-row ubatch, so llama.cpp decodes it in pieces with no logits) beside a
    decoding slot; both answers equal each request alone."""
    from flashdraft import batch
    from flashdraft.drafters.ngram import NgramDrafter
    from flashdraft.generate import GenerationRequest, SpeculativeGenerator, generate_text
    from flashdraft.sampling import SamplingParams
    from flashdraft.targets.llama import LlamaTarget

    t = LlamaTarget(tiny_gguf, n_ctx=256, n_seq=2, tokenizer=byte_tokenizer())
    gen = SpeculativeGenerator(t, NgramDrafter(), ctx_size=256, n_draft=4)
    long, short = t.encode("the quick brown fox " * 8)[:150], t.encode("abcabc")
    want = [generate_text(gen, ids, 20, SamplingParams(), ignore_eos=True)[1] for ids in (short, long)]
    slots = batch.make_slots(gen, 2)
    for slot, ids in zip(slots, (short, long)):
        batch.start(gen, slot, GenerationRequest(ids, 20, SamplingParams(), ignore_eos=True), prefill_chunk=64)
    got = [[], []]
    while any(s.seq is not None for s in slots):
        busy = [s for s in slots if s.seq is not None]
        for s, step in zip(busy, batch.step_together(t, [s.seq for s in busy])):
            assert not isinstance(step, Exception), step
            got[s.index] += step.token_ids
            if s.seq.done:
                s.seq = None
    assert got == want
