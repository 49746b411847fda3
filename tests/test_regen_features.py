"""Packed regeneration, stored features and the blocks forward (tiny random models)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flashdraft.drafters.dflash import DFlashDraftModel, drafter_config_for_target
from flashdraft.fast_forward import BatchKV
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from flashdraft.train.features import FeatureStore, build_features
from flashdraft.train.loop import TrainConfig, Trainer
from flashdraft.train.shards import read_shards
from flashdraft.train.objective import block_attention_mask, build_blocks
from flashdraft.train.regen import generate_packed, regenerate_packed
from tiny import tiny_target

PROMPTS = [{"id": f"p{i}", "prompt": " ".join(f"t{(7 * i + j) % 60 + 1}" for j in range(3 + i % 4))}
           for i in range(7)]


@pytest.fixture(scope="module")
def target():
    t = tiny_target("llama", seed=4, layers=4)
    t.tokenizer.chat_template = ("{% for m in messages %}t61 {{ m['content'] }} t62 {% endfor %}"
                                 "{% if add_generation_prompt %}t63 {% endif %}")
    return t


def test_decode_rows_equals_single_sequence_forward(target):
    lean = target.lean
    kv = BatchKV(lean, 3, 64)
    prompts = [torch.tensor([5, 9, 3, 7]), torch.tensor([11, 2]), torch.tensor([33, 1, 1, 1, 8, 2, 40])]
    for row, ids in enumerate(prompts):
        lean.prefill_row(ids, kv, row)
    logits, feats = lean.decode_rows(torch.tensor([4, 4, 4]), kv, [1, 3])
    for row, ids in enumerate(prompts):
        cache = target.new_cache(32)
        target.set_feature_layers([1, 3])
        target.forward(ids, cache, ids.shape[0] - 1)
        want, want_f = target.forward(torch.tensor([4]), cache, 0)
        torch.testing.assert_close(logits[row], want[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(feats[row], want_f[0], rtol=1e-4, atol=1e-4)
    target.set_feature_layers(None)


def test_packed_greedy_answers_equal_the_plain_loop(target):
    encoded = [(p["id"], target.chat_prompt_ids([{"role": "user", "content": p["prompt"]}])) for p in PROMPTS]
    # fewer rows than prompts: rows are refilled as answers end (continuous batching)
    got = {pid: (resp, finish) for pid, resp, finish, _, _ in
           generate_packed(target, encoded, 20, SamplingParams(), batch_size=3)}
    gen = SpeculativeGenerator(target)
    for pid, ids in encoded:
        _, want, finish, _ = generate_text(gen, ids, 20, SamplingParams())
        resp, got_finish = got[pid]
        if finish == "stop":
            assert got_finish == "eos" and resp == want + [0]
        else:
            assert got_finish == "length" and resp == want


def test_regeneration_stores_features_and_resumes(tmp_path, target):
    out = tmp_path / "data"
    regenerate_packed(out, PROMPTS[:4], target=target, max_new_tokens=12, batch_size=2, layer_ids=[1, 3],
                      progress=False)
    regenerate_packed(out, PROMPTS, target=target, max_new_tokens=12, batch_size=2, layer_ids=[1, 3],
                      progress=False)  # picks up the other three only
    seqs = read_shards(out)
    assert sorted(s[0] for s in seqs) == sorted(p["id"] for p in PROMPTS)
    store = FeatureStore(out)
    assert len(store) == len(PROMPTS) and store.layer_ids == [1, 3]
    target.set_feature_layers([1, 3])
    for sid, ids, n_prompt in seqs:
        rows = store.get(sid)
        assert rows.features.shape == (ids.shape[0] - 1, 2 * target.hidden_size)
        logits, feats = target.forward(ids[:-1], target.new_cache(64), 0)
        np.testing.assert_allclose(rows.features, feats.numpy(), rtol=2e-2, atol=2e-2)  # fp16 rows
        # row t holds the distribution of token t+1; greedy answers are its top-1
        assert rows.topk_ids[n_prompt - 1:, 0].tolist() == ids[n_prompt:].tolist()
        top = torch.log_softmax(logits, -1).topk(8, -1)
        assert rows.topk_ids.tolist() == top.indices.tolist()
    target.set_feature_layers(None)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["state"] == "complete" and manifest["counts"]["done"] == len(PROMPTS)
    with pytest.raises(ValueError, match="different"):
        regenerate_packed(out, PROMPTS, target=target, max_new_tokens=13, layer_ids=[1, 3], progress=False)


def test_build_features_fills_what_is_missing(tmp_path, target):
    out = tmp_path / "data"
    regenerate_packed(out, PROMPTS[:3], target=target, max_new_tokens=8, batch_size=2, layer_ids=(),
                      progress=False)
    assert not (out / "features").exists()
    assert build_features(out, target, [0, 2], progress=False) == 3
    assert build_features(out, target, [0, 2], progress=False) == 0
    store = FeatureStore(out)
    assert len(store) == 3 and store.columns([2]) == list(range(target.hidden_size, 2 * target.hidden_size))
    with pytest.raises(ValueError, match="not stored"):
        store.columns([1])


def test_forward_blocks_equals_the_dense_mask(target):
    cfg = drafter_config_for_target(target.config, num_layers=2, block_size=5, mask_token_id=63,
                                    target_layer_ids=[1, 2])
    model = DFlashDraftModel(cfg)
    T = 30
    feats, ids = torch.randn(T, 2 * target.hidden_size), torch.randint(1, 60, (T + 1,))
    anchors = torch.tensor([0, 4, 5, 17, 28])
    block_ids, pos, _ = build_blocks(ids, anchors, 5, 63)
    ctx = model.context_kv(model.fuse(feats[None]), torch.arange(T)[None])
    x = target.embed_tokens.weight[block_ids].detach()
    dense = model(x[None], pos[None], ctx, block_attention_mask(anchors, T, 5)[None, None])[0]
    blocks = model.forward_blocks(x.view(5, 5, -1), anchors, ctx).reshape(25, -1)
    torch.testing.assert_close(blocks, dense, rtol=1e-5, atol=1e-5)


def test_trainer_uses_stored_features_and_soft_labels(tmp_path, target):
    data = tmp_path / "data"
    regenerate_packed(data, PROMPTS, target=target, max_new_tokens=16, batch_size=4, layer_ids=[0, 1, 2, 3],
                      progress=False)
    cfg = TrainConfig(data_dir=str(data), out_dir=str(tmp_path / "run"), num_layers=1, feature_layer_ids=[1, 3],
                      block_size=4, blocks_per_step=8, seqs_per_step=2, steps=6, draft_vocab=0,
                      mask_token_id=63, soft_weight=0.5, eval_minutes=0, bf16=False)
    trainer = Trainer(cfg, target=target)
    assert trainer.stores[0] is not None  # read from disk, not recomputed
    trainer._features = None  # any fallback to a target forward would now fail
    result = trainer.train()
    assert result["step"] == 6 and result["tokens_seen"] > 0
    assert (tmp_path / "run" / "drafter" / "config.json").exists()
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert all("cpu_hours" in rec for rec in log if "loss" in rec)


def test_gzipped_shards_are_read_and_not_regenerated(tmp_path, target):
    import gzip

    out = tmp_path / "data"
    regenerate_packed(out, PROMPTS[:3], target=target, max_new_tokens=6, batch_size=2, layer_ids=(),
                      progress=False)
    before = {s[0]: s[1].tolist() for s in read_shards(out)}
    for shard in out.glob("shard-*.jsonl"):  # how shards are committed
        with gzip.open(shard.with_suffix(".jsonl.gz"), "wt", encoding="utf-8") as f:
            f.write(shard.read_text())
        shard.unlink()
    regenerate_packed(out, PROMPTS[:4], target=target, max_new_tokens=6, batch_size=2, layer_ids=(),
                      progress=False)  # only the fourth prompt is new
    after = {s[0]: s[1].tolist() for s in read_shards(out)}
    assert {k: after[k] for k in before} == before and len(after) == 4
    assert len(list(out.glob("shard-*.jsonl"))) == 1  # a new plain shard for the new answer


def test_cpu_hour_budget_stops_training_and_drives_the_schedule(tmp_path, target):
    data = tmp_path / "data"
    regenerate_packed(data, PROMPTS, target=target, max_new_tokens=16, batch_size=4, layer_ids=[0, 1, 2, 3],
                      progress=False)
    # 3 CPU-seconds: several steps of this tiny drafter (0.2-0.5 CPU-s each, more on a busy
    # machine), far fewer than 10,000
    budget_h = 3.0 / 3600
    cfg = TrainConfig(data_dir=str(data), out_dir=str(tmp_path / "run"), num_layers=1, feature_layer_ids=[1, 3],
                      block_size=4, blocks_per_step=8, seqs_per_step=2, steps=10_000, draft_vocab=0,
                      mask_token_id=63, eval_minutes=0, bf16=False, max_cpu_hours=budget_h)
    trainer = Trainer(cfg, target=target)
    result = trainer.train()
    assert 0 < result["step"] < 10_000
    assert trainer.cpu_seconds >= 3.0
    # the cosine ran over CPU time: the last step began past half the budget, so its learning
    # rate is past half the decay (a step-count cosine over 10,000 steps would still be ~cfg.lr)
    assert trainer.opt.param_groups[0]["lr"] < 0.5 * cfg.lr


def test_sigterm_saves_and_leaves_without_the_held_out_walk(tmp_path, target, monkeypatch):
    """SIGTERM mid-run: the loop stops after its step, saves a checkpoint to resume from and
    returns at once (``stopped``), without the final held-out evaluation (it takes minutes)."""
    import os
    import signal

    import flashdraft.train.loop as loop

    data = tmp_path / "data"
    regenerate_packed(data, PROMPTS, target=target, max_new_tokens=16, batch_size=4, layer_ids=[0, 1, 2, 3],
                      progress=False)
    cfg = TrainConfig(data_dir=str(data), out_dir=str(tmp_path / "run"), num_layers=1, feature_layer_ids=[1, 3],
                      block_size=4, blocks_per_step=8, seqs_per_step=2, steps=1_000, draft_vocab=0,
                      mask_token_id=63, eval_minutes=30, bf16=False)
    trainer = Trainer(cfg, target=target)
    monkeypatch.setattr(Trainer, "evaluate", lambda self: pytest.fail("evaluated after SIGTERM"))
    real = loop.checkpoint_and_eval

    def term_at_step_3(tr, *a):
        if tr.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(tr, *a)

    monkeypatch.setattr(loop, "checkpoint_and_eval", term_at_step_3)
    result = trainer.train()
    assert result["stopped"] and result["step"] == 3
    assert (tmp_path / "run" / "checkpoint.pt").exists()
    assert Trainer(cfg, target=target).step == 3  # the same command resumes there


def test_build_features_cli_never_regenerates(tmp_path, target, monkeypatch):
    """`flashdraft train --build-features` fills in features for what DATA holds and exits; with
    the default --prompts it used to regenerate (and append answers to DATA) first."""
    import flashdraft.engine as engine
    import flashdraft.train.regen as regen
    from flashdraft.cli import main

    data = tmp_path / "data"
    regenerate_packed(data, PROMPTS[:3], target=target, max_new_tokens=8, batch_size=2, layer_ids=(),
                      progress=False)
    monkeypatch.setattr(regen, "regenerate_packed", lambda *a, **k: pytest.fail("regenerated"))
    monkeypatch.setattr(engine, "load_engine_target", lambda cfg: target)
    assert main(["train", "--out", str(tmp_path / "run"), "--data", str(data), "--build-features"]) == 0
    assert len(FeatureStore(data)) == 3
    target.set_feature_layers(None)


@pytest.mark.parametrize("gamma", [None, 1.5])
def test_loss_gamma_reaches_the_loss(tmp_path, target, monkeypatch, gamma):
    """--loss-gamma sets the per-position decay the loss uses; unset, the paper's default."""
    import flashdraft.train.loop as loop
    from flashdraft.train.objective import default_gamma

    data = tmp_path / "data"
    regenerate_packed(data, PROMPTS[:4], target=target, max_new_tokens=16, batch_size=4, layer_ids=[0, 1, 2, 3],
                      progress=False)
    seen = []
    real = loop.dflash_loss

    def spy(drafter, feats, ids, anchors, embed, head, t2d, g, *a, **k):
        seen.append(g)
        return real(drafter, feats, ids, anchors, embed, head, t2d, g, *a, **k)

    monkeypatch.setattr(loop, "dflash_loss", spy)
    cfg = TrainConfig(data_dir=str(data), out_dir=str(tmp_path / "run"), num_layers=1, feature_layer_ids=[1, 3],
                      block_size=4, blocks_per_step=8, seqs_per_step=2, steps=2, draft_vocab=0,
                      mask_token_id=63, eval_minutes=0, bf16=False, loss_gamma=gamma)
    monkeypatch.setattr(Trainer, "evaluate", lambda self: {})
    Trainer(cfg, target=target).train()
    assert seen and set(seen) == {gamma or default_gamma(4)}


def test_loss_gamma_must_be_positive(capsys):
    from flashdraft.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--out", "x", "--loss-gamma", "0"])
    assert e.value.code == 2 and "--loss-gamma: must be > 0" in capsys.readouterr().err


def test_stored_rows_name_their_backend_and_the_walk_reads_only_its_own(tmp_path, target):
    """meta.json records the engine whose forward made the rows; the walk uses stored rows
    only when its target runs on that backend (llama.cpp's rows differ slightly)."""
    from types import SimpleNamespace

    from flashdraft.train.walk import load_answers

    out = tmp_path / "data"
    regenerate_packed(out, PROMPTS[:2], target=target, max_new_tokens=8, batch_size=2, layer_ids=[0, 2],
                      progress=False)
    target.set_feature_layers(None)
    store = FeatureStore(out)
    assert store.backend == "torch" and json.loads((out / "features" / "meta.json").read_text())["backend"] == "torch"
    assert all(f is not None for *_, f in load_answers(out, target, [0, 2]))
    on_llama = SimpleNamespace(backend="llama")
    assert all(f is None for *_, f in load_answers(out, on_llama, [0, 2]))
    # a store written before the key reads as torch's, and torch rows can still be added to it
    meta = out / "features" / "meta.json"
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "backend"}))
    assert FeatureStore(out).backend == "torch"
    regenerate_packed(out, PROMPTS[:3], target=target, max_new_tokens=8, batch_size=2, layer_ids=[0, 2],
                      progress=False)
    assert len(FeatureStore(out)) == 3
    target.set_feature_layers(None)


def test_trainer_warns_when_it_would_mix_two_engines_features(tmp_path, target, caplog):
    """Stored llama rows plus sequences without rows: the trainer fills those in with its torch
    target, and says so, naming the command that keeps a run on one engine's features."""
    data = tmp_path / "data"
    regenerate_packed(data, PROMPTS[:3], target=target, max_new_tokens=8, batch_size=2, layer_ids=[0, 1, 2, 3],
                      progress=False)
    regenerate_packed(data, PROMPTS[:5], target=target, max_new_tokens=8, batch_size=2, layer_ids=(),
                      progress=False)  # two more answers, no feature rows
    target.set_feature_layers(None)
    cfg = TrainConfig(data_dir=str(data), out_dir=str(tmp_path / "run"), num_layers=1, feature_layer_ids=[1, 3],
                      block_size=4, blocks_per_step=8, seqs_per_step=2, steps=1, draft_vocab=0,
                      mask_token_id=63, eval_minutes=0, bf16=False)
    with caplog.at_level("WARNING", logger="flashdraft.train.loop"):
        Trainer(cfg, target=target)
    assert not [r for r in caplog.records if "computed with the torch target" in r.getMessage()]  # torch rows: no mix
    meta = data / "features" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "backend": "llama"}))
    caplog.clear()
    with caplog.at_level("WARNING", logger="flashdraft.train.loop"):
        Trainer(cfg, target=target)
    warned = [r.getMessage() for r in caplog.records if "computed with the torch target" in r.getMessage()]
    assert len(warned) == 1 and "2 sequences" in warned[0] and "--build-features --backend llama" in warned[0]


def test_regeneration_drops_a_half_written_line_and_starts_a_new_shard(tmp_path, target):
    """A run killed while writing a line resumes: the broken line is gone, its prompt is
    answered again in a new shard, earlier answers stay as they were."""
    kw = dict(target=target, max_new_tokens=6, batch_size=2, shard_size=3, layer_ids=(), progress=False)
    regenerate_packed(tmp_path, PROMPTS[:2], **kw)
    first = sorted(tmp_path.glob("shard-*.jsonl"))[0]
    before = first.read_text()
    with open(first, "a") as f:
        f.write('{"id": "%s", "prompt": "How do' % PROMPTS[2]["id"])
    m = regenerate_packed(tmp_path, PROMPTS, **kw)
    assert sorted(s[0] for s in read_shards(tmp_path)) == sorted(p["id"] for p in PROMPTS)  # no duplicates
    assert first.read_text().startswith(before) and (tmp_path / "shard-00001.jsonl").exists()
    assert m["counts"]["done"] == len(PROMPTS) and m["counts"]["eos"] + m["counts"]["length"] == len(PROMPTS)
    assert m["counts"]["response_tokens"] == sum(len(ids) - n for _, ids, n in read_shards(tmp_path))


def test_regeneration_with_nothing_left_writes_nothing(tmp_path, target):
    kw = dict(target=target, max_new_tokens=6, batch_size=2, layer_ids=(), progress=False)
    regenerate_packed(tmp_path, PROMPTS[:3], **kw)
    shards = {p.name: p.read_text() for p in tmp_path.glob("shard-*.jsonl")}
    m = regenerate_packed(tmp_path, PROMPTS[:3], **kw)
    assert m["state"] == "complete" and m["eos_token_ids"] == sorted(target.eos_token_ids)
    assert {p.name: p.read_text() for p in tmp_path.glob("shard-*.jsonl")} == shards


def test_regeneration_refuses_duplicate_prompt_ids(tmp_path, target):
    with pytest.raises(ValueError, match="unique"):
        regenerate_packed(tmp_path, PROMPTS + PROMPTS[:1], target=target, max_new_tokens=4, progress=False)
