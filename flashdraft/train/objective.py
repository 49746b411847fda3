"""The DFlash training objective (arXiv 2602.06036 §4.2 and App. A.1).

One target forward per sequence gives the context features. Many blocks of one sequence
share one drafter forward: block j starts at a random *anchor* ``a_j`` inside the response
(clean anchor token + ``B-1`` mask tokens); it sees the context strictly before its
anchor and itself bidirectionally, never another block. Position k of a block predicts
token ``a_j + k`` with cross-entropy weighted ``exp(-(k-1)/gamma)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flashdraft.drafters.dflash import DFlashDraftModel, seed_block

IGNORE = -100


def default_gamma(block_size: int) -> float:
    """Loss decay of the paper: 7 for B=16, 5 for B=10, 4 for B=8 (interpolated otherwise)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, 0.45 * block_size))


def loss_weights(block_size: int, gamma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[B-1]`` weights ``w_k = exp(-(k-1)/gamma)`` for block positions k = 1..B-1, on ``device``."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(n_prompt: int, seq_len: int, n_blocks: int, generator: torch.Generator) -> torch.Tensor:
    """Random distinct anchors among response positions, sorted.

    An anchor at position a needs a label at a+1, so anchors lie in ``[n_prompt, seq_len-2]``
    (the first response token is the first anchor at inference: it is the first bonus token).
    Returns ``[K]`` int64 with ``K = min(n_blocks, available)`` (0 when the response is too short).
    """
    lo, hi = n_prompt, seq_len - 2
    if hi < lo:
        return torch.empty(0, dtype=torch.long)
    count = hi - lo + 1
    pick = torch.randperm(count, generator=generator)[: min(n_blocks, count)]
    return (lo + pick).sort().values


def build_blocks(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int,
                 ngram_seeded: bool = False):
    """Inputs, positions and labels of the blocks at ``anchors``.

    Args:
        ids: ``[T]`` token ids of prompt + response.
        anchors: ``[K]`` anchor positions (increasing), on ``ids``' device.
        ngram_seeded: fill each block's mask positions with the prompt-lookup continuation
            of its anchor from the sequence's own prefix (tokens up to the anchor only), as
            an n-gram-seeded drafter sees at inference.
    Returns:
        ``(block_ids [K*B], positions [K*B], labels [K*B])``; labels are ``IGNORE`` at each
        block's anchor position and past the end of the sequence.
    """
    B, T = block_size, ids.shape[0]
    positions = (anchors[:, None] + torch.arange(B, device=ids.device)[None]).reshape(-1)  # [K*B]
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[::B] = ids[anchors]
    if ngram_seeded:
        from flashdraft.drafters.ngram import lookup_candidates

        blocks = block_ids.view(-1, B)
        for j, cand in enumerate(lookup_candidates(ids.tolist(), anchors.tolist(), B - 1)):
            seed_block(blocks[j], cand)
    labels = torch.where(positions < T, ids[positions.clamp(max=T - 1)], torch.full_like(positions, IGNORE))
    labels[::B] = IGNORE
    return block_ids, positions, labels


def block_attention_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Visibility of the packed blocks: ``[K*B, ctx_len + K*B]`` bool, True = may attend.

    Query rows of block j see context columns ``p < a_j`` and the B columns of block j.
    """
    K, B, dev = anchors.shape[0], block_size, anchors.device
    block_of_row = torch.arange(K * B, device=dev) // B  # [K*B]
    ctx = torch.arange(ctx_len, device=dev)[None, :] < anchors[block_of_row][:, None]  # [K*B, T]
    own = block_of_row[:, None] == block_of_row[None, :]  # [K*B, K*B]
    return torch.cat([ctx, own], dim=1)


def reached(right: torch.Tensor) -> torch.Tensor:
    """Which block positions decoding can reach: ``right [K, B]`` bool (position 0 = the
    anchor, ignored) -> ``[K, B]`` bool, True at positions 1..B-1 while every earlier draft
    position of the block is right (position 1 always)."""
    K, dev = right.shape[0], right.device
    ones = torch.ones(K, 1, dtype=torch.bool, device=dev)
    reach = torch.cat([ones, right[:, 1:-1].int().cumprod(1).bool()], 1)  # positions 1..B-1
    return torch.cat([~ones, reach], 1)


def dflash_loss(drafter: DFlashDraftModel, features: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor,
                embed_weight: torch.Tensor, head_weight: torch.Tensor, t2d: torch.Tensor | None,
                gamma: float, soft: tuple[torch.Tensor, torch.Tensor] | None = None,
                soft_weight: float = 0.0, after_miss: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted block loss for one sequence: hard cross-entropy, soft-label KL, or a mix.

    Args:
        features: ``[T', k*H]`` target context features (layers ``target_layer_ids``) for
            positions ``0..T'-1``, ``T' >= max(anchors)``.
        ids: ``[T]`` token ids.
        anchors: ``[K]`` anchors (see :func:`sample_anchors`).
        embed_weight: ``[V, H]`` the target's (frozen) embedding table.
        head_weight: ``[V_d, H]`` rows of the target's (frozen) LM head: all of it, or the
            reduced draft vocabulary.
        t2d: ``[V]`` target id -> draft index (-1 outside the draft vocabulary), or None.
        gamma: loss decay.
        soft: the target's own next-token distributions ``(top_ids [T', k] target ids,
            top_logp [T', k])``: row t is the distribution of token t+1 (NVIDIA
            Model-Optimizer's default DFlash objective distils these logits; top-k
            renormalised over the ids inside the draft vocabulary).
        soft_weight: share of the soft-label term (0 = hard labels only, 1 = soft only).
        after_miss: train the positions after a block's first miss too (the DFlash paper's
            loss). False = GRIFFIN-style masking (Hu et al. 2025, "GRIFFIN", §3.2): a position
            counts only while the drafter's argmax is right at every position before it, the
            only positions decoding can reach.
    Returns:
        ``(loss, correct [B-1], counted [B-1])``: the scalar loss and, per block position,
        how many labels the drafter's argmax (a DFlash2 drafter: its selector, given the true
        previous token) got right out of how many there were.

    A DFlash2 drafter (``drafter.candidate_selector``) adds the selector's cross-entropy over
    each row's top-k candidates (:meth:`CandidateSelector.loss`; rows whose label is not a
    candidate add 0), weighted as the drafter's rows.

    All K blocks go through one :meth:`DFlashDraftModel.forward_blocks` (each sees only the
    context before its anchor and itself). Every tensor argument must be on the drafter's
    device; the results are made there too.
    """
    B = drafter.block_size
    K = anchors.shape[0]
    block_ids, positions, labels = build_blocks(ids, anchors, B, drafter.mask_token_id, drafter.ngram_seeded)
    T = features.shape[0]
    # 1. context K/V from fused features at their own positions (once for all blocks)
    fused = drafter.fuse(features[None])  # [1, T', H]
    dev = features.device
    ctx_kv = drafter.context_kv(fused, torch.arange(T, device=dev)[None])
    # 2. every block in one forward
    x = F.embedding(block_ids, embed_weight).view(K, B, -1)
    hidden = drafter.forward_blocks(x, anchors, ctx_kv).reshape(K * B, -1)  # [K*B, H]
    logits = hidden @ head_weight.t()  # [K*B, V_d]
    # 3. labels in draft-vocabulary indices; tokens outside it cannot be predicted
    target = labels if t2d is None else torch.where(labels >= 0, t2d[labels.clamp(min=0)], labels)
    target = torch.where(target < 0, torch.full_like(target, IGNORE), target)
    logp = torch.log_softmax(logits.float(), dim=-1)
    k = torch.arange(block_ids.shape[0], device=dev) % B  # block position of every row
    valid_row = (labels != IGNORE)
    loss_rows = torch.zeros(K * B, device=dev)
    if soft_weight < 1.0:
        ce = F.nll_loss(logp, target, ignore_index=IGNORE, reduction="none")  # [K*B]
        loss_rows = loss_rows + (1.0 - soft_weight) * ce
    if soft is not None and soft_weight > 0.0:
        top_ids, top_logp = soft
        src = (positions - 1).clamp(0, T - 1)  # row p-1 holds the distribution of token p
        rows_ids, rows_lp = top_ids[src].long(), top_logp[src].float()  # [K*B, k]
        d_ids = rows_ids if t2d is None else t2d[rows_ids]
        keep = d_ids >= 0
        p = torch.where(keep, rows_lp.exp(), torch.zeros_like(rows_lp))
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
        soft_ce = -(p * logp.gather(1, d_ids.clamp(min=0))).sum(-1)  # [K*B]
        loss_rows = loss_rows + soft_weight * soft_ce * valid_row
    w = torch.cat([torch.zeros(1, device=dev), loss_weights(B, gamma, dev)])[k] * valid_row
    if soft_weight < 1.0:
        w = w * ((target != IGNORE) | (soft is not None and soft_weight > 0))
    picked = logits.argmax(-1)
    if not after_miss:
        with torch.no_grad():
            w = w * reached(((picked == target) | ~valid_row).view(K, B)).view(-1)
    if drafter.candidate_selector is not None:
        # DFlash2: the selector's cross-entropy over each row's top-k, predecessor = the true
        # previous token (the anchor at block position 1), on the same position weights
        prev = ids[(positions - 1).clamp(0, ids.shape[0] - 1)]
        sel_rows, _, sel_right = drafter.candidate_selector.loss(hidden, logits, labels, prev, drafter.d2t)
        loss_rows = loss_rows + sel_rows
        # what the path walk would pick on the true prefix: the selector's choice where the
        # label is a candidate, else (a miss either way) the argmax
        picked = torch.where(sel_right, target, torch.where(picked == target, -1, picked))
    loss = (loss_rows * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        hit = (picked == target) & valid_row
        correct = torch.zeros(B, device=dev).index_add_(0, k, hit.float())[1:]
        counted = torch.zeros(B, device=dev).index_add_(0, k, valid_row.float())[1:]
    return loss, correct, counted


def cosine_lr(step: int, total: int, peak: float, warmup_frac: float = 0.04) -> float:
    """Linear warmup for ``warmup_frac`` of ``total`` steps, then cosine decay to 0."""
    warm = max(1, int(total * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
