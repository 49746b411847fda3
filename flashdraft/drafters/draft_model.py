"""``--spec-type draft``: a classic autoregressive draft model (Leviathan et al. 2023).

The draft model must share the target's tokenizer (same vocabulary ids); it runs ``n``
single-token steps per draft and keeps its own KV cache, rolled back after every verify.
"""

from __future__ import annotations

import torch
from flashdraft.targets.torch import rollback_cache

from flashdraft.device import HOST
from flashdraft.drafters.base import Draft, Drafter
from flashdraft.sampling import SamplingParams, filtered_probs, sample


def pick_draft_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                     probs: list[torch.Tensor]) -> int:
    """One autoregressive draft token from logits ``[V]``: the argmax at T = 0; at T > 0 a
    sample from the filtered q, whose ``[V]`` row is appended to ``probs`` for verify
    (speculative sampling needs the distribution each draft was drawn from)."""
    if params.greedy:
        return int(torch.argmax(logits))
    q = filtered_probs(logits[None], params)
    probs.append(q[0])
    return int(sample(q, generator)[0])


class DraftModelDrafter(Drafter):
    """Autoregressive drafter around a transformers causal LM.

    Args:
        draft_model: a transformers ``*ForCausalLM`` with the target's vocabulary.
        vocab_size: the target's vocabulary size; raises ValueError when the draft
            model's is smaller (ids would not line up).
    """

    name = "draft"

    def __init__(self, draft_model, vocab_size: int):
        n = draft_model.get_output_embeddings().weight.shape[0]
        if n < vocab_size:
            raise ValueError(f"draft model vocabulary ({n}) is smaller than the target's ({vocab_size})")
        self.draft_model = draft_model.eval().requires_grad_(False)
        self.device = draft_model.get_input_embeddings().weight.device
        self.vocab_size = vocab_size
        self.reset()

    def reset(self) -> None:
        self.cache = rollback_cache(self.draft_model.config)

    def rewind(self, n_context: int) -> int:
        # the draft model catches up on missing positions from the token ids itself
        extra = self._cached() - n_context
        if extra > 0:
            self.cache.crop(-extra)
        return n_context

    def _cached(self) -> int:
        return self.cache.get_seq_length()

    def commit(self, n_context: int, features: torch.Tensor | None) -> None:
        # K/V beyond the committed context belong to rejected drafts: drop them
        extra = self._cached() - n_context
        if extra > 0:
            self.cache.crop(-extra)

    @torch.inference_mode()
    def _step(self, ids: torch.Tensor) -> torch.Tensor:
        start = self._cached()
        pos = torch.arange(start, start + ids.shape[0], device=self.device).unsqueeze(0)
        out = self.draft_model(input_ids=ids.to(self.device).unsqueeze(0), position_ids=pos,
                               past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1, : self.vocab_size].float()  # [V]

    def propose(self, tokens: torch.Tensor, n: int, params: SamplingParams,
                generator: torch.Generator, constraint=None) -> Draft:
        if n <= 0:
            return Draft.empty()
        # 1. catch up on committed tokens the draft model has not seen (incl. the anchor)
        logits = self._step(tokens[self._cached():])
        out, probs = [], []
        for k in range(n):
            # 2. pick the next draft token (sampled from q at T > 0, argmax at T = 0)
            tok = pick_draft_token(logits, params, generator, probs)
            out.append(tok)
            if k + 1 < n:
                logits = self._step(torch.tensor([tok], device=HOST))
        return Draft(torch.tensor(out, dtype=torch.long, device=HOST), torch.stack(probs) if probs else None)
