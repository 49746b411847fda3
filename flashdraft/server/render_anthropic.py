"""Renderer of Anthropic's Messages API answers and errors.

A non-streamed answer is a ``message`` with ``text`` and/or ``tool_use`` content blocks,
``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``) and ``usage``
(``input_tokens`` prefilled, ``cache_read_input_tokens`` reused from the prompt cache,
``output_tokens``). A stream is Anthropic's event sequence: ``message_start``, then per
block ``content_block_start`` / ``content_block_delta`` (``text_delta``, or
``input_json_delta`` for a tool's input) / ``content_block_stop``, then ``message_delta``
(stop reason, usage) and ``message_stop``; each event named in an ``event:`` line, as the
``anthropic`` SDK reads them.

``message_start`` and ``message_delta`` carry the same input counts (``input_tokens``
prefilled, ``cache_read_input_tokens`` from the prompt cache: the prompt's split is known
when its first step arrives), and ``message_delta``'s ``output_tokens`` the answer's.

``timings`` (llama-server's, with the draft counters) ride on the stream's ``message_delta``,
the event that ends the answer with its usage (the ``anthropic`` SDK ignores the extra field).
The non-streamed ``message`` and ``message_stop`` carry none, as llama-server: its own tests
check that they do not (``test_compat_anthropic.py``). The server's request log shows every
request's speed and draft acceptance.

Source: Anthropic, "Messages" and "Streaming Messages" API references.
"""

from __future__ import annotations

import json
import uuid

from fastapi.responses import JSONResponse

from flashdraft.generate import Step, Timings
from flashdraft.server.errors import APIError
from flashdraft.server.render_base import Completion, RenderContext, ResponseMeta, StreamFormat, sse, stop_details
from flashdraft.server.tools import CallSniffer, parse_calls

#: our error types -> Anthropic's (by HTTP status where the type has no twin)
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_error(err: APIError) -> JSONResponse:
    """``err`` in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``
    (the OpenAI-style ``param`` and ``code`` kept beside them, for the curious)."""
    return JSONResponse(error_body(err), status_code=err.status)


def error_body(err: APIError) -> dict:
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message, "param": err.param, "code": err.code}}


class MessagesRenderer:
    """``message`` bodies and Anthropic event streams."""

    def __init__(self, ctx: RenderContext):
        self.ctx = ctx
        self.meta = ResponseMeta.new("msg", ctx.model, sep="_")
        self.tools = bool(ctx.req.tools.active)

    def stop(self, c: Completion, called: bool) -> tuple[str, str | None]:
        """Anthropic's ``(stop_reason, stop_sequence)``."""
        if called:
            return "tool_use", None
        kind, word = stop_details(self.ctx.prompts.decode, c, self.ctx.jobs[0].stop)
        return {"limit": ("max_tokens", None), "word": ("stop_sequence", word)}.get(kind, ("end_turn", None))

    def usage(self, t: Timings | None, output: bool = True) -> dict:
        """Anthropic ``usage`` from a generation's timings (its running copy at the first
        step, or the final one); ``output`` False: before the answer, no output yet. Without
        timings, the whole prompt counts as input."""
        if t is None:
            return {"input_tokens": len(self.ctx.jobs[0].prompt_ids), "output_tokens": 0,
                    "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        return {"input_tokens": t.prompt_n, "output_tokens": t.predicted_n if output else 0,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": t.cache_n}

    def message(self, content: list[dict], stop: tuple[str | None, str | None], usage: dict) -> dict:
        return {"id": self.meta.id, "type": "message", "role": "assistant", "model": self.meta.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def body(self, results: list[Completion]) -> dict:
        c = results[0]
        calls = parse_calls(c.text) if self.tools else None
        content = [tool_use_block(call) for call in calls] if calls else [{"type": "text", "text": c.text}]
        return self.message(content, self.stop(c, bool(calls)), self.usage(c.timings))

    def stream(self) -> StreamFormat:
        return MessagesStream(self)


def tool_use_block(call: dict, with_input: bool = True) -> dict:
    """An OpenAI-shaped call (:func:`parse_calls`) as a ``tool_use`` block (``input`` empty
    in a stream's ``content_block_start``, whose input follows as JSON deltas)."""
    fn = call["function"]
    return {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": fn["name"],
            "input": json.loads(fn["arguments"]) if with_input else {}}


class MessagesStream(StreamFormat):
    """Anthropic's events. Text streams as it comes; an answer that is a tool call is held
    back (it opens with ``{``) and sent at the end as ``tool_use`` blocks with their input
    as one ``input_json_delta`` each."""

    def __init__(self, renderer: MessagesRenderer):
        self.r = renderer
        self.sniffer = CallSniffer(renderer.tools)
        self.index = 0  # the next content block's index
        self.text_open = False

    def event(self, obj: dict) -> bytes:
        return sse(obj, event=obj["type"])

    def start(self, first: Step | None = None) -> list[bytes]:
        usage = self.r.usage(first.progress if first is not None else None, output=False)
        return [self.event({"type": "message_start", "message": self.r.message([], (None, None), usage)})]

    def _text(self, text: str) -> list[bytes]:
        out = []
        if not self.text_open:
            out.append(self.event({"type": "content_block_start", "index": self.index,
                                   "content_block": {"type": "text", "text": ""}}))
            self.text_open = True
        if text:
            out.append(self.event({"type": "content_block_delta", "index": self.index,
                                   "delta": {"type": "text_delta", "text": text}}))
        return out

    def delta(self, step: Step) -> bytes | None:
        text = self.sniffer.feed(step.text)
        return b"".join(self._text(text)) if text else None

    def end(self, step: Step, c: Completion) -> list[bytes]:
        out = [e for e in [self.delta(step)] if e is not None]
        calls = parse_calls(c.text) if self.r.tools else None
        if not calls and (self.sniffer.held or not self.text_open):  # a call cut short, or no text at all
            out += self._text(self.sniffer.held)
        if self.text_open:
            out.append(self.event({"type": "content_block_stop", "index": self.index}))
            self.index += 1
        for call in calls or []:
            block = tool_use_block(call, with_input=False)
            out.append(self.event({"type": "content_block_start", "index": self.index, "content_block": block}))
            out.append(self.event({"type": "content_block_delta", "index": self.index,
                                   "delta": {"type": "input_json_delta",
                                             "partial_json": call["function"]["arguments"]}}))
            out.append(self.event({"type": "content_block_stop", "index": self.index}))
            self.index += 1
        reason, word = self.r.stop(c, bool(calls))
        out.append(self.event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": word},
                               "usage": self.r.usage(c.timings), "timings": self.r.ctx.timings(c)}))
        out.append(self.event({"type": "message_stop"}))
        return out

    def ping(self) -> bytes:
        """Anthropic's own keep-alive event (its SDKs skip it)."""
        return self.event({"type": "ping"})

    def error(self, err: APIError) -> bytes:
        return sse(error_body(err), event="error")
