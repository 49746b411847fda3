"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause is raised as :class:`APIError` (or converted into one
by the handlers registered in :func:`install_error_handlers`), so every 4xx/5xx body has
the same shape whatever went wrong.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class APIError(Exception):
    """A request failure with an HTTP status and OpenAI's error fields.

    Args:
        status: HTTP status code (4xx for the client's fault, 5xx for ours).
        message: human-readable text; says what was wrong and, where it helps, the numbers.
        type: OpenAI error type (``invalid_request_error``, ``authentication_error``...).
        param: the request field at fault, dotted (``messages.0.role``), or None.
        code: machine-readable code (``context_length_exceeded``, ``model_loading``...).
        extra: more fields for the error object (llama-server adds ``n_prompt_tokens``...).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.extra = param, code, extra or {}

    def body(self) -> dict:
        """The JSON body: ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code, **self.extra}}

    def response(self) -> JSONResponse:
        """A JSONResponse carrying :meth:`body` with :attr:`status`."""
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


def internal_error(exc: BaseException) -> APIError:
    """500 for a failure that is ours; the message names the exception, not a traceback."""
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def install_error_handlers(app: FastAPI) -> None:
    """Route APIError, Starlette's HTTP errors (404/405) and anything unexpected to
    OpenAI-shaped JSON bodies."""

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return APIError(exc.status_code, message, type=kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return internal_error(exc).response()
