"""Response bodies: OpenAI chat / text completions and llama-server's ``/completion``.

Every completion carries llama-server's ``timings`` (:meth:`Timings.to_dict`) and
``usage`` with ``completion_tokens == timings.predicted_n``: both count exactly the
returned tokens, never anything after a stop.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import flashdraft
from flashdraft.generate import Timings, TokenLogprob

SSE_DONE = b"data: [DONE]\n\n"
#: OpenAI's ``system_fingerprint``: which build answered (llama-server sends its build id)
SYSTEM_FINGERPRINT = f"flashdraft-{flashdraft.__version__}"


@dataclass
class Completion:
    """A finished generation, as the routes see it."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    timings: Timings | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class ResponseMeta:
    """What every chunk of one response repeats."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, prefix: str, model: str) -> "ResponseMeta":
        """A fresh id like ``chatcmpl-<hex>``."""
        return cls(f"{prefix}-{uuid.uuid4().hex[:24]}", model)


def sse(obj: dict) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class Logprobs:
    """Writes :class:`TokenLogprob` lists in each API's shape.

    Args:
        piece: ``token_id -> (text, bytes)``: the token's text and its raw bytes (as a
            list of ints, what OpenAI's ``bytes`` holds).
        n_top: alternatives to list per token (OpenAI's ``top_logprobs`` may be 0 while
            ``logprobs: true`` still returns each token's own log-probability).
    """

    def __init__(self, piece: Callable[[int], tuple[str, list[int]]], n_top: int, post_sampling: bool = False):
        self.piece, self.n_top, self.post_sampling = piece, n_top, post_sampling

    def _entry(self, token_id: int, logprob: float) -> dict:
        text, raw = self.piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    def chat(self, lps: list[TokenLogprob]) -> dict:
        """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(i, v) for i, v in lp.top[: self.n_top]]} for lp in lps]}

    def completion(self, lps: list[TokenLogprob], offset: int = 0) -> dict:
        """OpenAI (legacy) completions ``logprobs``: parallel lists; ``text_offset`` in characters
        from the start of the answer (``offset`` for a streamed chunk)."""
        tokens, offsets, pos = [], [], offset
        for lp in lps:
            text = self.piece(lp.token_id)[0]
            tokens.append(text)
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self.piece(i)[0]: v for i, v in lp.top[: self.n_top]} for lp in lps],
                "text_offset": offsets}

    def llama(self, lps: list[TokenLogprob]) -> list[dict]:
        """llama-server ``completion_probabilities``: ``[{id, token, bytes, logprob, top_logprobs}]``;
        with ``post_sampling_probs``, ``prob`` and ``top_probs`` (probabilities, as llama-server)."""
        if self.post_sampling:
            def entry(i: int, v: float) -> dict:
                text, raw = self.piece(i)
                return {"id": i, "token": text, "bytes": raw, "prob": math.exp(v)}
            return [{**entry(lp.token_id, lp.logprob), "top_probs": [entry(i, v) for i, v in lp.top[: self.n_top]]}
                    for lp in lps]
        return [{"id": lp.token_id, **self._entry(lp.token_id, lp.logprob),
                 "top_logprobs": [{"id": i, **self._entry(i, v)} for i, v in lp.top[: self.n_top]]} for lp in lps]


def usage(t: Timings) -> dict:
    """OpenAI ``usage``: the whole prompt (prefilled + reused from the prompt cache, the
    latter also in ``prompt_tokens_details.cached_tokens``) and the returned tokens."""
    prompt = t.prompt_n + t.cache_n
    return {"prompt_tokens": prompt, "completion_tokens": t.predicted_n, "total_tokens": prompt + t.predicted_n,
            "prompt_tokens_details": {"cached_tokens": t.cache_n}}


# -- /v1/chat/completions ------------------------------------------------------------------

def chat_response(meta: ResponseMeta, c: Completion, timings: dict, logprobs: Logprobs | None = None,
                  tool_calls: list[dict] | None = None) -> dict:
    """Non-streamed ``chat.completion``; with ``tool_calls``, the message carries them (no
    content) and ``finish_reason`` is ``tool_calls``."""
    message = {"role": "assistant", "content": c.text}
    finish = c.finish_reason
    if tool_calls:
        message, finish = {"role": "assistant", "content": None, "tool_calls": tool_calls}, "tool_calls"
    return {
        "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{"index": 0, "message": message,
                     "logprobs": logprobs.chat(c.logprobs) if logprobs else None, "finish_reason": finish}],
        "usage": usage(c.timings), "timings": timings,
    }


def chat_batch_response(meta: ResponseMeta, results: list[Completion], timings: list[dict],
                        logprobs: Logprobs | None = None, tool_calls: list[list[dict] | None] | None = None) -> dict:
    """Non-streamed ``chat.completion`` with ``n`` choices: one per result (``index`` in
    order, each with its own ``timings``); usage counts the prompt once, as OpenAI does, and
    the tokens of every choice."""
    calls = tool_calls or [None] * len(results)
    body = chat_response(meta, results[0], timings[0], logprobs, calls[0])
    body["choices"] = [{**chat_response(meta, c, t, logprobs, k)["choices"][0], "index": i, "timings": t}
                       for i, (c, t, k) in enumerate(zip(results, timings, calls))]
    first = results[0].timings
    total = Timings(prompt_n=first.prompt_n, cache_n=first.cache_n,
                    predicted_n=sum(c.timings.predicted_n for c in results))
    body["usage"] = usage(total)
    return body


def chat_chunk(meta: ResponseMeta, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    """One streamed ``chat.completion.chunk``."""
    return {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


# -- /v1/completions -----------------------------------------------------------------------

def completion_response(meta: ResponseMeta, c: Completion, timings: dict, logprobs: Logprobs | None = None) -> dict:
    """Non-streamed ``text_completion``."""
    return {
        "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{"index": 0, "text": c.text, "logprobs": logprobs.completion(c.logprobs) if logprobs else None,
                     "finish_reason": c.finish_reason}],
        "usage": usage(c.timings), "timings": timings,
    }


def completion_batch_response(meta: ResponseMeta, results: list[Completion], timings: list[dict],
                              logprobs: Logprobs | None = None) -> dict:
    """Non-streamed ``text_completion`` for several prompts: one choice per prompt (``index``
    in order, each with its own ``timings``), usage summed over them."""
    total = Timings(prompt_n=sum(c.timings.prompt_n for c in results),
                    cache_n=sum(c.timings.cache_n for c in results),
                    predicted_n=sum(c.timings.predicted_n for c in results))
    return {
        "id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [{"index": i, "text": c.text, "logprobs": logprobs.completion(c.logprobs) if logprobs else None,
                     "finish_reason": c.finish_reason, "timings": t}
                    for i, (c, t) in enumerate(zip(results, timings))],
        "usage": usage(total),
    }


def completion_chunk(meta: ResponseMeta, text: str, finish_reason: str | None = None,
                     logprobs: dict | None = None) -> dict:
    """One streamed ``text_completion`` chunk."""
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(meta: ResponseMeta, obj: str, c: Completion, timings: dict) -> dict:
    """The stream's last chunk, after the one with ``finish_reason``: no choices, ``usage``
    and ``timings`` (llama-server sends it with or without ``stream_options.include_usage``;
    OpenAI's clients read usage from it)."""
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model,
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [], "usage": usage(c.timings), "timings": timings}


# -- /completion (llama-server) ------------------------------------------------------------

def stop_details(decode: Callable[[list[int]], str], c: Completion, stops: list[str]) -> tuple[str, str]:
    """llama-server's ``(stop_type, stopping_word)``: ``eos`` | ``word`` | ``limit``.

    The loop reports only ``stop``/``length``; a stop string cut the text short exactly
    when the decoded tokens run past the returned text, and the stop string is what
    follows it there.
    """
    if c.finish_reason == "length":
        return "limit", ""
    full = decode(c.token_ids)
    if len(full) > len(c.text) and full.startswith(c.text):
        for s in stops:
            if s and full.startswith(s, len(c.text)):
                return "word", s
    return "eos", ""


def llama_response(c: Completion, timings: dict, model: str, prompt_n: int, stop_type: str,
                   stopping_word: str, settings: dict, return_tokens: bool = False,
                   logprobs: Logprobs | None = None, prompt: str = "") -> dict:
    """Non-streamed (or final streamed) ``/completion`` body; ``tokens`` is empty unless
    ``return_tokens`` (llama-server's default); ``completion_probabilities`` with ``n_probs``;
    ``prompt``: the prompt as the model saw it (special tokens as text)."""
    extra = {"completion_probabilities": logprobs.llama(c.logprobs)} if logprobs else {}
    return {**extra,
        "content": c.text, "tokens": c.token_ids if return_tokens else [], "id_slot": 0, "stop": True, "model": model,
        "tokens_predicted": c.timings.predicted_n, "tokens_evaluated": prompt_n,
        "generation_settings": settings, "prompt": prompt, "has_new_line": "\n" in c.text, "truncated": False,
        "stop_type": stop_type, "stopping_word": stopping_word,
        "tokens_cached": c.timings.cache_n,
        "timings": timings,
    }


def llama_chunk(text: str, token_ids: list[int], return_tokens: bool = False) -> dict:
    """One streamed ``/completion`` chunk (not the last)."""
    return {"content": text, "tokens": token_ids if return_tokens else [], "stop": False, "id_slot": 0}
