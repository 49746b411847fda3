"""The chat page: ``GET /`` and ``GET /static/<file>`` from ``flashdraft/server/static/``.

The files are read through :mod:`importlib.resources`, so an installed wheel serves them
as an editable checkout does (``pyproject.toml`` ships ``server/static/*`` and
``server/static/vendor/*`` as package data). They are read once, when the app is built: a
fixed list of small files, so a request can never touch the file system with a name of its
choosing.

``static/vendor/`` holds the pinned Markdown, sanitiser and highlighting libraries (see
``VENDOR.json`` and ``scripts/vendor_webui.sh``), checked in so the page loads nothing from
elsewhere; the Content-Security-Policy says so to the browser too (scripts, styles and
requests only from this server, no inline script or style, no eval).
"""

from __future__ import annotations

from functools import reduce
from importlib import resources
from operator import truediv

from fastapi import FastAPI
from fastapi.responses import Response

from flashdraft.server.errors import APIError

JS = "text/javascript; charset=utf-8"
CSS = "text/css; charset=utf-8"
TEXT = "text/plain; charset=utf-8"

#: every file under static/, by its path there, with its media type; anything else is a 404.
#: The licences and VENDOR.json are served too, so the page's provenance can be checked.
FILES = {
    "index.html": "text/html; charset=utf-8",
    "chat.js": JS,
    "chat.css": CSS,
    "vendor/marked.umd.js": JS,
    "vendor/purify.min.js": JS,
    "vendor/highlight.min.js": JS,
    "vendor/github.min.css": CSS,
    "vendor/marked.LICENSE": TEXT,
    "vendor/dompurify.LICENSE": TEXT,
    "vendor/highlightjs.LICENSE": TEXT,
    "vendor/VENDOR.json": "application/json",
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
    # one path part at a time: a Traversable (a wheel, a zip) only promises child names
    return {name: reduce(truediv, name.split("/"), root).read_bytes() for name in FILES}


def register(app: FastAPI) -> None:
    """Add ``/``, ``/index.html`` and ``/static/{name}`` (``name`` may be ``vendor/...``)."""
    files = read_static()

    def serve(name: str) -> Response:
        return Response(files[name], media_type=FILES[name], headers=HEADERS)

    @app.get("/", include_in_schema=False)
    @app.get("/index.html", include_in_schema=False)
    async def index() -> Response:
        """The chat page."""
        return serve("index.html")

    @app.get("/static/{name:path}", include_in_schema=False)
    async def static(name: str) -> Response:
        """One of the page's files; 404 in OpenAI's error shape for any other name."""
        if name not in FILES:
            raise APIError(404, f"GET /static/{name}: Not Found", type="not_found_error")
        return serve(name)
