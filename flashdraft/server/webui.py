"""The chat page: ``GET /`` and ``GET /static/<file>`` from ``flashdraft/server/static/``.

The files are read through :mod:`importlib.resources`, so an installed wheel serves them
as an editable checkout does (``pyproject.toml`` ships ``server/static/*`` as package
data). They are read once, when the app is built: a handful of small files, and a request
can then never touch the file system with a name of its choosing.

The page loads nothing from elsewhere; the Content-Security-Policy says so to the browser
too (scripts, styles and requests only from this server).
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from flashdraft.server.errors import APIError

#: the files the page needs, with their media types; anything else under /static/ is a 404
FILES = {
    "index.html": "text/html; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
}

HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    # small files that change with every release: always revalidate, never serve a stale page
    "Cache-Control": "no-cache",
}


def read_static() -> dict[str, bytes]:
    """The page's files from the installed package.

    Raises:
        FileNotFoundError: a file is missing (a broken install).
    """
    root = resources.files("flashdraft.server") / "static"
    return {name: (root / name).read_bytes() for name in FILES}


def register(app: FastAPI) -> None:
    """Add ``/``, ``/index.html`` and ``/static/{name}`` to ``app``."""
    files = read_static()

    def serve(name: str) -> Response:
        return Response(files[name], media_type=FILES[name], headers=HEADERS)

    @app.get("/", include_in_schema=False)
    @app.get("/index.html", include_in_schema=False)
    async def index() -> Response:
        """The chat page."""
        return serve("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        """One of the page's files; 404 in OpenAI's error shape for any other name."""
        if name not in FILES:
            raise APIError(404, f"GET /static/{name}: Not Found", type="not_found_error")
        return serve(name)
