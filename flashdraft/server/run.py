"""Step 4 of every generation route: run the jobs on the scheduler, collected or streamed.

Errors known before the first token are plain HTTP errors even for ``stream: true`` (the
stream waits for the first step before it sends headers), unless the prompt is still
prefilling after ``--sse-ping-interval`` seconds: then the headers go out with a keep-alive
ping, and one more each interval, so an agent's client does not give up on a silent
connection (Claude Code resends after 300 s without a byte). A failure after the headers
ends the stream with the API's error event. A client that disconnects cancels its jobs (queued:
never runs; running: stops within one verify step). On SIGTERM a queued job is answered
503 and a running stream that outlives the grace period ends with an error event (see
:mod:`.scheduler`).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager, suppress
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from flashdraft.generate import Cancelled, ContextOverflowError, Step
from flashdraft.server.errors import APIError, internal_error
from flashdraft.server.render_base import Completion, StreamFormat
from flashdraft.server.scheduler import JobFailed, ServerShuttingDown, Ticket

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: nginx's code for "client closed request": the body is never read by anyone
CLIENT_CLOSED = 499


@asynccontextmanager
async def cancel_on_disconnect(request: Request, *tickets: Ticket):
    """While inside, a client disconnect cancels ``tickets`` (the body is already read, so
    the next ASGI message can only be ``http.disconnect``)."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for ticket in tickets:
                    ticket.cancel()
                return

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        with suppress(asyncio.CancelledError):  # the watcher is gone before the answer is written
            await task


def failure(e: JobFailed | ServerShuttingDown) -> APIError:
    """HTTP error for a failed job: the client's fault only if it failed before any output
    with a validation error; 503 when the server is stopping; otherwise ours (500)."""
    if isinstance(e, ServerShuttingDown):
        return APIError(503, str(e), type="unavailable_error", code="server_shutting_down")
    if isinstance(e.error, ContextOverflowError):
        return APIError(400, str(e.error), type="exceed_context_size_error", code="context_length_exceeded",
                        extra={"n_prompt_tokens": e.error.n_prompt, "n_ctx": e.error.ctx_size})
    if isinstance(e.error, ValueError) and not e.after_output:
        return APIError(400, str(e.error))
    return internal_error(e.error)


def cancelled() -> APIError:
    """499: the client went away before the answer was complete."""
    return APIError(CLIENT_CLOSED, "the client closed the request", code="cancelled")


async def collect(request: Request, tickets: list[Ticket]) -> list[Completion]:
    """Every step of each ticket gathered into one :class:`Completion`, in order. The first
    failure cancels the others and is raised.

    Raises:
        APIError: a job failed (4xx/5xx) or the client left (499).
    """
    try:
        async with cancel_on_disconnect(request, *tickets):
            return list(await asyncio.gather(*(_collect(t) for t in tickets)))
    except (JobFailed, ServerShuttingDown) as e:
        raise failure(e) from None
    except Cancelled:
        raise cancelled() from None
    finally:
        for ticket in tickets:
            ticket.cancel()  # no-op once finished; stops the rest after a failure or a disconnect


async def _collect(ticket: Ticket) -> Completion:
    c, parts = Completion(), []
    async for step in ticket.events():
        parts.append(step.text)
        c.token_ids.extend(step.token_ids)
        c.logprobs.extend(step.logprobs or ())
        if step.finish_reason is not None:
            c.finish_reason, c.timings = step.finish_reason, step.timings
    c.text = "".join(parts)
    return c


async def stream(request: Request, ticket: Ticket, fmt: StreamFormat,
                 observe: Callable[[str, Completion | None], None],
                 ping_interval: float = 0.0) -> StreamingResponse:
    """Stream ``ticket``'s steps as server-sent events written by ``fmt``.

    Args:
        observe: called once when the stream ends, with its outcome (``ok``, ``cancelled``,
            ``client_error``, ``server_error``) and the completion when it finished.
        ping_interval: seconds; if the first step has not come by then, the headers are
            sent with ``fmt.ping()`` and another ping follows every interval until it
            does. <= 0: wait for the first step however long it takes.
    Raises:
        APIError: the job failed before its first step and before any ping (plain HTTP
            error) or the client left.
    """
    events = ticket.events()
    first_step = asyncio.ensure_future(anext(events))
    try:
        async with cancel_on_disconnect(request, ticket):
            await asyncio.wait({first_step}, timeout=ping_interval if ping_interval > 0 else None)
            first = first_step.result() if first_step.done() else None
    except (JobFailed, ServerShuttingDown) as e:
        raise failure(e) from None
    except Cancelled:
        raise cancelled() from None
    except BaseException:
        first_step.cancel()
        ticket.cancel()
        raise
    if first is None:  # still prefilling: headers now, the first step under pings
        body = _sse_body(ticket, _pinged(first_step, ping_interval, fmt), events, fmt, observe)
    else:
        body = _sse_body(ticket, first, events, fmt, observe)
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


async def _pinged(first_step: asyncio.Future, interval: float, fmt: StreamFormat) -> AsyncIterator[bytes | Step]:
    """``fmt.ping()`` now and every ``interval`` seconds until ``first_step`` is done, then
    its step (or its exception)."""
    try:
        while True:
            yield fmt.ping()
            done, _ = await asyncio.wait({first_step}, timeout=interval)
            if done:
                yield first_step.result()
                return
    finally:
        first_step.cancel()  # no-op once done; the client left while we were pinging


async def _sse_body(ticket: Ticket, first: Step | AsyncIterator[bytes | Step], events: AsyncIterator[Step],
                    fmt: StreamFormat, observe: Callable[[str, Completion | None], None]) -> AsyncIterator[bytes]:
    """The stream's bytes; ``first`` is the first step, or pings that end with it."""
    c, parts, status, done = Completion(), [], "ok", None
    try:
        if not isinstance(first, Step):
            async for item in first:
                if isinstance(item, Step):
                    first = item
                else:
                    yield item
        for event in fmt.start(first):
            yield event
        step = first
        while True:
            if step.prompt_progress is not None and (event := fmt.progress(step)) is not None:
                yield event
            if step.only_progress:
                step = await anext(events)
                continue
            parts.append(step.text)
            c.token_ids.extend(step.token_ids)
            if step.finish_reason is not None:
                c.text, c.finish_reason, c.timings = "".join(parts), step.finish_reason, step.timings
                done = c
                for event in fmt.end(step, c):
                    yield event
                return
            event = fmt.delta(step)
            if event is not None:
                yield event
            step = await anext(events)
    except (JobFailed, ServerShuttingDown) as e:  # headers are sent: end with an error event
        err = failure(e)
        status = "client_error" if err.status < 500 else "server_error"
        yield fmt.error(err)
    except Cancelled:
        status = "cancelled"
    except BaseException:  # the client went away (CancelledError) or shutdown
        status = "cancelled"
        raise
    finally:
        ticket.cancel()  # frees the slot within one step if we stopped early
        observe(status, done)
