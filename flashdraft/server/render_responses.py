"""Renderer of OpenAI Responses API answers (``/v1/responses``).

A ``response`` object whose ``output`` holds one ``message`` item (``output_text`` content)
or the answer's ``function_call`` items, with ``usage`` in the Responses shape and, as
llama-server adds, ``timings`` (with the draft counters). A stream is the Responses event
sequence: ``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` (for a call:
``response.function_call_arguments.delta`` / ``.done``), and ``response.completed`` with the
whole response and, at the top level as llama-server sends it, ``timings`` (sent after a
length cut too, with ``status: incomplete``, as llama-server does).

Source: OpenAI, "Responses" and "Streaming events" API references.
"""

from __future__ import annotations

import uuid

from flashdraft.generate import Step
from flashdraft.server.errors import APIError
from flashdraft.server.render_base import Completion, RenderContext, ResponseMeta, StreamFormat, sse
from flashdraft.server.tools import CallSniffer, parse_calls


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponsesRenderer:
    """``response`` bodies and Responses event streams."""

    def __init__(self, ctx: RenderContext):
        self.ctx = ctx
        self.meta = ResponseMeta.new("resp", ctx.model, sep="_")
        self.tools = bool(ctx.req.tools.active)
        self.msg_id = _id("msg")

    def response(self, output: list[dict], c: Completion | None, status: str) -> dict:
        """The ``response`` object (``c`` None: not finished yet, no usage)."""
        wire = self.ctx.req.wire
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        body = {"id": self.meta.id, "object": "response", "created_at": self.meta.created, "status": status,
                "model": self.meta.model, "output": output, "error": None, "incomplete_details": incomplete,
                "instructions": wire.instructions, "max_output_tokens": wire.max_output_tokens,
                "parallel_tool_calls": wire.parallel_tool_calls is not False,
                "previous_response_id": None, "store": False, "temperature": wire.temperature,
                "top_p": wire.top_p, "tool_choice": wire.tool_choice or "auto", "tools": wire.tools or [],
                "text": wire.text or {"format": {"type": "text"}}, "truncation": "disabled", "metadata": {},
                "usage": None}
        if c is not None:
            t = c.timings
            body["usage"] = {"input_tokens": t.prompt_n + t.cache_n, "input_tokens_details": {"cached_tokens": t.cache_n},
                             "output_tokens": t.predicted_n, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": t.prompt_n + t.cache_n + t.predicted_n}
        return body

    def message_item(self, text: str, status: str = "completed") -> dict:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" \
            else []
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

    def output(self, c: Completion) -> list[dict]:
        calls = parse_calls(c.text) if self.tools else None
        if calls:
            return [call_item(call, self.ctx.req.tools.namespaced) for call in calls]
        return [self.message_item(c.text)]

    @staticmethod
    def status(c: Completion) -> str:
        return "incomplete" if c.finish_reason == "length" else "completed"

    def body(self, results: list[Completion]) -> dict:
        c = results[0]
        return {**self.response(self.output(c), c, self.status(c)), "timings": self.ctx.timings(c)}

    def stream(self) -> StreamFormat:
        return ResponsesStream(self)


def call_item(call: dict, namespaced: dict[str, tuple[str, str]] | None = None, status: str = "completed") -> dict:
    """An OpenAI-shaped call (:func:`parse_calls`) as a ``function_call`` output item; a
    call of a function offered inside a ``namespace`` tool (``namespaced``, from
    :attr:`Tools.namespaced`) names its namespace and its own name, as Codex CLI reads it."""
    fn = call["function"]
    item = {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if status == "completed" else "", "status": status}
    if fn["name"] in (namespaced or {}):
        item["namespace"], item["name"] = namespaced[fn["name"]]
    return item


class ResponsesStream(StreamFormat):
    """The Responses events, each with ``sequence_number``. Text streams as it comes; an
    answer that is a tool call is held back (it opens with ``{``) and sent at the end as
    ``function_call`` items, their arguments in one delta each."""

    def __init__(self, renderer: ResponsesRenderer):
        self.r = renderer
        self.sniffer = CallSniffer(renderer.tools)
        self.seq = 0
        self.text_open = False
        self.text = ""
        self.opened = False

    def event(self, obj: dict, step: Step | None = None) -> bytes:
        obj["sequence_number"] = self.seq
        self.seq += 1
        if step is not None:
            obj = self.tag(obj, step)
        return sse(obj, event=obj["type"])

    def start(self, first: Step | None = None) -> list[bytes]:
        if self.opened:  # already sent while the prompt prefilled
            return []
        self.opened = True
        pending = self.r.response([], None, "in_progress")
        return [self.event({"type": "response.created", "response": pending}),
                self.event({"type": "response.in_progress", "response": pending})]

    def ping(self) -> bytes:
        """The keep-alive while the prompt prefills is an event, not an SSE comment: Codex CLI's
        idle timer (``stream_idle_timeout_ms``, 300 s) counts events and skips comments, so a
        5k-token first prompt prefilling for more than 300 s made it drop the stream and send
        the request again. The first ping is the stream's opening ``response.created`` and
        ``response.in_progress`` (OpenAI sends them before any output too); every later one is
        another ``response.in_progress`` with the next ``sequence_number``, which the SDKs and
        Codex CLI read as nothing new."""
        if not self.opened:
            return b"".join(self.start())
        return self.event({"type": "response.in_progress", "response": self.r.response([], None, "in_progress")})

    def progress(self, step: Step) -> bytes | None:
        """A ``response.in_progress`` event carrying ``prompt_progress``, as llama-server's."""
        event = {"type": "response.in_progress", "response": self.r.response([], None, "in_progress"),
                 "prompt_progress": step.prompt_progress.to_dict()}
        return self.event(event, step)

    def _text(self, text: str, step: Step | None = None) -> list[bytes]:
        out, where = [], {"item_id": self.r.msg_id, "output_index": 0, "content_index": 0}
        if not self.text_open:
            self.text_open = True
            out.append(self.event({"type": "response.output_item.added", "output_index": 0,
                                   "item": self.r.message_item("", "in_progress")}))
            out.append(self.event({"type": "response.content_part.added", **where,
                                   "part": {"type": "output_text", "text": "", "annotations": []}}))
        if text:
            self.text += text
            out.append(self.event({"type": "response.output_text.delta", **where, "delta": text, "logprobs": []},
                                  step))
        return out

    def delta(self, step: Step) -> bytes | None:
        text = self.sniffer.feed(step.text)
        return b"".join(self._text(text, step)) if text else None

    def end(self, step: Step, c: Completion) -> list[bytes]:
        out = [e for e in [self.delta(step)] if e is not None]
        calls = parse_calls(c.text) if self.r.tools else None
        if not calls and (self.sniffer.held or not self.text_open):  # a call cut short, or no text at all
            out += self._text(self.sniffer.held)
        output = []
        if self.text_open:
            where = {"item_id": self.r.msg_id, "output_index": 0, "content_index": 0}
            item = self.r.message_item(self.text)
            out.append(self.event({"type": "response.output_text.done", **where, "text": self.text, "logprobs": []}))
            out.append(self.event({"type": "response.content_part.done", **where, "part": item["content"][0]}))
            out.append(self.event({"type": "response.output_item.done", "output_index": 0, "item": item}))
            output.append(item)
        for i, call in enumerate(calls or []):
            item = call_item(call, self.r.ctx.req.tools.namespaced)
            out.append(self.event({"type": "response.output_item.added", "output_index": i,
                                   "item": {**item, "arguments": "", "status": "in_progress"}}))
            out.append(self.event({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                                   "output_index": i, "delta": item["arguments"]}))
            out.append(self.event({"type": "response.function_call_arguments.done", "item_id": item["id"],
                                   "output_index": i, "name": item["name"], "arguments": item["arguments"]}))
            out.append(self.event({"type": "response.output_item.done", "output_index": i, "item": item}))
            output.append(item)
        # response.completed even after a length cut (its status says "incomplete"): agents
        # such as Codex wait for this event, and llama-server always sends it
        out.append(self.event({"type": "response.completed", "response": self.r.response(output, c, self.r.status(c)),
                               "timings": self.r.ctx.timings(c)}))
        return out

    def error(self, err: APIError) -> bytes:
        return self.event({"type": "error", "code": err.code or err.type, "message": err.message, "param": err.param})
