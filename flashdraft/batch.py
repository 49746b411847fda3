"""Parallel slots (``-np N``): several requests decode together, one target forward per step.

    each step:  every busy slot ─► Sequence.prepare()  (prefill input, or draft + [anchor, drafts])
                all inputs ─► Target.forward_packed (one pass: the weights are read once)
                every slot ─► Sequence.finish(logits, features) ─► its Step

On a memory-bound CPU a decode or verify step costs mostly the reading of the weights, so
packing the rows of N sequences into one forward makes N steps cost little more than one.
Each slot owns everything per-request: its :class:`~flashdraft.generate.Sequence` (cache,
sampling generator, stops, timings), a drafter fork (:meth:`Drafter.fork`: shared weights,
own context state) and its own copy of the depth controller (a slot's estimates persist
across the requests it serves). Drafting runs per slot; only the target forward is shared.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from flashdraft.adaptive import ProfitController
from flashdraft.drafters.base import Drafter
from flashdraft.generate import GenerationRequest, PromptCache, Sequence, SpeculativeGenerator, Step, common_prefix


@dataclass
class Slot:
    """One parallel slot.

    Attributes:
        index: 0-based slot id.
        drafter: this slot's drafter (per-request state of its own).
        controller: this slot's depth controller, or None (fixed depth).
        seq: the request being decoded, or None when the slot is free.
        owner: whatever the caller attaches to the request (the scheduler's ticket).
        delivered: whether any step of the current request has been handed out.
        prompt_cache: the caches the slot's last request left (its drafter holds the same
            context), for the next request's common prefix; None = start afresh.
    """

    index: int
    drafter: Drafter
    controller: ProfitController | None
    seq: Sequence | None = None
    owner: object = None
    delivered: bool = False
    prompt_cache: PromptCache | None = None

    @property
    def free(self) -> bool:
        return self.seq is None


def make_slots(generator: SpeculativeGenerator, n: int) -> list[Slot]:
    """``n`` free slots for ``generator``: each with a drafter fork and a controller copy.

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"need at least one slot, got {n}")
    generator.target.ensure_sequences(2 * n + 1)  # llama: a sequence and a prompt cache per slot
    return [Slot(i, generator.drafter.fork(), copy.deepcopy(generator.controller)) for i in range(n)]


#: a slot's cache counts as this prompt's when it holds at least this fraction of the prompt
#: (llama-server's ``--slot-prompt-similarity`` default): a chat template's first few tokens,
#: shared by every prompt, do not make a short side request take a long conversation's slot
SLOT_PROMPT_SIMILARITY = 0.1


def best_slot(free: list[Slot], prompt_ids: list[int], reuse: bool = True) -> Slot:
    """The free slot for a request: the one whose prompt cache shares the longest prefix with
    ``prompt_ids`` if that covers :data:`SLOT_PROMPT_SIMILARITY` of the prompt (llama-server's
    slot choice by similarity); otherwise (or with ``reuse`` False: no ``cache_prompt``) the
    one whose cache holds the fewest tokens, an empty one first, so a side request (an
    agent's title or summary call) never evicts the slot holding a long prefix while a
    cheaper one is free."""
    def held(slot: Slot) -> int:
        return 0 if slot.prompt_cache is None else len(slot.prompt_cache.tokens)

    if reuse:
        shared = {slot.index: common_prefix(slot.prompt_cache, prompt_ids) for slot in free}
        best = max(free, key=lambda slot: shared[slot.index])
        if shared[best.index] > 0 and shared[best.index] >= SLOT_PROMPT_SIMILARITY * len(prompt_ids):
            return best
    return min(free, key=held)


def start(generator: SpeculativeGenerator, slot: Slot, request: GenerationRequest,
          prefill_chunk: int | None = None) -> None:
    """Begin ``request`` in ``slot`` (its first steps are the prefill); with
    ``request.cache_prompt`` it starts from the slot's prompt cache (its common prefix is
    not prefilled). ``prefill_chunk``: most prompt tokens per step (None = the whole
    prompt in one): a long prompt is prefilled over several steps, each packed with the
    other slots' decode steps, which a whole-prompt prefill would stall for its duration
    (:attr:`~flashdraft.generate.Sequence.prefill_chunk`); the steps before the last
    return empty (:attr:`~flashdraft.generate.Sequence.prefilled` still False).

    Raises:
        ContextOverflowError / ValueError: as :class:`~flashdraft.generate.Sequence`; the slot stays free.
    """
    cached, slot.prompt_cache = slot.prompt_cache, None  # the new sequence owns (or drops) it
    if generator.prompt_store is not None:  # save what this request would overwrite; load a better match
        cached = generator.prompt_store.swap(cached, request.prompt_ids, generator.target, slot.drafter,
                                             reuse=request.cache_prompt)
    slot.seq = Sequence(generator, request, drafter=slot.drafter, controller=slot.controller, reuse=cached)
    slot.seq.prefill_chunk = prefill_chunk
    slot.delivered = False


@torch.inference_mode()
def step_together(target, seqs: list[Sequence]) -> list[Step | Exception]:
    """One step of every sequence in ``seqs`` (none of them done) with one packed target forward.

    Returns:
        per sequence, in order, its :class:`Step` or the exception its step raised. A
        failure in one sequence's own work (drafting, acceptance) touches only that one; a
        failure of the shared forward is reported to every sequence in it.
    """
    results: list[Step | Exception | None] = [None] * len(seqs)
    inputs, members = [], []
    for i, seq in enumerate(seqs):
        try:
            inputs.append(seq.prepare())
            members.append(i)
        except Exception as e:  # noqa: BLE001 - reported to that request only
            results[i] = e
    if inputs:
        try:
            outputs = target.forward_packed(inputs)
        except Exception as e:  # noqa: BLE001
            outputs = None
            for i in members:
                results[i] = e
        for i, out in zip(members, outputs or ()):
            try:
                results[i] = seqs[i].finish(*out)
            except Exception as e:  # noqa: BLE001
                results[i] = e
    return results
