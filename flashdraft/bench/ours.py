"""Our engine's configurations: ``none``, ``dflash``, ``ngram``, ``hybrid``, ``draft``, the
``-adaptive`` forms (the ``profit`` depth controller), the ``-cost`` forms (the ``cost``
controller), ``default`` (what ``make serve`` runs) and ``dflash@N``.

All of them share one loaded :class:`Target`; each has its own drafter and generator.
"""

from __future__ import annotations

import time

from flashdraft.bench.constrained import TimedConstraint
from flashdraft.bench.contender import (BenchPrompt, Contender, Unavailable, adaptive_base, controller_of, describe,
                                       fixed_depth)
from flashdraft.bench.measure import Generation, counts_from_timings
from flashdraft.constraints import TokenizerInfo
from flashdraft.engine import (DEFAULT_AR_DRAFTER_DIR, EngineConfig, default_dflash_drafter, load_engine,
                               exact_step_threads)
from flashdraft.generate import SpeculativeGenerator
from flashdraft.sampling import SamplingParams
from flashdraft.targets.torch import Target

OURS = ("none", "default", "dflash", "dflash-adaptive", "dflash-cost", "ngram", "ngram-adaptive", "ngram-cost",
        "ngram-standing-cost", "ngram-latest-cost", "ngram-fullprobe-cost",
        "suffix", "suffix-adaptive", "hybrid", "hybrid-adaptive", "hybrid-cost", "hybrid-suffix",
        "hybrid-suffix-adaptive", "dflash-gated-adaptive", "hybrid-gated-adaptive", "draft", "draft-adaptive",
        "self-draft", "self-draft-adaptive")
#: target layers of ``self-draft`` when ``--self-draft-layers`` is not given
SELF_DRAFT_LAYERS = 4
#: the confidence gate of the ``-gated`` configurations when ``--spec-draft-p-min`` is not given
GATED_P_MIN = 0.5


def is_ours(name: str) -> bool:
    """True for our engine's configurations, ``dflash@N`` included."""
    return name in OURS or fixed_depth(name) is not None


class EngineContender(Contender):
    """One :class:`SpeculativeGenerator`; times each :class:`Step` as it arrives."""

    kind = "ours"
    takes_constraint = True

    def __init__(self, name: str, generator: SpeculativeGenerator):
        self.name, self.description = name, describe(name)
        self.generator = generator
        self._runs: dict[str, int] = {}  # runs so far per prompt id

    def client(self, prompt: BenchPrompt) -> str:
        """The client key of this run: the how-many-th run of this prompt it is. A drafter
        that keeps past answers per client (suffix) then sees the answers of the other
        prompts run before it in the same pass, never an earlier answer to this prompt
        (a repeat would otherwise copy its own previous answer)."""
        k = self._runs.get(prompt.id, 0)
        self._runs[prompt.id] = k + 1
        return f"run-{k}"

    def activate(self) -> None:
        # generators share the target, whose feature hooks belong to the last one built
        g = self.generator
        g.target.set_feature_layers(g.drafter.feature_layer_ids)
        exact_step_threads(g.target)  # one-token steps on the same threads in every mode

    def run(self, prompt: BenchPrompt, params: SamplingParams) -> Generation:
        g = self.generator
        ids, parts, first, last, finish, timings = [], [], None, None, None, None
        # the matcher is built before the clock starts, as the server builds it while
        # validating the request; its own cost is kept apart (GrammarCost.setup_ms)
        constraint = None
        if prompt.grammar is not None:
            constraint = TimedConstraint(TokenizerInfo.for_target(g.target), prompt.grammar)
        t0 = time.perf_counter()
        for step in g.generate(prompt.ids, prompt.max_tokens, params, constraint=constraint, client=self.client(prompt),
                               cache_prompt=prompt.cache_prompt):
            last = time.perf_counter()
            first = first or last  # the first step arrives right after prefill
            ids.extend(step.token_ids)
            parts.append(step.text)
            finish, timings = step.finish_reason, step.timings or timings
        spec = counts_from_timings(timings) if g.drafting and timings is not None else None
        return Generation(text="".join(parts), token_ids=ids, prompt_tokens=len(prompt.ids),
                          completion_tokens=len(ids), ttft_ms=1e3 * (first - t0), total_ms=1e3 * (last - t0),
                          finish_reason=finish, spec=spec, grammar=None if constraint is None else constraint.cost,
                          cached_tokens=None if timings is None else timings.cache_n)


def dflash_drafter_path(model: str | None, drafter: str | None, target=None) -> str | None:
    """The DFlash drafter to use: ``-md`` if given, else the shipped one for the default
    target, or for ``target``'s shape (:func:`~flashdraft.engine.default_dflash_drafter`)."""
    if drafter:
        return drafter
    if target is None and model is not None:
        return None
    shipped = default_dflash_drafter(model, target)
    return None if shipped is None else str(shipped)


def build_ours(name: str, base: EngineConfig, target: Target, draft_model: str | None,
               self_draft_layers: int = SELF_DRAFT_LAYERS) -> Contender | Unavailable:
    """Our configuration ``name`` on ``target``, or why it cannot run.

    Args:
        base: engine settings from the command line (n_draft, ctx_size, cross_ctx, drafter).
        draft_model: the AR drafter for ``draft`` (``--draft-model``; default: the shipped one
            for the default target).
        self_draft_layers: N of ``self-draft`` (``-md self:N``).
    """
    # plain names draft a fixed length; X-adaptive is X under the profit controller, X-cost under the
    # cost controller; default is what `make serve` runs (contender.SERVE_DEFAULT)
    adaptive = adaptive_base(name)
    depth = fixed_depth(name)  # dflash@N: the same drafter at a fixed depth N
    kind = adaptive or ("dflash" if depth else name)
    # hybrid-suffix: the hybrid with SuffixDecoding as its lookup source; X-gated: X with the
    # DFlash drafter's confidence gate (--spec-draft-p-min, else GATED_P_MIN)
    lookup = "suffix" if kind == "hybrid-suffix" else base.lookup
    p_min = (base.p_min or GATED_P_MIN) if kind.endswith("-gated") else base.p_min
    kind = kind.removesuffix("-suffix").removesuffix("-gated")
    # ngram-standing: prompt lookup asked for drafts only at the controller's standing depth
    standing = kind == "ngram-standing"
    kind = kind.removesuffix("-standing")
    # ngram-latest: lookup copying from the latest occurrence; ngram-fullprobe: probes verify
    # the whole copy (the rules before docs/performance.md §15)
    occurrences = 1 if kind == "ngram-latest" else base.ngram_occurrences
    probe_extra = None if kind == "ngram-fullprobe" else base.probe_extra
    kind = kind.removesuffix("-latest").removesuffix("-fullprobe")
    self_draft = kind == "self-draft"
    kind = "draft" if self_draft else kind
    cfg = EngineConfig(model=base.model, spec_type=kind, lookup=lookup, p_min=p_min, suffix_cache=base.suffix_cache,
                       suffix_factor=base.suffix_factor, suffix_min_prob=base.suffix_min_prob,
                       n_draft=depth or base.n_draft,
                       ctx_size=base.ctx_size, cross_ctx=base.cross_ctx, ngram_max=base.ngram_max,
                       ngram_min=base.ngram_min, ngram_occurrences=occurrences, probe_extra=probe_extra, draft_dtype=base.draft_dtype, controller=controller_of(name),
                       cache_type_k=base.cache_type_k, cache_type_v=base.cache_type_v,
                       cache_type_k_draft=base.cache_type_k_draft, cache_type_v_draft=base.cache_type_v_draft,
                       kv_sink_tokens=base.kv_sink_tokens, kv_tail_tokens=base.kv_tail_tokens,
                       # --spec-synth-*: every drafting configuration at that acceptance; the
                       # baseline stays plain
                       synth_rates=None if kind == "none" else base.synth_rates,
                       synth_len=None if kind == "none" else base.synth_len)
    if cfg.spec_type in ("dflash", "hybrid"):
        cfg.draft_model = dflash_drafter_path(base.model, base.draft_model, target)
        if cfg.draft_model is None:
            return Unavailable(name, "ours", "no DFlash drafter for this target: pass -md PATH "
                                             "(train one with `flashdraft train`)")
    elif self_draft:
        cfg.draft_model = f"self:{self_draft_layers}"
    elif kind == "draft":
        if not draft_model and base.model is None and (DEFAULT_AR_DRAFTER_DIR / "config.json").exists():
            draft_model = str(DEFAULT_AR_DRAFTER_DIR)
        if not draft_model:
            return Unavailable(name, "ours", "no draft model: pass --draft-model PATH (train an AR drafter with "
                                             "`flashdraft train --kind ar`)")
        cfg.draft_model = draft_model
    # warm-up is the runner's job: it runs every configuration the same way
    generator = load_engine(cfg, target=target, warmup=False)
    if standing:
        generator.drafter.free_drafts = False
    return EngineContender(name, generator)
