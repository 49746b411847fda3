"""Drafter export/convert round trips and ``evaluate`` statistics, on tiny random models."""

from __future__ import annotations

import json

import gguf
import pytest
import torch

from flashdraft.cli import main
from flashdraft.drafters.dflash import DFlashDraftModel, DFlashDrafter, load_dflash_model, random_dflash_model
from flashdraft.drafters.dflash_format import load_dflash_checkpoint
from flashdraft.drafters.draft_model import DraftModelDrafter
from flashdraft.generate import SpeculativeGenerator
from flashdraft.sampling import SamplingParams
from flashdraft.train.evaluate import evaluate, format_report
from flashdraft.train.export import export_drafter
from tiny import VOCAB, tiny_target

CONTEXTS = [[5, 9, 17, 3, 22, 41], [7, 7, 30, 2, 11, 60, 12, 8, 1]]
FORMATS = [("specforge", "dflash-draft", "d"), ("gguf", "dflash-draft", "d.gguf"), ("gguf", "dflash", "d.gguf")]


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=1, layers=6)


@pytest.fixture(scope="module")
def drafter_model(target):
    """A 2-layer random drafter with non-trivial norms, so swapped tensor names would show."""
    model = random_dflash_model(target.model, num_layers=2, block_size=8, mask_token_id=VOCAB - 1, seed=4)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    return model


def drafts(model, target) -> list[list[int]]:
    """Greedy block drafts (B-1 tokens) of ``model`` after each context in CONTEXTS."""
    drafter = DFlashDrafter(model, target.embed_tokens, target.lm_head)
    target.set_feature_layers(drafter.feature_layer_ids)
    out = []
    for ctx in CONTEXTS:
        drafter.reset()
        tokens = torch.tensor(ctx)
        _, features = target.forward(tokens[:-1], target.new_cache())  # context = all but the anchor
        drafter.commit(len(ctx) - 1, features)
        out.append(drafter.propose(tokens, model.block_size - 1, SamplingParams(), torch.Generator()).tokens.tolist())
    return out


def rounded_copy(model, vectors_too: bool):
    """``model`` with its weights rounded through fp16 (GGUF keeps norm vectors in F32)."""
    copy = DFlashDraftModel(model.config)
    state = {k: (v.half().float() if v.ndim > 1 or vectors_too else v) for k, v in model.state_dict().items()}
    copy.load_state_dict(state)
    return copy


@pytest.mark.parametrize("fmt,arch,name", FORMATS)
def test_export_load_gives_identical_drafts(tmp_path, target, drafter_model, fmt, arch, name):
    want = drafts(drafter_model, target)
    # f32: weights and drafts come back exactly
    export_drafter(drafter_model, tmp_path / name, fmt, dtype=torch.float32, arch=arch)
    loaded = load_dflash_model(tmp_path / name)
    assert loaded.config["dflash_config"] == drafter_model.config["dflash_config"]
    assert loaded.block_size == drafter_model.block_size
    for k, v in drafter_model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert drafts(loaded, target) == want
    # default f16: exactly the drafts of the fp16-rounded weights
    export_drafter(drafter_model, tmp_path / ("h" + name), fmt, arch=arch)
    loaded = load_dflash_model(tmp_path / ("h" + name))
    assert drafts(loaded, target) == drafts(rounded_copy(drafter_model, vectors_too=fmt == "specforge"), target)


def test_d2t_survives_export_and_conversion(tmp_path, drafter_model):
    d2t = torch.arange(20, dtype=torch.int64) * 3
    export_drafter(drafter_model, tmp_path / "sf", "specforge", d2t=d2t)
    assert torch.equal(load_dflash_checkpoint(tmp_path / "sf")[1]["d2t"], d2t)
    for arch in ("dflash-draft", "dflash"):
        assert main(["convert", str(tmp_path / "sf"), str(tmp_path / f"{arch}.gguf"), "--arch", arch]) == 0
        got = load_dflash_checkpoint(tmp_path / f"{arch}.gguf")[1]["d2t"]
        assert got.dtype == torch.int64 and torch.equal(got, d2t)
    assert main(["convert", str(tmp_path / "dflash.gguf"), str(tmp_path / "back")]) == 0
    assert torch.equal(load_dflash_checkpoint(tmp_path / "back")[1]["d2t"], d2t)
    with pytest.raises(ValueError, match="d2t"):
        export_drafter(drafter_model, tmp_path / "x", "specforge", d2t=torch.zeros(3, 2))


def test_convert_cli_round_trip(tmp_path, target, drafter_model, capsys):
    export_drafter(drafter_model, tmp_path / "sf", "specforge", dtype=torch.float32)
    # format inferred from the suffix; default arch dflash-draft, f16
    assert main(["convert", str(tmp_path / "sf"), str(tmp_path / "d.gguf")]) == 0
    assert "wrote" in capsys.readouterr().out
    reader = gguf.GGUFReader(tmp_path / "d.gguf")
    assert reader.fields["general.architecture"].contents() == "dflash-draft"
    assert {t.name: t for t in reader.tensors}["dflash_fc.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    # explicit --to/--arch/--dtype on a name without the suffix
    assert main(["convert", str(tmp_path / "sf"), str(tmp_path / "up"), "--to", "gguf", "--arch", "dflash",
                 "--dtype", "f32"]) == 0
    assert gguf.GGUFReader(tmp_path / "up").fields["general.architecture"].contents() == "dflash"
    # GGUF -> SpecForge: bf16 dtype recorded; f32 round trip drafts identically
    assert main(["convert", str(tmp_path / "d.gguf"), str(tmp_path / "bf"), "--dtype", "bf16"]) == 0
    assert json.loads((tmp_path / "bf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert main(["convert", str(tmp_path / "up"), str(tmp_path / "sf32"), "--dtype", "f32"]) == 0
    assert drafts(load_dflash_model(tmp_path / "sf32"), target) == drafts(drafter_model, target)


@pytest.mark.parametrize("argv,message", [
    (["{tmp}/missing", "{tmp}/out.gguf"], "no drafter checkpoint"),
    (["{tmp}/sf", "{tmp}/out.gguf", "--to", "specforge"], "ends in .gguf"),
    (["{tmp}/sf", "{tmp}/out", "--dtype", "q8_0"], "only in GGUF"),
    (["{tmp}/sf", "{tmp}/sf"], "same path"),
])
def test_convert_errors_exit_1(tmp_path, drafter_model, capsys, argv, message):
    export_drafter(drafter_model, tmp_path / "sf", "specforge")
    assert main(["convert", *[a.format(tmp=tmp_path) for a in argv]]) == 1
    err = capsys.readouterr().err
    assert "flashdraft convert: error:" in err and message in err


# ---------------------------------------------------------------- evaluate


@pytest.fixture(scope="module")
def self_drafting():
    """The target drafting for itself: at T=0 every draft is accepted."""
    target = tiny_target("llama", seed=3)
    return SpeculativeGenerator(target, DraftModelDrafter(target.model, target.vocab_size), n_draft=4)


PROMPTS = [{"id": "a", "prompt": "t5 t9 t17 t3"}, "t22 t41 t8"]


@pytest.mark.parametrize("max_tokens,hist", [
    (16, [0, 0, 0, 0, 3]),  # 1 prefill token + 3 steps of 4 drafts + bonus
    (20, [0, 0, 0, 1, 3]),  # ... + a last step drafting only the 3 tokens left before max_tokens
])
def test_evaluate_self_drafting(self_drafting, max_tokens, hist):
    r = evaluate(self_drafting, PROMPTS, max_tokens, SamplingParams(), progress=False, ignore_eos=True)
    steps = sum(hist)
    assert r["block_size"] == 5 and r["prompts"] == 2
    assert r["tokens"] == 2 * max_tokens
    assert r["verify_steps"] == r["drafted_steps"] == 2 * steps
    assert r["histogram"] == [2 * h for h in hist]
    assert sum(r["histogram"]) == r["verify_steps"]
    assert r["tau"] == pytest.approx((max_tokens - 1) / steps)
    assert r["tau_drafted"] == pytest.approx(r["tau"])
    assert r["per_position_acceptance"] == [1.0, 1.0, 1.0, 1.0]
    assert r["draft_n"] == r["draft_n_accepted"] == 2 * (max_tokens - 1 - steps)
    assert r["acceptance_rate"] == 1.0
    assert r["finish_reasons"] == {"length": 2}
    text = format_report(r)
    assert "tau" in text and "P(accept k)" in text


def test_evaluate_sampling_is_seeded_per_prompt(self_drafting):
    params = SamplingParams(temperature=0.7, seed=11)
    a = evaluate(self_drafting, PROMPTS, 24, params, progress=False)
    b = evaluate(self_drafting, PROMPTS, 24, params, progress=False)
    for key in ("tokens", "histogram", "draft_n", "draft_n_accepted", "per_position_acceptance"):
        assert a[key] == b[key], key
    assert a["acceptance_rate"] > 0.9  # same model on both sides: p == q up to rounding
    assert sum(a["histogram"]) == a["verify_steps"]


def test_evaluate_untrained_dflash_drafter_counts_add_up(target, drafter_model):
    gen = SpeculativeGenerator(target, DFlashDrafter(drafter_model, target.embed_tokens, target.lm_head), n_draft=16)
    r = evaluate(gen, PROMPTS, 30, SamplingParams(), progress=False)
    assert r["block_size"] == 8  # capped by the drafter's block
    assert len(r["per_position_acceptance"]) == 7 and len(r["histogram"]) == 8
    assert sum(r["histogram"]) == r["verify_steps"]
    accepted = sum((a or 0.0) * d for a, d in zip(r["per_position_acceptance"], r["per_position_drafted"]))
    assert accepted == pytest.approx(r["draft_n_accepted"], abs=0.5)
    assert r["draft_n"] == sum(r["per_position_drafted"])
    lengths = range(1, 9)
    assert r["tau"] == pytest.approx(sum(n * c for n, c in zip(lengths, r["histogram"])) / sum(r["histogram"]),
                                     abs=1e-4)  # τ is the histogram's mean
    assert 1.0 <= r["tau"] <= 8.0


def test_eval_cli_json(tmp_path, capsys):
    """End to end: a tiny HF target directory, the target drafting for itself, --json."""
    target = tiny_target("llama", seed=3)
    target.model.save_pretrained(tmp_path / "m")
    target.tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["t1 t2 t3", "t9 t8"]))
    rc = main(["eval", "--target", str(tmp_path / "m"), "--spec-type", "draft", "--drafter", "target",
               "--dataset", str(tmp_path / "p.jsonl"), "--max-tokens", "13", "--block-size", "6",
               "--ignore-eos", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_prompts"] == 2 and [r["temperature"] for r in out["results"]] == [0.0, 0.7]
    greedy = out["results"][0]
    assert greedy["block_size"] == 6 and greedy["tau"] == pytest.approx(6.0)  # 1 + 2 steps of (5 drafts + bonus)
    assert greedy["histogram"] == [0, 0, 0, 0, 0, 4]
    assert main(["eval", "--target", str(tmp_path / "m"), "--dataset", "nope", "--spec-type", "ngram"]) == 1
