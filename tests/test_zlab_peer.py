"""Our drafter in z-lab's reference package (``dflash`` 0.1.0): the export loads in its
``DFlashDraftModel`` and drafts for a transformers target through its ``dflash_generate``.

Skipped with the reason when the package is absent (``make zlab-peer`` installs it).
"""

import importlib.util

import pytest
import torch

from flashdraft.bench.contender import BenchPrompt
from flashdraft.bench.zlab import ZLabContender, export_zlab, load_zlab_drafter, spec_counts, zlab_limits
from flashdraft.drafters.dflash_format import save_specforge
from flashdraft.sampling import SamplingParams
from tiny import VOCAB, tiny_model, tiny_tokenizer

needs_zlab = pytest.mark.skipif(importlib.util.find_spec("dflash") is None,
                                reason="z-lab's dflash package is not installed (make zlab-peer)")


def _drafter_dir(tmp_path, target, seeded: bool):
    """Our drafter format for ``target``, initialised from the target's last layer so its drafts
    are sometimes right (random weights would never be accepted)."""
    from flashdraft.drafters.dflash import DFlashDraftModel, drafter_config_for_target, init_from_target

    config = drafter_config_for_target(target.config, num_layers=1, block_size=4)
    config["dflash_config"]["mask_token_id"] = VOCAB - 1
    if seeded:
        config["dflash_config"]["ngram_seeded"] = True
    drafter = DFlashDraftModel(config)
    init_from_target(drafter, target)
    state = {k: v.detach() for k, v in drafter.state_dict().items()}
    state["d2t"] = torch.arange(0, VOCAB, 2, dtype=torch.int64)
    save_specforge(tmp_path / "ours", drafter.config, state, dtype=torch.float32)
    return tmp_path / "ours"


def test_limits_name_what_the_reference_class_cannot_hold():
    config = {"dflash_config": {"ngram_seeded": True}}
    got = zlab_limits(config, has_d2t=True)
    assert len(got) == 2 and "d2t" in got[0] and "n-gram" in got[1]
    assert zlab_limits({"dflash_config": {}}, has_d2t=False) == []


def test_counters_from_verify_positions():
    # prompt of 10: the prefill yields position 10; steps anchored at 10, 13, 14 yield 3, 1, 2 tokens
    c = spec_counts([0, 10, 13, 14], end=16, drafts=3)
    assert c.steps == 4 and c.accepted_hist == [2, 1, 1]
    assert c.draft_n == 9 and c.draft_n_accepted == 3
    assert c.tau() == pytest.approx((1 + 3 + 1 + 2) / 4)


@needs_zlab
def test_export_loads_in_zlab_and_its_greedy_output_is_the_targets(tmp_path):
    from dflash.model import DFlashDraftModel

    target = tiny_model("llama", seed=3)
    out, limits = export_zlab(_drafter_dir(tmp_path, target, seeded=True), tmp_path / "zlab")
    assert len(limits) == 2  # d2t and the seeding, left out and said
    drafter = load_zlab_drafter(out)
    assert isinstance(drafter, DFlashDraftModel)
    assert drafter.block_size == 4 and drafter.mask_token_id == VOCAB - 1
    assert list(drafter.target_layer_ids) == list(drafter.config.dflash_config["target_layer_ids"])

    tok = tiny_tokenizer()
    ids = tok.encode("t5 t9 t17 t3 t22 t41 t5 t9 t17 t3")
    prompt = BenchPrompt("p", "tiny", "", ids, max_tokens=24)
    want = target.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=0,
                           pad_token_id=0)[0, len(ids):].tolist()
    if 0 in want:
        want = want[:want.index(0)]
    plain = ZLabContender("zlab", target, {0}, tok.decode, drafter, drafting=False)
    spec = ZLabContender("zlab-dflash", target, {0}, tok.decode, drafter, drafting=True)
    g_plain, g_spec = plain.run(prompt, SamplingParams()), spec.run(prompt, SamplingParams())
    assert g_plain.token_ids == want and g_spec.token_ids == want
    assert g_plain.spec is None
    assert g_spec.spec.draft_n > 0 and g_spec.spec.steps >= 2
    # every token is counted once: the prefill's, then accepted drafts + bonus per step
    assert sum((k + 1) * n for k, n in enumerate(g_spec.spec.accepted_hist)) in (len(want), len(want) + 1)
