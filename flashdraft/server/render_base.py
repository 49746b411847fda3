"""What every API's renderer (``render_*``) shares: the finished completion, the render
context, the stream-writer interface, server-sent events and log-probability shapes."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from flashdraft.generate import GenerationRequest, Step, Timings, TokenLogprob
from flashdraft.server.errors import APIError
from flashdraft.server.prompting import PromptBuilder
from flashdraft.server.request import GenRequest


@dataclass
class Completion:
    """A finished generation, as the renderers see it."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    timings: Timings | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class RenderContext:
    """What a renderer may read besides the results.

    Attributes:
        req: the internal request. jobs: its jobs, in answer order.
        model: the model id to report.
        prompts: the tokenizer's side (``decode``, ``piece_and_bytes``).
        drafting: whether the server drafts (the speculative counters in ``timings``).
        n_ctx: the context size [tokens].
        verbose: the server runs with ``-v`` (every answer carries ``__verbose``).
    """

    req: GenRequest
    jobs: list[GenerationRequest]
    model: str
    prompts: PromptBuilder
    drafting: bool
    n_ctx: int
    verbose: bool = False

    def timings(self, c: Completion) -> dict:
        """llama-server's ``timings`` object of ``c`` (with the speculative counters)."""
        return c.timings.to_dict(self.drafting)

    def logprobs(self, n_top: int | None = None) -> "Logprobs | None":
        """The log-probability writer when the jobs compute them (``n_top``: alternatives
        to list; default: the request's count)."""
        job = self.jobs[0]
        if not job.n_probs:
            return None
        return Logprobs(self.prompts.piece_and_bytes, self.req.n_probs if n_top is None else n_top,
                        job.post_sampling_probs)


@dataclass
class ResponseMeta:
    """What every chunk of one response repeats."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, prefix: str, model: str, sep: str = "-") -> "ResponseMeta":
        """A fresh id like ``chatcmpl-<hex>`` (``sep="_"``: ``msg_<hex>``)."""
        return cls(f"{prefix}{sep}{uuid.uuid4().hex[:24]}", model)


def sse(obj: dict, event: str | None = None) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (with an ``event:`` line when named)."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class StreamFormat:
    """How one API writes its event stream.

    ``per_token``: with llama-server's ``timings_per_token``, turns a step's running
    :class:`~flashdraft.generate.Timings` into the ``timings`` object each chunk carries.
    """

    per_token: Callable[[Timings], dict] | None = None

    def tag(self, chunk: dict, step: Step) -> dict:
        """``chunk`` plus the timings so far when asked for (``timings_per_token``)."""
        if self.per_token is not None and step.progress is not None:
            chunk["timings"] = self.per_token(step.progress)
        return chunk

    def start(self, first: Step | None = None) -> list[bytes]:
        """Events before the first text; ``first`` is the first step (its ``progress`` says
        how much of the prompt was prefilled and how much came from the prompt cache)."""
        return []

    def delta(self, step: Step) -> bytes | None:
        """Event for a step that is not the last (None = nothing to send)."""
        raise NotImplementedError

    def progress(self, step: Step) -> bytes | None:
        """Event for a step's ``prompt_progress`` (llama-server's ``return_progress``: the
        chunk carries ``prompt_progress`` and no text); None = this API sends none."""
        return None

    def end(self, step: Step, c: Completion) -> list[bytes]:
        """Events for the last step, given the whole completion."""
        raise NotImplementedError

    def ping(self) -> bytes:
        """A keep-alive sent while the prompt prefills: an SSE comment, which every client's
        parser skips (the OpenAI SDKs, ``EventSource``)."""
        return b": ping\n\n"

    def error(self, err: APIError) -> bytes:
        """The event that ends a stream that failed after its first step."""
        return sse(err.body())


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
