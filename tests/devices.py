"""Which accelerators the device-marked tests run on, and a tiny target + drafter saved on disk
the way users get them (a Hugging Face directory and a z-lab/SpecForge drafter directory)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from flashdraft.device import mps_available
from flashdraft.drafters.dflash import random_dflash_model
from flashdraft.drafters.dflash_format import save_specforge
from tiny import tiny_model, tiny_tokenizer

#: accelerators present here (CUDA, MPS); the CPU runs everywhere else in the suite.
#: FLASHDRAFT_TEST_DEVICES=cpu (comma-separated) overrides it, to run these tests' bodies on the CPU
ACCELERATORS = [d for d in os.environ.get("FLASHDRAFT_TEST_DEVICES", "").split(",") if d] or [
    d for d, ok in (("cuda", torch.cuda.is_available()), ("mps", mps_available())) if ok]
#: ``@pytest.mark.parametrize("device", ACCELERATOR_PARAMS)``: one case per accelerator, or
#: one skipped case that says why
ACCELERATOR_PARAMS = ACCELERATORS or [pytest.param("none", marks=pytest.mark.skip(
    reason="no GPU present (CUDA or MPS): device tests run where one is; scripts/gpu_check.sh"))]


def save_tiny_pair(root: Path, block_size: int = 8) -> tuple[str, str]:
    """A tiny random qwen3 target (HF directory) and a tiny random DFlash drafter for it in
    the z-lab/SpecForge layout (``config.json`` + ``model.safetensors``, fp16). Returns both paths."""
    target_dir, drafter_dir = root / "tiny-qwen3", root / "tiny-qwen3-DFlash-b8"
    model = tiny_model("qwen3", seed=3)
    model.save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    drafter = random_dflash_model(model, num_layers=1, block_size=block_size, mask_token_id=63)
    save_specforge(drafter_dir, drafter.config, drafter.state_dict())
    return str(target_dir), str(drafter_dir)
