"""The generation routes: ``/v1/chat/completions``, ``/v1/completions``, ``/completion``.

Each route: parse + validate the body (400 on anything wrong), tokenise, check the
context, submit one job to the scheduler, then either collect its steps into one JSON
body or stream them as server-sent events. Errors known before the first token are
plain HTTP errors even for ``stream: true`` (the route waits for the first step before
it starts the event stream); a failure after that ends the stream with an ``error`` event.
A client that disconnects cancels its job (queued: never runs; running: stops within
one verify step). On SIGTERM a queued job is answered 503 and a running stream that
outlives the grace period ends with an ``error`` event (see :mod:`.scheduler`).
"""

from __future__ import annotations

import asyncio
import functools
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from flashdraft.generate import Cancelled, ContextOverflowError, Step, Timings
from flashdraft.server import responses as R
from flashdraft.server.clients import REQUEST_CLIENT, client_of
from flashdraft.server.errors import APIError, bad_request, internal_error
from flashdraft.server.limits import check_request, over
from flashdraft.server.request_fields import check_extra_fields
from flashdraft.server.tools import active_tools, parse_calls, tool_grammar, tool_prompt
from flashdraft.server.scheduler import JobFailed, ServerShuttingDown, Ticket
from flashdraft.server.schemas import ChatCompletionRequest, CompletionRequest, LlamaCompletionRequest, parse_request
from flashdraft.server.state import ServerState

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: nginx's code for "client closed request": the body is never read by anyone
CLIENT_CLOSED = 499


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


def shutting_down(e: ServerShuttingDown) -> APIError:
    """503 for a job refused or ended because the server is stopping (clients may retry)."""
    return APIError(503, str(e), type="unavailable_error", code="server_shutting_down")


def failure(e: JobFailed | ServerShuttingDown) -> APIError:
    """HTTP error for a failed job: the client's fault only if it failed before any output
    with a validation error; 503 when the server is stopping; otherwise ours (500)."""
    if isinstance(e, ServerShuttingDown):
        return shutting_down(e)
    if isinstance(e.error, ContextOverflowError):
        return APIError(400, str(e.error), type="exceed_context_size_error", code="context_length_exceeded",
                        extra={"n_prompt_tokens": e.error.n_prompt, "n_ctx": e.error.ctx_size})
    if isinstance(e.error, ValueError) and not e.after_output:
        return APIError(400, str(e.error))
    return internal_error(e.error)


async def run_to_end(request: Request, ticket: Ticket) -> R.Completion:
    """Collect every step of ``ticket`` into one :class:`Completion`.

    Raises:
        APIError: the job failed (4xx/5xx) or the client left (499).
    """
    return (await run_all(request, [ticket]))[0]


async def run_all(request: Request, tickets: list[Ticket]) -> list[R.Completion]:
    """:func:`run_to_end` of several jobs at once (a batched prompt), in order. The first
    failure cancels the others and is raised."""
    try:
        async with cancel_on_disconnect(request, *tickets):
            return list(await asyncio.gather(*(_collect(t) for t in tickets)))
    except (JobFailed, ServerShuttingDown) as e:
        raise failure(e) from None
    except Cancelled:
        raise APIError(CLIENT_CLOSED, "the client closed the request", code="cancelled") from None
    finally:
        for ticket in tickets:
            ticket.cancel()  # no-op once finished; stops the rest after a failure or a disconnect


async def _collect(ticket: Ticket) -> R.Completion:
    c, parts = R.Completion(), []
    async for step in ticket.events():
        parts.append(step.text)
        c.token_ids.extend(step.token_ids)
        c.logprobs.extend(step.logprobs or ())
        if step.finish_reason is not None:
            c.finish_reason, c.timings = step.finish_reason, step.timings
    c.text = "".join(parts)
    return c


class StreamFormat:
    """How one endpoint writes its event stream.

    ``per_token``: with llama-server's ``timings_per_token``, turns a step's running
    :class:`~flashdraft.generate.Timings` into the ``timings`` object each chunk carries.
    """

    per_token: Callable[[Timings], dict] | None = None

    def tag(self, chunk: dict, step: Step) -> dict:
        """``chunk`` plus the timings so far when asked for (``timings_per_token``)."""
        if self.per_token is not None and step.progress is not None:
            chunk["timings"] = self.per_token(step.progress)
        return chunk

    def start(self) -> list[bytes]:
        """Events before the first text."""
        return []

    def delta(self, step: Step) -> bytes | None:
        """Event for a step that is not the last (None = nothing to send)."""
        raise NotImplementedError

    def end(self, step: Step, c: R.Completion, timings: dict) -> list[bytes]:
        """Events for the last step, given the whole completion."""
        raise NotImplementedError


class ChatStream(StreamFormat):
    """OpenAI ``chat.completion.chunk`` events ending in ``data: [DONE]``; with logprobs,
    each chunk carries its own tokens' (a chunk may carry tokens whose text is still held back).

    With tools, an answer that opens with ``{`` is a tool call: it is held back and sent,
    whole, as one ``tool_calls`` delta before the finish chunk (``finish_reason: tool_calls``);
    plain-text answers stream as usual.
    """

    def __init__(self, meta: R.ResponseMeta, logprobs: R.Logprobs | None = None, tools: bool = False):
        self.meta, self.logprobs, self.tools = meta, logprobs, tools
        self.held = ""  # with tools: text not yet sent while it may be a call
        self.calling = False
        self.decided = not tools  # whether the answer's first character has been seen

    def start(self) -> list[bytes]:
        return [R.sse(R.chat_chunk(self.meta, {"role": "assistant", "content": None}))]

    def delta(self, step: Step) -> bytes | None:
        text = step.text
        if not self.decided or self.calling:
            self.held += text
            if not self.held.strip():
                return None
            self.decided = True
            self.calling = self.held.lstrip().startswith("{")
            if self.calling:
                return None
            text, self.held = self.held, ""
        lps = self.logprobs.chat(step.logprobs) if self.logprobs and step.logprobs else None
        if not text and lps is None:
            return None
        return R.sse(self.tag(R.chat_chunk(self.meta, {"content": text}, logprobs=lps), step))

    def end(self, step: Step, c: R.Completion, timings: dict) -> list[bytes]:
        out = [e for e in [self.delta(step)] if e is not None]
        calls = parse_calls(c.text) if self.tools else None
        if calls:
            deltas = [{"index": i, **call} for i, call in enumerate(calls)]
            out.append(R.sse(R.chat_chunk(self.meta, {"tool_calls": deltas})))
            out.append(R.sse(R.chat_chunk(self.meta, {}, "tool_calls")))
            out.append(R.sse(R.usage_chunk(self.meta, "chat.completion.chunk", c, timings)))
            return out + [R.SSE_DONE]
        if self.held:  # a call cut short (max_tokens): the client gets the text it is
            out.append(R.sse(R.chat_chunk(self.meta, {"content": self.held})))
        out.append(R.sse(R.chat_chunk(self.meta, {}, c.finish_reason)))
        out.append(R.sse(R.usage_chunk(self.meta, "chat.completion.chunk", c, timings)))
        return out + [R.SSE_DONE]


class CompletionStream(StreamFormat):
    """OpenAI ``text_completion`` events ending in ``data: [DONE]``."""

    def __init__(self, meta: R.ResponseMeta, logprobs: R.Logprobs | None = None):
        self.meta, self.logprobs, self.offset = meta, logprobs, 0

    def delta(self, step: Step) -> bytes | None:
        lps = None
        if self.logprobs and step.logprobs:
            lps = self.logprobs.completion(step.logprobs, self.offset)
            self.offset += sum(len(t) for t in lps["tokens"])
        if not step.text and lps is None:
            return None
        return R.sse(self.tag(R.completion_chunk(self.meta, step.text, logprobs=lps), step))

    def end(self, step: Step, c: R.Completion, timings: dict) -> list[bytes]:
        out = [e for e in [self.delta(step)] if e is not None]
        out.append(R.sse(R.completion_chunk(self.meta, "", c.finish_reason)))
        out.append(R.sse(R.usage_chunk(self.meta, "text_completion", c, timings)))
        return out + [R.SSE_DONE]


class LlamaStream(StreamFormat):
    """llama-server ``/completion`` events: ``{"content", "tokens", "stop": false}`` chunks,
    then the full final object with ``stop: true`` (no ``[DONE]``, as llama-server)."""

    def __init__(self, final: Callable[[R.Completion, dict], dict], return_tokens: bool = False,
                 logprobs: R.Logprobs | None = None):
        self.final, self.return_tokens, self.logprobs = final, return_tokens, logprobs

    def _probs(self, step: Step) -> dict:
        return {"completion_probabilities": self.logprobs.llama(step.logprobs or [])} if self.logprobs else {}

    def delta(self, step: Step) -> bytes | None:
        if not (step.text or step.token_ids):
            return None
        return R.sse(self.tag({**R.llama_chunk(step.text, step.token_ids, self.return_tokens), **self._probs(step)},
                              step))

    def end(self, step: Step, c: R.Completion, timings: dict) -> list[bytes]:
        # the last event carries only its own piece of text (and probabilities), like every other event
        tokens = step.token_ids if self.return_tokens else []
        return [R.sse({**self.final(c, timings), "content": step.text, "tokens": tokens, **self._probs(step)})]


def register(app: FastAPI, state: ServerState) -> None:
    """Add the three generation routes to ``app``."""

    def timings_of(c: R.Completion) -> dict:
        return c.timings.to_dict(state.generator.drafting)

    def counted(endpoint: str):
        """Count every outcome in ``flashdraft_requests_total`` (streams count themselves)."""

        def deco(fn: Callable[[Request], Awaitable[Response]]):
            @functools.wraps(fn)
            async def wrapper(request: Request) -> Response:
                try:
                    response = await fn(request)
                except APIError as e:
                    status = "cancelled" if e.status == CLIENT_CLOSED else (
                        "client_error" if e.status < 500 else "server_error")
                    state.metrics.observe_request(endpoint, status)
                    raise
                if not isinstance(response, StreamingResponse):
                    state.metrics.observe_request(endpoint, "ok")
                return response
            return wrapper
        return deco

    async def stream(request: Request, endpoint: str, ticket: Ticket, fmt: StreamFormat,
                     per_token: bool = False) -> StreamingResponse:
        if per_token:
            fmt.per_token = lambda t: t.to_dict(state.generator.drafting)
        events = ticket.events()
        try:
            async with cancel_on_disconnect(request, ticket):
                first = await anext(events)  # errors before any output stay plain HTTP errors
        except (JobFailed, ServerShuttingDown) as e:
            raise failure(e) from None
        except Cancelled:
            raise APIError(CLIENT_CLOSED, "the client closed the request", code="cancelled") from None
        except BaseException:
            ticket.cancel()
            raise
        return StreamingResponse(sse_body(endpoint, ticket, first, events, fmt),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    async def sse_body(endpoint: str, ticket: Ticket, first: Step, events: AsyncIterator[Step],
                       fmt: StreamFormat) -> AsyncIterator[bytes]:
        c, parts, status = R.Completion(), [], "ok"
        try:
            for event in fmt.start():
                yield event
            step = first
            while True:
                parts.append(step.text)
                c.token_ids.extend(step.token_ids)
                if step.finish_reason is not None:
                    c.text, c.finish_reason, c.timings = "".join(parts), step.finish_reason, step.timings
                    for event in fmt.end(step, c, timings_of(c)):
                        yield event
                    return
                event = fmt.delta(step)
                if event is not None:
                    yield event
                step = await anext(events)
        except (JobFailed, ServerShuttingDown) as e:  # headers are sent: end with an error event
            err = failure(e)
            status = "client_error" if err.status < 500 else "server_error"
            yield R.sse(err.body())
        except Cancelled:
            status = "cancelled"
        except BaseException:  # the client went away (CancelledError) or shutdown
            status = "cancelled"
            raise
        finally:
            ticket.cancel()  # frees the slot within one step if we stopped early
            state.metrics.observe_request(endpoint, status)

    def logprobs_of(job, n_top: int) -> R.Logprobs | None:
        """The response's log-probability writer when the job computes them."""
        return R.Logprobs(state.prompts.piece_and_bytes, n_top, job.post_sampling_probs) if job.n_probs else None

    def batch_jobs(req, limit: int | None, limit_param: str, choices: int = 1) -> list:
        """One validated job per prompt of ``req`` and choice (``n``: the choices of a prompt
        are next to each other, as OpenAI orders them); ``stream`` takes a single prompt.
        Raises APIError 400 (naming ``prompt[i]``) before any job is queued."""
        prompts = req.prompts()
        if req.stream and len(prompts) > 1:
            raise bad_request(f"stream: true takes one prompt, got {len(prompts)}; send one request per prompt "
                              "or stream: false for a batch", param="prompt")
        jobs = []
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            ids = state.prompts.prompt(prompt, param)
            jobs += [state.make_job(ids, limit, req, limit_param=limit_param, prompt_param=param, choice=k)
                     for k in range(choices)]
        return jobs

    async def body_of(request: Request, model):
        state.require_ready()
        req = parse_request(await read_body(request, state.settings.limits.body_bytes), model)
        REQUEST_CLIENT.set(client_of(request.headers))  # read by make_job: the suffix drafter's key
        meta_model = state.check_model(req.model)
        check_extra_fields(req.model_extra)
        check_request(req, state.settings.limits)
        return req, meta_model

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions", include_in_schema=False)  # llama-server registers both
    @counted("chat")
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions (``stream`` supported for one choice; ``n`` choices otherwise)."""
        req, model = await body_of(request, ChatCompletionRequest)
        n_choices = req.choices()
        tools, must_call = chat_tools(req)
        ids = state.prompts.encode_segments(chat_segments(req, tools, must_call))
        limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        spec = tool_grammar(tools, must_call, req.parallel_tool_calls) if tools else None
        jobs = [state.make_job(ids, req.max_new_tokens(), req, limit_param=limit_param, prompt_param="messages",
                               constraint_spec=spec, choice=i) for i in range(n_choices)]
        meta = R.ResponseMeta.new("chatcmpl", model)
        lps = logprobs_of(jobs[0], req.top_logprobs or 0)
        if req.stream:
            return await stream(request, "chat", state.submit(jobs[0]), ChatStream(meta, lps, tools=bool(tools)),
                                req.timings_per_token)
        results = await run_all(request, state.submit_all(jobs))
        calls = [parse_calls(c.text) if tools else None for c in results]
        if len(results) == 1:
            body = R.chat_response(meta, results[0], timings_of(results[0]), lps, calls[0])
        else:
            body = R.chat_batch_response(meta, results, [timings_of(c) for c in results], lps, calls)
        return JSONResponse(with_verbose(body, req, ids, results[0]))

    def chat_tools(req: ChatCompletionRequest) -> tuple[list | None, bool]:
        """The request's active tools and whether it must call one."""
        must_call = req.tool_choice == "required" or isinstance(req.tool_choice, dict)
        return active_tools(req.tools, req.tool_choice), must_call

    def chat_segments(req: ChatCompletionRequest, tools: list | None, must_call: bool):
        """A chat request rendered by the template: the tool list (if any) in the system turn,
        the template's rules for the end of the conversation (prefill, no generation prompt)."""
        system = tool_prompt(tools, must_call) if tools else None
        return state.prompts.render(req.messages, req.chat_template_kwargs, system=system,
                                    add_generation_prompt=req.add_generation_prompt,
                                    continue_final_message=req.continue_final_message)

    def with_verbose(body: dict, req, ids: list[int], c: R.Completion) -> dict:
        """``body`` plus llama-server's ``__verbose`` object when the request (``verbose``)
        or the server (``-v``) asks: the prompt as the model saw it, special tokens
        included, and the first choice's text."""
        if req.verbose or state.settings.verbose:
            body["__verbose"] = {"prompt": state.prompts.decode(ids, skip_special=False), "content": c.text,
                                 "tokens_evaluated": len(ids), "tokens_predicted": c.timings.predicted_n}
        return body

    @app.post("/apply-template")
    async def apply_template(request: Request) -> Response:
        """llama-server's ``/apply-template``: a chat request's ``messages`` rendered by the
        chat template, as text (nothing is decoded)."""
        state.require_ready()
        req = parse_request(await read_body(request, state.settings.limits.body_bytes), ChatCompletionRequest)
        return JSONResponse({"prompt": state.prompts.text(chat_segments(req, *chat_tools(req)))})

    @app.post("/v1/chat/completions/input_tokens")
    @app.post("/chat/completions/input_tokens", include_in_schema=False)
    async def chat_input_tokens(request: Request) -> Response:
        """llama-server's token count of a chat request's prompt (``max_tokens`` not needed)."""
        req, _ = await body_of(request, ChatCompletionRequest)
        ids = state.prompts.encode_segments(chat_segments(req, *chat_tools(req)))
        return JSONResponse({"object": "response.input_tokens", "input_tokens": len(ids)})

    @app.post("/v1/completions")
    @counted("completions")
    async def completions(request: Request) -> Response:
        """OpenAI text completions: one prompt, or a batch (one choice per prompt)."""
        req, model = await body_of(request, CompletionRequest)
        jobs = batch_jobs(req, req.max_tokens, "max_tokens", choices=req.choices())
        meta = R.ResponseMeta.new("cmpl", model)
        lps = logprobs_of(jobs[0], req.logprob_count())
        if req.stream:
            return await stream(request, "completions", state.submit(jobs[0]), CompletionStream(meta, lps),
                                req.timings_per_token)
        results = await run_all(request, state.submit_all(jobs))
        if len(results) == 1:
            body = R.completion_response(meta, results[0], timings_of(results[0]), lps)
        else:
            body = R.completion_batch_response(meta, results, [timings_of(c) for c in results], lps)
        return JSONResponse(with_verbose(body, req, jobs[0].prompt_ids, results[0]))

    @app.post("/completion")
    @app.post("/completions", include_in_schema=False)  # llama-server: the native endpoint too, not OpenAI's
    @counted("completion")
    async def llama_completion(request: Request) -> Response:
        """llama-server's native completion (``prompt``, ``n_predict``, ``stop``, ``stream``...)."""
        req, model = await body_of(request, LlamaCompletionRequest)
        jobs = batch_jobs(req, None if req.n_predict < 0 else req.n_predict, "n_predict")
        job = jobs[0]  # every job of a batch has the same settings

        def final(c: R.Completion, timings: dict, prompt_ids: list[int] = job.prompt_ids) -> dict:
            stop_type, word = R.stop_details(state.prompts.decode, c, job.stop)
            p = job.params
            settings = {"n_predict": req.n_predict, "temperature": p.temperature, "top_k": p.top_k,
                        "top_p": p.top_p, "min_p": p.min_p, "seed": -1 if p.seed is None else p.seed,
                        "stop": job.stop, "ignore_eos": job.ignore_eos, "n_ctx": state.generator.ctx_size}
            prompt = state.prompts.decode(prompt_ids, skip_special=False)
            return req.pick_fields(R.llama_response(c, timings, model, len(prompt_ids), stop_type, word, settings,
                                                    req.return_tokens, lps, prompt))

        lps = logprobs_of(job, req.n_probs)
        if req.stream:
            return await stream(request, "completion", state.submit(job), LlamaStream(final, req.return_tokens, lps),
                                req.timings_per_token)
        results = await run_all(request, state.submit_all(jobs))
        if len(results) == 1:
            return JSONResponse(final(results[0], timings_of(results[0])))
        # several prompts: one result object each, in order (llama-server's array)
        return JSONResponse([{"index": i, **final(c, timings_of(c), j.prompt_ids)}
                             for i, (c, j) in enumerate(zip(results, jobs))])
