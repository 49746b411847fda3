"""The target on llama.cpp's kernels (``--backend llama``): one ``llama_decode`` per step.

The contract of :mod:`flashdraft.targets.base`, as the torch :class:`~flashdraft.targets.torch.Target`: ``forward(token_ids, cache,
logits_from) -> (logits [T', V], features [T, F])`` and a cache that rolls back, so the
speculative loop, the drafters, sampling, constraints and the server do not know which
engine runs the target.

- One llama.cpp context holds every sequence (a unified KV cache); a :class:`LlamaCache`
  is one llama.cpp sequence id, and its ``rollback(n)`` is ``llama_memory_seq_rm(seq, n, -1)``.
- A verify step is one ``llama_decode`` over the anchor and the draft tokens with logits
  for every row; the server's parallel slots put all their rows in the same batch, one
  sequence id each (:meth:`LlamaTarget.forward_packed`). Prefill goes in ``n_ubatch`` chunks.
- Logits are a NumPy view of llama.cpp's own output buffer wrapped as a torch tensor: no
  copy, valid until the next decode on this target (the loop reads them before that).
- Context features (the outputs of ``feature_layer_ids``) are llama.cpp's layer inputs
  (``llama_get_embeddings_layer_inp(lid + 1)``: the input of layer i+1 is the output of
  layer i), the tensors its own DFlash reads.
- Embeddings and LM head for a DFlash drafter are read from the GGUF (dequantised by the
  ``gguf`` package, as transformers does), lazily: plain decoding never loads them.

Tokenizer and chat template are transformers' (read from the GGUF), as on the torch
backend, so both backends see the same token ids.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from flashdraft.targets.torch import ModelNotFoundError, TokenizerSide
from flashdraft.targets.binding import binding

log = logging.getLogger(__name__)

#: KV cache types llama.cpp knows (``--cache-type-k/-v``) -> ggml type ids
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
#: rows per llama_decode (n_batch = n_ubatch: the batch is never split behind our back). Below
#: ggml's GGML_FA_TILE_Q (64): from 64 query rows on, ggml's CPU flash attention takes a tiled
#: kernel that rounds otherwise, and a prefill of 64+ rows gave logits up to 1.2 away from the
#: same tokens stepped one by one (measured): a cached prompt would then answer otherwise than
#: the same prompt prefilled afresh. Under 64 rows every row is computed as a one-token step is.
#: ``-ub 512`` (llama.cpp's default) prefills long prompts 1.3-3x faster and gives up only that
#: (drafting still equals plain decoding: both prefill a prompt the same way).
DEFAULT_UBATCH = 48
#: most rows of one decode that packs several sequences (or verify blocks): under the tiled
#: kernel's 64, so a verify block packed beside another slot's prefill is still computed as
#: one-token steps are, whatever ``ubatch`` is; a longer item runs in decodes of its own
PACK_ROWS = 48
#: ``--repack`` values (LlamaTarget's ``repack``)
REPACK_MODES = ("auto", "on", "off")


class LlamaCache:
    """One sequence's K/V in the llama.cpp context: a sequence id and a length.

    Attributes:
        seq_id: the llama.cpp sequence id.
        length: positions ``0..length-1`` whose K/V are stored.
    """

    def __init__(self, target: "LlamaTarget", seq_id: int):
        self._target = weakref.ref(target)
        self.seq_id: int | None = seq_id
        self.length = 0
        self.last_used = 0

    def rollback(self, length: int) -> None:
        """Drop the K/V of every position >= ``length`` (``llama_memory_seq_rm``).

        Raises:
            ValueError: ``length`` is negative or beyond what the cache holds.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds only {self.length}")
        if self.seq_id is None:
            raise RuntimeError("this cache was evicted (more live sequences than the context holds)")
        if length < self.length:
            target = self._target()
            target._seq_rm(self.seq_id, length)
        self.length = length

    def shift(self, n_keep: int, n_discard: int) -> None:
        """llama-server's context shift: drop positions ``n_keep .. n_keep + n_discard - 1``
        (``llama_memory_seq_rm``) and move the later ones down by ``n_discard``
        (``llama_memory_seq_add``; llama.cpp re-rotates the moved keys before the next decode).

        Raises:
            ValueError: a span outside what the cache holds.
        """
        if n_keep < 0 or n_discard < 0 or n_keep + n_discard > self.length:
            raise ValueError(f"cannot shift out {n_discard} positions after {n_keep}: cache holds {self.length}")
        if self.seq_id is None:
            raise RuntimeError("this cache was evicted (more live sequences than the context holds)")
        if n_discard:
            self._target()._shift(self.seq_id, n_keep, n_discard, self.length)
        self.length -= n_discard

    def _evict(self) -> int:
        """Give up the sequence id (the target needs it for a new cache): length becomes 0, so a
        prompt cache holding this reuses nothing. Returns the id, emptied."""
        seq, self.seq_id, self.length = self.seq_id, None, 0
        self._target()._seq_rm(seq, 0)
        return seq

    def __del__(self):
        target = self._target()
        if target is not None and self.seq_id is not None:
            target._release(self.seq_id)


class CacheSnapshot:
    """A sequence's K/V copied to host memory (:meth:`LlamaTarget.save_cache`): ``data``
    (llama.cpp's sequence state), ``length`` positions, ``nbytes``."""

    def __init__(self, data, length: int, nbytes: int):
        self.data, self.length, self.nbytes = data, length, nbytes


#: GGUF architectures whose llama.cpp graph (this vendored version) records each layer's input,
#: so ``llama_get_embeddings_layer_inp`` can return DFlash context features; asking another
#: graph for them aborts in ``llm_graph_result::set_outputs`` (e.g. ``gemma3``)
LAYER_INPUT_ARCHS = frozenset({"llama", "qwen3", "qwen3moe", "qwen3next", "gemma3n", "lfm2"})


class LlamaTarget(TokenizerSide):
    """A GGUF target run by llama.cpp (:class:`flashdraft.targets.base.Target`). See the module
    docstring for the design.

    Args:
        path: the ``.gguf`` file.
        n_ctx: positions per sequence (``-c``).
        n_seq: sequences decoded together (``-np``); the context holds ``2 * n_seq + 1``
            sequences of ``n_ctx`` positions each (a prompt cache kept per slot fits beside
            them); past that, the least recently used cache is evicted.
        threads: CPU threads (``-t``).
        cache_type_k / cache_type_v: KV cache types, keys of :data:`KV_TYPES` (``-ctk/-ctv``).
        ubatch: rows per ``llama_decode``.
        warn: log the startup line.
        tokenizer: a transformers tokenizer to use instead of the GGUF's (tests' tiny models).
        repack: ``auto`` (default): ggml's repacked weight layouts (faster multi-row kernels for
            Q4_0, Q4_K, IQ4_NL, BF16 ...) where a verify block then still equals one-token steps
            bit for bit on this CPU, checked at load, else the plain layout; ``on``: repacked
            regardless (measurement only: drafting may then change greedy output); ``off``: plain.
    Raises:
        BindingUnavailableError: the binding is missing or broken (names the fix).
        ValueError: an unknown cache type, or a file llama.cpp cannot load.
    """

    backend = "llama"

    def __init__(self, path: str | Path, n_ctx: int = 4096, n_seq: int = 1, threads: int = 1,
                 cache_type_k: str = "f32", cache_type_v: str = "f32", ubatch: int = DEFAULT_UBATCH,
                 warn: bool = True, tokenizer=None, repack: str = "auto"):
        for kind in (cache_type_k, cache_type_v):
            if kind not in KV_TYPES:
                raise ValueError(f"--backend llama: cache type {kind!r} is not one llama.cpp knows; "
                                 f"choose from {', '.join(KV_TYPES)}")
        b = self._b = binding()
        lib = b.api
        path = Path(path)
        if not path.is_file():
            raise ModelNotFoundError(f"model file not found: {path}")
        self.path, self.name = path, path.stem
        if repack not in REPACK_MODES:
            raise ValueError(f"--repack {repack!r}: choose from {', '.join(REPACK_MODES)}")
        self.repack_mib = 0.0
        self._model, self.repack_mib = b.load_model(path, repack != "off")
        if not self._model:
            raise ValueError(f"llama.cpp could not load {path} (not a GGUF model it supports)")
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(self._vocab))
        self.hidden_size = int(lib.llama_model_n_embd(self._model))
        self.num_layers = int(lib.llama_model_n_layer(self._model))
        # one KV stream per sequence (not llama.cpp's unified cache): a sequence's cells then stay
        # in position order through rollbacks, and flash attention sums them in that order, so
        # -np packing leaves every sequence's logits bit-identical to decoding it alone (with a
        # unified cache another sequence's freed cells broke that: greedy drifted, tested)
        self.ubatch = ubatch
        self.threads = threads
        # one-token steps on every thread where the loaded ggml can keep a row's attention on
        # one thread (binding.FA_SPLIT_KV_ENV), else on one: see _make_context
        self.exact_step_threads = threads if b.exact_threaded_steps else 1
        self._step_threads = self.exact_step_threads
        self.n_ctx = n_ctx
        self.cache_types = (cache_type_k, cache_type_v)
        self._ctx = None
        self._feature_layer_ids: list[int] = []
        self._make_context(2 * n_seq + 1)  # each slot's sequence and prompt cache, one spare
        self._batch = lib.llama_batch_init(ubatch, 0, 1)
        # NumPy views of the batch's arrays: a step fills them without a Python loop
        self._tok = np.ctypeslib.as_array(self._batch.token, shape=(ubatch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(ubatch,))
        self._nsq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(ubatch,))
        self._out = np.ctypeslib.as_array(self._batch.logits, shape=(ubatch,))
        self._nsq[:] = 1
        self._seq_ptrs = [self._batch.seq_id[i] for i in range(ubatch)]
        self._live: "weakref.WeakValueDictionary[int, LlamaCache]" = weakref.WeakValueDictionary()
        self._clock = 0  # forwards so far: a cache's last use, for eviction
        self._lock = threading.Lock()
        self._embed = self._head = None
        self.device = torch.device("cpu")
        self.lean = None
        self.model = None  # no transformers model: `-md target` and training need --backend torch
        self.weights = "gguf"
        self._load_tokenizer(tokenizer)
        self.repack = "on" if self.repack_mib else "off"
        if repack == "auto" and self.repack_mib and self._repack_drifts():
            # the repacked kernels round a verify row otherwise than a one-token step on this
            # CPU and weight type: lossless drafting needs them equal, so load the plain layout
            self._reload_without_repack()
            self.repack = "off (repacked kernels changed verify rows here)"
        if warn:
            log.info("target %s on llama.cpp (%s): %d layers, hidden %d, vocab %d, %d threads, KV %s; %s; "
                     "repacked weights: %s", self.name, b.version, self.num_layers, self.hidden_size,
                     self.vocab_size, threads, "/".join(self.cache_types), b.cpu.describe(),
                     f"{self.repack} ({self.repack_mib:.0f} MiB)" if self.repack_mib else self.repack)

    def _repack_drifts(self) -> bool:
        """True where a verify block of any size 2..16 differs from one-token steps with the
        repacked weights (checked at 2, 5 and 16 rows: a 4-row kernel's tail, the tiled path)."""
        return any(self.verify_drift(k) > 0 for k in (2, 5, 16))

    def _reload_without_repack(self) -> None:
        lib = self._b.api
        self.__dict__.pop("_drift", None)
        lib.llama_free(self._ctx)
        self._ctx = None
        lib.llama_model_free(self._model)
        self._model, self.repack_mib = self._b.load_model(self.path, False)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.path} (not a GGUF model it supports)")
        self._vocab = lib.llama_model_get_vocab(self._model)
        self._live.clear()
        self._make_context(self.n_seq_max)

    def _make_context(self, n_seq_max: int) -> None:
        lib = self._b.api
        cp = lib.llama_context_default_params()
        # one KV stream per sequence (not llama.cpp's unified cache): a sequence's cells then stay
        # in position order through rollbacks, and flash attention sums them in that order, so
        # -np packing leaves every sequence's logits bit-identical to decoding it alone (with a
        # unified cache another sequence's freed cells broke that: greedy drifted, tested)
        self.n_seq_max = min(256, n_seq_max)
        cp.kv_unified = False
        cp.n_seq_max = self.n_seq_max
        cp.n_ctx = self.n_ctx * self.n_seq_max  # n_ctx positions per stream
        cp.n_batch = cp.n_ubatch = self.ubatch
        if any(f[0] == "n_outputs_max" for f in type(cp)._fields_):
            # llama.cpp reserves one output row per sequence at creation and asserts that this
            # fits n_outputs_max (default n_batch): more sequences than ubatch rows aborted
            cp.n_outputs_max = max(self.ubatch, self.n_seq_max)
        # one-token steps on exact_step_threads: stock ggml splits a single row's attention over
        # the KV cache across threads (0.77 apart at a 300-token context), which rounds otherwise
        # than the row-wise attention of a verify block, so there steps run on one thread; the
        # patched ggml `make llama` builds keeps the row on one thread, and steps use all of
        # them. Batches (verify, prefill, -np packs) always use every thread. Plain decoding
        # too, so every mode gives the same tokens (engine.exact_step_threads)
        cp.n_threads = self._step_threads
        cp.n_threads_batch = self.threads
        cp.type_k, cp.type_v = (KV_TYPES[t] for t in self.cache_types)
        cp.no_perf = True
        # flash attention on: it attends row by row, so a verify block's rows get the logits of
        # one-token steps bit for bit; without it the batched K/V matmuls round otherwise and
        # greedy drafting drifted from plain decoding (tested). On an f32 cache it is 2.2x
        # slower per step than on f16 (28 vs 13 ms here), hence f16 by default (engine.py)
        cp.flash_attn_type = 1
        ctx = lib.llama_init_from_model(self._model, cp)
        if not ctx:
            raise ValueError(f"llama.cpp could not create a context for {self.path} ({self.n_seq_max} sequences of "
                             f"{self.n_ctx} positions, cache types {'/'.join(self.cache_types)})")
        if self._ctx is not None:
            lib.llama_free(self._ctx)
        self._ctx = ctx
        self._mem = lib.llama_get_memory(ctx)
        self._free_seqs = list(range(self.n_seq_max))
        self._to_release = []
        if self._feature_layer_ids:
            for i in self._feature_layer_ids:
                self._b.set_layer_inp(ctx, i + 1, True)

    def set_step_threads(self, n: int) -> None:
        """Threads for one-token steps (default :attr:`exact_step_threads`, see
        :meth:`_make_context`). More than that makes steps faster on a stock ggml and no longer
        equal to verify rows: for measurements only."""
        self._step_threads = max(1, n)
        self._b.api.llama_set_n_threads(self._ctx, self._step_threads, self.threads)

    def ensure_sequences(self, n: int) -> None:
        """Make room for ``n`` live sequences (the server's slots: a sequence and a prompt
        cache each). A larger context replaces the current one, and every cache made before
        is evicted (empty): call it before serving, as :func:`flashdraft.batch.make_slots` does."""
        if n <= self.n_seq_max:
            return
        with self._lock:
            for cache in list(self._live.values()):
                cache.seq_id, cache.length = None, 0
            self._live.clear()
            self._make_context(n)

    @classmethod
    def load(cls, path: str | Path, **kw) -> "LlamaTarget":
        """:class:`LlamaTarget` (the constructor's arguments)."""
        return cls(path, **kw)

    def close(self) -> None:
        """Free the llama.cpp context and model (also at garbage collection)."""
        lib = self._b.api
        if getattr(self, "_ctx", None) is not None:
            lib.llama_batch_free(self._batch)
            lib.llama_free(self._ctx)
            lib.llama_model_free(self._model)
            self._ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- tokenizer, chat template, metadata (transformers', read from the GGUF) --------------
    def _load_tokenizer(self, tokenizer=None) -> None:
        from transformers import AutoTokenizer

        src, name = str(self.path.parent), self.path.name
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(src, gguf_file=name)
        # what callers read of a config, from llama.cpp (transformers' GGUF config parse took 3 s)
        api = self._b.api
        eos = int(api.llama_vocab_eos(self._vocab))
        self.config = SimpleNamespace(max_position_embeddings=int(api.llama_model_n_ctx_train(self._model)),
                                      eos_token_id=eos if eos >= 0 else None, model_type=self.architecture)
        ids = set()
        for src_ids in (self.config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(src_ids, int):
                ids.add(src_ids)
            elif isinstance(src_ids, (list, tuple)):
                ids.update(int(i) for i in src_ids)
        self.eos_token_ids = ids

    @property
    def architecture(self) -> str | None:
        """The GGUF's ``general.architecture`` (``llama``, ``gemma3``, ...), None if it has none."""
        buf = ctypes.create_string_buffer(64)
        n = self._b.api.llama_model_meta_val_str(self._model, b"general.architecture", buf, 64)
        return buf.value.decode() if n > 0 else None

    @property
    def fast(self) -> bool:
        return False

    # -- drafter's embeddings and LM head (from the GGUF, on first use) -----------------------
    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        """The target's token embeddings ``[V, H]`` as a frozen torch module (for a DFlash drafter)."""
        if self._embed is None:
            self._read_head()
        return self._embed

    @property
    def lm_head(self) -> torch.nn.Linear:
        """The target's LM head ``[V, H]`` (the embeddings when tied) as a frozen torch module."""
        if self._head is None:
            self._read_head()
        return self._head

    def _read_head(self) -> None:
        from gguf import GGUFReader
        from gguf.quants import dequantize

        reader = GGUFReader(str(self.path))
        tensors = {t.name: t for t in reader.tensors}

        def weight(name: str) -> torch.Tensor:
            t = tensors[name]
            w = dequantize(t.data, t.tensor_type).reshape(self.vocab_size, self.hidden_size)
            return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))

        emb = weight("token_embd.weight")
        self._embed = torch.nn.Embedding.from_pretrained(emb, freeze=True)
        head = weight("output.weight") if "output.weight" in tensors else emb
        self._head = torch.nn.Linear(self.hidden_size, self.vocab_size, bias=False)
        self._head.weight = torch.nn.Parameter(head, requires_grad=False)
        # Gemma-style models scale the embeddings inside the graph; a drafter trained on the
        # torch path reads the same module, so nothing else changes here

    # -- context features ---------------------------------------------------------------------
    def set_feature_layers(self, layer_ids: list[int] | None) -> None:
        """Capture the outputs of these decoder layers (0-based) in :meth:`forward`.

        Raises:
            ValueError: a layer id outside ``[0, num_layers - 1)`` (llama.cpp exposes layer
                inputs, so the last layer's output has none), a binding without the
                llama-ext functions, or an architecture outside :data:`LAYER_INPUT_ARCHS`.
        """
        layer_ids = list(layer_ids or [])
        b = self._b
        arch = self.architecture
        if layer_ids and arch not in LAYER_INPUT_ARCHS:  # llama.cpp aborts the process (GGML_ASSERT)
            raise ValueError(f"the llama backend cannot read context features of a {arch} target: llama.cpp's "
                             f"{arch} graph does not export its layer inputs (it does for "
                             f"{', '.join(sorted(LAYER_INPUT_ARCHS))}); use --backend torch for DFlash on it")
        if layer_ids and (b.set_layer_inp is None or b.get_layer_inp is None):
            raise ValueError(f"{b.version} does not export llama_set/get_embeddings_layer_inp: DFlash features "
                             "need them; use --backend torch")
        for i in layer_ids:
            if not 0 <= i < self.num_layers - 1:
                raise ValueError(f"target layer id {i} out of range for the llama backend on a "
                                 f"{self.num_layers}-layer target (0..{self.num_layers - 2})")
        for i in self._feature_layer_ids:
            if i not in layer_ids:
                b.set_layer_inp(self._ctx, i + 1, False)
        for i in layer_ids:
            b.set_layer_inp(self._ctx, i + 1, True)
        self._feature_layer_ids = layer_ids

    @property
    def feature_size(self) -> int:
        return len(self._feature_layer_ids) * self.hidden_size

    def verify_drift(self, k: int = 8) -> float:
        """Max |logit| difference between a k-row verify and k one-token steps over the same
        tokens (0.0: bit-identical, so greedy drafting reproduces plain decoding exactly).

        Measured once per target and k on a fixed text (2k + 4 forwards, a fraction of a
        second). 0.0 on SmolLM2's Q4_1 GGUF and, with ggml's tiled K-quant matmul off
        (:data:`~flashdraft.targets.binding.TILED_MM_ENV`), on Gemma 3's Q4_K_M (1.63 with it on,
        from 8 rows: docs/performance.md, "The llama backend").
        """
        drift = self.__dict__.setdefault("_drift", {})
        if k not in drift:
            ids = self.encode("The quick brown fox jumps over the lazy dog. " * 3)
            ids = (ids * (1 + (k + 9) // max(len(ids), 1)))[: k + 8]
            prompt, block = ids[:8], ids[8:8 + k]
            a, b = self.new_cache(), self.new_cache()
            self.forward(torch.tensor(prompt), a, len(prompt) - 1)
            self.forward(torch.tensor(prompt), b, len(prompt) - 1)
            rows = self.forward(torch.tensor(block), a)[0].clone()
            steps = torch.cat([self.forward(torch.tensor([x]), b)[0].clone() for x in block])
            drift[k] = float((rows - steps).abs().max())
        return drift[k]

    # -- sequences ------------------------------------------------------------------------------
    def new_cache(self, capacity: int | None = None, fast: bool | None = None, kv=None) -> LlamaCache:
        """An empty sequence in the shared context.

        Args:
            capacity / fast: ignored (llama.cpp's context is sized at load).
            kv: a :class:`~flashdraft.kv_cache.KVCacheSpec`: the types this context was made
                with (``-ctk/-ctv`` set them at load), no sink/tail tokens.
        Raises:
            ValueError: other cache types, or sink/tail tokens (the torch backend's codecs).
            RuntimeError: every sequence id is in use.
        """
        if kv is not None and ((kv.type_k, kv.type_v) != self.cache_types or kv.sink_tokens or kv.tail_tokens):
            raise ValueError(f"--backend llama: this context holds {'/'.join(self.cache_types)} K/V, not "
                             f"{kv.label()}; sink/tail tokens and turbo/q3 types are the torch backend's")
        self._drain()
        if not self._free_seqs:  # evict the least recently used cache (an idle prompt cache)
            victim = min(self._live.values(), key=lambda c: c.last_used)
            self._free_seqs.append(victim._evict())
        seq = self._free_seqs.pop(0)
        self._b.api.llama_memory_seq_rm(self._mem, seq, 0, -1)
        cache = LlamaCache(self, seq)
        cache.last_used = self._clock
        self._live[seq] = cache
        return cache

    def save_cache(self, cache: LlamaCache) -> "CacheSnapshot":
        """A host copy of ``cache``'s K/V (``llama_state_seq_get_data``); the cache stays as it is.

        Raises:
            RuntimeError: the cache was evicted, or llama.cpp wrote less than it sized.
        """
        if cache.seq_id is None:
            raise RuntimeError("this cache was evicted (more live sequences than the context holds)")
        api = self._b.api
        size = int(api.llama_state_seq_get_size(self._ctx, cache.seq_id))
        buf = (ctypes.c_uint8 * size)()
        if int(api.llama_state_seq_get_data(self._ctx, buf, size, cache.seq_id)) != size:
            raise RuntimeError(f"llama.cpp did not copy the {size} bytes of sequence {cache.seq_id}")
        return CacheSnapshot(buf, cache.length, size)

    def load_cache(self, snapshot: "CacheSnapshot") -> LlamaCache:
        """A new cache holding ``snapshot``'s K/V (``llama_state_seq_set_data``).

        Raises:
            RuntimeError: llama.cpp could not restore it (e.g. no room in the context).
        """
        cache = self.new_cache()
        n = int(self._b.api.llama_state_seq_set_data(self._ctx, snapshot.data, snapshot.nbytes, cache.seq_id))
        if n != snapshot.nbytes:
            raise RuntimeError(f"llama.cpp restored {n} of {snapshot.nbytes} bytes of a saved prompt")
        cache.length = snapshot.length
        return cache

    def free_cache(self, cache: LlamaCache) -> None:
        """Give ``cache``'s sequence back now (it holds nothing after)."""
        if cache.seq_id is not None:
            seq = cache._evict()
            self._live.pop(seq, None)
            self._free_seqs.append(seq)

    @property
    def can_shift(self) -> bool:
        """Whether llama.cpp can move this context's cached positions (``llama_memory_can_shift``)."""
        return bool(self._b.api.llama_memory_can_shift(self._mem))

    def _shift(self, seq: int, n_keep: int, n_discard: int, length: int) -> None:
        with self._lock:
            api = self._b.api
            if not api.llama_memory_seq_rm(self._mem, seq, n_keep, n_keep + n_discard):
                raise RuntimeError(f"llama.cpp could not drop positions {n_keep}..{n_keep + n_discard - 1} of sequence {seq}")
            api.llama_memory_seq_add(self._mem, seq, n_keep + n_discard, length, -n_discard)

    def _seq_rm(self, seq: int, start: int) -> None:
        if not self._b.api.llama_memory_seq_rm(self._mem, seq, start, -1):
            raise RuntimeError(f"llama.cpp refused to remove positions >= {start} of sequence {seq}")

    def _release(self, seq: int) -> None:
        # called from __del__ (any thread): freed on the owner's next call
        self._to_release.append(seq)

    def _drain(self) -> None:
        while self._to_release:
            seq = self._to_release.pop()
            if self._ctx is not None:
                self._b.api.llama_memory_seq_rm(self._mem, seq, 0, -1)
            self._free_seqs.append(seq)

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, token_ids: torch.Tensor, cache: LlamaCache,
                logits_from: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the target over ``token_ids`` appended at position ``cache.length``.

        Args:
            token_ids: ``[T]`` ids.
            cache: the sequence (:meth:`new_cache`); grows by T positions.
            logits_from: logits only for rows ``>= logits_from`` (prefill: the last row).
        Returns:
            ``(logits [T - logits_from, V] float32, features [T, len(layer_ids)*H] or None)``.
            The logits may be a view of llama.cpp's buffer: valid until the next forward.
        Raises:
            RuntimeError: llama_decode failed (no room left in the context, or an error).
        """
        return self.forward_packed([(token_ids, cache, logits_from)])[0]

    def forward_packed(self, items: list[tuple[torch.Tensor, LlamaCache, int]]
                       ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """:meth:`forward` for several sequences in one ``llama_decode`` (the server's slots).

        Consecutive items share a decode while their rows fit :data:`PACK_ROWS` (and
        ``ubatch``); a longer item (a prefill) runs alone, in ``ubatch``-row chunks. Returns per
        item ``(logits [T_i - logits_from_i, V], features [T_i, F] or None)``.
        """
        with self._lock:
            self._drain()
            limit = min(self.ubatch, PACK_ROWS)
            groups, group, rows = [], [], 0  # consecutive items in decodes of <= limit rows
            for i, (t, c, lf) in enumerate(items):
                T = int(t.shape[0])
                if group and (rows + T > limit or T > limit):
                    groups.append(group)
                    group, rows = [], 0
                group.append(i)
                rows += T
                if T > limit:  # alone: its rows must not change how a packed block is computed
                    groups.append(group)
                    group, rows = [], 0
            if group:
                groups.append(group)
            out: list = [None] * len(items)
            for g, members in enumerate(groups):
                last = g == len(groups) - 1  # earlier decodes' logits views are overwritten: copy them
                if len(members) == 1 and int(items[members[0]][0].shape[0]) > self.ubatch:
                    t, c, lf = items[members[0]]
                    lg, ft = self._forward_long(t.tolist(), c, lf)
                    out[members[0]] = (lg if last else lg.clone(), ft)
                    continue
                for i, (lg, ft) in zip(members, self._decode([(items[i][0].tolist(), items[i][1], items[i][2])
                                                               for i in members])):
                    out[i] = (lg if last else lg.clone(), ft)
            return out

    def _forward_long(self, ids: list[int], cache: LlamaCache, logits_from: int):
        # one sequence, chunked; logits are copied unless they all come from the last chunk
        logits, feats = [], []
        chunks = list(range(0, len(ids), self.ubatch))
        for k, start in enumerate(chunks):
            part = ids[start:start + self.ubatch]
            lf = min(max(logits_from - start, 0), len(part))
            last = k == len(chunks) - 1
            (lg, ft), = self._decode([(part, cache, lf)])
            if lg.shape[0]:
                logits.append(lg if last else lg.clone())
            if ft is not None:
                feats.append(ft)
        if not logits:  # no row asked for logits (a chunk of a prompt that goes on)
            lg = torch.empty(0, self.vocab_size)
        else:
            lg = logits[0] if len(logits) == 1 else torch.cat(logits)
        return lg, (torch.cat(feats) if feats else None)

    def _decode(self, items: list[tuple[list[int], LlamaCache, int]]):
        b, lib = self._b, self._b.api
        n = 0
        for ids, cache, lf in items:
            if cache.seq_id is None:
                raise RuntimeError("a cache of this target was evicted: more live sequences than the context "
                                   f"holds ({self.n_seq_max}); call ensure_sequences() first")
            T = len(ids)
            self._tok[n:n + T] = ids
            self._pos[n:n + T] = np.arange(cache.length, cache.length + T, dtype=np.int32)
            self._out[n:n + T] = 0
            self._out[n + lf:n + T] = 1
            for i in range(n, n + T):
                self._seq_ptrs[i][0] = cache.seq_id
            n += T
        self._batch.n_tokens = n
        self._clock += 1
        rc = lib.llama_decode(self._ctx, self._batch)
        if rc != 0:
            # positions of a failed batch are not kept (llama.cpp rolls the ubatch back)
            raise RuntimeError(f"llama_decode failed with code {rc}"
                               + (" (no room left in the context: raise -c, or fewer parallel slots)" if rc == 1 else ""))
        n_out = int(self._out[:n].sum())
        V = self.vocab_size
        all_logits = None
        if n_out:
            buf = np.ctypeslib.as_array(lib.llama_get_logits(self._ctx), shape=(n_out, V))
            all_logits = torch.from_numpy(buf)  # a view of llama.cpp's buffer, no copy
        feats = None
        if self._feature_layer_ids:
            H = self.hidden_size
            feats = torch.cat([torch.from_numpy(np.ctypeslib.as_array(b.get_layer_inp(self._ctx, i + 1), shape=(n, H)))
                               for i in self._feature_layer_ids], dim=-1)  # [n, F]: a copy (the buffer is reused)
        out, row, o = [], 0, 0
        for ids, cache, lf in items:
            T = len(ids)
            k = T - lf
            lg = all_logits[o:o + k] if k else torch.empty(0, V)
            out.append((lg, None if feats is None else feats[row:row + T]))
            cache.length += T
            cache.last_used = self._clock
            row += T
            o += k
        return out
