"""The FastAPI application: :func:`create_app` wires state, auth, errors and routes.

Routes (llama-server compatible):

- ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /completion``,
  ``POST /v1/messages`` (Anthropic), ``POST /v1/responses`` (OpenAI Responses): see
  :mod:`flashdraft.server.pipeline`
- ``GET /``: the chat page (``static/``); ``GET /static/<file>``: its script and style
- ``GET /health`` (503 while loading or stopping, 200 ``{"status": "ok"}``), ``GET /v1/models``
  (also ``/models``), ``GET /props``, ``POST /tokenize``, ``POST /detokenize``,
  ``GET /metrics`` (Prometheus; 501 unless ``--metrics``), ``GET /slots`` (501 with ``--no-slots``)

CORS (``--cors-*``, default: any origin): preflight ``OPTIONS`` requests are answered without
the API key, as browsers send them without credentials.

With ``api_key`` set, every API route except ``/health`` and ``/models`` (llama-server's
public endpoints) needs ``Authorization: Bearer KEY`` (or ``X-Api-Key: KEY``). The chat page and its static files stay public: a browser cannot
send a header when it opens a URL, the files hold no data, and the page asks for the key
and sends it with each API call.

SIGTERM/SIGINT: the app chains itself before uvicorn's handler to start draining at once
(see :meth:`ServerState.begin_shutdown`); uvicorn then stops accepting connections and
waits for the in-flight ones.
"""

from __future__ import annotations

import logging
import secrets
import signal
import threading
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema

import flashdraft
from flashdraft.generate import SpeculativeGenerator
from flashdraft.server import pipeline, request_dump, request_log, webui
from flashdraft.server.errors import APIError, install_error_handlers
from flashdraft.server.metrics import CONTENT_TYPE
from flashdraft.server.parse_anthropic import MessagesRequest
from flashdraft.server.parse_responses import ResponsesRequest
from flashdraft.server.render_anthropic import error_body as anthropic_error_body
from flashdraft.server.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       LlamaCompletionRequest, TokenizeRequest, parse_request)
from flashdraft.server.state import ServerSettings, ServerState

log = logging.getLogger(__name__)

#: routes that never need the API key (load balancers probe them; the page holds no data)
class PreflightCORS(CORSMiddleware):
    """Starlette's CORS middleware, with llama-server's answer to a refused preflight: 200
    without ``Access-Control-Allow-Origin`` (Starlette answers 400). The browser refuses the
    cross-origin request either way; a 200 keeps clients that treat any 4xx as an outage calm."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code == 400:
            response.status_code = 200
        return response


PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/", "/index.html"})
PUBLIC_PREFIXES = ("/static/",)

#: request body schema per route, for the OpenAPI document (routes parse bodies themselves
#: so that every validation error has OpenAI's shape)
REQUEST_MODELS = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/completion": LlamaCompletionRequest,
    "/v1/messages": MessagesRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}

Loader = Callable[[], SpeculativeGenerator]


class APIKeyMiddleware:
    """Pure ASGI middleware (does not wrap ``receive``, so disconnect detection and
    streaming behave as without it): 401 unless the request carries the key."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        if secrets.compare_digest(token, self.key):
            return await self.app(scope, receive, send)
        err = APIError(401, "Invalid API key: send 'Authorization: Bearer <key>' (the --api-key value)",
                       type="authentication_error", code="invalid_api_key")
        response = err.response()
        if path.startswith(pipeline.ANTHROPIC_PATHS):  # the anthropic SDK reads its own error shape
            response = JSONResponse(anthropic_error_body(err), status_code=401)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


class HeadAsGet:
    """Pure ASGI middleware: ``HEAD`` is answered as ``GET`` without the body, as llama-server's
    HTTP library answers it (FastAPI's routes list only ``GET``, so ``HEAD /`` was a 405;
    Claude Code probes its base URL with ``HEAD /`` before the first request). A route with no
    ``GET`` still answers ``HEAD`` with 405."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


def create_app(generator_or_loader: SpeculativeGenerator | Loader, settings: ServerSettings | None = None,
               on_load_failed: Callable[[BaseException], None] | None = None,
               dump_requests: str | None = None) -> FastAPI:
    """Build the server application.

    Args:
        generator_or_loader: a ready generator, or a no-argument function that loads one;
            a loader runs on a background thread once the ASGI server has started, so
            ``/health`` answers 503 until it returns.
        settings: server defaults and switches (defaults: :class:`ServerSettings`).
        on_load_failed: called (on the loader thread) if the loader raises; the CLI uses
            it to stop the process.
        dump_requests: a directory to record every request in, one JSON file each
            (``--dump-requests``; :mod:`flashdraft.server.request_dump`).
    Returns:
        The FastAPI app; its :class:`ServerState` is ``app.state.flashdraft``.
    """
    settings = settings or ServerSettings()
    state = ServerState(settings, on_load_failed=on_load_failed)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        restore = _drain_on_signals(state)
        if isinstance(generator_or_loader, SpeculativeGenerator):
            state.set_ready(generator_or_loader)
        else:
            threading.Thread(target=state.load, args=(generator_or_loader,), name="flashdraft-loader",
                             daemon=True).start()
        try:
            yield
        finally:
            restore()
            state.shutdown()

    app = FastAPI(title="flashdraft", version=flashdraft.__version__, lifespan=lifespan)
    app.state.flashdraft = state
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    # added last = outermost: preflights are answered before the key check, and every
    # response (a 401 too) carries the CORS headers a browser needs to read it
    cors = settings.cors
    app.add_middleware(PreflightCORS, allow_origins=cors.listed_origins(), allow_origin_regex=cors.origin_regex(),
                       allow_methods=cors.methods, allow_headers=cors.headers, allow_credentials=cors.credentials)
    app.add_middleware(HeadAsGet)
    # outermost of all: the request log sees every answer, a 401 or a CORS preflight too
    app.add_middleware(request_log.RequestLogMiddleware)
    if dump_requests:  # outside the log too: it records exactly what came in and went out
        app.add_middleware(request_dump.RequestDumpMiddleware, directory=dump_requests)
    install_error_handlers(app)
    if settings.webui:
        webui.register(app)
    _add_info_routes(app, state)
    pipeline.register(app, state)
    _document_request_bodies(app)
    return app


def _drain_on_signals(state: ServerState) -> Callable[[], None]:
    """Call ``state.begin_shutdown()`` on SIGTERM/SIGINT, then the handler that was there
    (uvicorn's, which starts its graceful shutdown). Returns a function that puts the old
    handlers back.

    Why chain rather than wait for the lifespan shutdown: uvicorn sends that only after
    every connection has closed, i.e. after a long stream would have been cut at its
    graceful-shutdown timeout; starting the drain at the signal lets queued requests get a
    503 at once and the running one end with a proper error event. Only callable
    handlers are chained (a default or ignored signal is left alone), and only on the main
    thread, where Python allows it (an app run in a thread by tests is not chained).
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    chained: dict[int, object] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)
        if not callable(previous):
            continue

        def handler(signum, frame, previous=previous):
            state.begin_shutdown()
            previous(signum, frame)

        signal.signal(sig, handler)
        chained[sig] = previous

    def restore() -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, previous in chained.items():
                signal.signal(sig, previous)

    return restore


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    settings = state.settings

    @app.get("/health")
    @app.get("/v1/health", include_in_schema=False)
    async def health() -> Response:
        """200 ``{"status": "ok"}`` when ready; 503 while loading or shutting down; 500 if loading failed."""
        state.require_ready()
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    @app.get("/models", include_in_schema=False)
    async def models() -> Response:
        """The one served model (OpenAI list shape, plus llama-server's ``models``); its
        ``meta`` carries the context sizes as llama-server's does (``n_ctx_train``, the
        model's training context, and ``n_ctx``, what a slot holds here), so a client can
        size its prompts."""
        state.require_ready()
        target = state.generator.target
        meta = {"n_ctx": state.generator.ctx_size, "n_vocab": target.vocab_size,
                "n_ctx_train": getattr(target.config, "max_position_embeddings", None),
                "n_embd": target.hidden_size,
                "spec_type": settings.spec_type, "drafter": state.generator.drafter.name}
        entry = {"id": state.model_id, "object": "model", "created": state.started, "owned_by": "flashdraft",
                 "aliases": settings.aliases() or [state.model_id], "tags": settings.tags, "meta": meta}
        return JSONResponse({"object": "list", "data": [entry],
                             "models": [{"name": state.model_id, "model": state.model_id}]})

    @app.get("/props")
    async def props() -> Response:
        """Server defaults and model facts (llama-server's ``/props`` subset)."""
        state.require_ready()
        g = state.generator
        params = {"temperature": settings.temperature, "top_k": settings.top_k, "top_p": settings.top_p,
                  "min_p": settings.min_p, "seed": -1 if settings.seed is None else settings.seed,
                  "n_predict": settings.n_predict, "speculative.n_max": g.n_draft}
        return JSONResponse({
            "default_generation_settings": {"n_ctx": g.ctx_size, "params": params},
            "total_slots": state.scheduler.n_slots,
            "model_alias": state.model_id,
            "model_path": _model_path(settings.model_path),
            "chat_template": state.prompts.chat_template or "",
            "modalities": {"vision": False, "audio": False},
            "speculative": {"type": settings.spec_type, "drafter": g.drafter.name, "n_max": g.n_draft,
                            "drafting": g.drafting},
            "build_info": f"flashdraft {flashdraft.__version__}",
            "backend": g.target.backend,  # the engine running the target
        })

    @app.get("/slots")
    async def slots() -> Response:
        """Each slot's state (llama-server's ``/slots`` subset): id, context size, whether it
        decodes now, and the tokens its prompt cache holds."""
        if not settings.slots_endpoint:
            raise APIError(501, "This server does not support slots endpoint. Start it with `--slots`",
                           type="not_supported_error")
        state.require_ready()
        g = state.generator
        return JSONResponse([{**slot, "n_ctx": g.ctx_size, "speculative": g.drafting}
                             for slot in state.scheduler.slot_states()])

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """``{"content", "add_special", "with_pieces"}`` -> ``{"tokens": [...]}``."""
        state.require_ready()
        req = parse_request(await pipeline.read_body(request, settings.limits.body_bytes), TokenizeRequest)
        ids = await request.app.state.prompt_thread.run(lambda: state.prompts.encode(req.content, add_special=req.add_special))
        if req.with_pieces:  # a piece that is not whole UTF-8 is sent as its bytes, as llama-server does
            return JSONResponse({"tokens": [{"id": i, "piece": state.prompts.piece_or_bytes(i)} for i in ids]})
        return JSONResponse({"tokens": ids})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """``{"tokens": [...]}`` -> ``{"content": str}`` (special tokens kept, so
        ``/tokenize`` then ``/detokenize`` gives the text back)."""
        state.require_ready()
        req = parse_request(await pipeline.read_body(request, settings.limits.body_bytes), DetokenizeRequest)
        ids = state.prompts.check_ids(req.tokens)
        return JSONResponse({"content": state.prompts.decode(ids, skip_special=False)})

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format; 501 unless the server was started with ``--metrics``."""
        if not settings.metrics:
            raise APIError(501, "This server does not support metrics endpoint. Start it with `--metrics`",
                           type="not_supported_error")
        return Response(state.metrics.render(), media_type=CONTENT_TYPE, headers=state.metrics.headers())


def _model_path(given: str | None) -> str:
    """``/props`` ``model_path``: the file served (the packaged GGUF when ``-m`` was not given)."""
    if given:
        return given
    from flashdraft.targets.torch import default_model_path

    try:
        return str(default_model_path())
    except Exception:  # noqa: BLE001 - the model loaded, so this is only a report
        return ""


def _document_request_bodies(app: FastAPI) -> None:
    """Put the request models into the OpenAPI document (``/openapi.json``)."""
    base_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = base_openapi()
        refs, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS.values()],
                                        ref_template="#/components/schemas/{model}")
        doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        for path, model in REQUEST_MODELS.items():
            op = doc["paths"].get(path, {}).get("post")
            if op is not None:
                op["requestBody"] = {"required": True,
                                     "content": {"application/json": {"schema": refs[(model, "validation")]}}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
