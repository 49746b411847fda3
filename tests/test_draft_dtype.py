"""``--spec-draft-dtype``: the dtype the drafter network and its LM head rows run in; auto
picks bf16 only where a measured bf16 matmul beats float32, and output never changes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import flashdraft.device as device_mod
from flashdraft.device import resolve_draft_dtype
from flashdraft.engine import EngineConfig, load_drafter
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from tiny import tiny_target

CPU = torch.device("cpu")


def test_named_dtypes_and_a_bad_name():
    assert resolve_draft_dtype("f32", CPU) == torch.float32
    assert resolve_draft_dtype("bf16", CPU) == torch.bfloat16
    with pytest.raises(ValueError, match="--spec-draft-dtype"):
        resolve_draft_dtype("fp8", CPU)
    with pytest.raises(ValueError, match="--spec-draft-dtype 'fp8'"):
        EngineConfig(draft_dtype="fp8").validate(CPU)


@pytest.mark.parametrize("pays", [True, False])
def test_auto_follows_the_measurement_on_the_cpu(monkeypatch, pays):
    asked = []
    monkeypatch.setattr(device_mod, "bf16_pays", lambda *shape: asked.append(shape) or pays)
    assert resolve_draft_dtype("auto", CPU) == (torch.bfloat16 if pays else torch.float32)
    assert asked and asked[0][0] == 8  # measured at a drafter's block size, not the training size


def test_auto_is_float32_off_the_cpu(monkeypatch):
    monkeypatch.setattr(device_mod, "bf16_pays", lambda *shape: pytest.fail("measured off the CPU"))
    assert resolve_draft_dtype("auto", torch.device("cuda")) == torch.float32


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_greedy_output_is_the_targets_in_either_dtype(dtype):
    """A random DFlash drafter loaded through the engine in ``dtype``: network and LM-head rows
    in that dtype, greedy output token-identical to plain decoding."""
    target = tiny_target("llama", seed=5)
    prompt = [3, 8, 5, 2, 9, 4] * 5
    want = generate_text(SpeculativeGenerator(target), prompt, 48, SamplingParams())[1]
    torch.manual_seed(0)
    drafter = load_drafter(EngineConfig(spec_type="dflash", draft_model="random:1", draft_dtype=dtype), target)
    expect = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    assert drafter.model.fc.weight.dtype == drafter.head_weight.dtype == expect
    _, got, _, t = generate_text(SpeculativeGenerator(target, drafter, n_draft=5), prompt, 48, SamplingParams())
    assert got == want
    assert t.draft_n > 0


def test_serve_and_generate_take_the_flag():
    from flashdraft.cli import build_parser as build_cli
    from flashdraft.server.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["--spec-draft-dtype", "bf16", "--spec-draft-p-min", "0.25"])
    cfg = engine_config_from_args(args)
    assert (cfg.draft_dtype, cfg.p_min) == ("bf16", 0.25)
    assert engine_config_from_args(build_parser().parse_args([])).draft_dtype == "auto"
    cli, _ = build_cli()
    gen = EngineConfig.from_args(cli.parse_args(["generate", "-p", "x", "--spec-draft-dtype", "f32", "--spec-draft-p-min", "0.5"]))
    assert (gen.draft_dtype, gen.p_min) == ("f32", 0.5)
    r = subprocess.run([sys.executable, "-m", "flashdraft.cli", "generate", "-p", "x", "--spec-draft-dtype", "fp8"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--spec-draft-dtype" in r.stderr and "invalid choice" in r.stderr
