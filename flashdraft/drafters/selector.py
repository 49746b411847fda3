"""DFlash2's additions to the drafter: dynamic causal convolutions and the candidate selector.

DFlash drafts every block position independently (one argmax per position), so two
neighbouring drafts need not fit together. DFlash2 (z-lab's successor of DFlash; in
llama.cpp as the ``dflash`` arch with ``selector_*`` keys) keeps the drafter's top-k
candidates per position and picks a path through them with a low-rank pairwise score:

    score(c | prev, h) = logit(c) + ((P[prev] * (W h)) . S[c])

where ``P``/``S`` are ``[V, r]`` predecessor/successor codebooks over the target's
vocabulary and ``W`` ``[r, H]`` projects the position's hidden state. The path is walked
left to right (greedy, or sampled at T > 0): position 1's predecessor is the anchor, each
later one's is the token chosen before it. The chosen path is verified as one linear block,
so nothing on the target's side changes.

Each decoder layer also wraps its attention and MLP inputs/outputs in a grouped *dynamic*
causal convolution along the block (a static kernel plus a per-token kernel projected from
the hidden state), which lets neighbouring positions mix before and after each sublayer.

Sources, read and not copied: z-lab's ``dflash`` 0.1.0 package (``dflash/model.py``:
``GroupedDynamicCausalConv``, ``CandidateSelector``) and llama.cpp's ``src/models/dflash.cpp``
(``build_dflash2_conv``, ``build_dflash2_selector``) and ``common/speculative.cpp`` (the greedy
lattice walk and its ``p_min`` gate on the selector's softmax). Weight names and shapes follow
both, so a drafter trained here loads there.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE = -100


class DynamicCausalConv(nn.Module):
    """Grouped dynamic causal convolution along the block axis.

    ``y[t] = sum_j (base[side, j] + dyn[t, side, j, g]) * x[t - j]`` for taps ``j < kernel``,
    per channel group ``g`` of ``group`` channels (``x[t - j] = 0`` before the block start).
    ``side`` 0 is applied before a sublayer with ``dyn`` projected from its input, side 1
    after it with the same token's second set of coefficients.

    Args:
        hidden: channels H (divisible by ``group``).
        kernel: taps.
        group: channels sharing one dynamic coefficient.
    Weights: ``base_kernel [2, kernel, H]``, ``kernel_projection.weight [2*kernel*H/group, H]``.
    Initialised to the identity (tap 0 = 1, the rest and the projection 0), so adding the
    convolutions to a trained DFlash drafter changes none of its outputs.

    Raises:
        ValueError: ``hidden`` is not a multiple of ``group``.
    """

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        if hidden % group:
            raise ValueError(f"conv_group_size {group} does not divide hidden size {hidden}")
        self.kernel, self.group, self.groups = kernel, group, hidden // group
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * self.groups, bias=False)
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token dynamic coefficients of ``x [N, L, H]``: ``[N, L, 2, kernel, groups]``."""
        return self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel, self.groups)

    def apply(self, x: torch.Tensor, dyn: torch.Tensor, side: int) -> torch.Tensor:
        """Convolve ``x [N, L, H]`` along L with side ``side``'s kernel and ``dyn`` from
        :meth:`coefficients`; returns ``[N, L, H]``."""
        N, L, H = x.shape
        xs = x.view(N, L, self.groups, self.group)
        out = torch.zeros_like(xs)
        for j in range(min(self.kernel, L)):  # taps past the block only read the zero padding
            shifted = xs if j == 0 else F.pad(xs[:, : L - j], (0, 0, 0, 0, j, 0))
            weight = self.base_kernel[side, j].view(1, 1, self.groups, self.group) + dyn[:, :, side, j, :, None]
            out = out + weight.to(x.dtype) * shifted
        return out.view(N, L, H)


class CandidateSelector(nn.Module):
    """Scores the drafter's top-k candidates per position given the previous token.

    Args:
        hidden: drafter hidden size H.
        vocab: the target's vocabulary size V (codebooks are indexed by target ids, also
            with a reduced draft vocabulary).
        rank: codebook rank r.
        top_k: candidates kept per position (1 = the plain DFlash argmax, exactly).
    Weights: ``predecessor_codebook``/``successor_codebook`` ``[V, r]`` (``nn.Embedding``),
    ``hidden_projection.weight [r, H]``. The successor codebook starts at zero, so a fresh
    selector picks the drafter's argmax until trained.
    """

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        if top_k < 1 or rank < 1:
            raise ValueError(f"selector_top_k and selector_rank must be >= 1, got {top_k}, {rank}")
        self.top_k, self.rank = top_k, rank
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        with torch.no_grad():
            nn.init.normal_(self.predecessor_codebook.weight, std=rank ** -0.5)
            self.successor_codebook.weight.zero_()
            nn.init.normal_(self.hidden_projection.weight, std=hidden ** -0.5)

    def candidates(self, logits: torch.Tensor, d2t: torch.Tensor | None):
        """Top-k of ``logits [..., V_d]``: ``(unary [..., k] float, draft indices [..., k],
        target ids [..., k])``, best first (ties: the lower index, as ``torch.argmax``)."""
        if self.top_k == 1:  # exactly the plain drafter's pick, ties included
            idx = logits.argmax(-1, keepdim=True)
            unary = logits.float().gather(-1, idx)
        else:
            unary, idx = torch.topk(logits.float(), self.top_k, dim=-1, sorted=True)
        return unary, idx, (idx if d2t is None else d2t[idx])

    def scores(self, prev_ids: torch.Tensor, hidden: torch.Tensor, unary: torch.Tensor,
               cand_ids: torch.Tensor) -> torch.Tensor:
        """Scores ``[N, k]`` of candidates ``cand_ids [N, k]`` (target ids) with unary
        ``[N, k]`` after ``prev_ids [N]`` at positions with hidden states ``hidden [N, H]``."""
        gate = self.predecessor_codebook(prev_ids) * self.hidden_projection(hidden)  # [N, r]
        pair = torch.einsum("nr,nkr->nk", gate.float(), self.successor_codebook(cand_ids).float())
        return unary + pair

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor,
             d2t: torch.Tensor | None, temperature: float = 0.0,
             generator: torch.Generator | None = None):
        """Choose one path through the candidates, left to right.

        Args:
            hidden: ``[N, n, H]`` drafter states of block positions 1..n.
            logits: ``[N, n, V_d]`` their logits (draft vocabulary).
            anchor_ids: ``[N]`` target id of each block's anchor (position 1's predecessor).
            d2t: draft index -> target id ``[V_d]``, or None.
            temperature: 0 = argmax of the scores; > 0 = a sample of softmax(scores / T).
        Returns:
            ``(idx [N, n] draft indices, q [N, n, k] or None, cand [N, n, k] draft indices,
            scores [N, n, k])``: q is the distribution each token was drawn from over the
            candidates (T > 0 only); scores are the chosen predecessor's rows (the gate reads
            their softmax).
        """
        unary, cand, cand_ids = self.candidates(logits, d2t)
        prev = anchor_ids
        picks, qs, rows = [], [], []
        for i in range(hidden.shape[1]):
            s = self.scores(prev, hidden[:, i], unary[:, i], cand_ids[:, i])  # [N, k]
            if temperature > 0:
                q = torch.softmax(s / temperature, dim=-1)
                j = torch.multinomial(q, 1, generator=generator)[:, 0]
                qs.append(q)
            else:
                j = torch.argmax(s, dim=-1)
            rows.append(s)
            picks.append(cand[:, i].gather(1, j[:, None])[:, 0])
            prev = cand_ids[:, i].gather(1, j[:, None])[:, 0]
        return (torch.stack(picks, 1), torch.stack(qs, 1) if qs else None, cand, torch.stack(rows, 1))

    def loss(self, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
             prev_ids: torch.Tensor, d2t: torch.Tensor | None):
        """Cross-entropy of the selector over each row's candidates (teacher forcing).

        The predecessor of every row is the *true* previous token: a draft is accepted only
        while every earlier draft was right, so the true prefix is the only one whose
        choice matters (the walk reads the chosen, i.e. true, token there).

        Args:
            hidden: ``[R, H]`` drafter states; logits ``[R, V_d]``; labels ``[R]`` target ids
                (``IGNORE`` = no label); prev_ids ``[R]`` target ids before each row; d2t as
                in :meth:`walk`.
        Returns:
            ``(loss_rows [R], in_top_k [R] bool, picked_right [R] bool)``: rows whose label
            is not among the candidates get loss 0 and ``in_top_k`` False.
        """
        unary, _, cand_ids = self.candidates(logits, d2t)
        s = self.scores(prev_ids.clamp(min=0), hidden, unary, cand_ids)  # [R, k]
        hit = (cand_ids == labels[:, None]) & (labels[:, None] >= 0)  # [R, k]
        inside = hit.any(-1)
        where = hit.float().argmax(-1)
        rows = F.cross_entropy(s, where, reduction="none") * inside
        return rows, inside, inside & (s.argmax(-1) == where)
