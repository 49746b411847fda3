"""Reshaping a warm-start drafter keeps what it computes (tiny random models)."""

from __future__ import annotations

import pytest
import torch

from flashdraft.drafters.dflash import DFlashDraftModel, drafter_config_for_target
from flashdraft.train.objective import build_blocks
from flashdraft.train.warm_start import adapt_drafter
from tiny import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=5, layers=4)


def _drafter(target, layer_ids):
    torch.manual_seed(0)
    model = DFlashDraftModel(drafter_config_for_target(target.model.config, 1, 8, 63, layer_ids))
    with torch.no_grad():  # a trained-looking drafter: no zero weights anywhere
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.eval()


def _blocks(model, target, feats_by_layer, ids, anchors, block):
    feats = torch.cat([feats_by_layer[i] for i in model.target_layer_ids], -1)
    T = feats.shape[0]
    block_ids, _, _ = build_blocks(ids, anchors, block, 63)
    ctx = model.context_kv(model.fuse(feats[None]), torch.arange(T)[None])
    x = target.embed_tokens.weight[block_ids].detach().view(anchors.numel(), block, -1)
    return model.forward_blocks(x, anchors, ctx)


def test_more_layers_and_feature_layers_start_as_the_same_function(target):
    old = _drafter(target, [1, 3])
    new = adapt_drafter(old, target.model, num_layers=2, feature_layer_ids=[0, 1, 3], block_size=4)
    assert len(new.layers) == 2 and new.target_layer_ids == [0, 1, 3] and new.block_size == 4
    assert new.config["num_hidden_layers"] == 2 and new.config["block_size"] == 4
    T, H = 30, target.hidden_size
    torch.manual_seed(1)
    feats = {i: torch.randn(T, H) for i in range(4)}
    ids, anchors = torch.randint(1, 60, (T + 1,)), torch.tensor([0, 5, 11, 20])
    with torch.no_grad():
        want = _blocks(old, target, feats, ids, anchors, 4)
        got = _blocks(new, target, feats, ids, anchors, 4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the new layer is not a dead copy: its other weights came from the target
    src = target.model.get_decoder().layers[3].self_attn.q_proj.weight
    torch.testing.assert_close(new.layers[1].self_attn.q_proj.weight, src)


def test_new_parts_receive_gradient(target):
    new = adapt_drafter(_drafter(target, [1, 3]), target.model, num_layers=2, feature_layer_ids=[1, 2, 3])
    T, H = 20, target.hidden_size
    feats = {i: torch.randn(T, H) for i in range(4)}
    out = _blocks(new, target, feats, torch.randint(1, 60, (T + 1,)), torch.tensor([0, 7]), 8)
    out.square().sum().backward()
    assert new.layers[1].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert new.fc.weight.grad[:, H:2 * H].abs().sum() > 0  # the added layer 2's columns


def test_draft_vocabulary_is_replaced_and_layers_cannot_shrink(target):
    old = _drafter(target, [1, 3])
    old.set_draft_vocab(torch.arange(10))
    assert adapt_drafter(old, target.model).d2t.tolist() == list(range(10))
    assert adapt_drafter(old, target.model, d2t=None).d2t is None
    two = adapt_drafter(old, target.model, num_layers=2)
    with pytest.raises(ValueError, match="cannot remove layers"):
        adapt_drafter(two, target.model, num_layers=1)
