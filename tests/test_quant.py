"""4-bit GGUF weights (``--weights q4``): block decoding, kernels, and lossless speculative decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from flashdraft.quant import Int4Linear, Int8Linear, Q4Weight, _unpermute_rows, decode_blocks

#: every projection shape of SmolLM2-135M (N outputs, K inputs): q/k/v fused, o, gate/up fused, down
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_decode_blocks_matches_ggufs_own_dequantize(kind):
    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[kind])
    codes, d, m = decode_blocks(raw, kind)
    assert codes.shape == (64, 256) and codes.max() <= 15 and d.shape == m.shape == (64, 8)
    mine = codes.astype(np.float32) * np.repeat(d, 32, 1) + np.repeat(m, 32, 1)
    assert np.array_equal(mine, dequantize(raw, GGMLQuantizationType[kind]))


def test_decode_blocks_refuses_other_types_and_partial_blocks():
    with pytest.raises(ValueError, match="not a 4-bit"):
        decode_blocks(np.zeros((2, 34), np.uint8), "Q8_0")
    with pytest.raises(ValueError, match="whole"):
        decode_blocks(np.zeros((2, 21), np.uint8), "Q4_1")


def test_unpermute_rows_undoes_llama_cpp_rope_interleave():
    # llama.cpp's converter: rows of each head reordered (half, i) -> (i, half)
    n_head, dim = 3, 8
    hf = torch.arange(n_head * dim)
    gguf_rows = hf.view(n_head, 2, dim // 2).transpose(1, 2).reshape(-1)
    assert torch.equal(gguf_rows[_unpermute_rows(n_head * dim, n_head)], hf)


def _random_q4(n: int, k: int, seed: int = 0) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    zero = -8 * scale + torch.randn(n, k // 32, generator=g) * 0.01
    return Q4Weight(codes, scale, zero)


@pytest.mark.parametrize("n,k", SHAPES)
def test_int4_linear_close_to_dequantized_and_rows_independent_of_block_size(n, k):
    w = _random_q4(n, k)
    lin = Int4Linear(w)
    x = torch.randn(17, k)
    full = lin(x)
    ref = x @ w.dequantize().t()
    # bf16 activations and bf16 scales: a few bf16 ulps of the output's scale
    assert (full - ref).abs().max() <= 0.02 * ref.abs().max()
    for m in range(1, 17):  # a verify block's rows equal one-token steps, bit for bit
        assert torch.equal(lin(x[:m]), full[:m]), m
        assert torch.equal(lin(x[m:m + 1]), full[m:m + 1]), m


def test_int8_linear_rows_independent_of_block_size():
    w = torch.randn(4096, 576)
    lin = Int8Linear(w)
    x = torch.randn(16, 576)
    full = lin(x)
    assert (full - x @ w.t()).abs().max() <= 0.02 * (x @ w.t()).abs().max()
    for m in (1, 2, 3, 5, 8):
        assert torch.equal(lin(x[:m]), full[:m])


# ---------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def q4_target():
    from flashdraft.targets.torch import Target

    return Target.load(weights="q4")


@pytest.mark.real
def test_real_model_loads_every_4bit_projection(q4_target):
    # 30 layers x 7 projections, each checked bit for bit against transformers' dequantisation
    assert len(q4_target.q4) == 210 and q4_target.weights == "q4"
    assert q4_target.lean.q4 and all(p.kernel is not None for layer in q4_target.lean.proj for p in layer)


@pytest.mark.real
def test_real_model_q4_verify_block_reproduces_single_steps_bitwise(q4_target):
    t = q4_target
    ids = torch.tensor(t.chat_prompt_ids([{"role": "user", "content": "Write a haiku about caches."}]))
    block = torch.tensor([504, 2077, 314, 253, 1345, 28, 13, 5, 30, 216, 1035, 8, 3, 99, 1000, 42])
    t.set_feature_layers([1, 15, 28])
    c1 = t.new_cache(256)
    t.forward(ids, c1, ids.shape[0])
    logits, feats = t.forward(block, c1, 0)
    c2 = t.new_cache(256)
    t.forward(ids, c2, ids.shape[0])
    for i, tok in enumerate(block):
        lg, f = t.forward(tok.view(1), c2, 0)
        assert torch.equal(lg[0], logits[i]) and torch.equal(f[0], feats[i]), i
    t.set_feature_layers([])


@pytest.mark.real
def test_real_model_q4_greedy_speculative_equals_q4_baseline(q4_target):
    from flashdraft.engine import DEFAULT_DRAFTER_DIR, EngineConfig, load_drafter
    from flashdraft.generate import SpeculativeGenerator, generate_text
    from flashdraft.prompts import SEED_PROMPTS
    from flashdraft.sampling import SamplingParams

    t = q4_target
    ids = t.chat_prompt_ids([{"role": "user", "content": SEED_PROMPTS[0]}])
    base = generate_text(SpeculativeGenerator(t), ids, 96, SamplingParams())
    dflash = str(DEFAULT_DRAFTER_DIR) if (DEFAULT_DRAFTER_DIR / "config.json").exists() else "random"
    for spec, draft_model in [("ngram", None), ("dflash", dflash), ("hybrid", dflash)]:
        drafter = load_drafter(EngineConfig(spec_type=spec, draft_model=draft_model), t)
        out = generate_text(SpeculativeGenerator(t, drafter, n_draft=15), ids, 96, SamplingParams())
        assert out[1] == base[1], spec
        assert out[3].draft_n > 0


def test_q4_needs_a_gguf_file(tmp_path):
    from flashdraft.targets.torch import Target

    with pytest.raises(ValueError, match="not a .gguf"):
        Target.load(tmp_path, weights="q4")


# ---------------------------------------------------------------- a tiny q4 target


def tiny_q4_target():
    """A tiny llama whose projections are replaced by their Q4_1 round trip, with the codes."""
    from tiny import tiny_model, tiny_tokenizer

    from flashdraft.targets.torch import Target

    model = tiny_model(hidden=64, layers=3)
    q4 = {}
    for name, module in model.named_modules():
        if name.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            raw = quantize(module.weight.detach().numpy(), GGMLQuantizationType.Q4_1)
            codes, d, m = decode_blocks(raw, "Q4_1")
            with torch.no_grad():
                module.weight.copy_(torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1)))
            q4[name] = Q4Weight(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m + 8 * d))
    return Target(model, tiny_tokenizer(), name="tiny-q4", q4=q4)


def test_tiny_q4_packed_forward_keeps_short_blocks_on_the_int4_kernel():
    from flashdraft.fast_forward import QUANT_MAX_ROWS

    t = tiny_q4_target()
    g = torch.Generator().manual_seed(1)
    ctx = [torch.randint(1, 64, (n,), generator=g) for n in (20, 33, 9)]
    blocks = [torch.randint(1, 64, (n,), generator=g) for n in (QUANT_MAX_ROWS + 12, 16, 1, 16)]

    def fresh():
        caches = [t.new_cache(400) for _ in blocks]
        for c, x in zip(caches[1:], ctx):
            t.forward(x, c, x.shape[0])
        return caches

    alone = [t.forward(b, c, 0) for b, c in zip(blocks, fresh())]
    packed = t.forward_packed(list(zip(blocks, fresh(), [0] * len(blocks))))
    for (la, _), (lp, _) in zip(alone, packed):
        assert torch.equal(la, lp)


def test_tiny_q4_greedy_speculative_equals_baseline():
    from flashdraft.drafters.ngram import NgramDrafter
    from flashdraft.generate import SpeculativeGenerator, generate_text
    from flashdraft.sampling import SamplingParams

    t = tiny_q4_target()
    ids = [5, 9, 3, 5, 9, 3, 7, 5, 9, 3, 5, 9]
    base = generate_text(SpeculativeGenerator(t), ids, 48, SamplingParams())
    out = generate_text(SpeculativeGenerator(t, NgramDrafter(), n_draft=8), ids, 48, SamplingParams())
    assert out[1] == base[1] and out[3].draft_n > 0
