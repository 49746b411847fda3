"""The DFlash training objective on tiny models: masks, weights, and that it learns."""

from __future__ import annotations

import torch

from flashdraft.drafters.dflash import DFlashDraftModel, DFlashDrafter, drafter_config_for_target
from flashdraft.generate import SpeculativeGenerator, generate_text
from flashdraft.sampling import SamplingParams
from flashdraft.train.objective import (IGNORE, block_attention_mask, build_blocks, cosine_lr, dflash_loss,
                                        loss_weights, reached, sample_anchors)
from tiny import tiny_target


def test_mask_visibility():
    anchors = torch.tensor([3, 7])
    m = block_attention_mask(anchors, ctx_len=10, block_size=4)
    assert m.shape == (8, 18)
    for row in range(8):
        j = row // 4
        a = int(anchors[j])
        # context strictly before its own anchor, never its own future
        assert m[row, :a].all() and not m[row, a:10].any()
        # its own block fully (bidirectional), never another block
        own = torch.zeros(8, dtype=torch.bool)
        own[4 * j:4 * j + 4] = True
        assert torch.equal(m[row, 10:], own)


def test_blocks_and_labels():
    ids = torch.arange(100, 112)  # T = 12
    block_ids, pos, labels = build_blocks(ids, torch.tensor([2, 9]), 4, mask_token_id=7)
    assert block_ids.tolist() == [102, 7, 7, 7, 109, 7, 7, 7]
    assert pos.tolist() == [2, 3, 4, 5, 9, 10, 11, 12]
    assert labels.tolist() == [IGNORE, 103, 104, 105, IGNORE, 110, 111, IGNORE]


def test_anchors_inside_response():
    g = torch.Generator().manual_seed(0)
    a = sample_anchors(n_prompt=5, seq_len=12, n_blocks=100, generator=g)
    assert a.tolist() == list(range(5, 11))
    assert sample_anchors(5, 6, 4, g).numel() == 0


def test_loss_weights_and_schedule():
    w = loss_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0
    torch.testing.assert_close(w[7], torch.exp(torch.tensor(-1.0)))
    assert cosine_lr(0, 100, 1.0) < cosine_lr(3, 100, 1.0) == 1.0
    assert abs(cosine_lr(99, 100, 1.0)) < 1e-3


def _tiny_pair(block_size: int):
    """A 2-layer tiny target and a fresh 1-layer drafter reading both its layers."""
    target = tiny_target("llama", layers=2)
    cfg = drafter_config_for_target(target.config, num_layers=1, block_size=block_size, mask_token_id=0,
                                    target_layer_ids=[0, 1])
    drafter = DFlashDraftModel(cfg)
    target.set_feature_layers(drafter.target_layer_ids)
    return target, drafter


def test_training_drives_accuracy_up_on_a_synthetic_task():
    """A language of repeated tokens (each sequence repeats one random token): the drafter
    must learn to copy its anchor into every block position."""
    torch.manual_seed(0)
    target, drafter = _tiny_pair(block_size=4)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    emb, head = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()

    def batch():
        ids = torch.full((30,), int(torch.randint(1, 64, (1,), generator=g)))
        with torch.no_grad():
            _, feats = target.forward(ids, target.new_cache())
        return ids, feats.clone(), sample_anchors(4, 30, 8, g)  # out of inference mode

    accs = []
    for step in range(400):
        ids, feats, anchors = batch()
        loss, correct, counted = dflash_loss(drafter, feats, ids, anchors, emb, head, None, gamma=4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        accs.append(float(correct.sum() / counted.sum()))
    assert sum(accs[:20]) / 20 < 0.3
    assert sum(accs[-20:]) / 20 > 0.7
    # and the trained drafter drafts well inside the real loop (still lossless)
    gen = SpeculativeGenerator(target, DFlashDrafter(drafter, target.embed_tokens, target.lm_head), n_draft=3)
    prompt = [9] * 10
    out = generate_text(gen, prompt, 12, SamplingParams(), ignore_eos=True)
    base = generate_text(SpeculativeGenerator(target), prompt, 12, SamplingParams(), ignore_eos=True)
    assert out[1] == base[1]


def test_reached_positions_end_at_the_first_miss():
    right = torch.tensor([[False, True, True, False, True, True],
                          [True, False, True, True, True, True],
                          [False, True, True, True, True, True]])
    assert reached(right).tolist() == [[False, True, True, True, False, False],
                                       [False, True, False, False, False, False],
                                       [False, True, True, True, True, True]]


def test_griffin_mask_keeps_positions_up_to_the_first_miss():
    """``after_miss=False``: the loss is the weighted CE of the positions whose earlier block
    positions the drafter all got right (computed here row by row from its argmax)."""
    torch.manual_seed(1)
    target, drafter = _tiny_pair(block_size=5)
    ids = torch.tensor([3, 7, 7, 9, 12, 3, 7, 7, 9, 12, 3, 7, 7, 5, 2, 8])
    with torch.no_grad():
        _, feats = target.forward(ids, target.new_cache())
    feats = feats.clone()
    anchors = torch.tensor([2, 5, 9])
    emb, head = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    full, _, _ = dflash_loss(drafter, feats, ids, anchors, emb, head, None, gamma=4.0)
    masked, _, _ = dflash_loss(drafter, feats, ids, anchors, emb, head, None, gamma=4.0, after_miss=False)
    # reference: the same forward, rows weighted by hand
    with torch.no_grad():
        block_ids, positions, labels = build_blocks(ids, anchors, 5, 0)
        fused = drafter.fuse(feats[None])
        ctx = drafter.context_kv(fused, torch.arange(feats.shape[0])[None])
        x = torch.nn.functional.embedding(block_ids, emb).view(3, 5, -1)
        logits = (drafter.forward_blocks(x, anchors, ctx).reshape(15, -1) @ head.t()).float()
        ce = torch.nn.functional.cross_entropy(logits, labels.clamp(min=0), reduction="none")
        w_k = loss_weights(5, 4.0)
        num = den = 0.0
        kept = 0
        for j in range(3):
            ok = True
            for k in range(1, 5):
                r = j * 5 + k
                if ok:
                    num, den, kept = num + w_k[k - 1] * ce[r], den + w_k[k - 1], kept + 1
                ok = ok and int(logits[r].argmax()) == int(labels[r])
    assert 3 <= kept < 12  # some positions masked, not all
    assert torch.allclose(masked, num / den, atol=1e-5)
    assert not torch.allclose(masked, full)
