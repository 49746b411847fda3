"""``--weights {fp32,bf16}``: every command that loads a target passes it through, and greedy
speculative output stays equal to the greedy baseline under bf16 weights."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from flashdraft.cli import main
from flashdraft.engine import EngineConfig, load_engine
from tiny import tiny_target


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    t = tiny_target("llama")
    t.model.save_pretrained(d)
    t.tokenizer.save_pretrained(d)
    return str(d)


def test_every_command_parses_weights():
    from flashdraft.bench import runner
    from flashdraft.generate_cli import add_arguments as generate_arguments
    from flashdraft.server.cli import build_parser, engine_config_from_args
    from flashdraft.train import evaluate

    assert engine_config_from_args(build_parser().parse_args([])).weights == "fp32"
    assert engine_config_from_args(build_parser().parse_args(["--weights", "bf16"])).weights == "bf16"
    for add, extra in ((generate_arguments, ["-p", "x"]), (evaluate.add_arguments, []), (runner.add_arguments, [])):
        p = argparse.ArgumentParser()
        add(p)
        assert EngineConfig.from_args(p.parse_args(extra + ["--weights", "bf16"])).weights == "bf16"
        with pytest.raises(SystemExit):  # argparse refuses an unknown dtype
            p.parse_args(extra + ["--weights", "int3"])


def test_load_engine_loads_bf16_weights(model_dir):
    gen = load_engine(EngineConfig(model=model_dir, spec_type="ngram", weights="bf16"), warmup=False)
    assert gen.target.model.get_input_embeddings().weight.dtype == torch.bfloat16
    gen = load_engine(EngineConfig(model=model_dir, spec_type="none"), warmup=False)
    assert gen.target.model.get_input_embeddings().weight.dtype == torch.float32
    with pytest.raises(ValueError, match="unknown weights"):
        load_engine(EngineConfig(model=model_dir, weights="int3"), warmup=False)


def _generate(capsys, *args) -> list[int]:
    assert main(["generate", "-p", "t5 t9 t17 t3 t22 t41 t5 t9", "-n", "24", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)["token_ids"]


def test_generate_bf16_greedy_speculative_equals_bf16_baseline(model_dir, capsys):
    common = ["-m", model_dir, "--weights", "bf16", "--spec-dm-controller", "off", "--spec-draft-n-max", "4"]
    base = _generate(capsys, *common, "--spec-type", "none")
    assert len(base) > 0
    assert _generate(capsys, *common, "--spec-type", "ngram") == base
    assert _generate(capsys, *common, "--spec-type", "dflash", "-md", "random:1") == base
