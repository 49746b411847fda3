"""Round trips and error paths of flashdraft.drafters.dflash_format, on a tiny random drafter."""

import json

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from flashdraft.drafters.dflash_format import (
    REQUIRED_CONFIG_KEYS,
    dflash_weight_shapes,
    load_dflash_checkpoint,
    save_gguf,
    save_specforge,
    validate_dflash_config,
)

H, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 2, 4, 2, 16, 128


@pytest.fixture
def config() -> dict:
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
        "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "max_position_embeddings": 4096, "vocab_size": 1000, "num_hidden_layers": LAYERS,
        "num_target_layers": 8, "block_size": 16, "attention_bias": False,
        "tie_word_embeddings": False, "hidden_act": "silu",
        "dflash_config": {"mask_token_id": 999, "target_layer_ids": [1, 3, 5]},
    }


@pytest.fixture
def state_dict(config) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) for name, shape in dflash_weight_shapes(config).items()}


def _canonical(config: dict) -> dict:
    return {k: config[k] for k in REQUIRED_CONFIG_KEYS}


def _assert_same_tensors(got, want, atol):
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        torch.testing.assert_close(got[name].float(), want[name].float(), atol=atol, rtol=0, msg=name)


def test_shapes_follow_config(config):
    shapes = dflash_weight_shapes(config)
    assert shapes["fc.weight"] == (H, 3 * H)
    assert shapes["layers.1.self_attn.k_proj.weight"] == (KV_HEADS * HEAD_DIM, H)
    assert shapes["layers.0.self_attn.q_norm.weight"] == (HEAD_DIM,)
    assert shapes["layers.0.mlp.down_proj.weight"] == (H, INTER)
    assert len(shapes) == 3 + 11 * LAYERS


def test_specforge_round_trip(tmp_path, config, state_dict):
    save_specforge(tmp_path / "d", config, state_dict)
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert saved["torch_dtype"] == saved["dtype"] == "float16"
    got_config, got = load_dflash_checkpoint(tmp_path / "d")
    assert _canonical(got_config) == _canonical(config)
    assert got_config["rope_parameters"] == {"rope_theta": 1000000, "rope_type": "default"}
    assert got["fc.weight"].dtype == torch.float16
    _assert_same_tensors(got, state_dict, atol=2e-3)


@pytest.mark.parametrize("arch", ["dflash-draft", "dflash"])
def test_gguf_round_trip(tmp_path, config, state_dict, arch):
    path = tmp_path / "d.gguf"
    save_gguf(path, config, state_dict, arch=arch)
    got_config, got = load_dflash_checkpoint(path)
    assert _canonical(got_config) == _canonical(config)
    _assert_same_tensors(got, state_dict, atol=2e-3)


def test_gguf_layout_on_disk(tmp_path, config, state_dict):
    """The conventions llama.cpp expects: reversed dims, F32 norms, F16 matrices, +1 target layers."""
    save_gguf(tmp_path / "up.gguf", config, state_dict, arch="dflash")
    reader = gguf.GGUFReader(tmp_path / "up.gguf")
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.attn_q.weight"].shape.tolist() == [H, HEADS * HEAD_DIM]  # ne0 = in-features
    assert tensors["fc.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["enc.output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert "blk.1.ffn_norm.weight" in tensors
    assert reader.fields["dflash.target_layers"].contents() == [2, 4, 6]
    assert reader.fields["tokenizer.ggml.mask_token_id"].contents() == 999

    save_gguf(tmp_path / "legacy.gguf", config, state_dict, arch="dflash-draft")
    reader = gguf.GGUFReader(tmp_path / "legacy.gguf")
    names = {t.name for t in reader.tensors}
    assert {"dflash_fc.weight", "dflash_hidden_norm.weight", "blk.0.post_attention_norm.weight"} <= names
    assert reader.fields["dflash-draft.dflash.target_layer_ids"].contents() == [1, 3, 5]
    assert reader.fields["dflash-draft.dflash.n_target_features"].contents() == 3 * H


def test_gguf_q8_0_and_bf16_dequantize(tmp_path, config, state_dict):
    for dtype, atol in [("q8_0", 0.05), (torch.bfloat16, 0.05)]:
        save_gguf(tmp_path / "q.gguf", config, state_dict, arch="dflash", dtype=dtype)
        _, got = load_dflash_checkpoint(tmp_path / "q.gguf")
        _assert_same_tensors(got, state_dict, atol=atol)


def test_model_prefix_and_d2t_are_tolerated(tmp_path, config, state_dict):
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    prefixed = {f"model.{k}": v for k, v in state_dict.items()}
    prefixed["d2t"] = torch.zeros(10, dtype=torch.int64)
    prefixed["lm_head.weight"] = torch.zeros(1000, H)  # ignored: the drafter uses the target's
    save_file(prefixed, str(d / "model.safetensors"))
    _, got = load_dflash_checkpoint(d)
    assert got["d2t"].dtype == torch.int64 and "lm_head.weight" not in got
    _assert_same_tensors({k: v for k, v in got.items() if k != "d2t"}, state_dict, atol=0)


def test_missing_tensor_is_named(tmp_path, config, state_dict):
    save_specforge(tmp_path / "d", config, state_dict)
    weights = load_file(str(tmp_path / "d" / "model.safetensors"))
    del weights["layers.1.self_attn.k_norm.weight"]
    save_file(weights, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'layers\.1\.self_attn\.k_norm\.weight'"):
        load_dflash_checkpoint(tmp_path / "d")


def test_shape_mismatch_is_reported(tmp_path, config, state_dict):
    state_dict["fc.weight"] = torch.zeros(H, 2 * H)
    with pytest.raises(ValueError, match=r"fc\.weight.*config expects \(64, 192\)"):
        save_gguf(tmp_path / "d.gguf", config, state_dict)


def test_unknown_gguf_arch(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_tensor("output_norm.weight", torch.ones(4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF arch 'llama' is not a DFlash drafter"):
        load_dflash_checkpoint(tmp_path / "llama.gguf")
    with pytest.raises(ValueError, match="unknown GGUF arch"):
        save_gguf(tmp_path / "x.gguf", {}, {}, arch="eagle3")


def test_nonexistent_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_dflash_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_dflash_checkpoint(tmp_path / "empty")


def test_validate_names_missing_key(config):
    validate_dflash_config(config)
    del config["num_target_layers"]
    with pytest.raises(ValueError, match="'num_target_layers'"):
        validate_dflash_config(config)
    config["num_target_layers"] = 8
    del config["dflash_config"]["mask_token_id"]
    with pytest.raises(ValueError, match="dflash_config.mask_token_id"):
        validate_dflash_config(config)


def test_rope_parameters_and_sharded_weights(tmp_path, config, state_dict):
    """transformers 5 writes rope_parameters instead of rope_theta; big drafters come sharded."""
    del config["rope_theta"]
    config["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    names = sorted(state_dict)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    for shard, shard_names in shards.items():
        save_file({n: state_dict[n] for n in shard_names}, str(d / shard))
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got_config, got = load_dflash_checkpoint(d)
    assert got_config["rope_theta"] == 10000.0
    _assert_same_tensors(got, state_dict, atol=0)


def test_gguf_for_llama_cpp_carries_the_targets_tokenizer_and_head_rows(tmp_path, config, state_dict):
    import numpy as np

    from tiny import VOCAB
    from tiny_gguf import write_tiny_gguf

    target = write_tiny_gguf(tmp_path / "target.gguf", hidden=H)
    config = {**config, "vocab_size": VOCAB, "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 2]}}
    gen = torch.Generator().manual_seed(1)
    state = {n: torch.randn(s, generator=gen) for n, s in dflash_weight_shapes(config).items()}
    state["d2t"] = torch.tensor([3, 1, 40, 7], dtype=torch.int64)
    path = tmp_path / "up.gguf"
    save_gguf(path, config, state, arch="dflash", target_gguf=target)

    r, t = gguf.GGUFReader(path), gguf.GGUFReader(target)
    assert r.fields["tokenizer.ggml.tokens"].contents() == t.fields["tokenizer.ggml.tokens"].contents()
    assert r.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert r.fields["tokenizer.ggml.mask_token_id"].contents() == VOCAB - 1
    head = {x.name: x for x in r.tensors}["output.weight"]
    want = np.asarray({x.name: x for x in t.tensors}["output.weight"].data)[[3, 1, 40, 7]]
    np.testing.assert_array_equal(np.asarray(head.data), want)
    got_config, got = load_dflash_checkpoint(path)  # our loader ignores the head, keeps d2t
    assert got["d2t"].tolist() == [3, 1, 40, 7] and "output.weight" not in got

    with pytest.raises(ValueError, match="vocabulary has 64 tokens"):
        save_gguf(tmp_path / "bad.gguf", {**config, "vocab_size": 1000}, state, arch="dflash", target_gguf=target)
