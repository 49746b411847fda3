"""Offline acceptance: walk regenerated answers the way decoding visits them.

At T=0 the target's answer to a prompt is fixed, so a drafter's acceptance can be
measured without running the target step by step: regenerate the answer once, take one
target forward for its context features, then *walk* it as the speculative loop would
(DESIGN.md §8): the drafter proposes from the anchor, the leading drafts equal to the
answer are accepted, the next answer token is the bonus token, and the walk jumps past
them to the next anchor. Every counter mirrors :class:`flashdraft.generate.Sequence` and
:func:`flashdraft.train.evaluate._run_one` (same ``room`` rule near ``max_tokens``, same
EOS handling, same histogram), so at T=0 the walk gives the online τ exactly (tested).

A DFlash drafter's proposal at anchor ``a`` depends only on the context before ``a`` and
the anchor token, so the proposals at *every* anchor of an answer come from a few batched
drafter forwards (:meth:`DFlashDraftModel.forward_blocks`) and the walk itself is index
look-ups: minutes for hundreds of answers on a CPU.

At T>0 the walk follows a *sampled* answer and counts a draft as accepted when it equals
the sampled token (the reference implementation's rule for an argmax drafter); true
speculative sampling accepts at least as often, so this is a lower bound.

Reference drafters walked the same way: prompt lookup (:class:`NgramDrafter`) and a
bigram table (each token's most frequent successor in the training answers, chained).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from flashdraft.generate import Timings
from flashdraft.train.shards import read_shards
from flashdraft.train.stats import AcceptanceStats

log = logging.getLogger(__name__)

#: ``propose(i, room) -> draft token ids`` for the anchor at answer index ``i``
Proposer = Callable[[int, int], Sequence[int]]


def walk_answer(response: Sequence[int], propose: Proposer, n_draft: int, max_tokens: int,
                eos: set[int], stats: AcceptanceStats) -> None:
    """Walk one answer; add its verify steps to ``stats`` (the counters of ``flashdraft eval``).

    Args:
        response: the target's answer token ids (ending with EOS if it stopped there);
            ``response[0]`` is the prefill's token, the first anchor.
        propose: the drafter under test (see :data:`Proposer`).
        n_draft: draft tokens per step (block size - 1).
        max_tokens: the generation limit the answer was made with.
        eos: token ids that end generation.
    """
    t = Timings(n_steps=1)  # the prefill's step
    finish = None
    if response[0] in eos:
        finish = "stop"
    else:
        t.predicted_n = 1
        if t.predicted_n >= max_tokens:
            finish = "length"
    i = 0  # index of the anchor in ``response``
    while finish is None:
        # 1. draft: never past max_tokens (the bonus token adds one)
        room = min(n_draft, max_tokens - t.predicted_n - 1)
        drafts = list(propose(i, room))[:room] if room > 0 else []
        n = len(drafts)
        # 2. verify: the leading drafts equal to the answer, then the bonus token
        n_acc = 0
        while n_acc < n and i + 1 + n_acc < len(response) and drafts[n_acc] == response[i + 1 + n_acc]:
            n_acc += 1
        if i + 1 + n_acc >= len(response) and not (n_acc and drafts[n_acc - 1] in eos):
            raise ValueError(f"answer of {len(response)} tokens ended without EOS before max_tokens={max_tokens}")
        new = drafts[:n_acc] + ([response[i + 1 + n_acc]] if i + 1 + n_acc < len(response) else [])
        # 3. stops: count only what would be returned
        kept = []
        produced = 0  # Timings.verify_n's rule: through the token that ended the answer, EOS included
        for tok in new:
            produced += 1
            if tok in eos:
                finish = "stop"
                break
            kept.append(tok)
            t.predicted_n += 1
            if t.predicted_n >= max_tokens:
                finish = "length"
                break
        t.count_step(produced)
        if n:
            t.count_draft(n, min(n_acc, produced))
        i += n_acc + 1
    stats.add(t, finish)


# ------------------------------------------------------------------------- proposers


class DFlashProposals:
    """A DFlash drafter's greedy proposals at every anchor of one answer, precomputed.

    Args:
        model: the drafter network (its dtype is used throughout).
        embed_weight: ``[V, H]`` target embedding table.
        head_weight: ``[V_d, H]`` LM-head rows of the draft vocabulary (all rows if none).
        d2t: ``[V_d]`` draft index -> target id, or None.
        features: ``[T', k*H]`` the target's context features for positions ``0..T'-1``
            (at least every position before the last anchor).
        ids: ``[T]`` prompt + answer token ids.
        n_prompt: prompt length: the first anchor is position ``n_prompt``.
        chunk: anchors per batched forward.
    Calling ``(i, room)`` gives the ``room`` drafts for the anchor at answer index ``i``:
    from the table when ``room`` is the full block, else from one shorter block (the block
    length changes the bidirectional attention, as it does online).
    """

    @torch.inference_mode()
    def __init__(self, model, embed_weight: torch.Tensor, head_weight: torch.Tensor, d2t: torch.Tensor | None,
                 features: torch.Tensor, ids: torch.Tensor, n_prompt: int, chunk: int = 64):
        self.model, self.embed_weight, self.head_weight, self.d2t = model, embed_weight, head_weight, d2t
        self.device = dev = model.fc.weight.device  # the drafts are computed there, tabled on the host
        self.ids, self.n_prompt = ids.to(dev), n_prompt
        dtype = model.fc.weight.dtype
        T = features.shape[0]
        fused = model.fuse(features.to(device=dev, dtype=dtype)[None])  # [1, T', H]
        self.ctx = model.context_kv(fused, torch.arange(T, device=dev)[None])
        B = model.block_size
        anchors = torch.arange(n_prompt, min(ids.shape[0], T + 1), device=dev)  # context < anchor must exist
        self.candidates = None
        if model.ngram_seeded:  # every anchor's prompt-lookup continuation, from its own prefix
            from flashdraft.drafters.ngram import lookup_candidates

            self.candidates = lookup_candidates(ids.tolist(), anchors.tolist(), B - 1)
        rows = []
        for c in range(0, anchors.shape[0], chunk):
            rows.append(self._draft(anchors[c:c + chunk], B))
        self.table = (torch.cat(rows) if rows else torch.empty(0, B - 1, dtype=torch.long)).cpu()  # [n_anchors, B-1]

    def _draft(self, anchors: torch.Tensor, length: int) -> torch.Tensor:
        """Greedy drafts ``[K, length-1]`` (target ids) of blocks of ``length`` rows (a DFlash2
        drafter's: the selector's path, :meth:`DFlashDraftModel.pick`)."""
        block = torch.full((anchors.shape[0], length), self.model.mask_token_id, dtype=torch.long, device=self.device)
        block[:, 0] = self.ids[anchors]
        if self.candidates is not None:
            from flashdraft.drafters.dflash import seed_block

            for j, a in enumerate(anchors.tolist()):
                seed_block(block[j], self.candidates[a - self.n_prompt])
        x = F.embedding(block, self.embed_weight).to(self.model.fc.weight.dtype)  # [K, length, H]
        hidden = self.model.forward_blocks(x, anchors, self.ctx)[:, 1:]  # [K, length-1, H]
        logits = hidden.to(self.head_weight.dtype) @ self.head_weight.t()
        idx = self.model.pick(hidden, logits, self.ids[anchors])  # argmax, or DFlash2's path
        return idx if self.d2t is None else self.d2t[idx]

    @torch.inference_mode()
    def __call__(self, i: int, room: int) -> list[int]:
        if room >= self.table.shape[1]:
            return self.table[i].tolist()
        return self._draft(torch.tensor([self.n_prompt + i], device=self.device), room + 1)[0].tolist()


class DrafterProposals:
    """Any feature-free :class:`~flashdraft.drafters.base.Drafter` (prompt lookup, a draft
    model) asked at each anchor with the tokens up to it, after a ``commit`` that rolls
    its own state back to the anchor, as the loop would."""

    def __init__(self, drafter, ids: torch.Tensor, n_prompt: int):
        from flashdraft.sampling import SamplingParams

        self.drafter, self.ids, self.n_prompt = drafter, ids, n_prompt
        self.params, self.gen = SamplingParams(), torch.Generator().manual_seed(0)
        drafter.reset()
        drafter.commit(n_prompt, None)

    def __call__(self, i: int, room: int) -> list[int]:
        a = self.n_prompt + i
        self.drafter.commit(a, None)
        return self.drafter.propose(self.ids[:a + 1], room, self.params, self.gen).tokens.tolist()


def ar_proposer(drafter, target):
    """``proposer_for(ids, n_prompt, features)`` for :func:`~flashdraft.train.walk.walk_dataset`:
    the AR drafter asked at every anchor after a commit of the context before it, as the online
    loop does (with features: the target's states of that context)."""
    from flashdraft.sampling import SamplingParams

    params, gen = SamplingParams(), torch.Generator().manual_seed(0)

    def proposer_for(ids, n_prompt, feats):
        if drafter.feature_layer_ids and feats is None:
            feats = target_features(target, ids, drafter.feature_layer_ids)
        drafter.reset()

        def propose(i: int, room: int) -> list[int]:
            a = n_prompt + i
            drafter.commit(a, None if feats is None else feats[:a])
            return drafter.propose(ids[:a + 1], room, params, gen).tokens.tolist()

        return propose

    return proposer_for


class SuffixHistory:
    """Suffix-drafter proposals (:class:`~flashdraft.drafters.suffix.SuffixDrafter`) for answers
    walked in order, as one client's requests: each answer's tree is its own prompt and
    answer so far, plus (with ``past_answers``) the answers walked before it, kept as the
    server keeps finished answers.

    Args:
        past_answers: answers kept (``--spec-suffix-cache``); 0 = the request alone.
    Calling ``(ids, n_prompt, features)`` gives that answer's :data:`Proposer`; the previous
    answer is kept first (it is finished once the next one starts).
    """

    def __init__(self, past_answers: int):
        from flashdraft.drafters.suffix import SuffixStore

        self.store = SuffixStore(past_answers)
        self._last: list[int] | None = None

    def __call__(self, ids: torch.Tensor, n_prompt: int, _features=None) -> Proposer:
        from flashdraft.drafters.suffix import SuffixDrafter

        if self._last is not None:
            self.store.add(None, self._last)
        self._last = ids[n_prompt:].tolist()
        return DrafterProposals(SuffixDrafter(self.store), ids, n_prompt)


class BigramTable:
    """Each token's most frequent successor in a set of answers; drafts chain it.

    Args:
        sequences: ``(ids [T], n_prompt)`` pairs; successors are counted over answer tokens.
        vocab_size: target vocabulary size.
    """

    def __init__(self, sequences, vocab_size: int):
        pairs = []
        for ids, n_prompt in sequences:
            r = np.asarray(ids[n_prompt:], dtype=np.int64)
            if r.size > 1:
                pairs.append(r[:-1] * vocab_size + r[1:])
        self.successor = np.full(vocab_size, -1, dtype=np.int64)
        if pairs:
            keys, counts = np.unique(np.concatenate(pairs), return_counts=True)
            order = np.lexsort((-counts, keys // vocab_size))  # per prev token, most frequent first
            keys = keys[order]
            prev = keys // vocab_size
            first = np.ones(prev.shape[0], dtype=bool)
            first[1:] = prev[1:] != prev[:-1]
            self.successor[prev[first]] = keys[first] % vocab_size

    def proposer(self, ids: torch.Tensor, n_prompt: int) -> Proposer:
        def propose(i: int, room: int) -> list[int]:
            out, tok = [], int(ids[n_prompt + i])
            for _ in range(room):
                tok = int(self.successor[tok])
                if tok < 0:
                    break
                out.append(tok)
            return out
        return propose


# ------------------------------------------------------------------------- answers


def heldout_answers_dir(root: str | Path, target_name: str, dataset: str, temperature: float) -> Path:
    """Where the held-out answers of ``dataset`` at ``temperature`` live."""
    return Path(root) / target_name / f"{dataset}-t{temperature:g}"


def ensure_heldout_answers(target, dataset: str, temperature: float, root: str | Path, max_tokens: int = 256,
                           limit: int | None = None, batch_size: int = 32, progress: bool = True) -> Path:
    """Regenerate the target's answers to a held-out prompt set once (resumable), with features.

    Greedy at T=0; at T>0 sampled with top-k 64 / top-p 0.95 (the bench's defaults) and a
    seed per prompt. Returns the directory (shards + ``features/``).
    """
    from flashdraft.prompts import load_prompt_set
    from flashdraft.train.regen import regenerate_packed

    out = heldout_answers_dir(root, target.name, dataset, temperature)
    prompts = [{"id": str(p.get("id", i)), "prompt": p["prompt"],  # raw_prompt: a base model's text
                **({"raw_prompt": p["raw_prompt"]} if "raw_prompt" in p else {})}
               for i, p in enumerate(load_prompt_set(dataset))]
    if limit is not None:
        prompts = prompts[:limit]
    regenerate_packed(out, prompts, target=target, max_new_tokens=max_tokens, temperature=temperature,
                      batch_size=batch_size, progress=progress)
    return out


def load_answers(directory: str | Path, target, layer_ids, limit: int | None = None):
    """``[(id, ids [T], n_prompt, features [T', k*H] or None)]`` of a directory's answers.

    Features come from the stored rows when they hold ``layer_ids`` and were made by
    ``target``'s backend; otherwise None (the caller computes them with a target forward).
    """
    from flashdraft.train.features import FeatureStore

    seqs = read_shards(Path(directory))
    if limit is not None:
        seqs = seqs[:limit]
    try:
        store = FeatureStore(directory)
        cols = store.columns(layer_ids) if layer_ids else None
    except (FileNotFoundError, ValueError):
        store, cols = None, None
    if store is not None and store.backend != target.backend:
        store = None  # rows of another engine differ slightly: walk on this backend's own
    out = []
    for sid, ids, n_prompt in seqs:
        feats = None
        if store is not None and cols is not None and sid in store:
            feats = torch.from_numpy(np.ascontiguousarray(store.get(sid).features[:, cols])).float()
        out.append((sid, ids, n_prompt, feats))
    return out


@torch.inference_mode()
def target_features(target, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """``[T, k*H]`` features of ``ids`` from one target forward (when none are stored)."""
    target.set_feature_layers(list(layer_ids))
    _, feats = target.forward(ids, target.new_cache(ids.shape[0] + 1), ids.shape[0] - 1)
    return feats.float()


def walk_dataset(answers, proposer_for: Callable, n_draft: int, max_tokens: int, eos: set[int],
                 progress: bool = False, desc: str = "walk") -> dict:
    """Walk every answer with ``proposer_for(ids, n_prompt, features) -> Proposer``.

    Returns :meth:`AcceptanceStats.to_dict` for block size ``n_draft + 1``.
    """
    from tqdm import tqdm

    stats = AcceptanceStats()
    for _, ids, n_prompt, feats in tqdm(answers, desc=desc, unit="answer", disable=not progress):
        response = ids[n_prompt:].tolist()
        walk_answer(response, proposer_for(ids, n_prompt, feats), n_draft, max_tokens, eos, stats)
    return stats.to_dict(n_draft + 1)


# ------------------------------------------------------------------------- offline eval


def reference_sequences(data_dirs) -> list[tuple[torch.Tensor, int]]:
    """``(ids, n_prompt)`` of the training answers in ``data_dirs`` (for the bigram table)."""

    return [(ids, n) for d in data_dirs for _, ids, n in read_shards(Path(d))]


def offline_eval(target, dflash_model, answers_dir: str | Path, n_draft: int, max_tokens: int = 256,
                 bigram: BigramTable | None = None, limit: int | None = None, progress: bool = True,
                 ngram_depth: int | None = None, ar_drafter=None) -> dict:
    """τ and per-position acceptance of the drafter and the reference drafters on one answer set.

    Args:
        n_draft: draft tokens per step of the DFlash, ngram and bigram walks (block size - 1).
        ngram_depth: longest prompt-lookup draft of the hybrid (as ``--spec-type hybrid``
            online, whose copies may run past the DFlash block); when it exceeds ``n_draft``,
            prompt lookup is also walked at that depth (``"ngram (depth D)"``).
        ar_drafter: an :class:`~flashdraft.drafters.ar.ARDrafter` walked as ``"draft (AR)"``.
    Returns ``{"dflash": stats, "ngram": stats, "bigram": stats, ...}`` (the :class:`AcceptanceStats`
    dict of each; ``dflash`` and the hybrids only when a drafter is given, ``bigram`` only with a table).
    ``suffix`` drafts from the answer's own prompt and answer so far, ``suffix (+ past answers)``
    also from the answers walked before it (:class:`SuffixHistory`, the server's default bound).
    """
    from flashdraft.drafters.dflash import draft_head_rows
    from flashdraft.drafters.ngram import NgramDrafter
    from flashdraft.drafters.suffix import DEFAULT_CACHE

    layer_ids = dflash_model.target_layer_ids if dflash_model is not None else []
    if ar_drafter is not None and ar_drafter.feature_layer_ids:
        layer_ids = ar_drafter.feature_layer_ids
    answers = load_answers(answers_dir, target, layer_ids, limit)
    eos = target.eos_token_ids
    out = {}
    if ar_drafter is not None:
        out["draft (AR)"] = walk_dataset(answers, ar_proposer(ar_drafter, target), n_draft, max_tokens, eos,
                                         progress, "draft (AR)")
    if dflash_model is not None:
        model = dflash_model.eval()
        head = draft_head_rows(target.lm_head.weight.detach(), model)
        emb = target.embed_tokens.weight.detach()

        tables: dict[int, DFlashProposals] = {}  # per answer, shared by the dflash and hybrid walks

        def dflash(ids, n_prompt, feats):
            if id(ids) not in tables:
                if feats is None:
                    feats = target_features(target, ids, layer_ids)
                tables[id(ids)] = DFlashProposals(model, emb, head, model.d2t, feats, ids, n_prompt)
            return tables[id(ids)]

        out["dflash"] = walk_dataset(answers, dflash, n_draft, max_tokens, eos, progress, "dflash")

        def hybrid(ids, n_prompt, feats):
            # per step: the prompt-lookup continuation where one exists, else the drafter's
            lookup, drafted = DrafterProposals(NgramDrafter(), ids, n_prompt), dflash(ids, n_prompt, feats)
            return lambda i, room: lookup(i, room) or drafted(i, room)

        # the DFlash table's rows are n_draft long: a deeper walk takes them whole, the
        # n-gram continuation up to its own depth
        deep = max(n_draft, ngram_depth or n_draft)
        out["hybrid (ngram, else dflash)"] = walk_dataset(answers, hybrid, deep, max_tokens, eos, progress,
                                                          "hybrid")
        history = SuffixHistory(DEFAULT_CACHE)

        def hybrid_suffix(ids, n_prompt, feats):
            lookup, drafted = history(ids, n_prompt), dflash(ids, n_prompt, feats)
            return lambda i, room: lookup(i, room) or drafted(i, room)

        out["hybrid (suffix, else dflash)"] = walk_dataset(answers, hybrid_suffix, deep, max_tokens, eos, progress,
                                                           "hybrid suffix")
    def lookup(ids, n_prompt, _):
        return DrafterProposals(NgramDrafter(), ids, n_prompt)

    out["ngram"] = walk_dataset(answers, lookup, n_draft, max_tokens, eos, progress, "ngram")
    out["suffix"] = walk_dataset(answers, SuffixHistory(0), n_draft, max_tokens, eos, progress, "suffix")
    out["suffix (+ past answers)"] = walk_dataset(answers, SuffixHistory(DEFAULT_CACHE), n_draft, max_tokens, eos,
                                                  progress, "suffix past")
    if ngram_depth is not None and ngram_depth > n_draft:
        out[f"ngram (depth {ngram_depth})"] = walk_dataset(answers, lookup, ngram_depth, max_tokens, eos,
                                                           progress, "ngram deep")
        out[f"suffix (+ past answers, depth {ngram_depth})"] = walk_dataset(
            answers, SuffixHistory(DEFAULT_CACHE), ngram_depth, max_tokens, eos, progress, "suffix deep")
    if bigram is not None:
        out["bigram"] = walk_dataset(answers, lambda ids, n, _: bigram.proposer(ids, n), n_draft, max_tokens,
                                     eos, progress, "bigram")
    return out


def format_offline_table(dataset: str, temperature: float, results: dict) -> str:
    """A Markdown table: one row per drafter, τ and P(accept) at each block position."""
    n_pos = max(len(r["per_position_acceptance"]) for r in results.values())
    head = "| drafter | τ | " + " | ".join(f"k={k}" for k in range(1, n_pos + 1)) + " |"
    lines = [f"{dataset}, T={temperature:g}, {next(iter(results.values()))['prompts']} answers", "",
             head, "|" + " --- |" * (n_pos + 2)]
    best = {name: r["tau"] for name, r in results.items()}
    for name, r in results.items():
        acc = [f"{a:.3f}" if a is not None else "-" for a in r["per_position_acceptance"]]
        lines.append(f"| {name} | {r['tau']:.3f} | " + " | ".join(acc + ["-"] * (n_pos - len(acc))) + " |")
    if "dflash" in results:
        others = {k: v for k, v in best.items() if k != "dflash"}
        beats = all(best["dflash"] > v for v in others.values())
        per_pos = all(
            (a or 0) > (b or 0)
            for other in others
            for a, b in zip(results["dflash"]["per_position_acceptance"], results[other]["per_position_acceptance"]))
        lines.append("")
        lines.append(f"dflash beats {', '.join(others)} on τ: {'yes' if beats else 'NO'}; "
                     f"at every block position: {'yes' if per_pos else 'NO'}")
    return "\n".join(lines)


class AnswerTarget:
    """The target that regenerates held-out answers: the walk's own, except a torch target
    without the lean forward (Gemma), whose answers the llama backend writes several times
    faster from the same GGUF (the walk then computes the features with its torch forward)."""

    def __init__(self, target, args):
        self.target, self.args, self._answers = target, args, None

    def get(self):
        if self._answers is None:
            self._answers = self.target
            model = self.args.model
            if (self.target.lean is None and self.target.backend == "torch"
                    and model and str(model).endswith(".gguf") and self.args.backend == "auto"):
                from flashdraft.engine import EngineConfig, load_engine_target

                try:
                    self._answers = load_engine_target(EngineConfig(model=model, spec_type="none", device="cpu",
                                                                    n_parallel=32, ctx_size=1024))
                except Exception as e:  # noqa: BLE001 - the torch target still writes them, slower
                    log.warning("held-out answers on the torch backend: %s", e)
        return self._answers


def run_offline(args) -> int:
    """``flashdraft eval --offline``: answers regenerated once, then walked by each drafter."""
    import json

    from flashdraft.drafters.ar_model import is_ar_drafter
    from flashdraft.drafters.dflash import load_dflash_model
    from flashdraft.engine import default_dflash_drafter

    # the walk's bookkeeping (answer tables, bigram counts) is host code, not yet audited for
    # another device: it runs on the CPU, and says so rather than ignoring --device
    if args.device not in ("auto", "cpu"):
        raise ValueError(f"eval --offline runs on the CPU only (got --device {args.device}); "
                         "the online `flashdraft eval` runs on any device")
    log.info("eval --offline: walking on the CPU")
    from flashdraft.engine import EngineConfig, load_engine_target

    drafter_path = args.spec_draft_model
    walks_ar = bool(drafter_path) and (str(drafter_path).startswith("self:") or is_ar_drafter(drafter_path))
    # a DFlash walk reads the target's features: the backend must be able to give them
    target = load_engine_target(EngineConfig(model=args.model, weights=args.weights,
                                             spec_type="draft" if walks_ar else "dflash",
                                             draft_model=str(drafter_path) if walks_ar else None,
                                             backend=args.backend, device="cpu"))
    if not drafter_path:
        drafter_path = default_dflash_drafter(args.model or None, target)
    ar = None
    if walks_ar:
        from flashdraft.engine import draft_model_drafter

        # an AR drafter (or self:N) walks at the shipped DFlash drafter's depth unless --block-size says
        ar = draft_model_drafter(EngineConfig(model=args.model, spec_type="draft", draft_model=str(drafter_path)),
                                 target)
        model = None
    else:
        # the dtype serving would run it in (--spec-draft-dtype), so the walk sees the same drafts
        dtype = EngineConfig(draft_dtype=args.spec_draft_dtype).drafter_dtype(target.device)
        model = load_dflash_model(drafter_path, dtype) if drafter_path else None
    depth = model.block_size - 1 if model else (7 if ar else 15)
    n_draft = (args.block_size - 1) if args.block_size else depth
    data_dirs = args.bigram_data or default_training_dirs(target)
    bigram = BigramTable(reference_sequences(data_dirs), target.vocab_size) if data_dirs else None
    ngram_depth = args.spec_draft_n_max  # the hybrid's n-gram depth online
    report = {"target": target.name, "drafter": str(drafter_path), "n_draft": n_draft, "ngram_depth": ngram_depth,
              "bigram_data": [str(d) for d in data_dirs], "results": {}}
    answer_target = AnswerTarget(target, args)
    for dataset in args.dataset.split(","):
        for temperature in args.temperature:
            directory = heldout_answers_dir(args.heldout_root, target.name, dataset, temperature)
            if not (directory / "manifest.json").exists() or \
                    json.loads((directory / "manifest.json").read_text()).get("state") != "complete":
                directory = ensure_heldout_answers(answer_target.get(), dataset, temperature, args.heldout_root,
                                                   args.max_tokens, args.limit, progress=not args.json)
            results = offline_eval(target, model, directory, n_draft, args.max_tokens, bigram, args.limit,
                                   progress=not args.json, ngram_depth=ngram_depth, ar_drafter=ar)
            report["results"][f"{dataset}@{temperature:g}"] = results
            if not args.json:
                print(format_offline_table(dataset, temperature, results), "\n", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report))
    return 0


def default_training_dirs(target=None) -> list[Path]:
    """The repository's regenerated training answer sets (``datasets/*`` with shards); with
    ``target``, only that target's (the directory name starts with its family,
    :func:`target_family`): another target's token ids mean nothing in this vocabulary."""
    root = Path(__file__).resolve().parents[2] / "datasets"
    dirs = sorted(d for d in root.glob("*") if d.is_dir() and d.name != "heldout" and any(d.glob("shard-*")))
    if target is None:
        return dirs
    return [d for d in dirs if dataset_target(d) == target_family(target)]


def target_family(target) -> str:
    """``gemma3`` / ``smollm2`` / ...: the name prefix training sets of a target carry
    (``datasets/<family>-...``), told by the target's shape."""
    return {(49152, 576): "smollm2", (262144, 640): "gemma3"}.get((target.vocab_size, target.hidden_size),
                                                                   target.name.lower())


def dataset_target(directory: Path) -> str:
    """The family prefix of a training set directory's name (``smollm2-regen-greedy`` -> ``smollm2``)."""
    return directory.name.split("-", 1)[0]
