"""``--spec-type draft`` with an :class:`~flashdraft.drafters.ar_model.ARDraftModel`: a trained
AR assistant drafter (``-md DIR``) or the target's own first layers (``-md self:N``).

A step drafts ``n`` tokens one after another (Leviathan et al. 2023, §2): ``n`` drafter
forwards of one token each, against DFlash's one forward for the whole block, so its cost
grows with the depth; the adaptive controller measures the step time at each depth and
keeps the depth that pays (:mod:`flashdraft.adaptive`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from flashdraft.device import HOST
from flashdraft.drafters.ar_model import ARDraftModel
from flashdraft.drafters.base import Draft, Drafter
from flashdraft.fast_forward import LeanForward, unsupported_reason
from flashdraft.drafters.draft_model import pick_draft_token
from flashdraft.sampling import SamplingParams


class ARDrafter(Drafter):
    """Drafts with an AR drafter, keeping its KV cache across steps and rolling it back.

    Args:
        model: the drafter network.
        embed_weight: ``[V, H]`` the target's token embeddings (the drafter stores none).
        vocab_size: the target's vocabulary ``V``; draft tokens outside the draft vocabulary
            get probability 0.
        lean: run the layers with :class:`~flashdraft.fast_forward.LeanForward` where it
            supports the architecture (else transformers' forward, as with ``lean=False``).
    Raises:
        ValueError: the drafter's vocabulary or hidden size differs from the target's.

    With features (EAGLE-1), position ``p`` of the cache is trusted only when it was computed
    from the target's state at ``p-1``: drafted positions (fed the drafter's own state) are
    dropped at the next commit even when their tokens were accepted.
    """

    name = "draft"

    def __init__(self, model: ARDraftModel, embed_weight: torch.Tensor, vocab_size: int, lean: bool = True):
        want_v, want_h = int(model.config["vocab_size"]), int(model.config["hidden_size"])
        if want_v != vocab_size or want_h != embed_weight.shape[1]:
            raise ValueError(f"AR drafter made for vocabulary {want_v} / hidden {want_h}, the target has "
                             f"{vocab_size} / {embed_weight.shape[1]}")
        self.model = model.eval().requires_grad_(False)
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.embed_weight = embed_weight
        self.vocab_size = vocab_size
        self.feature_layer_ids = model.feature_layer_ids
        self.d2t = None if model.d2t is None else model.d2t.to(self.device)
        # 1-token steps through transformers spend most of their time in per-call setup; the
        # target's lean forward (flashdraft.fast_forward) runs the same layers without it
        proxy = _LeanView(model, embed_weight)
        self.lean = LeanForward(proxy) if lean and unsupported_reason(proxy) is None else None
        self.reset()

    def reset(self) -> None:
        if self.lean is not None:
            self.cache = self.lean.new_cache(256)
        else:
            self.cache = DynamicCache(config=self.model.lcfg)
        self.trusted = 0  # cache positions computed from committed tokens (and target states)
        self.states = torch.zeros(0, self.embed_weight.shape[1], dtype=self.dtype, device=self.device)

    def _cached(self) -> int:
        return self.cache.length if self.lean is not None else self.cache.get_seq_length()

    def _crop(self, n: int) -> None:
        extra = self._cached() - n
        if extra > 0:
            if self.lean is not None:
                self.cache.length = n  # K/V are written by position: a rollback is a length move
            else:
                self.cache.crop(-extra)
        self.trusted = min(self.trusted, n)

    def save_context(self) -> object:
        # its states come from the target's features of each position: not kept off the slot
        raise NotImplementedError("the AR drafter's context is not saved to the prompt store")

    def rewind(self, n_context: int) -> int:
        self._crop(n_context)
        self.states = self.states[:n_context]
        return n_context

    def commit(self, n_context: int, features: torch.Tensor | None) -> None:
        if self.model.use_features and features is not None:
            m = features.shape[0]
            g = ARDraftModel.state(features.to(device=self.device, dtype=self.dtype))
            self.states = torch.cat([self.states[: n_context - m], g])
        # features off: accepted drafts' K/V are right (they were computed from these tokens);
        # features on: only positions computed from the target's states are
        self._crop(n_context if not self.model.use_features else min(n_context, self.trusted))

    def _run(self, ids: torch.Tensor, prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``ids [t]`` at the next cache positions: the last row's draft-vocabulary logits
        ``[V_d]`` and pre-norm hidden state ``[H]``."""
        ids = ids.to(self.device)
        x = F.embedding(ids, self.embed_weight).to(self.dtype)  # [t, H]
        if self.model.use_features:
            x = self.model.inputs(x, prev)
        if self.lean is not None:
            last = [self.model.num_layers - 1]
            logits, hidden = self.lean.forward(ids, self.cache, ids.shape[0] - 1, last, inputs_embeds=x)
            return logits[-1], hidden[-1]
        start = self._cached()
        pos = torch.arange(start, start + ids.shape[0], device=self.device)[None]
        out = self.model.body(inputs_embeds=x[None], position_ids=pos, past_key_values=self.cache, use_cache=True)
        hidden = out.last_hidden_state[0, -1]
        return self.model.logits(hidden).float(), hidden

    def _full_logits(self, z: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[V_d]`` -> the target vocabulary ``[V]`` (-inf outside)."""
        z = z.float()
        if self.d2t is None:
            return z[: self.vocab_size]
        full = torch.full((self.vocab_size,), float("-inf"), device=self.device)
        return full.index_copy_(0, self.d2t, z)

    @torch.inference_mode()
    def propose(self, tokens: torch.Tensor, n: int, params: SamplingParams,
                generator: torch.Generator, constraint=None) -> Draft:
        if n <= 0:
            return Draft.empty()
        L = tokens.shape[0]
        # 1. catch up on committed tokens the drafter has not run (the anchor included)
        start = self._cached()
        prev = None
        if self.model.use_features:  # position p reads the target's state at p-1 (0 before the start)
            H = self.embed_weight.shape[1]
            lead = torch.zeros(1 if start == 0 else 0, H, dtype=self.dtype, device=self.device)
            prev = torch.cat([lead, self.states[max(0, start - 1): L - 1]])
            if prev.shape[0] != L - start:
                raise RuntimeError(f"AR drafter: target states for {self.states.shape[0]} positions, need {L - 1}")
        z, hidden = self._run(tokens[start:], prev)
        self.trusted = L
        out, probs = [], []
        for k in range(n):
            # 2. the next draft token: argmax at T = 0, sampled from q (kept for verify) at T > 0
            tok = pick_draft_token(self._full_logits(z), params, generator, probs)
            out.append(tok)
            if k + 1 < n:  # 3. run it; with features, its own state stands in for the target's
                state = ARDraftModel.state(hidden)[None] if self.model.use_features else None
                z, hidden = self._run(torch.tensor([tok]), state)
        return Draft(torch.tensor(out, dtype=torch.long, device=HOST), torch.stack(probs) if probs else None)


class _LeanView(torch.nn.Module):
    """What :class:`~flashdraft.fast_forward.LeanForward` reads from a causal LM, over an AR
    drafter: its layers, rotary table and final norm, the target's embeddings and the
    drafter's (draft-vocabulary) head. Shares every weight; copies nothing."""

    def __init__(self, model: ARDraftModel, embed_weight: torch.Tensor):
        super().__init__()
        self.config = model.lcfg
        self._decoder = _Decoder(model)
        self._embed = torch.nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self._head = model.lm_head

    def get_decoder(self):
        return self._decoder

    def get_input_embeddings(self):
        return self._embed

    def get_output_embeddings(self):
        return self._head


class _Decoder(torch.nn.Module):
    def __init__(self, model: ARDraftModel):
        super().__init__()
        self.layers, self.norm, self.rotary_emb = model.body.layers, model.norm, model.body.rotary_emb
