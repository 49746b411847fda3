"""``--device``: resolution, the CLI flag on every command, and the engine on a device.

The CPU tests run the same code a CUDA run takes, with ``device="cpu"``; while a request
decodes, torch's default device is the meta device, so any tensor the loop makes without
naming its device would be a meta tensor and fail against the real ones: on a GPU that
tensor would have been on the wrong device. ``@pytest.mark.device`` tests repeat the key
checks on each accelerator present and skip with a reason where there is none.
"""

import json
import logging
from contextlib import contextmanager

import pytest
import torch

from devices import ACCELERATOR_PARAMS, save_tiny_pair
from flashdraft.cli import main
from flashdraft.device import DeviceUnavailableError, resolve_device
from flashdraft.engine import EngineConfig, load_engine
from flashdraft.generate import GenerationRequest, generate_text
from flashdraft.sampling import SamplingParams

PROMPT = "t5 t9 t17 t33"  # the tiny target's greedy answer to it is varied, not one repeated token
SPEC_TYPES = ("dflash", "ngram", "hybrid", "draft")
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("zlab"))


@contextmanager
def tensors_must_name_their_device():
    """Tensors made without ``device=`` land on the meta device (and fail when mixed)."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def engine(pair, spec_type: str, device: str = "cpu", **kw):
    target_dir, drafter_dir = pair
    draft = {"none": None, "ngram": None, "draft": target_dir}.get(spec_type, drafter_dir)
    cfg = EngineConfig(model=target_dir, spec_type=spec_type, draft_model=draft, controller="off", n_draft=7,
                       ctx_size=256, device=device, **kw)
    return load_engine(cfg, warmup=False)


def answer(gen, params=SamplingParams(), n=24):
    ids = gen.target.encode(PROMPT)
    with tensors_must_name_their_device():
        _, tokens, _, timings = generate_text(gen, ids, n, params)
    return tokens, timings


# -- resolution -------------------------------------------------------------------------
def test_resolve_cpu_and_auto():
    assert resolve_device("cpu") == torch.device("cpu")
    auto = resolve_device("auto")
    want = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    assert auto.type == want and resolve_device(None) == auto


@NO_CUDA
def test_resolve_cuda_absent_is_a_clear_error():
    with pytest.raises(DeviceUnavailableError, match="--device cuda: .*use --device cpu"):
        resolve_device("cuda")


def test_resolve_unknown_name():
    with pytest.raises(DeviceUnavailableError, match="unknown device"):
        resolve_device("tpu7")


# -- the z-lab layout on the CPU, through the device code path ---------------------------
def test_zlab_layout_loads_and_dflash_greedy_equals_baseline(pair):
    base, _ = answer(engine(pair, "none"))
    gen = engine(pair, "dflash")
    assert gen.target.device == gen.drafter.device == torch.device("cpu")
    assert gen.drafter.max_draft == 7  # block size 8 from the drafter's config.json
    tokens, timings = answer(gen)
    assert tokens == base and timings.draft_n > 0
    assert len(set(base)) > 3  # a varied answer, not one repeated token


@pytest.mark.parametrize("spec_type", SPEC_TYPES[1:])
def test_every_drafter_greedy_equals_baseline_on_cpu(pair, spec_type):
    base, _ = answer(engine(pair, "none"))
    gen = engine(pair, spec_type)
    assert answer(gen)[0] == base
    answer(gen, SamplingParams(temperature=0.8, top_p=0.9, seed=1))  # the sampled loop, same discipline


def test_sampling_runs_with_every_tensor_on_its_device(pair):
    gen = engine(pair, "dflash")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    assert answer(gen, params)[0] == answer(gen, params)[0]  # seeded: the generator lives on the device


def test_cpu_only_paths_refuse_another_device(pair):
    cfg = EngineConfig(model=pair[0], spec_type="none", weights="q4")
    with pytest.raises(ValueError, match="q4 runs on CPU-only"):
        cfg.validate(torch.device("cuda"))
    cfg = EngineConfig(model=pair[0], spec_type="none", cache_type_k="q8_0", cache_type_v="q8_0")
    with pytest.raises(ValueError, match="compressed KV caches run on the CPU only"):
        cfg.validate(torch.device("cuda"))
    cfg.validate(torch.device("cpu"))


# -- the CLI ------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", [["--device", "cpu"], ["-dev", "cpu"], ["--device", "auto"], []])
def test_generate_cli_device(pair, flag, capsys, caplog):
    caplog.set_level(logging.INFO, logger="flashdraft.device")
    argv = ["generate", "-m", pair[0], "-md", pair[1], "--spec-draft-n-max", "7", "-c", "256",
            "-p", PROMPT, "-n", "8", "--json", *flag]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 8
    assert "device: " in caplog.text
    assert ("auto-selected" in caplog.text) == (flag[-1:] != ["cpu"])


@NO_CUDA
@pytest.mark.parametrize("command", [["generate", "-p", "t1"], ["eval", "--dataset", "seed", "--spec-type", "ngram"],
                                     ["bench", "--configs", "none"], ["train", "--out", "OUT"], ["serve"]])
def test_cuda_without_cuda_exits_nonzero(pair, command, capsys, caplog, tmp_path):
    command = [str(tmp_path) if c == "OUT" else c for c in command]
    model = ["--target", pair[0], "--prompts", "0"] if command[0] == "train" else ["-m", pair[0]]
    assert main([*command, *model, "-dev", "cuda"]) != 0
    said = capsys.readouterr().err + caplog.text
    assert "--device cuda" in said and "use --device cpu" in said


def test_device_is_no_longer_an_ignored_server_flag():
    import argparse

    from flashdraft.server import cli as server_cli
    from flashdraft.server import llama_flags

    parser = argparse.ArgumentParser()
    server_cli.add_arguments(parser)
    args = parser.parse_args(["-dev", "cpu"])
    assert args.device == "cpu" and llama_flags.ignored(args) == []


# -- on each accelerator present -----------------------------------------------------------
@pytest.mark.device
@pytest.mark.parametrize("device", ACCELERATOR_PARAMS)
@pytest.mark.parametrize("spec_type", SPEC_TYPES)
def test_greedy_equals_baseline_on_device(pair, device, spec_type):
    gen = engine(pair, spec_type, device)
    assert gen.target.device.type == device
    assert gen.target.new_cache(capacity=8).buffer.device.type == device
    base, _ = answer(engine(pair, "none", device))
    tokens, timings = answer(gen)
    assert tokens == base and timings.draft_n > 0


@pytest.mark.device
@pytest.mark.parametrize("device", ACCELERATOR_PARAMS)
def test_sampling_and_packed_slots_on_device(pair, device):
    from flashdraft.batch import make_slots, start, step_together

    gen = engine(pair, "dflash", device)
    params = SamplingParams(temperature=0.8, seed=2)
    assert answer(gen, params)[0] == answer(gen, params)[0]
    slots = make_slots(gen, 2)
    for slot in slots:
        start(gen, slot, GenerationRequest(gen.target.encode(PROMPT), 8, SamplingParams()))
    while not all(s.seq.done for s in slots):
        live = [s.seq for s in slots if not s.seq.done]
        for result in step_together(gen.target, live):
            assert not isinstance(result, Exception), result


@pytest.mark.device
@pytest.mark.parametrize("device", ACCELERATOR_PARAMS)
def test_training_step_on_device(pair, device):
    training_step(pair, device)


def test_training_step_on_cpu(pair):
    training_step(pair, "cpu")


def training_step(pair, device):
    """One DFlash loss + backward with the target, features, labels and drafter on ``device``."""
    from flashdraft.device import autocast_device_type
    from flashdraft.drafters.dflash import load_dflash_model
    from flashdraft.targets.torch import Target
    from flashdraft.train.objective import dflash_loss, sample_anchors

    target = Target.load(pair[0], device=device)
    drafter = load_dflash_model(pair[1], device=target.device).train().requires_grad_(True)
    target.set_feature_layers(drafter.target_layer_ids)
    ids = torch.tensor(target.encode(PROMPT + " t1 t2 t3 t4 t5 t6 t7 t8"))
    _, feats = target.forward(ids, target.new_cache())
    anchors = sample_anchors(3, ids.shape[0], 4, torch.Generator().manual_seed(0)).to(target.device)
    with torch.autocast(autocast_device_type(target.device), dtype=torch.bfloat16):
        loss, correct, counted = dflash_loss(drafter, feats.float(), ids.to(target.device), anchors,
                                             target.embed_tokens.weight, target.lm_head.weight, None, 7.0)
    loss.backward()
    assert torch.isfinite(loss) and drafter.fc.weight.grad.device.type == device
