"""Renderers of OpenAI chat and text completions (``/v1/chat/completions``, ``/v1/completions``).

Every completion carries llama-server's ``timings`` (:meth:`Timings.to_dict`) and ``usage``
with ``completion_tokens == timings.predicted_n``: both count exactly the returned tokens,
never anything after a stop.
"""

from __future__ import annotations

import flashdraft
from flashdraft.generate import Step, Timings
from flashdraft.server.render_base import Completion, Logprobs, RenderContext, ResponseMeta, StreamFormat, sse
from flashdraft.server.tools import CallSniffer, parse_calls

SSE_DONE = b"data: [DONE]\n\n"
#: OpenAI's ``system_fingerprint``: which build answered (llama-server sends its build id)
SYSTEM_FINGERPRINT = f"flashdraft-{flashdraft.__version__}"


def usage(t: Timings) -> dict:
    """OpenAI ``usage``: the whole prompt (prefilled + reused from the prompt cache, the
    latter also in ``prompt_tokens_details.cached_tokens``) and the returned tokens."""
    prompt = t.prompt_n + t.cache_n
    return {"prompt_tokens": prompt, "completion_tokens": t.predicted_n, "total_tokens": prompt + t.predicted_n,
            "prompt_tokens_details": {"cached_tokens": t.cache_n}}


def with_verbose(body: dict, ctx: RenderContext, c: Completion) -> dict:
    """``body`` plus llama-server's ``__verbose`` object when the request (``verbose``) or
    the server (``-v``) asks: the prompt as the model saw it, special tokens included, and
    the first choice's text."""
    if ctx.req.verbose or ctx.verbose:
        ids = ctx.jobs[0].prompt_ids
        body["__verbose"] = {"prompt": ctx.prompts.decode(ids, skip_special=False), "content": c.text,
                             "tokens_evaluated": len(ids), "tokens_predicted": c.timings.predicted_n}
    return body


def usage_chunk(meta: ResponseMeta, obj: str, c: Completion, timings: dict) -> dict:
    """A chat stream's last chunk, after the one with ``finish_reason``: no choices, ``usage``
    and ``timings`` (llama-server sends it with or without ``stream_options.include_usage``;
    OpenAI's clients read usage from it)."""
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model,
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [], "usage": usage(c.timings), "timings": timings}


# -- /v1/chat/completions ------------------------------------------------------------------

class ChatRenderer:
    """``chat.completion`` bodies and ``chat.completion.chunk`` streams. With tools, an
    answer that parses as calls is returned as ``tool_calls`` (``finish_reason: tool_calls``)."""

    def __init__(self, ctx: RenderContext):
        self.ctx = ctx
        self.meta = ResponseMeta.new("chatcmpl", ctx.model)
        self.lps = ctx.logprobs(getattr(ctx.req.wire, "top_logprobs", None) or 0)
        self.tools = bool(ctx.req.tools.active)

    def body(self, results: list[Completion]) -> dict:
        """The non-streamed answer: one choice per result (``n``)."""
        ctx = self.ctx
        calls = [parse_calls(c.text) if self.tools else None for c in results]
        timings = [ctx.timings(c) for c in results]
        body = self.response(results[0], timings[0], calls[0])
        if len(results) > 1:  # n choices: each with its own timings; usage counts the prompt once
            body["choices"] = [{**self.response(c, t, k)["choices"][0], "index": i, "timings": t}
                               for i, (c, t, k) in enumerate(zip(results, timings, calls))]
            first = results[0].timings
            body["usage"] = usage(Timings(prompt_n=first.prompt_n, cache_n=first.cache_n,
                                          predicted_n=sum(c.timings.predicted_n for c in results)))
        return with_verbose(body, ctx, results[0])

    def response(self, c: Completion, timings: dict, tool_calls: list[dict] | None) -> dict:
        """One result as a ``chat.completion``; with ``tool_calls``, the message carries them
        (no content) and ``finish_reason`` is ``tool_calls``."""
        message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
        if tool_calls:
            message, finish = {"role": "assistant", "content": None, "tool_calls": tool_calls}, "tool_calls"
        m = self.meta
        return {"id": m.id, "object": "chat.completion", "created": m.created, "model": m.model,
                "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": [{"index": 0, "message": message,
                             "logprobs": self.lps.chat(c.logprobs) if self.lps else None, "finish_reason": finish}],
                "usage": usage(c.timings), "timings": timings}

    def stream(self) -> StreamFormat:
        return ChatStream(self.meta, self.ctx, self.lps, self.tools)


def chat_chunk(meta: ResponseMeta, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    """One streamed ``chat.completion.chunk``."""
    return {"id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


class ChatStream(StreamFormat):
    """OpenAI ``chat.completion.chunk`` events ending in ``data: [DONE]``; with logprobs,
    each chunk carries its own tokens' (a chunk may carry tokens whose text is still held back).

    With tools, an answer that opens with ``{`` is a tool call: it is held back and sent,
    whole, as one ``tool_calls`` delta before the finish chunk (``finish_reason: tool_calls``);
    plain-text answers stream as usual.
    """

    def __init__(self, meta: ResponseMeta, ctx: RenderContext, logprobs: Logprobs | None, tools: bool):
        self.meta, self.ctx, self.logprobs, self.tools = meta, ctx, logprobs, tools
        self.sniffer = CallSniffer(tools)

    def start(self, first: Step | None = None) -> list[bytes]:
        return [sse(chat_chunk(self.meta, {"role": "assistant", "content": None}))]

    def progress(self, step: Step) -> bytes | None:
        # llama-server repeats the opening delta with each report
        chunk = chat_chunk(self.meta, {"role": "assistant", "content": None})
        return sse(self.tag({**chunk, "prompt_progress": step.prompt_progress.to_dict()}, step))

    def delta(self, step: Step) -> bytes | None:
        holding = not self.sniffer.decided or self.sniffer.calling
        text = self.sniffer.feed(step.text)
        if holding and not text:
            return None
        lps = self.logprobs.chat(step.logprobs) if self.logprobs and step.logprobs else None
        if not text and lps is None:
            return None
        return sse(self.tag(chat_chunk(self.meta, {"content": text}, logprobs=lps), step))

    def end(self, step: Step, c: Completion) -> list[bytes]:
        timings = self.ctx.timings(c)
        out = [e for e in [self.delta(step)] if e is not None]
        calls = parse_calls(c.text) if self.tools else None
        if calls:
            deltas = [{"index": i, **call} for i, call in enumerate(calls)]
            out.append(sse(chat_chunk(self.meta, {"tool_calls": deltas})))
            out.append(sse(chat_chunk(self.meta, {}, "tool_calls")))
        else:
            if self.sniffer.held:  # a call cut short (max_tokens): the client gets the text it is
                out.append(sse(chat_chunk(self.meta, {"content": self.sniffer.held})))
            out.append(sse(chat_chunk(self.meta, {}, c.finish_reason)))
        out.append(sse(usage_chunk(self.meta, "chat.completion.chunk", c, timings)))
        return out + [SSE_DONE]


# -- /v1/completions -----------------------------------------------------------------------

class CompletionsRenderer:
    """``text_completion`` bodies and streams; several prompts give one choice each."""

    def __init__(self, ctx: RenderContext):
        self.ctx = ctx
        self.meta = ResponseMeta.new("cmpl", ctx.model)
        self.lps = ctx.logprobs()

    def body(self, results: list[Completion]) -> dict:
        """The non-streamed answer (usage summed over the prompts)."""
        m, lps = self.meta, self.lps
        timings = [self.ctx.timings(c) for c in results]
        choices = [{"index": i, "text": c.text, "logprobs": lps.completion(c.logprobs) if lps else None,
                    "finish_reason": c.finish_reason} for i, c in enumerate(results)]
        if len(results) > 1:
            for choice, t in zip(choices, timings):
                choice["timings"] = t
        total = Timings(prompt_n=sum(c.timings.prompt_n for c in results),
                        cache_n=sum(c.timings.cache_n for c in results),
                        predicted_n=sum(c.timings.predicted_n for c in results))
        body = {"id": m.id, "object": "text_completion", "created": m.created, "model": m.model,
                "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices, "usage": usage(total)}
        if len(results) == 1:
            body["timings"] = timings[0]
        return with_verbose(body, self.ctx, results[0])

    def stream(self) -> StreamFormat:
        return CompletionStream(self.meta, self.ctx, self.lps)


def completion_chunk(meta: ResponseMeta, text: str, finish_reason: str | None = None,
                     logprobs: dict | None = None) -> dict:
    """One streamed ``text_completion`` chunk."""
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


class CompletionStream(StreamFormat):
    """OpenAI ``text_completion`` events ending in ``data: [DONE]``."""

    def __init__(self, meta: ResponseMeta, ctx: RenderContext, logprobs: Logprobs | None):
        self.meta, self.ctx, self.logprobs, self.offset = meta, ctx, logprobs, 0

    def progress(self, step: Step) -> bytes | None:
        chunk = completion_chunk(self.meta, "")
        return sse(self.tag({**chunk, "prompt_progress": step.prompt_progress.to_dict()}, step))

    def delta(self, step: Step) -> bytes | None:
        lps = None
        if self.logprobs and step.logprobs:
            lps = self.logprobs.completion(step.logprobs, self.offset)
            self.offset += sum(len(t) for t in lps["tokens"])
        if not step.text and lps is None:
            return None
        return sse(self.tag(completion_chunk(self.meta, step.text, logprobs=lps), step))

    def end(self, step: Step, c: Completion) -> list[bytes]:
        """The last text, then one chunk with the ``finish_reason``, ``usage`` and ``timings``:
        as llama-server ends a ``/v1/completions`` stream, every chunk has a choice (the
        ``openai`` client's users read ``chunk.choices[0]`` on each, as llama.cpp's
        ``test_completion_stream_with_openai_library`` does)."""
        out = [e for e in [self.delta(step)] if e is not None]
        last = completion_chunk(self.meta, "", c.finish_reason)
        last.update(usage=usage(c.timings), timings=self.ctx.timings(c))
        out.append(sse(last))
        return out + [SSE_DONE]
