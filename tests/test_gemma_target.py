"""A second target family (Gemma 3): what the trainer, engine and backends read from the
target instead of assuming SmolLM2 (tiny random Gemma-shaped model; the real GGUF is in
tests/test_gemma_real.py)."""

from __future__ import annotations

import torch

from flashdraft.drafters.dflash import (DFlashDraftModel, DFlashDrafter, drafter_config_for_target,
                                        init_from_target, norm_gain)
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from flashdraft.train.loop import TrainConfig, Trainer
from flashdraft.train.regen import regenerate_packed
from flashdraft.train.shards import read_shards
from tiny import tiny_gemma3_target

PROMPTS = [{"id": f"g{i}", "prompt": " ".join(f"t{(5 * i + j) % 58 + 2}" for j in range(3 + i % 3))}
           for i in range(5)]


def test_a_base_model_prompt_is_its_text_after_bos():
    t = tiny_gemma3_target()
    assert not t.has_chat_template
    assert t.user_prompt_ids("t5 t9") == [1, 5, 9]
    assert t.user_prompt_ids("t5 t9", raw_text="t7") == [1, 7]


def test_drafters_read_the_raw_embedding_table():
    t = tiny_gemma3_target()
    ids = torch.tensor([3, 4])
    assert torch.equal(t.embed_tokens(ids), t.model.model.embed_tokens.weight[ids])
    # the target's own module scales by sqrt(hidden): a drafter trained on it would not fit the llama backend
    assert not torch.allclose(t.model.model.embed_tokens(ids), t.embed_tokens(ids))


def test_drafter_init_takes_gemma_norm_gains_and_the_pre_mlp_norm():
    t = tiny_gemma3_target()
    src = t.model.model
    assert torch.allclose(norm_gain(src.norm), 1 + src.norm.weight)
    d = DFlashDraftModel(drafter_config_for_target(t.config, 1, 4, 0, [1, 2]))
    init_from_target(d, t.model)
    last = src.layers[-1]
    assert torch.allclose(d.norm.weight, 1 + src.norm.weight)
    assert torch.allclose(d.layers[0].input_layernorm.weight, 1 + last.input_layernorm.weight)
    assert torch.allclose(d.layers[0].post_attention_layernorm.weight, 1 + last.pre_feedforward_layernorm.weight)
    assert torch.allclose(d.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)


def test_greedy_drafting_equals_plain_decoding_past_the_sliding_window():
    t = tiny_gemma3_target(seed=2, sliding_window=16)
    d = DFlashDraftModel(drafter_config_for_target(t.config, 1, 4, 0, [1, 2]))
    init_from_target(d, t.model)
    prompt = t.user_prompt_ids("t5 t9 t13 t2 t7")
    plain = generate_text(SpeculativeGenerator(t, None, n_draft=0), prompt, 60, SamplingParams())
    spec = generate_text(SpeculativeGenerator(t, DFlashDrafter(d, t.embed_tokens, t.lm_head), n_draft=3),
                         prompt, 60, SamplingParams())
    assert len(plain[1]) + len(prompt) > 3 * 16  # rollbacks happened after the window filled
    assert spec[1] == plain[1]
    assert spec[3].draft_n > 0


def test_regeneration_and_training_on_a_gemma_shaped_target(tmp_path):
    t = tiny_gemma3_target(seed=3)
    data = tmp_path / "data"
    regenerate_packed(data, PROMPTS, target=t, max_new_tokens=12, batch_size=3, layer_ids=[1, 2], progress=False)
    seqs = {sid: (ids.tolist(), n) for sid, ids, n in read_shards(data)}
    for p in PROMPTS:  # the stepped path (no lean forward) writes what plain decoding writes
        ids, n = seqs[p["id"]]
        prompt = t.user_prompt_ids(p["prompt"])
        assert ids[:n] == prompt
        assert ids[n:] == generate_text(SpeculativeGenerator(t, None, n_draft=0), prompt, 12, SamplingParams())[1]
    cfg = TrainConfig(data_dir=str(data), out_dir=str(tmp_path / "run"), num_layers=1, feature_layer_ids=[1, 2],
                      block_size=4, blocks_per_step=8, seqs_per_step=2, steps=3, draft_vocab=16, eval_minutes=0,
                      bf16=False)
    trainer = Trainer(cfg, target=t)
    assert trainer.drafter.mask_token_id == 0  # no SmolLM2 <empty_output>: the pad token
    d2t = trainer.drafter.d2t.tolist()
    assert 0 in d2t and len(d2t) == 16  # EOS (= pad here) always in the draft vocabulary
    assert trainer.train()["step"] == 3


def _gguf_with_architecture(path, arch: str):
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_dflash_on_a_graph_without_layer_inputs_stays_on_torch(tmp_path):
    import pytest

    from flashdraft.targets.load import choose_backend, torch_only_reason

    gemma = _gguf_with_architecture(tmp_path / "g.gguf", "gemma3")
    llama = _gguf_with_architecture(tmp_path / "l.gguf", "llama")
    cpu = torch.device("cpu")
    assert "gemma3 graph does not export the layer inputs" in torch_only_reason(str(gemma), None, cpu, features=True)
    assert torch_only_reason(str(gemma), None, cpu, features=False) is None  # plain / n-gram decoding runs there
    assert torch_only_reason(str(llama), None, cpu, features=True) is None
    assert choose_backend("auto", str(gemma), None, cpu, features=True).backend == "torch"
    with pytest.raises(ValueError, match="use --backend torch"):
        choose_backend("llama", str(gemma), None, cpu, features=True)


def test_the_shipped_drafter_is_picked_by_the_target_shape():
    from types import SimpleNamespace

    from flashdraft.engine import DEFAULT_DRAFTER_DIR, shipped_drafter_for

    smollm2 = SimpleNamespace(hidden_size=576, vocab_size=49152, num_layers=30)
    assert shipped_drafter_for(smollm2) == DEFAULT_DRAFTER_DIR
    assert shipped_drafter_for(tiny_gemma3_target()) is None


def test_a_training_run_ends_with_a_model_card(tmp_path):
    from flashdraft.train.card import write_model_card
    from flashdraft.train.walk import heldout_answers_dir

    t = tiny_gemma3_target(seed=5)
    data = tmp_path / "data"
    regenerate_packed(data, PROMPTS, target=t, max_new_tokens=10, batch_size=2, layer_ids=(), progress=False)
    root = tmp_path / "heldout"
    heldout = [{"id": "h0", "prompt": "t3 t8 t3 t8"}, {"id": "h1", "prompt": "t9 t2 t9"}]
    for name in ("humaneval", "sharegpt-heldout"):  # the card's held-out sets, made from two tiny prompts
        regenerate_packed(heldout_answers_dir(root, t.name, name, 0.0), heldout, target=t, max_new_tokens=10,
                          batch_size=2, layer_ids=(), progress=False)
    cfg = TrainConfig(data_dir=str(data), out_dir=str(tmp_path / "run"), target="tiny.gguf", num_layers=1,
                      feature_layer_ids=[1, 2], block_size=4, blocks_per_step=8, seqs_per_step=2, steps=2,
                      draft_vocab=16, eval_minutes=0, bf16=False, heldout_root=str(root), eval_answers=2)
    trainer = Trainer(cfg, target=t)
    card = write_model_card(trainer, trainer.train()).read_text()
    assert "tiny-gemma3" in card and "| humaneval | 2 |" in card and "| sharegpt-heldout | 2 |" in card
    assert "draft vocabulary 16" in card and "5 regenerated answers" in card and "2 steps" in card


def test_hidden_states_beyond_float16_train_and_refuse_to_be_stored(tmp_path):
    """Gemma's residual stream reaches 1e5, past float16: cached features go bf16 (fp16 made
    them inf and every loss NaN), and the feature store refuses them with the fix."""
    import pytest

    t = tiny_gemma3_target(seed=6)
    with torch.no_grad():
        t.model.model.embed_tokens.weight.mul_(1e6)  # x sqrt(64) inside: residuals past 1e5
    data = tmp_path / "data"
    with pytest.raises(ValueError, match="--no-features"):
        regenerate_packed(tmp_path / "with-features", PROMPTS[:2], target=t, max_new_tokens=4, batch_size=2,
                          layer_ids=[1, 2], progress=False)
    regenerate_packed(data, PROMPTS, target=t, max_new_tokens=8, batch_size=2, layer_ids=(), progress=False)
    cfg = TrainConfig(data_dir=str(data), out_dir=str(tmp_path / "run"), num_layers=1, feature_layer_ids=[1, 2],
                      block_size=4, blocks_per_step=8, seqs_per_step=2, steps=2, draft_vocab=16, eval_minutes=0,
                      bf16=False)
    trainer = Trainer(cfg, target=t)
    sid, ids, _, d = trainer.seqs[0]
    feats, _ = trainer._sequence(sid, ids, d)
    assert torch.isfinite(feats).all() and feats.abs().max() > 7e4
    assert trainer.features[sid].dtype == torch.bfloat16
    trainer.train()
    log = (tmp_path / "run" / "train_log.jsonl").read_text()
    assert "NaN" not in log


def test_model_card_names_the_default_target_and_the_dflash2_recipe(tmp_path):
    """No -m: the card names the packaged target (not `None`) and its command drops -m; a
    DFlash2 run with masking says so in the training row."""
    import json
    from types import SimpleNamespace

    from flashdraft.train.card import model_card

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 1, "block_size": 8, "dflash_config": {}}))
    target = SimpleNamespace(name="Smol.Q4_1", num_layers=30, hidden_size=576, vocab_size=49152)
    cfg = TrainConfig(data_dir="d", out_dir="o", target=None, selector_top_k=16, selector_lr=3e-3,
                      mask_after_miss=True)
    card = model_card(target, tmp_path, cfg, {"step": 3, "cpu_hours": 0.5},
                      {"answers": 2, "tokens": 9, "dirs": ["d"]}, [])
    assert "`None`" not in card and "-m None" not in card
    assert "the packaged default, Smol.Q4_1" in card and "`flashdraft eval --offline --dataset" in card
    assert "top-16 (selector rank 32, lr 0.003)" in card and "after the first miss" in card
