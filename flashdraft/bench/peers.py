"""Peer engines on the same target: transformers ``generate()`` and llama.cpp.

- ``hf``: ``generate()`` greedy or sampled, on the very model object our engine uses.
- ``hf-lookup``: transformers prompt-lookup decoding (``prompt_lookup_num_tokens``).
- ``hf-dflash``: ``generate(assistant_model=..., speculation_type="dflash")`` with our DFlash
  drafter's weights (see :mod:`flashdraft.bench.hf_dflash`).
- ``hf-draft``: assisted generation with an autoregressive draft model (transformers'
  default, adaptive number of assistant tokens).
- ``llamacpp`` / ``llamacpp-lookup``: ``llama-cpp-python`` on the same GGUF file, plain and
  with its ``LlamaPromptLookupDecoding``.

llama.cpp's own server (``llama-server*``) and z-lab's reference loop (``zlab*``) have their
own modules: :mod:`flashdraft.bench.llama_server`, :mod:`flashdraft.bench.zlab`.

transformers' speculative counters are not exposed by ``generate()``; they are rebuilt from
what it does: a forward pre-hook on the target records each forward's input length
(1 anchor + drafts, or prompt + drafts on the first one) and a streamer records how many
tokens each forward added (accepted drafts + 1).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

from flashdraft.bench.contender import DESCRIPTIONS, BenchPrompt, Contender, Unavailable
from flashdraft.bench.measure import Generation, SpecCounts
from flashdraft.engine import EngineConfig, load_drafter
from flashdraft.sampling import SamplingParams
from flashdraft.targets.torch import Target, default_model_path, load_hf_model

HF_PEERS = ("hf", "hf-lookup", "hf-dflash", "hf-draft")
LLAMACPP_PEERS = ("llamacpp", "llamacpp-lookup")
LLAMACPP_INSTALL = "make llama: builds llama-cpp-python 0.3.36 from source, ~4 min on 2 cores"


# ---------------------------------------------------------------- transformers


class _TimingStreamer:
    """A ``generate(streamer=...)`` that only records when tokens arrive and how many.

    ``puts[0]`` is the prompt (transformers sends it first); each later entry is one
    forward's accepted tokens: ``(perf_counter seconds, count)``.
    """

    def __init__(self):
        self.puts: list[tuple[float, int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


class _ForwardLengths:
    """Context manager: input length of every forward of ``model`` while active."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.lengths, self._hook = model, [], None

    def _record(self, _module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.lengths.append(int(ids.shape[-1]))

    def __enter__(self) -> "_ForwardLengths":
        self._hook = self.model.register_forward_pre_hook(self._record, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()


def _spec_counts(prompt_len: int, lengths: list[int], puts: list[tuple[float, int]]) -> SpecCounts:
    """Rebuild counters: forward i proposed ``len_i - 1`` drafts (``- prompt_len`` on the
    first) and accepted ``added_i - 1`` of them."""
    counts = SpecCounts(steps=0)
    for i, (n_in, (_, n_out)) in enumerate(zip(lengths, puts[1:])):
        counts.add_step(n_in - (prompt_len if i == 0 else 1), n_out - 1)
    return counts


class HFContender(Contender):
    """``model.generate()`` on the target's transformers model with fixed extra arguments."""

    kind = "peer"
    # generate() has no grammar argument; a logits processor would have to track the
    # grammar through assisted generation's rejected candidates, which is not built here
    constraint_note = "transformers generate() takes no grammar, and no grammar logits processor is wired in"

    def __init__(self, name: str, target: Target, extra: dict, speculative: bool, note: str | None = None):
        self.name = name
        self.description = DESCRIPTIONS[name] + (f"; {note}" if note else "")
        self.target, self.extra, self.speculative = target, extra, speculative
        self.eos = sorted(target.eos_token_ids)
        self.pad = self.eos[0] if self.eos else 0

    def activate(self) -> None:
        # our engine's feature hooks would only add work to transformers' forwards
        self.target.set_feature_layers(None)

    def _sampling(self, params: SamplingParams) -> dict:
        if params.greedy:
            return {"do_sample": False}
        if params.seed is not None:
            torch.manual_seed(params.seed)
        # same filters in the same order as ours: temperature, top-k, top-p, min-p
        return {"do_sample": True, "temperature": params.temperature, "top_k": params.top_k,
                "top_p": params.top_p, "min_p": params.min_p or None}

    def run(self, prompt: BenchPrompt, params: SamplingParams) -> Generation:
        model = self.target.model
        n_prompt = len(prompt.ids)
        input_ids = torch.tensor([prompt.ids], dtype=torch.long)
        streamer = _TimingStreamer()
        sampling = self._sampling(params)
        with _ForwardLengths(model) as forwards:
            t0 = time.perf_counter()
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=prompt.max_tokens, eos_token_id=self.eos or None,
                                 pad_token_id=self.pad, streamer=streamer, **sampling, **self.extra)
            t_end = time.perf_counter()
        new = out[0, n_prompt:].tolist()
        finish = "length"
        for i, tok in enumerate(new):
            if tok in self.target.eos_token_ids:
                new, finish = new[:i], "stop"
                break
        first = streamer.puts[1][0] if len(streamer.puts) > 1 else t_end
        spec = _spec_counts(n_prompt, forwards.lengths, streamer.puts) if self.speculative else None
        return Generation(text=self.target.decode(new), token_ids=new, prompt_tokens=n_prompt,
                          completion_tokens=len(new), ttft_ms=1e3 * (first - t0), total_ms=1e3 * (t_end - t0),
                          finish_reason=finish, spec=spec)


def build_hf(name: str, target: Target, base: EngineConfig, draft_model: str | None,
             dflash_path: str | None) -> Contender | Unavailable:
    """transformers configuration ``name`` on ``target``'s model, or why it cannot run.

    Args:
        base: engine settings (``n_draft`` and ``ngram_max`` size prompt lookup like ours).
        draft_model: ``--draft-model`` path for ``hf-draft``.
        dflash_path: the DFlash drafter for ``hf-dflash`` (None = none available).
    """
    if target.model is None:
        return Unavailable(name, "peer", "transformers runs the target's torch model: use --backend torch")
    if name == "hf":
        return HFContender(name, target, {}, speculative=False)
    if name == "hf-lookup":
        return HFContender(name, target, {"prompt_lookup_num_tokens": base.n_draft,
                                          "max_matching_ngram_size": base.ngram_max}, speculative=True)
    if name == "hf-dflash":
        from flashdraft.bench.hf_dflash import HFDFlashUnsupported, draft_vocab_note, hf_dflash_assistant
        if dflash_path is None:
            return Unavailable(name, "peer", "no DFlash drafter for this target: pass -md PATH")
        # transformers runs the target in float32 and the assistant beside it: the same dtype
        cfg = EngineConfig(model=base.model, spec_type="dflash", draft_model=dflash_path, draft_dtype="f32")
        drafter = load_drafter(cfg, target).model
        try:
            assistant = hf_dflash_assistant(drafter)
        except HFDFlashUnsupported as e:
            return Unavailable(name, "peer", f"cannot be wrapped for transformers: {e}")
        return HFContender(name, target, {"assistant_model": assistant, "speculation_type": "dflash"},
                           speculative=True, note=draft_vocab_note(drafter))
    if name == "hf-draft":
        if not draft_model:
            return Unavailable(name, "peer", "no draft model: pass --draft-model PATH")
        if draft_model == "target":
            return Unavailable(name, "peer", "--draft-model target is a plumbing test of our engine only")
        assistant = load_hf_model(draft_model, torch.float32)[0]
        return HFContender(name, target, {"assistant_model": assistant}, speculative=True)
    raise ValueError(f"not a transformers configuration: {name}")


# ---------------------------------------------------------------- llama.cpp


class LlamaCppContender(Contender):
    """``llama_cpp.Llama.generate`` over the same prompt token ids (same vocabulary)."""

    kind = "peer"
    constraint_note = "llama-cpp-python's grammar (LlamaGrammar) is not passed by the bench yet"

    def __init__(self, name: str, gguf: Path, target: Target, threads: int, ctx_size: int,
                 lookup: bool, n_draft: int, ngram_max: int):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.name, self.description = name, DESCRIPTIONS[name]
        self.target = target  # for EOS ids and decoding only
        draft = LlamaPromptLookupDecoding(max_ngram_size=ngram_max, num_pred_tokens=n_draft) if lookup else None
        self.llm = Llama(model_path=str(gguf), n_ctx=ctx_size, n_threads=threads, n_threads_batch=threads,
                         draft_model=draft, verbose=False)

    def run(self, prompt: BenchPrompt, params: SamplingParams) -> Generation:
        llm = self.llm
        # forget the previous request: otherwise generate() reuses the cached prompt prefix
        llm.reset()
        if params.greedy:
            sampling = {"temp": 0.0}
        else:
            if params.seed is not None:
                llm.set_seed(params.seed)
            sampling = {"temp": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                        "min_p": params.min_p}
        ids, finish, first = [], "length", None
        t0 = time.perf_counter()
        stream = llm.generate(prompt.ids, repeat_penalty=1.0, **sampling)
        try:
            for tok in stream:
                first = first or time.perf_counter()
                if tok in self.target.eos_token_ids:
                    finish = "stop"
                    break
                ids.append(int(tok))
                if len(ids) >= prompt.max_tokens:
                    break
        finally:
            stream.close()
        t_end = time.perf_counter()
        return Generation(text=self.target.decode(ids), token_ids=ids, prompt_tokens=len(prompt.ids),
                          completion_tokens=len(ids), ttft_ms=1e3 * ((first or t_end) - t0),
                          total_ms=1e3 * (t_end - t0), finish_reason=finish)


def build_llamacpp(name: str, target: Target, model: str | None, base: EngineConfig,
                   threads: int) -> Contender | Unavailable:
    """llama.cpp configuration ``name`` on the target's GGUF, or why it cannot run."""
    if importlib.util.find_spec("llama_cpp") is None:
        return Unavailable(name, "peer", f"not installed ({LLAMACPP_INSTALL})")
    gguf = Path(model) if model is not None else default_model_path()
    if gguf.suffix != ".gguf":
        return Unavailable(name, "peer", "needs a GGUF target (-m FILE.gguf)")
    return LlamaCppContender(name, gguf, target, threads, base.ctx_size, lookup=name == "llamacpp-lookup",
                             n_draft=base.n_draft, ngram_max=base.ngram_max)
