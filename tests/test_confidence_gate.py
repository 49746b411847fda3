"""The DFlash drafter's confidence gate (``--spec-draft-p-min``): blocks cut where the drafter
is unsure, output unchanged."""

from __future__ import annotations

import pytest
import torch

from flashdraft.drafters.dflash import DFlashDrafter, confident_prefix, random_dflash_model
from flashdraft.drafters.hybrid import HybridDrafter
from flashdraft.engine import drafter_controller
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from tiny import tiny_target

GREEDY = SamplingParams()


def test_confident_prefix():
    p = torch.tensor([0.9, 0.6, 0.2, 0.95])
    assert confident_prefix(p, 0.5) == 2
    assert confident_prefix(p, 0.1) == 4
    assert confident_prefix(p, 0.95) == 0
    assert confident_prefix(torch.empty(0), 0.5) == 0


def drafter(target, p_min):
    torch.manual_seed(0)
    model = random_dflash_model(target.model, num_layers=1, block_size=8)
    return DFlashDrafter(model, target.embed_tokens, target.lm_head, p_min=p_min)


def test_gated_block_is_the_confident_prefix_of_the_full_block():
    target = tiny_target("llama", seed=3)
    prompt = torch.tensor([5, 9, 3, 7] * 6)
    target.set_feature_layers(drafter(target, 0.0).feature_layer_ids)
    _, feats = target.forward(prompt[:-1], target.new_cache(prompt.shape[0] + 1), 0)
    # an untrained drafter is equally unsure at every position: spread its outputs so that
    # its confidence varies along the block (the same spread for every p_min)
    # (larger near the anchor: the drafter is surer of its first drafts, as a trained one is)
    scale = torch.linspace(8.0, 1.0, 7)[:, None]
    spread = torch.randn(7, target.hidden_size, generator=torch.Generator().manual_seed(1)) * scale

    def propose(p_min):
        d = drafter(target, p_min)
        d.model.register_forward_hook(lambda _m, _i, out: out + torch.cat([spread.new_zeros(1, spread.shape[1]),
                                                                          spread])[None])
        d.commit(prompt.shape[0] - 1, feats)
        return d.propose(prompt, 7, GREEDY, None).tokens.tolist()

    full = propose(0.0)
    assert len(full) == 7
    lengths = set()
    for p_min in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        gated = propose(p_min)
        assert gated == full[: len(gated)]  # a prefix: the gate cuts, never changes a draft
        lengths.add(len(gated))
    assert 0 in lengths and len(lengths - {0, 7}) >= 1  # some cut inside the block
    with pytest.raises(ValueError):
        drafter(target, 1.5)


@pytest.mark.parametrize("hybrid", [False, True], ids=["dflash", "hybrid"])
def test_gated_greedy_output_equals_plain_under_the_controller(hybrid):
    target = tiny_target("llama", seed=3)
    prompt = [5, 9, 3, 7] * 12
    base = generate_text(SpeculativeGenerator(target), prompt, 60, GREEDY, ignore_eos=True)[1]
    d = drafter(target, 0.05)
    d = HybridDrafter(d) if hybrid else d
    ctl = drafter_controller("profit", d, 7)
    _, ids, _, t = generate_text(SpeculativeGenerator(target, d, n_draft=7, controller=ctl), prompt, 60, GREEDY,
                                 ignore_eos=True)
    assert ids == base
    assert t.n_steps > 1


@pytest.mark.real
def test_gated_greedy_output_equals_plain_on_the_real_model():
    from flashdraft.engine import DEFAULT_DRAFTER_DIR, EngineConfig, load_drafter
    from flashdraft.prompts import SEED_PROMPTS
    from flashdraft.targets.torch import Target

    target = Target.load()
    ids = target.chat_prompt_ids([{"role": "user", "content": SEED_PROMPTS[2]}])
    base = generate_text(SpeculativeGenerator(target), ids, 48, GREEDY)[1]
    dflash = str(DEFAULT_DRAFTER_DIR) if (DEFAULT_DRAFTER_DIR / "config.json").exists() else "random"
    for spec in ("dflash", "hybrid"):
        d = load_drafter(EngineConfig(spec_type=spec, draft_model=dflash, p_min=0.5), target)
        ctl = drafter_controller("profit", d, 7)
        for controller in (None, ctl):
            out = generate_text(SpeculativeGenerator(target, d, n_draft=7, controller=controller), ids, 48, GREEDY)
            assert out[1] == base, (spec, controller)
            assert out[3].draft_n > 0
