"""The generation routes, and the one path every one of them takes.

A route is an :class:`API`: a parser (body -> :class:`~flashdraft.server.request.GenRequest`)
and a renderer (results -> the API's wire format). :func:`handle` runs the steps in order,
each in its own module:

1. parse: :mod:`.parse_openai`, :mod:`.parse_anthropic`, :mod:`.parse_responses`
2. validate: :mod:`.validate` (unsupported fields, ``--max-*`` limits)
3. jobs: :mod:`.jobs` (chat template, tokens, context, grammar, sampling)
4. run: :mod:`.run` (the scheduler; collected, or streamed through the renderer)
5. render: :mod:`.render_openai`, :mod:`.render_llama`, :mod:`.render_anthropic`,
   :mod:`.render_responses`

Routes (llama-server's paths): ``/v1/chat/completions``, ``/v1/completions``,
``/completion``, ``/v1/messages`` (Anthropic), ``/v1/responses`` (OpenAI Responses), each
also without ``/v1`` where llama-server has it; and the prompt-only helpers
``/apply-template``, ``/v1/chat/completions/input_tokens``, ``/v1/messages/count_tokens``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from flashdraft.server import jobs as J
from flashdraft.server import parse_anthropic, parse_openai, parse_responses, run
from flashdraft.server.clients import client_of
from flashdraft.server.errors import APIError
from flashdraft.server.limits import over
from flashdraft.server.render_anthropic import MessagesRenderer, anthropic_error
from flashdraft.server.render_base import Completion, RenderContext
from flashdraft.server.render_llama import LlamaRenderer
from flashdraft.server.render_openai import ChatRenderer, CompletionsRenderer
from flashdraft.server.render_responses import ResponsesRenderer
from flashdraft.server.request import GenRequest
from flashdraft.server.state import ServerState
from flashdraft.server.validate import validate


@dataclass(frozen=True)
class API:
    """One wire format: how its bodies parse, how its answers and errors render.

    Attributes:
        name: the metrics' ``endpoint`` label and the request log's name.
        parse: body -> internal request (raises APIError 400).
        renderer: ``RenderContext -> renderer`` with ``body(results)`` and ``stream()``.
        error: an APIError in this API's error shape.
    """

    name: str
    parse: Callable[[bytes], GenRequest]
    renderer: Callable[[RenderContext], object]
    error: Callable[[APIError], Response] = APIError.response


CHAT = API("chat", parse_openai.chat, ChatRenderer)
COMPLETIONS = API("completions", parse_openai.completions, CompletionsRenderer)
COMPLETION = API("completion", parse_openai.completion, LlamaRenderer)
MESSAGES = API("messages", parse_anthropic.messages, MessagesRenderer, anthropic_error)
RESPONSES = API("responses", parse_responses.responses, ResponsesRenderer)

#: route -> API; the un-prefixed paths are llama-server's aliases (``/completions`` is its
#: native endpoint, not OpenAI's)
ROUTES = {
    "/v1/chat/completions": CHAT, "/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/completion": COMPLETION, "/completions": COMPLETION,
    "/v1/messages": MESSAGES,
    "/v1/responses": RESPONSES, "/responses": RESPONSES,
}
#: paths that answer in Anthropic's error shape (the API-key check uses it too)
ANTHROPIC_PATHS = ("/v1/messages",)

class PromptThread:
    """Steps 1-3 (parse, validate, jobs) run here, off the event loop, so ``/health`` and
    running streams are answered while a 5 MB body is parsed and tokenised (seconds). One
    worker per app, so prompts are built one at a time as before: a transformers tokenizer
    is not safe to share between threads (it resets its truncation state on every call)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashdraft-prompt")

    async def run(self, fn: Callable, *args):
        """``fn(*args)`` on the prompt thread; its exceptions are raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)


def _prepare(api: API, body: bytes, headers, state: ServerState) -> tuple[GenRequest, list]:
    """Steps 1-3: parse, validate, jobs (raises APIError)."""
    req = validate(api.parse(body), state.settings.limits)
    req.client = client_of(headers)
    return req, J.build(req, state)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than ``limit`` bytes (413, naming ``--max-body-bytes``)
    without reading it all."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise over("body_bytes", limit, int(declared), None, status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise over("body_bytes", limit, size, None, status=413)
        chunks.append(chunk)
    return b"".join(chunks)


async def handle(request: Request, state: ServerState, api: API, prompt_thread: PromptThread) -> Response:
    """One generation request, start to end: parse, validate, jobs, run, render.

    Every failure is answered in ``api``'s error shape and counted in
    ``flashdraft_requests_total`` (a stream counts itself when it ends).
    """
    metrics = state.metrics

    def observe(status: str, c: Completion | None = None) -> None:
        metrics.observe_request(api.name, status)

    try:
        state.require_ready()
        body = await read_body(request, state.settings.limits.body_bytes)
        req, jobs = await prompt_thread.run(_prepare, api, body, request.headers, state)
        g = state.generator
        ctx = RenderContext(req, jobs, state.check_model(req.model), state.prompts, g.drafting, g.ctx_size,
                            state.settings.verbose)
        if req.stream:
            fmt = api.renderer(ctx).stream()
            if req.timings_per_token:
                fmt.per_token = lambda t: t.to_dict(ctx.drafting)
            return await run.stream(request, state.submit(jobs[0]), fmt, observe, state.settings.sse_ping_interval)
        results = await run.collect(request, state.submit_all(jobs))
        response = JSONResponse(api.renderer(ctx).body(results))
    except APIError as e:
        observe("cancelled" if e.status == run.CLIENT_CLOSED else "client_error" if e.status < 500 else "server_error")
        return api.error(e)
    observe("ok", results[0])
    return response


def register(app: FastAPI, state: ServerState) -> None:
    """Add the generation routes and the prompt-only helpers to ``app``; its
    :class:`PromptThread` is ``app.state.prompt_thread``."""
    prompt_thread = app.state.prompt_thread = PromptThread()

    def route_for(api: API):
        async def route(request: Request) -> Response:
            return await handle(request, state, api, prompt_thread)

        route.__doc__ = f"{api.name}: see flashdraft.server.pipeline"
        return route

    for path, api in ROUTES.items():
        app.add_api_route(path, route_for(api), methods=["POST"], name=f"{api.name}:{path}",
                          include_in_schema=path.startswith("/v1/") or path == "/completion")

    async def chat_prompt(request: Request, parse: Callable[[bytes], GenRequest], check: bool = True) -> GenRequest:
        state.require_ready()
        req = await prompt_thread.run(parse, await read_body(request, state.settings.limits.body_bytes))
        return validate(req, state.settings.limits) if check else req

    @app.post("/apply-template")
    async def apply_template(request: Request) -> Response:
        """llama-server's ``/apply-template``: a chat request's ``messages`` rendered by the
        chat template, as text (nothing is decoded)."""
        req = await chat_prompt(request, parse_openai.chat, check=False)
        return JSONResponse({"prompt": await prompt_thread.run(lambda: state.prompts.text(J.segments(req, state)))})

    @app.post("/v1/chat/completions/input_tokens")
    @app.post("/chat/completions/input_tokens", include_in_schema=False)
    async def chat_input_tokens(request: Request) -> Response:
        """llama-server's token count of a chat request's prompt (``max_tokens`` not needed)."""
        req = await chat_prompt(request, parse_openai.chat)
        ids = await prompt_thread.run(J.prompt_ids, req, state)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(ids)})

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """Anthropic's token count of a Messages request (``max_tokens`` not needed)."""
        try:
            req = await chat_prompt(request, parse_anthropic.count_tokens)
            return JSONResponse({"input_tokens": len(await prompt_thread.run(J.prompt_ids, req, state))})
        except APIError as e:
            return anthropic_error(e)
