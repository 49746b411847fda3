"""The server's request log, as llama-server prints it: one line per HTTP request and, per
generation, its prompt-eval and eval speed and (when drafting) the draft acceptance.

    request: POST /v1/chat/completions 200 1532.4 ms
    slot 0: prompt eval time =     61.02 ms /    34 tokens (    1.79 ms per token,   557.19 tokens per second)
    slot 0:        eval time =   1467.30 ms /    48 tokens (   31.22 ms per token,    32.03 tokens per second)
    slot 0:       total time =   1528.32 ms /    82 tokens
    slot 0: draft acceptance rate = 0.41176 (   28 accepted /    68 drafted), tau 1.58, mean depth 3.2
    request: POST /v1/messages 400 2.1 ms: messages.0.role must be 'user', 'assistant' or 'system', got 'tool'

A refused or failed request's line ends with the error's message (JSON: a ``reason`` field).

The figures are the response's ``timings`` (:meth:`flashdraft.generate.Timings.to_dict`), not
a second measurement. On by default at INFO (logger ``flashdraft.request``); ``--log-disable``
keeps warnings and errors only, ``--log-file`` also writes the log to a file, and
``--log-format json`` writes every log line as one JSON object (``time``, ``level``,
``logger``, ``message``, plus ``event: "request"`` or ``event: "generation"`` and their
fields) for log shippers.

``/health`` polls are logged at DEBUG only (llama-server skips them too): a load balancer
probing every second would bury the requests.
"""

from __future__ import annotations

import json
import logging
import sys
import time

log = logging.getLogger("flashdraft.request")

FORMATS = ("text", "json")
#: paths polled by load balancers and clients waiting for the model: DEBUG, not INFO
QUIET_PATHS = frozenset({"/health", "/v1/health"})

_format = "text"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (ISO 8601, UTC), ``level``, ``logger``,
    ``message``, the record's ``fields`` (request and generation records) and ``exc_info``."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(timestamps: bool = False, prefix: bool = False, verbose: bool = False, quiet: bool = False,
                  log_file: str | None = None, fmt: str = "text") -> None:
    """Configure the root logger for ``flashdraft serve``: stderr, plus ``log_file`` when
    given (``logging.basicConfig``: a no-op where the root logger already has handlers, as
    under pytest's log capture; the main CLI leaves ``serve``'s logging to this).

    Args:
        timestamps / prefix: text format only: start lines with the time / the level letter.
        verbose: DEBUG; quiet: WARNING (``--log-disable``); else INFO.
        fmt: ``text`` or ``json`` (one object per line).
    Raises:
        ValueError: an unknown ``fmt``; OSError: ``log_file`` cannot be opened.
    """
    global _format
    if fmt not in FORMATS:
        raise ValueError(f"--log-format {fmt!r}: choose from {', '.join(FORMATS)}")
    _format = fmt
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
    if fmt == "json":
        formatter: logging.Formatter = JsonFormatter()
    else:
        formatter = logging.Formatter(("%(asctime)s " if timestamps else "") + ("%(levelname).1s " if prefix else "")
                                      + "%(name)s: %(message)s")
    for h in handlers:
        h.setFormatter(formatter)
    level = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, handlers=handlers)


#: bytes of an error body kept to find its reason (error bodies are a few hundred bytes)
REASON_BYTES = 8192


class RequestLogMiddleware:
    """Pure ASGI middleware (does not wrap ``receive``: streaming and disconnect detection
    behave as without it): logs ``METHOD PATH STATUS MS`` once the response has ended (a
    stream: after its last event), or ``STATUS 0`` if the client left before any answer.
    A 4xx/5xx line ends with the error's message, read from the body sent (every API's error
    shape has ``error.message``), so whoever reads the log sees why without the client's copy."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 0
        body = bytearray()

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < REASON_BYTES:
                body.extend(message.get("body", b"")[: REASON_BYTES - len(body)])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            request(scope.get("method", ""), scope.get("path", ""), status, 1e3 * (time.perf_counter() - t0),
                    reason=error_reason(bytes(body)) if status >= 400 else None)


def error_reason(body: bytes) -> str | None:
    """``error.message`` of an error body (OpenAI's, llama-server's and Anthropic's shapes),
    else its text; None for an empty body."""
    if not body:
        return None
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
    except (ValueError, AttributeError):
        pass
    return body.decode("utf-8", "replace").strip()[:500] or None


def request(method: str, path: str, status: int, ms: float, reason: str | None = None) -> None:
    """Log one HTTP request: ``request: POST /completion 200 812.3 ms``; a failed one with
    its reason: ``request: POST /v1/messages 400 2.1 ms: messages.0.role must be ...``."""
    level = logging.DEBUG if path in QUIET_PATHS else logging.INFO  # 503s while loading too: polled
    if log.isEnabledFor(level):
        fields = {"event": "request", "method": method, "path": path, "status": status, "ms": round(ms, 3)}
        if reason:
            fields["reason"] = reason
        log.log(level, "request: %s %s %d %.1f ms" + (": %s" if reason else ""), method, path, status, ms,
                *([reason] if reason else []), extra={"fields": fields})


def generation(timings: dict, slot: int = 0, finish_reason: str | None = None) -> None:
    """Log one finished generation from its response ``timings`` (``Timings.to_dict``):
    llama-server's prompt eval / eval / total lines, and the draft acceptance line when
    ``timings`` carries drafting counters."""
    if not log.isEnabledFor(logging.INFO):
        return
    t = timings
    if _format == "json":
        log.info("generation", extra={"fields": {"event": "generation", "slot": slot,
                                                 "finish_reason": finish_reason, **t}})
        return
    head = f"slot {slot}:"
    log.info("%s prompt eval time = %10.2f ms / %5d tokens (%8.2f ms per token, %8.2f tokens per second)", head,
             t["prompt_ms"], t["prompt_n"], t["prompt_per_token_ms"], t["prompt_per_second"])
    log.info("%s        eval time = %10.2f ms / %5d tokens (%8.2f ms per token, %8.2f tokens per second)", head,
             t["predicted_ms"], t["predicted_n"], t["predicted_per_token_ms"], t["predicted_per_second"])
    log.info("%s       total time = %10.2f ms / %5d tokens", head, t["prompt_ms"] + t["predicted_ms"],
             t["prompt_n"] + t["predicted_n"])
    if "draft_n" in t:
        rate = t["draft_n_accepted"] / t["draft_n"] if t["draft_n"] else 0.0
        log.info("%s draft acceptance rate = %0.5f (%5d accepted / %5d drafted), tau %.2f, mean depth %.1f", head,
                 rate, t["draft_n_accepted"], t["draft_n"], t["acceptance_length"], t["draft_depth"])
