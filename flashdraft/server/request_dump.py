"""``flashdraft serve --dump-requests DIR``: every HTTP request recorded as one JSON file.

For finding out what a client really sends (a coding agent's first prompt, its tools, the
fields it adds) and for replaying it later: ``tests/test_agent_replay.py`` replays the bodies
that ``scripts/agents_check.sh`` recorded from Claude Code, Codex CLI, aider and opencode.

One file per request, ``DIR/NNNNNN-METHOD-PATH.json`` (a counter in arrival order, then the
method and the path with ``/`` as ``_``), written when the response has ended (a stream:
after its last event), holding::

    {"seq": 1, "time": "2026-01-01T12:00:00.000Z", "method": "POST", "path": "/v1/messages",
     "query": "beta=true", "headers": {"content-type": "application/json", ...},
     "body": {...},                 # the JSON body as parsed; "body_text" if it is not JSON
     "status": 200, "ttfb_ms": 812.3, "elapsed_ms": 1532.4,
     "response": {"content_type": "text/event-stream", "text": "event: message_start\\n...",
                  "truncated": false}}      # or "json": {...} for a JSON answer

Secrets are scrubbed before anything is written: the ``Authorization``,
``Proxy-Authorization``, ``x-api-key``, ``api-key``, ``Cookie`` and ``Set-Cookie`` headers
are left out; any JSON string value under a key named like a credential (``api_key``,
``apiKey``, ``access_token``, ``secret``, ``password``, ...) is replaced by
``"[scrubbed]"``; and strings that look like API keys or tokens (``sk-...``, ``sk-ant-...``,
``ghp_...``, ``github_pat_...``, ``xox?-...``, ``AKIA...``, ``Bearer ...``) are replaced
wherever they occur, in the body and in the response text.

The middleware is pure ASGI: it tees the request's body messages as they pass (``receive``
gives the app exactly what it would have got, disconnects included) and copies the
response's first :data:`RESPONSE_BYTES` bytes, so streaming behaves as without it. Files are
written off the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import threading
import time
from pathlib import Path

log = logging.getLogger("flashdraft.server")

#: request headers never written (credentials and cookies)
SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie", "set-cookie",
                            "x-goog-api-key", "openai-organization", "openai-project"})
#: JSON keys whose string values are credentials, compared lower-case without ``-`` / ``_``
SECRET_KEYS = frozenset({"apikey", "xapikey", "accesstoken", "refreshtoken", "idtoken", "authtoken", "token",
                         "secret", "clientsecret", "password", "passwd", "authorization", "bearer", "sessiontoken",
                         "privatekey"})
#: credential-looking substrings, replaced wherever they occur
SECRET_PATTERNS = re.compile(
    r"sk-(?:ant-|proj-)?[A-Za-z0-9_\-]{16,}"
    r"|gh[pousr]_[A-Za-z0-9]{20,}"
    r"|github_pat_[A-Za-z0-9_]{20,}"
    r"|xox[abprs]-[A-Za-z0-9\-]{10,}"
    r"|AKIA[0-9A-Z]{16}"
    r"|(?<=Bearer )[A-Za-z0-9._~+/\-]{16,}=*")
SCRUBBED = "[scrubbed]"
#: bytes of each response kept (an agent's answers on a small model are far shorter)
RESPONSE_BYTES = 1 << 20
#: bytes of a request body kept when it is not JSON
TEXT_BYTES = 1 << 16


def scrub_text(text: str) -> str:
    """``text`` with every credential-looking substring replaced by ``[scrubbed]``."""
    return SECRET_PATTERNS.sub(SCRUBBED, text)


def _secret_key(key: str) -> bool:
    return key.lower().replace("-", "").replace("_", "") in SECRET_KEYS


def scrub(value):
    """A copy of the JSON value ``value`` with credentials replaced (see the module doc)."""
    if isinstance(value, dict):
        return {k: SCRUBBED if isinstance(v, str) and _secret_key(k) else scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    if isinstance(value, str):
        return scrub_text(value)
    return value


def scrub_headers(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """ASGI headers as a dict (repeated names joined by ``, ``), credentials left out."""
    out: dict[str, str] = {}
    for name, value in headers:
        key = name.decode("latin-1").lower()
        if key in SECRET_HEADERS:
            continue
        text = scrub_text(value.decode("latin-1"))
        out[key] = f"{out[key]}, {text}" if key in out else text
    return out


def _slug(path: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9.-]+", "_", path.strip("/")) or "root"
    return slug[:80]


def _body_fields(body: bytes) -> dict:
    if not body:
        return {}
    try:
        return {"body": scrub(json.loads(body))}
    except (ValueError, UnicodeDecodeError):
        text = body[:TEXT_BYTES].decode("utf-8", "replace")
        return {"body_text": scrub_text(text), **({"body_bytes": len(body)} if len(body) > TEXT_BYTES else {})}


def _response_fields(content_type: str, data: bytes, truncated: bool) -> dict:
    out: dict = {"content_type": content_type}
    if content_type.startswith("application/json") and not truncated:
        try:
            out["json"] = scrub(json.loads(data))
            return out
        except ValueError:
            pass
    out["text"] = scrub_text(data.decode("utf-8", "replace"))
    out["truncated"] = truncated
    return out


class RequestDumpMiddleware:
    """Pure ASGI middleware writing one JSON file per HTTP request into ``directory``
    (created if missing). See the module doc for the file's fields."""

    def __init__(self, app, directory: str | Path):
        self.app = app
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        start = 1 + max((int(p.name[:6]) for p in self.dir.glob("[0-9]" * 6 + "-*.json")), default=0)
        self._seq = itertools.count(start)  # a restart on the same DIR goes on numbering
        self._lock = threading.Lock()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        with self._lock:
            seq = next(self._seq)
        t0 = time.perf_counter()
        started = time.time()
        body = bytearray()
        response = bytearray()
        meta = {"status": 0, "ttfb_ms": None, "content_type": "", "truncated": False}

        async def receiving():
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
            return message

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                meta["status"] = message["status"]
                meta["ttfb_ms"] = round(1e3 * (time.perf_counter() - t0), 1)
                for name, value in message.get("headers") or []:
                    if name.lower() == b"content-type":
                        meta["content_type"] = value.decode("latin-1")
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                room = RESPONSE_BYTES - len(response)
                if len(chunk) > room:
                    meta["truncated"] = True
                response.extend(chunk[:max(room, 0)])
            await send(message)

        try:
            await self.app(scope, receiving, sending)
        finally:
            record = {
                "seq": seq,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started)) + f".{int(started % 1 * 1e3):03d}Z",
                "method": scope.get("method", ""), "path": scope.get("path", ""),
                "query": scrub_text(scope.get("query_string", b"").decode("latin-1")),
                "headers": scrub_headers(scope.get("headers") or []),
                "status": meta["status"], "ttfb_ms": meta["ttfb_ms"],
                "elapsed_ms": round(1e3 * (time.perf_counter() - t0), 1),
            }
            name = f"{seq:06d}-{record['method']}-{_slug(record['path'])}.json"
            try:
                await asyncio.to_thread(self._write, name, record, bytes(body), bytes(response), dict(meta))
            except Exception:  # a full disk must not turn an answered request into an error
                log.exception("--dump-requests: could not write %s", self.dir / name)

    def _write(self, name: str, record: dict, body: bytes, response: bytes, meta: dict) -> None:
        record.update(_body_fields(body))
        record["response"] = _response_fields(meta["content_type"], response, meta["truncated"])
        tmp = self.dir / (name + ".tmp")
        tmp.write_text(json.dumps(record, ensure_ascii=False, indent=1), encoding="utf-8")
        tmp.replace(self.dir / name)
