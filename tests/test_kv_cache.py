"""Compressed KV caches (flashdraft/kv_codecs.py, flashdraft/kv_cache.py).

Formats: llama.cpp's q8_0/q4_0/q4_1/q5_0 must produce the very bytes of the gguf package's
reference quantisers; every type has a round-trip error bound; the turbo rotation is
orthonormal. Caches: rollback keeps greedy speculative output equal to the greedy baseline
under the same cache type (tiny models and the real SmolLM2); an exact tail longer than the
sequence makes a compressed cache read exactly what the plain cache reads.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from flashdraft.drafters.dflash import ContextKVCache, DFlashDrafter, random_dflash_model
from flashdraft.drafters.draft_model import DraftModelDrafter
from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.kv_cache import KVCacheSpec, QuantizedKVCache
from flashdraft.kv_codecs import (CACHE_TYPES, Rotation, _pack_3bit, _pack_bits, _pack_nibbles, _unpack_3bit,
                                  _unpack_bits, _unpack_nibbles, hadamard, lloyd_max_gaussian, make_codec)
from flashdraft.sampling import SamplingParams
from tiny import tiny_target

GREEDY = SamplingParams()
PROMPT = [5, 9, 17, 3, 22, 41, 7, 30, 2, 11]


def _blocks_with_outliers(n: int = 64, hd: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hd, generator=g)
    x[:, 3] *= 12  # an outlier channel, as real keys have
    x[::7] = 0.0  # all-zero vectors must not divide by zero
    return x


# -- formats --------------------------------------------------------------------------------
@pytest.mark.parametrize("name,gtype", [("q8_0", "Q8_0"), ("q4_0", "Q4_0"), ("q4_1", "Q4_1"), ("q5_0", "Q5_0")])
def test_llama_cpp_formats_are_byte_identical_to_ggml(name, gtype):
    """Same bits, same block layout: our parts, laid out as a ggml block, equal the gguf
    package's bit-exact port of ggml-quants.c."""
    x = _blocks_with_outliers()
    parts = make_codec(name, 64).encode(x)
    b = [p.reshape(64 * 2, -1).contiguous().view(torch.uint8) if p.dtype != torch.float16 else
         p.reshape(64 * 2, 1).contiguous().view(torch.uint8) for p in parts]  # per 32-value block
    ours = {"q8_0": lambda: [b[1], b[0]], "q4_0": lambda: [b[1], b[0]], "q4_1": lambda: [b[1], b[2], b[0]],
            "q5_0": lambda: [b[2], b[1], b[0]]}[name]()
    ref = quants.quantize(x.numpy(), getattr(gguf.GGMLQuantizationType, gtype)).reshape(128, -1)
    assert np.array_equal(torch.cat(ours, dim=1).numpy(), ref)
    # and our decode equals ggml's dequantisation
    deq = quants.dequantize(ref.reshape(64, -1), getattr(gguf.GGMLQuantizationType, gtype))
    assert np.allclose(make_codec(name, 64).decode(parts).numpy(), deq, atol=1e-6)


@pytest.mark.parametrize("name", CACHE_TYPES)
def test_round_trip_error_bounds(name):
    x = _blocks_with_outliers(hd=128)
    codec = make_codec(name, 128)
    y = codec.decode(codec.encode(x)).float()
    if codec.rotated:
        y = codec.rotation.inverse(y)
    err = (y - x).abs().reshape(x.shape[0], -1, 32)
    amax = x.abs().reshape(x.shape[0], -1, 32).amax(-1, keepdim=True)
    rel_mse = ((y - x) ** 2).sum() / (x ** 2).sum()
    bound = {"f32": 0.0, "f16": 2 ** -11, "bf16": 2 ** -8}
    if name in bound:
        assert (err <= amax * bound[name]).all()
    elif name == "q8_0":  # half a step, plus the fp16 rounding of the scale
        assert (err <= amax / 127 * 0.57).all()
    elif name in ("q4_0", "q5_0", "q3_0"):  # at most one step (the far side of the range clips)
        bits = {"q4_0": 4, "q5_0": 5, "q3_0": 3}[name]
        assert (err <= amax / 2 ** (bits - 1) * 1.01).all()
    elif name == "q4_1":  # half a step of (max-min)/15, plus the fp16 min
        assert (err <= 2 * amax / 15 * 0.5 * 1.01 + amax * 2 ** -10).all()
    else:  # turbo: Lloyd–Max distortion of N(0,1) is 0.0095 (4 bits) / 0.0345 (3 bits)
        assert rel_mse < {"turbo4": 0.012, "turbo3": 0.04}[name]
    assert (y[::7] == 0).all()  # zero vectors stay zero


def test_turbo_beats_plain_scalar_quantisation_at_equal_bits_on_outliers():
    x = _blocks_with_outliers(n=256)
    def rel(name):
        c = make_codec(name, 64)
        y = c.decode(c.encode(x))
        y = c.rotation.inverse(y) if c.rotated else y
        return (((y - x) ** 2).sum() / (x ** 2).sum()).item()
    assert rel("turbo3") < rel("q3_0")
    assert rel("turbo4") < rel("q4_0") and rel("turbo4") < rel("q4_1")


def test_bits_per_value():
    bits = {n: make_codec(n, 64).bits_per_value for n in CACHE_TYPES}
    assert bits == {"f32": 32, "f16": 16, "bf16": 16, "q8_0": 8.5, "q5_0": 5.5, "q4_1": 5.0, "q4_0": 4.5,
                    "q3_0": 3.5, "turbo4": 4.25, "turbo3": 3.25}
    assert make_codec("turbo3", 128).bits_per_value == 3.125


def test_rotation_is_orthonormal_and_blockwise_bit_stable():
    for hd, block in ((64, 64), (256, 128)):
        r = Rotation(hd, block)
        eye = torch.eye(hd, dtype=torch.float64)
        m = r(eye)  # rows: images of the basis vectors
        torch.testing.assert_close(m @ m.T, eye, atol=1e-12, rtol=0)
        x = torch.randn(9, hd)
        torch.testing.assert_close(r.inverse(r(x)), x, atol=1e-5, rtol=0)
        # elementwise butterfly: one vector alone transforms to the same bits as in a batch
        assert torch.equal(r(x[4:5]), r(x)[4:5])
    y = torch.randn(3, 16)
    torch.testing.assert_close(hadamard(hadamard(y)), y, atol=1e-5, rtol=0)


def test_packing_round_trips():
    q = torch.randint(0, 16, (5, 32), dtype=torch.uint8)
    assert torch.equal(_unpack_nibbles(_pack_nibbles(q)), q)
    assert _pack_nibbles(q)[0, 0] == q[0, 0] | (q[0, 16] << 4)  # llama.cpp: value j and j+16 in byte j
    b = torch.randint(0, 2, (5, 32), dtype=torch.uint8)
    assert torch.equal(_unpack_bits(_pack_bits(b)), b)
    t = torch.randint(0, 8, (5, 64), dtype=torch.uint8)
    assert _pack_3bit(t).shape[-1] == 24 and torch.equal(_unpack_3bit(_pack_3bit(t), 64), t)


def test_lloyd_max_levels():
    torch.testing.assert_close(lloyd_max_gaussian(3)[4:], torch.tensor([0.2451, 0.7560, 1.3440, 2.1520],
                                                                        dtype=torch.float64), atol=2e-3, rtol=0)
    torch.testing.assert_close(lloyd_max_gaussian(4)[8:], torch.tensor(
        [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326], dtype=torch.float64), atol=2e-3, rtol=0)


def test_unusable_types_are_refused():
    with pytest.raises(ValueError, match="unknown cache type"):
        make_codec("q2_k", 64)
    with pytest.raises(ValueError, match="divisible by 32"):
        make_codec("q4_0", 48)
    with pytest.raises(ValueError, match="power-of-two"):
        make_codec("turbo4", 96)


# -- caches ---------------------------------------------------------------------------------
SPECS = [KVCacheSpec("q8_0", "q8_0"), KVCacheSpec("q5_0", "q4_1"), KVCacheSpec("q4_0", "q4_0"),
         KVCacheSpec("turbo4", "turbo3", sink_tokens=2, tail_tokens=5), KVCacheSpec("q3_0", "turbo4", 0, 3)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_speculative_equals_greedy_baseline_under_each_cache_type(arch):
    target = tiny_target(arch, hidden=128)  # head_dim 32
    for spec in SPECS:
        base = generate_text(SpeculativeGenerator(target, kv=spec), PROMPT, 40, GREEDY, ignore_eos=True)[1]
        for drafter in (NgramDrafter(), DraftModelDrafter(target.model, target.vocab_size)):
            out = generate_text(SpeculativeGenerator(target, drafter, n_draft=5, kv=spec), PROMPT, 40, GREEDY,
                                ignore_eos=True)
            assert out[1] == base, (spec, drafter.name)
            assert out[3].draft_n_accepted > 0
            if drafter.name == "ngram":
                assert out[3].draft_n > out[3].draft_n_accepted  # rollbacks happened


def test_compression_changes_outputs_and_tail_covering_everything_is_exact():
    """A lossy cache must change the logits (else the test above proves nothing), and an
    exact tail longer than the sequence must give the plain cache's logits."""
    target = tiny_target("llama", hidden=128)
    ids = torch.tensor(PROMPT * 3)
    def logits(kv):
        cache = target.new_cache(kv=kv)
        a, _ = target.forward(ids[:20], cache)
        b, _ = target.forward(ids[20:], cache)  # a block after cached context
        cache.rollback(24)
        c, _ = target.forward(ids[24:25], cache)  # and a step after a rollback
        return torch.cat([a, b, c])
    plain = logits(None)
    assert not torch.allclose(logits(KVCacheSpec("q4_0", "q4_0")), plain, atol=1e-3)
    for t in ("q4_0", "turbo3"):
        torch.testing.assert_close(logits(KVCacheSpec(t, t, tail_tokens=64)), plain, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits(KVCacheSpec(t, t, sink_tokens=64)), plain, atol=1e-4, rtol=1e-4)


def test_rollback_is_a_length_move_and_memory_is_compressed():
    target = tiny_target("llama", hidden=128)
    cache = target.new_cache(capacity=64, kv=KVCacheSpec("q4_0", "q4_0"))
    assert isinstance(cache, QuantizedKVCache)
    target.forward(torch.tensor(PROMPT), cache)
    parts = [p.data_ptr() for p in cache.k.parts]
    cache.rollback(4)
    assert cache.length == 4 and [p.data_ptr() for p in cache.k.parts] == parts
    with pytest.raises(ValueError, match="roll back"):
        cache.rollback(5)
    plain = target.new_cache(capacity=64)
    assert plain.nbytes / cache.nbytes == pytest.approx(32 / 4.5, rel=0.01)  # f32 vs 4.5 bits


def test_compressed_types_need_the_lean_path():
    from tiny import tiny_model, tiny_tokenizer
    from flashdraft.targets.torch import Target
    t = Target(tiny_model("llama", hidden=128), tiny_tokenizer(), fast=False)
    with pytest.raises(ValueError, match="lean forward"):
        t.new_cache(kv=KVCacheSpec("q8_0", "q8_0"))


def test_dflash_drafter_with_compressed_context_cache_stays_lossless():
    target = tiny_target("llama", hidden=128)
    model = random_dflash_model(target.model, num_layers=1, block_size=4)
    base = generate_text(SpeculativeGenerator(target), PROMPT, 30, GREEDY, ignore_eos=True)[1]
    for kv in (KVCacheSpec("turbo3", "q4_0", 1, 4), KVCacheSpec("q8_0", "turbo4")):
        drafter = DFlashDrafter(model, target.embed_tokens, target.lm_head, kv=kv)
        assert drafter.cache.stores is not None
        out = generate_text(SpeculativeGenerator(target, drafter, n_draft=3), PROMPT, 30, GREEDY, ignore_eos=True)
        assert out[1] == base and out[3].draft_n > 0
    # a window decodes close to the plain cache's (rotation undone), the tail exactly
    plain, comp = ContextKVCache(1, 2, 32), ContextKVCache(1, 2, 32, kv=KVCacheSpec("turbo4", "turbo4", 0, 3))
    k, v = torch.randn(1, 2, 10, 32), torch.randn(1, 2, 10, 32)
    plain.append([(k, v)])
    comp.append([(k, v)])
    wk, _ = comp.window(0, None)
    pk, _ = plain.window(0, None)
    assert ((wk - pk) ** 2).sum() / (pk ** 2).sum() < 0.02
    torch.testing.assert_close(wk[:, :, -3:], pk[:, :, -3:], atol=1e-5, rtol=0)
    assert comp.bytes_per_token * 7 < plain.bytes_per_token


def test_engine_refuses_bad_cache_settings():
    from flashdraft.engine import EngineConfig, load_engine
    with pytest.raises(ValueError, match="unknown cache type"):
        load_engine(EngineConfig(spec_type="none", cache_type_k="q9_9"), target=tiny_target("llama"))
    with pytest.raises(ValueError, match=">= 0"):
        load_engine(EngineConfig(spec_type="none", cache_type_v="q8_0", kv_tail_tokens=-1), target=tiny_target("llama"))
    with pytest.raises(ValueError, match="divisible by 32"):  # tiny default head_dim is 16
        load_engine(EngineConfig(spec_type="none", cache_type_k="q8_0"), target=tiny_target("llama"))
    with pytest.raises(ValueError, match="context size"):  # a tail longer than any sequence
        load_engine(EngineConfig(spec_type="none", cache_type_k="q8_0", ctx_size=512, kv_tail_tokens=10 ** 12),
                    target=tiny_target("llama"))
    with pytest.raises(ValueError, match="-ctkd"):  # the drafter's cache names its flags
        load_engine(EngineConfig(spec_type="dflash", draft_model="random", cache_type_k_draft="q4_0"),
                    target=tiny_target("llama"))


def test_exact_tail_limits_draft_length():
    from flashdraft.engine import EngineConfig, load_engine
    with pytest.raises(ValueError, match="spec-draft-n-max"):
        load_engine(EngineConfig(spec_type="ngram", n_draft=64, cache_type_k="q8_0", kv_tail_tokens=8),
                    target=tiny_target("llama", hidden=128))


@pytest.mark.real
def test_eval_kv_command_on_the_real_model(tmp_path, capsys):
    """`flashdraft eval-kv` end to end (small settings): table, JSON, and numbers that order
    as they must: 8-bit closer to f32 than 3-bit, memory ratios from the formats."""
    from flashdraft.cli import main
    out = tmp_path / "kv.json"
    assert main(["eval-kv", "--types", "q8_0", "turbo3", "q5_0/q4_1", "--ctx", "96", "--contexts", "1",
                 "--chunk", "32", "--greedy-tokens", "8", "--greedy-prompts", "2", "--tau-prompts", "1",
                 "--tau-tokens", "8", "--speed-steps", "2", "--json-out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| q5_0/q4_1 |" in table and "f32 (reference)" in table
    import json
    r = json.loads(out.read_text())
    q8, t3 = r["types"]["q8_0"], r["types"]["turbo3"]
    assert 0 <= q8["kl"] < t3["kl"] and q8["top1"] >= t3["top1"]
    assert t3["less_than_f16"] == pytest.approx(16 / 3.25) and q8["less_than_f16"] == pytest.approx(16 / 8.5)
    for row in r["types"].values():
        assert row["ppl"] > 1 and row["tau"] >= 1 and row["decode_tok_s"] > 0 and len(row["greedy_leads"]) == 2
    assert main(["eval-kv", "--types", "q9_9"]) == 1  # a clear error, not a traceback


def test_matmul_rows_do_not_depend_on_the_batch():
    """The property the compressed cache's attention rests on (see kv_cache.matmul_nt)."""
    from flashdraft.kv_cache import matmul_nt
    g = torch.Generator().manual_seed(0)
    keys, q = torch.randn(300, 64, generator=g), torch.randn(48, 64, generator=g)
    full = matmul_nt(q, keys)
    assert torch.equal(matmul_nt(q[:3], keys), full[:3]) and torch.equal(matmul_nt(q[5:6], keys), full[5:6])
    assert torch.equal(matmul_nt(q[:3], keys[:290]), full[:3, :290])  # fewer columns
    p, vt = torch.rand(48, 300, generator=g), torch.randn(64, 300, generator=g)
    p[:, 290:] = 0  # trailing zero weights (a step sees fewer positions than a block)
    assert torch.equal(matmul_nt(p[:3, :290], vt[:, :290]), matmul_nt(p, vt)[:3])


def test_verify_block_reproduces_single_steps_bitwise_under_compressed_caches():
    """fp32 weights: with a compressed cache, a verify block's logits equal feeding the same
    tokens one step at a time, bit for bit (300-token context, exact tail and sinks too)."""
    target = tiny_target("llama", hidden=256, layers=3)  # head_dim 64
    context = torch.tensor(PROMPT * 30)
    block = torch.tensor([3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 32, 38, 4, 6, 2])
    for kv in (KVCacheSpec("q4_0", "q8_0"), KVCacheSpec("turbo3", "turbo4", sink_tokens=4, tail_tokens=8)):
        cache = target.new_cache(kv=kv)
        target.forward(context, cache, logits_from=context.shape[0] - 1)
        full, _ = target.forward(block, cache)
        cache.rollback(context.shape[0])
        steps = torch.cat([target.forward(block[i:i + 1], cache)[0] for i in range(block.shape[0])])
        assert torch.equal(full, steps), kv
