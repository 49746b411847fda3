"""Build a ready generator (target + drafter) from user-level settings.

Shared by ``flashdraft generate``, ``serve``, ``bench`` and ``eval`` so every command
picks models the same way.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft import costs
from flashdraft.adaptive import CONTROLLERS, ProfitController, make_controller
from flashdraft.synthetic import accept_probs
from flashdraft.device import DRAFT_DTYPES, log_device, resolve_device, resolve_draft_dtype
from flashdraft.fast_forward import QUANT_MAX_ROWS
from flashdraft.drafters.ar import ARDrafter
from flashdraft.drafters.ar_model import ar_from_target, is_ar_drafter, load_ar_drafter
from flashdraft.drafters.base import Drafter, NoDrafter
from flashdraft.drafters.dflash import DFlashDrafter, load_dflash_model, random_dflash_model
from flashdraft.drafters.draft_model import DraftModelDrafter
from flashdraft.drafters.hybrid import HybridDrafter
from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.drafters.suffix import SuffixDrafter, SuffixStore
from flashdraft.generate import SpeculativeGenerator
from flashdraft.kv_cache import ROLLBACK_MARGIN, KVCacheSpec
from flashdraft.kv_codecs import CACHE_TYPES
from flashdraft.targets.base import Target
from flashdraft.targets.load import choose_backend, load_target, training_context
from flashdraft.targets.torch import load_hf_model

log = logging.getLogger(__name__)

#: lookup sources of the hybrid (``--spec-lookup``)
LOOKUPS = ("ngram", "suffix")
#: packaged drafters, one directory each (trained with ``flashdraft train``)
DRAFTERS_DIR = Path(__file__).parent / "assets" / "drafters"
#: the DFlash drafter shipped for the packaged default target
DEFAULT_DRAFTER_DIR = DRAFTERS_DIR / "smollm2-135m-instruct-dflash"
#: AR assistant drafter shipped for the packaged default target (``flashdraft train --kind ar``)
DEFAULT_AR_DRAFTER_DIR = DRAFTERS_DIR / "smollm2-135m-instruct-ar"


#: how far past its cut a probe of the cost controller verifies a free draft (prompt lookup;
#: None = the whole draft): docs/performance.md §15
FREE_PROBE_EXTRA = 2


@dataclass
class EngineConfig:
    """What to load.

    Attributes:
        model: target path (GGUF / HF dir / hub id); None = packaged SmolLM2-135M-Instruct.
        spec_type: one of ``none | dflash | draft | ngram | suffix | hybrid`` (suffix:
            SuffixDecoding, :mod:`flashdraft.drafters.suffix`; hybrid: a lookup source where it
            has a match and pays, else the DFlash drafter ``draft_model``).
        lookup: the hybrid's lookup source, ``ngram`` (prompt lookup) or ``suffix`` (``--spec-lookup``).
        suffix_cache: past answers the suffix drafter keeps over all clients (``--spec-suffix-cache``).
        suffix_factor / suffix_min_prob: its draft length per matched token and probability
            floor (``--spec-suffix-factor``, ``--spec-suffix-min-prob``).
        draft_model: drafter path. ``dflash``: SpecForge dir or GGUF, or ``random[:LAYERS]``
            (an untrained drafter, for plumbing tests). ``draft``: a causal LM sharing the
            target's tokenizer, or ``target`` (the target drafts for itself).
            None with ``dflash`` on the default target = the shipped drafter.
        n_draft: draft tokens per step (``--spec-draft-n-max``); with a controller, the most it may pick.
        controller: ``profit`` (default) picks each step's depth for the most tokens/s and turns
            drafting off when it does not pay (``flashdraft.adaptive``); ``off`` always drafts
            ``n_draft`` tokens (``--spec-dm-controller``).
        ctx_size: positions per sequence (``-c``).
        cross_ctx: DFlash drafter attends to at most this many recent positions.
        ngram_max / ngram_min: n-gram sizes of prompt lookup.
        ngram_occurrences: latest occurrences of each n-gram prompt lookup chooses among (the
            best-matching is copied; 1 = the latest, Saxena's rule).
        probe_extra: cost controller, free drafts: positions a probe verifies past the cut
            (None = the whole draft).
        cache_type_k / cache_type_v: target KV cache types (``--cache-type-k/-v``).
        cache_type_k_draft / cache_type_v_draft: the DFlash drafter's context cache types.
        kv_sink_tokens / kv_tail_tokens: first / most recent positions kept exact in
            compressed caches (``--kv-sink-tokens``, ``--kv-tail-tokens``).
        weights: target weights, ``fp32``, ``bf16`` or ``q4`` (``--weights``); bf16 halves the
            bytes a decode step reads but is fast only on CPUs with AVX512-BF16/AMX; q4 runs a
            GGUF's Q4_0/Q4_1 projections on the int4 kernel (:mod:`flashdraft.quant`). Greedy
            speculative output equals the greedy baseline under the same weights.
        device: ``auto`` (CUDA, then MPS, then CPU), ``cpu``, ``cuda[:N]``, ``mps``
            (``--device``): where the target, drafter, caches and sampler live. q4 weights
            and compressed KV cache types are CPU-only.
        backend: ``auto`` (default), ``torch`` or ``llama``: the engine that runs the target
            (:func:`flashdraft.targets.load.choose_backend`).
        n_parallel: sequences decoded together (the server's ``-np``).
    """

    model: str | None = None
    spec_type: str = "dflash"
    draft_model: str | None = None
    n_draft: int = 16
    ctx_size: int = 4096
    cross_ctx: int | None = None
    ngram_max: int = 3
    ngram_min: int = 1
    ngram_occurrences: int = 8
    probe_extra: int | None = FREE_PROBE_EXTRA
    lookup: str = "ngram"
    suffix_cache: int = 256
    suffix_factor: float = 4.0
    suffix_min_prob: float = 0.1
    #: the DFlash drafter's confidence gate (``--spec-draft-p-min``; :class:`DFlashDrafter`), 0 = off
    p_min: float = 0.0
    #: ``--spec-draft-dtype``: ``auto`` | ``f32`` | ``bf16``, what a loaded drafter network
    #: (``dflash`` / ``hybrid`` / ``draft``) runs in (:func:`flashdraft.device.resolve_draft_dtype`);
    #: the target's is ``weights``
    draft_dtype: str = "auto"
    #: profit by default: a drafter that loses on this machine or prompt (τ ≈ 1.1 on CPU) would
    #: otherwise make decoding slower than plain; the controller keeps it at >= plain speed
    controller: str = "profit"
    #: KV cache types (llama.cpp names, ``--cache-type-k/-v``; see flashdraft.kv_codecs) of the
    #: target and of the DFlash drafter's context cache, and the positions kept exact
    cache_type_k: str = "f32"
    cache_type_v: str = "f32"
    cache_type_k_draft: str = "f32"
    cache_type_v_draft: str = "f32"
    kv_sink_tokens: int = 0
    kv_tail_tokens: int = 0
    #: False when -ctk/-ctv were not given: the llama backend then keeps K/V in f16, as
    #: llama.cpp does (f32 attention runs 2.2x slower there), the torch backend in f32
    cache_types_given: bool = False

    @classmethod
    def from_args(cls, args, **overrides) -> "EngineConfig":
        """The config of parsed shared flags (:func:`flashdraft.flags.add_model_arguments`, or
        serve's same flags); ``overrides`` set fields the command decides (serve's per-slot
        ``ctx_size`` and ``n_parallel``)."""
        given = args.cache_type_k is not None or args.cache_type_v is not None
        resolve_ctx_size(args)
        fields = dict(model=args.model, spec_type=resolve_spec_type(args.spec_type, args.model, args.spec_draft_model),
                      draft_model=args.spec_draft_model, n_draft=args.spec_draft_n_max, ctx_size=args.ctx_size,
                      cross_ctx=args.spec_dflash_cross_ctx, controller=args.spec_dm_controller,
                      weights=args.weights, device=args.device, backend=args.backend,
                      cache_type_k=args.cache_type_k or "f32", cache_type_v=args.cache_type_v or "f32",
                      cache_types_given=given, cache_type_k_draft=args.cache_type_k_draft,
                      cache_type_v_draft=args.cache_type_v_draft, kv_sink_tokens=args.kv_sink_tokens,
                      kv_tail_tokens=args.kv_tail_tokens, lookup=args.spec_lookup, suffix_cache=args.spec_suffix_cache,
                      suffix_factor=args.spec_suffix_factor, suffix_min_prob=args.spec_suffix_min_prob,
                      p_min=args.spec_draft_p_min, draft_dtype=args.spec_draft_dtype,
                      ubatch=getattr(args, "ubatch_size", None),
                      synth_rates=getattr(args, "spec_synth_rates", None),
                      synth_len=getattr(args, "spec_synth_len", None))
        return cls(**{**fields, **overrides})

    def report(self, names: tuple[str, ...]) -> dict:
        """``{name: value}`` of these fields (:data:`CACHE_FIELDS`, :data:`DRAFTER_FIELDS`), for
        the settings a report prints."""
        return {name: getattr(self, name) for name in names}

    def validate(self, device: torch.device | None = None) -> None:
        """Checks that need no model: spec type, controller, cache types, token counts and
        the device (``device``: the one the models are on already, else :attr:`device` resolved).

        Raises:
            ValueError: with the flag to fix.
        """
        if self.spec_type not in SPEC_TYPES:
            raise ValueError(f"unknown --spec-type {self.spec_type!r}; choose from {', '.join(SPEC_TYPES)}")
        if self.lookup not in LOOKUPS:
            raise ValueError(f"unknown --spec-lookup {self.lookup!r}; choose from {', '.join(LOOKUPS)}")
        if self.suffix_cache < 0 or self.suffix_factor <= 0 or not 0 <= self.suffix_min_prob <= 1:
            raise ValueError("need --spec-suffix-cache >= 0, --spec-suffix-factor > 0 and "
                             "0 <= --spec-suffix-min-prob <= 1")
        if not 0 <= self.p_min <= 1:
            raise ValueError(f"--spec-draft-p-min must be in [0, 1], got {self.p_min}")
        if self.draft_dtype != "auto" and self.draft_dtype not in DRAFT_DTYPES:
            raise ValueError(f"unknown --spec-draft-dtype {self.draft_dtype!r}; choose from auto, "
                             f"{', '.join(DRAFT_DTYPES)}")
        if self.controller not in CONTROLLERS:
            raise ValueError(f"unknown --spec-dm-controller {self.controller!r}; choose from {', '.join(CONTROLLERS)}")
        self.synth_accept()
        self.kv_spec()
        self.kv_spec(draft=True)
        device = device or resolve_device(self.device)  # DeviceUnavailableError (a ValueError) when absent
        if device.type != "cpu":
            if self.weights == "q4":
                raise ValueError(f"--weights q4 runs on CPU-only int4 kernels: use --device cpu, or --weights "
                                 f"fp32/bf16 on {device}")
            for label, spec in (("-ctk/-ctv", self.kv_spec()), ("-ctkd/-ctvd", self.kv_spec(draft=True))):
                if not spec.plain and (label == "-ctk/-ctv" or self.spec_type in ("dflash", "hybrid")):
                    raise ValueError(f"{label} {spec.label()}: compressed KV caches run on the CPU only: use f32 "
                                     f"on {device}, or --device cpu")
        if self.weights == "q4" and self.spec_type != "none" and self.n_draft >= QUANT_MAX_ROWS:
            raise ValueError(f"--weights q4 keeps verify blocks bit-identical to one-token steps up to "
                             f"{QUANT_MAX_ROWS} rows: use --spec-draft-n-max < {QUANT_MAX_ROWS}")
        if self.kv_tail_tokens and self.n_draft >= ROLLBACK_MARGIN:
            raise ValueError(f"--kv-tail-tokens keeps exact copies for rollbacks of < {ROLLBACK_MARGIN} positions: "
                             f"use --spec-draft-n-max < {ROLLBACK_MARGIN}")

    def drafter_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype a drafter network loaded on ``device`` runs in (``--spec-draft-dtype``,
        ``auto`` resolved by measurement: :func:`~flashdraft.device.resolve_draft_dtype`); logged."""
        dtype = resolve_draft_dtype(self.draft_dtype, device)
        why = " (auto: a bf16 matmul beats f32 on this CPU)" if self.draft_dtype == "auto" and dtype == torch.bfloat16 \
            else " (auto)" if self.draft_dtype == "auto" else ""
        log.info("drafter runs in %s%s", str(dtype).removeprefix("torch."), why)
        return dtype

    def kv_spec(self, draft: bool = False) -> KVCacheSpec:
        """The target's (or with ``draft`` the drafter's) cache types as a :class:`KVCacheSpec`.

        Raises:
            ValueError: an unknown cache type or a negative token count.
        """
        k, v = (self.cache_type_k_draft, self.cache_type_v_draft) if draft else (self.cache_type_k, self.cache_type_v)
        for name in (k, v):
            if name not in CACHE_TYPES:
                raise ValueError(f"unknown cache type {name!r}; choose from {', '.join(CACHE_TYPES)}")
        if self.kv_sink_tokens < 0 or self.kv_tail_tokens < 0:
            raise ValueError("--kv-sink-tokens and --kv-tail-tokens must be >= 0")
        if max(self.kv_sink_tokens, self.kv_tail_tokens) > self.ctx_size:
            raise ValueError(f"--kv-sink-tokens / --kv-tail-tokens cannot exceed the context size ({self.ctx_size})")
        return KVCacheSpec(k, v, self.kv_sink_tokens, self.kv_tail_tokens)
    weights: str = "fp32"
    device: str = "auto"
    #: ``--backend``: ``auto`` | ``torch`` | ``llama`` (:mod:`flashdraft.targets.load`)
    backend: str = "auto"
    #: sequences decoded together (``-np``): the llama backend sizes its context for them
    n_parallel: int = 1
    #: ``-ub``: rows per llama.cpp decode (llama backend); None = its exact default
    #: (:data:`flashdraft.targets.llama.DEFAULT_UBATCH`)
    ubatch: int | None = None
    #: benchmarking only (``--spec-synth-rates`` / ``--spec-synth-len``, llama-server's):
    #: drafts accepted by a coin at these rates, whatever the target says (:mod:`flashdraft.synthetic`)
    synth_rates: tuple[float, ...] | None = None
    synth_len: float | None = None

    def synth_accept(self) -> list[float] | None:
        """Per draft position, the synthetic acceptance probability (None: real verify).

        Raises:
            ValueError: bad rates or length (:func:`flashdraft.synthetic.accept_probs`), or
                either without a drafter.
        """
        probs = accept_probs(None if self.synth_rates is None else list(self.synth_rates), self.synth_len,
                             self.n_draft)
        if probs is not None and self.spec_type == "none":
            raise ValueError("synthetic acceptance (--spec-synth-rates/--spec-synth-len) needs a drafter: "
                             "give --spec-type or -md")
        return probs


#: the fields the KV cache flags set (:func:`flashdraft.flags.add_cache_arguments`)
CACHE_FIELDS = ("cache_type_k", "cache_type_v", "cache_types_given", "cache_type_k_draft", "cache_type_v_draft",
                "kv_sink_tokens", "kv_tail_tokens")
#: the fields the drafter network's flags set (:func:`flashdraft.flags.add_drafter_arguments`)
DRAFTER_FIELDS = ("p_min", "draft_dtype", "synth_rates", "synth_len")


def resolve_spec_type(spec_type: str | None, model: str | None, draft_model: str | None) -> str:
    """``--spec-type`` when given; else ``dflash`` when ``-md`` names a drafter, and ``none``
    otherwise: drafting only when asked for, as llama-server decodes plainly without a draft
    model (``--spec-type dflash`` alone uses the shipped drafter of the packaged target)."""
    if spec_type is not None:
        return spec_type
    return "dflash" if draft_model else "none"


def load_drafter(cfg: EngineConfig, target: Target) -> Drafter:
    """The drafter ``cfg`` asks for, wired to ``target``.

    Raises:
        ValueError: unknown spec type, or a drafter that needs a path and has none.
    """
    if cfg.spec_type not in DRAFTERS:
        raise ValueError(f"unknown --spec-type {cfg.spec_type!r}; choose from {', '.join(SPEC_TYPES)}")
    return DRAFTERS[cfg.spec_type](cfg, target)


def dflash_drafter(cfg: EngineConfig, target: Target) -> Drafter:
    """``--spec-type dflash`` (and ``hybrid``: prompt lookup where it pays, the DFlash drafter
    elsewhere): ``-md`` a SpecForge directory, GGUF or ``random[:LAYERS]``, else the shipped
    drafter for this target.

    Raises:
        ValueError: no drafter for this target, one trained for another, or a bad drafter cache.
    """
    try:
        draft_kv = cfg.kv_spec(draft=True)
    except ValueError as e:
        raise ValueError(f"drafter cache (-ctkd/-ctvd): {e}") from None
    path = cfg.draft_model
    if path is None:
        shipped = default_dflash_drafter(cfg.model, target)
        if shipped is not None:
            path = str(shipped)
        else:
            raise ValueError(f"--spec-type {cfg.spec_type} needs --spec-draft-model PATH (a DFlash drafter trained for "
                             "this target: SpecForge directory or GGUF); train one with `flashdraft train`")
    if path.startswith("random"):
        layers = int(path.split(":", 1)[1]) if ":" in path else 1
        if target.model is None:
            raise ValueError("-md random builds a drafter from the target's torch config: use --backend torch")
        model = random_dflash_model(target.model, num_layers=layers).to(target.device, cfg.drafter_dtype(target.device))
    else:
        model = load_dflash_model(path, cfg.drafter_dtype(target.device), target.device)
    check_drafter_fits(model.config, target, path)
    try:
        drafter = DFlashDrafter(model, target.embed_tokens, target.lm_head, cross_ctx=cfg.cross_ctx, kv=draft_kv,
                                p_min=cfg.p_min)
        if cfg.spec_type == "hybrid":  # prompt lookup where it pays, this DFlash drafter elsewhere
            # prompt lookup may copy past the DFlash block: up to --spec-draft-n-max tokens
            return HybridDrafter(drafter, lookup_drafter(cfg, cfg.lookup), ngram_depth=cfg.n_draft)
        return drafter
    except ValueError as e:
        if "head_dim" in str(e):
            raise ValueError(f"drafter cache (-ctkd/-ctvd): {e}") from None
        raise


def draft_model_drafter(cfg: EngineConfig, target: Target) -> Drafter:
    """``--spec-type draft``: ``-md self:N`` (the target's first N layers and head), an AR
    drafter directory (``flashdraft train --kind ar``), ``target``, or any transformers causal
    LM with the target's vocabulary; without ``-md`` on the packaged target, its shipped AR
    drafter.

    Raises:
        ValueError: no ``-md``, a bad ``self:N``, or a drafter made for another target.
    """
    path = cfg.draft_model
    if not path and cfg.model is None and (DEFAULT_AR_DRAFTER_DIR / "config.json").exists():
        path = str(DEFAULT_AR_DRAFTER_DIR)  # the packaged target's own AR drafter
    if not path:
        raise ValueError("--spec-type draft needs --spec-draft-model PATH (an AR drafter from `flashdraft train "
                         "--kind ar`, self:N for the target's first N layers, or a small model with the "
                         "target's tokenizer)")
    embed = target.embed_tokens.weight.detach()
    if path.startswith("self:") or path == "self":
        n = path.partition(":")[2]
        if not n.isdigit() or not 1 <= int(n) <= target.num_layers:
            raise ValueError(f"-md {path}: self:N takes N = 1..{target.num_layers} (the target's first N layers)")
        torch_model = target.model
        if torch_model is None:  # llama backend: the same GGUF, read by transformers
            torch_model = load_hf_model(target.path, cfg.drafter_dtype(target.device), target.device)[0]
        model = ar_from_target(torch_model, int(n), target_name=target.name).to(target.device)
        return ARDrafter(model, embed, target.vocab_size)
    if is_ar_drafter(path):
        model = load_ar_drafter(path, cfg.drafter_dtype(target.device), target.device)
        # the same refusal as a DFlash drafter's: hidden size, vocabulary, target layer count
        check_drafter_fits({**model.config, "num_target_layers": model.config["ar_drafter"].get("num_target_layers")},
                           target, path)
        return ARDrafter(model, embed, target.vocab_size)
    if path == "target" and target.model is None:
        raise ValueError("-md target drafts with the target's torch model: use --backend torch, or -md self:N")
    model = target.model if path == "target" else load_hf_model(path, cfg.drafter_dtype(target.device), target.device)[0]
    return DraftModelDrafter(model, target.vocab_size)


def lookup_drafter(cfg: EngineConfig, kind: str) -> Drafter:
    """The model-free drafter ``kind`` (``ngram`` or ``suffix``) with ``cfg``'s settings; a
    suffix drafter gets a new store of past answers, which the server's slots share (:meth:`Drafter.fork`)."""
    if kind == "suffix":
        return SuffixDrafter(SuffixStore(cfg.suffix_cache), cfg.suffix_factor, cfg.suffix_min_prob)
    return NgramDrafter(cfg.ngram_max, cfg.ngram_min, cfg.ngram_occurrences)


#: ``--spec-type`` -> the loader of its drafter, ``(cfg, target) -> Drafter``: the one list of drafters
DRAFTERS = {
    "none": lambda cfg, target: NoDrafter(),
    "dflash": dflash_drafter,
    "draft": draft_model_drafter,
    "ngram": lambda cfg, target: lookup_drafter(cfg, "ngram"),
    "suffix": lambda cfg, target: lookup_drafter(cfg, "suffix"),
    "hybrid": dflash_drafter,
}
SPEC_TYPES = tuple(DRAFTERS)


def shipped_drafter_for(target) -> Path | None:
    """The packaged DFlash drafter made for ``target``'s shape (hidden size, vocabulary,
    layer count: what :func:`check_drafter_fits` checks), or None. So ``-m`` on a GGUF of a
    target we ship a drafter for (SmolLM2-135M-Instruct, Gemma 3 270M) needs no ``-md``."""
    for config_path in sorted(DRAFTERS_DIR.glob("*-dflash/config.json")):
        config = json.loads(config_path.read_text())
        if (int(config["hidden_size"]), int(config["vocab_size"]), int(config.get("num_target_layers") or -1)) == \
                (target.hidden_size, target.vocab_size, target.num_layers):
            return config_path.parent
    return None


def default_dflash_drafter(model: str | None, target) -> Path | None:
    """The DFlash drafter used when ``-md`` is not given: the shipped one of the packaged
    default target (``model`` None), else the shipped one for ``target``'s shape; None when
    there is none (or its files are missing)."""
    shipped = DEFAULT_DRAFTER_DIR if model is None else shipped_drafter_for(target)
    return shipped if shipped is not None and (shipped / "config.json").exists() else None


def check_drafter_fits(config: dict, target, path: str) -> None:
    """Refuse a DFlash drafter trained for another target, before anything runs.

    Raises:
        ValueError: hidden size, vocabulary or target layer count differ from the target's.
    """
    for key, have in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size),
                      ("num_target_layers", target.num_layers)):
        want = config.get(key)
        if want and int(want) != int(have):
            raise ValueError(f"drafter {path} was trained for another target: its {key} is {want}, "
                             f"the target {target.name}'s is {have}; train one for this model with `flashdraft train`")


def load_engine_target(cfg: EngineConfig):
    """The target ``cfg`` asks for, on the backend ``--backend`` resolves to (logged with why).

    Raises:
        ValueError: ``--backend llama`` with settings it cannot run, or a bad model path.
        BindingUnavailableError: ``--backend llama`` without a working llama.cpp binding.
    """
    device = resolve_device(cfg.device)
    log_device(cfg.device, device)
    kv = cfg.kv_spec()
    choice = choose_backend(cfg.backend, cfg.model, cfg.weights, device, kv=kv,
                            draft_model=cfg.draft_model if cfg.spec_type != "none" else None,
                            features=cfg.spec_type in ("dflash", "hybrid"))
    log.info("%s", choice.line())
    if choice.backend == "llama" and not cfg.cache_types_given:
        kv = KVCacheSpec("f16", "f16")
    if cfg.ubatch is not None and choice.backend != "llama":
        log.warning("-ub %d: rows per llama.cpp decode; the torch backend has no such setting (ignored)", cfg.ubatch)
    return load_target(cfg.model, choice, weights=cfg.weights, device=device, n_ctx=cfg.ctx_size, ubatch=cfg.ubatch,
                       n_seq=cfg.n_parallel, kv=kv)


def drafter_controller(kind: str, drafter: Drafter, n_draft: int, target=None,
                       probe_extra: int | None = FREE_PROBE_EXTRA):
    """The depth controller ``kind`` (``--spec-dm-controller``: ``profit`` | ``off``) for
    ``drafter`` drafting at most ``n_draft`` tokens (and at most the drafter's own
    ``max_draft``); a mixed-source drafter (the hybrid) gets one controller per source.
    None when nothing is drafted (plain decoding or ``n_draft`` 0).

    ``cost`` measures (or reads from its cache) what a target call of 1..n_max+1 rows costs
    on ``target`` (:func:`flashdraft.costs.load_or_measure`): call it after the target's
    threads are set. There a free drafter's probes verify ``probe_extra`` positions past the
    cut (:attr:`ProfitController.probe_extra`; None = the whole draft).

    Raises:
        ValueError: an unknown controller, or ``cost`` without a target.
    """
    if isinstance(drafter, NoDrafter) or n_draft <= 0:
        return None
    n_max = n_draft if drafter.max_draft is None else min(n_draft, drafter.max_draft)
    verify_costs = None
    if kind == "cost":
        if target is None:
            raise ValueError("the cost controller measures the target: pass it")
        table = costs.load_or_measure(target, k_max=n_max + 1)
        log.info("%s", table.describe())
        verify_costs = table.verify_seconds(n_max)
    ctrl = make_controller(kind, n_max, drafter.SOURCES, drafter.source_max_draft, verify_costs)
    if isinstance(ctrl, ProfitController) and verify_costs is not None and drafter.free_drafts:
        ctrl.probe_extra = probe_extra  # every step's copy is cut; a probe looks just past the cut
    return ctrl


def resolve_ctx_size(args) -> None:
    """``-c 0`` (llama-server's "loaded from model"): set ``args.ctx_size`` to the model's
    training context (:func:`flashdraft.targets.load.training_context`), logged once; any
    other value is left as given."""
    if args.ctx_size == 0:
        args.ctx_size = training_context(args.model)
        log.info("-c 0: the model's training context, %d tokens", args.ctx_size)


def exact_step_threads(target) -> None:
    """llama backend: one-token steps on ``target.exact_step_threads``, with or without a
    drafter; batches (verify blocks, prefill) on every ``-t`` thread. Stock ggml splits a
    single row's attention across threads, and a verify row then differs from such a step
    (0.77 in the logits here), so plain decoding there would not give the tokens drafting
    gives: lossless means the same tokens in every mode. That costs a stock build's plain
    decoding at ``-t 2`` ≈ 30% (12.8 vs 8.7 ms a step); the ggml that ``make llama`` builds
    keeps a row on one thread and steps on every thread stay exact (docs/performance.md,
    "Threads"). Call it whenever generators with different drafters take turns on one target
    (the bench)."""
    target.set_step_threads(target.exact_step_threads)


def load_engine(cfg: EngineConfig, target: Target | None = None, warmup: bool = True) -> SpeculativeGenerator:
    """Load the target (unless given) and the drafter; returns a ready generator.

    ``warmup`` runs one short generation so the first request does not pay for kernel
    initialisation (the first forward of a process is several times slower on CPU).

    Raises:
        ValueError: unknown spec type, controller or weights, a drafter that needs a path and
            has none, or a device that is absent (:class:`~flashdraft.device.DeviceUnavailableError`)
            or cannot run the asked weights / cache types.
    """
    cfg.validate(None if target is None else target.device)  # refuse bad settings before loading anything
    kv = cfg.kv_spec()
    if cfg.spec_type not in ("dflash", "hybrid") and not cfg.kv_spec(draft=True).plain:
        log.warning("-ctkd/-ctvd apply to the DFlash drafter's cache only; ignored with --spec-type %s",
                    cfg.spec_type)
    if target is None:
        target = load_engine_target(cfg)
    if target.backend == "llama":  # its context holds K/V of the types it was made with
        kv = KVCacheSpec(*target.cache_types)
    drafter = load_drafter(cfg, target)
    target.new_cache(capacity=1, kv=kv)  # a type the model cannot use fails here, not per request
    exact_step_threads(target)
    controller = drafter_controller(cfg.controller, drafter, cfg.n_draft, target, probe_extra=cfg.probe_extra)
    synth = cfg.synth_accept()
    if synth is not None:
        # a fixed depth: the rates alone set the acceptance, and two runs draft alike
        controller = None
        log.warning("synthetic acceptance is on (benchmarking only): drafts of %d tokens are accepted at rates %s "
                    "whatever the target says, so the output is NOT the model's", cfg.n_draft,
                    ", ".join(f"{p:.3g}" for p in synth))
    if not isinstance(drafter, NoDrafter):
        drift = target.verify_drift()
        if drift:
            log.warning("on this model llama.cpp's batched verify rows differ from one-token steps (logits up to "
                        "%.3g apart): greedy output with drafting may differ from plain decoding; --backend torch "
                        "keeps it exact (docs/performance.md, 'The llama backend')", drift)
    gen = SpeculativeGenerator(target, drafter, ctx_size=cfg.ctx_size, n_draft=cfg.n_draft, controller=controller,
                               kv=kv, synth_accept=synth)
    if warmup:
        gen.warmup()
    return gen
