"""``flashdraft bench --url``: any running OpenAI-compatible server (ours, llama-server, vLLM).

Each prompt is sent once to ``POST /v1/chat/completions`` as a stream (with
``stream_options.include_usage``): the first content chunk gives the time to first token,
the last chunks give ``usage`` and, from llama-server and flashdraft, ``timings``. When a
server reports ``timings`` its own ``predicted_n / predicted_ms`` is the decode speed
(llama-server's definition); otherwise it is computed from the client's wall clock and
``usage.completion_tokens``. ``--no-stream`` sends plain requests (no TTFT).

Standard library HTTP only, so the benchmark needs nothing a server does not.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Callable

from flashdraft.bench.contender import BenchPrompt, Contender
from flashdraft.bench.measure import Generation, SpecCounts
from flashdraft.sampling import SamplingParams


def open_json(method: str, url: str, body: dict | None, timeout: float, error: type[Exception],
              headers: dict | None = None, unreachable: Callable[[], str] | None = None):
    """Send ``body`` as JSON (none for a GET) and return the open response.

    Args:
        unreachable: what to add to the message when the server cannot be reached (a
            child server's log tail).
    Raises:
        ``error``: an HTTP error status (its first 500 characters of body in the message) or
            a connection failure, naming the method and URL.
    """
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})},
                                 method=method)
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise error(f"{method} {url}: HTTP {e.code}: {detail}") from None
    except urllib.error.URLError as e:
        raise error(f"{method} {url}: {e.reason}" + (f"\n{unreachable()}" if unreachable else "")) from None


class ServerError(RuntimeError):
    """The server answered with an HTTP error or something that is not a completion."""


class RemoteServer(Contender):
    """One server at ``url`` (``http://host:port``, with or without ``/v1``).

    Args:
        url: base URL of the server.
        api_key: sent as ``Authorization: Bearer`` when given.
        model: model id to request; None = the first id of ``GET /v1/models``.
        stream: stream the answers (measures TTFT) or not.
        timeout: seconds to wait for one answer.
    """

    kind = "server"
    takes_constraint = True  # as response_format (flashdraft, llama-server, vLLM, SGLang)

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 stream: bool = True, timeout: float = 1800.0):
        self.base = url.rstrip("/").removesuffix("/v1")
        self.api_key, self.stream, self.timeout = api_key, stream, timeout
        self.model = model or self._first_model()
        self.name = f"{self.base.split('://', 1)[-1]}"
        self.description = f"server at {self.base}, model {self.model!r}"

    # -- HTTP ------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None = None):
        headers = {"Accept": "application/json, text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return open_json(method, self.base + path, body, self.timeout, ServerError, headers)

    def _first_model(self) -> str:
        with self._request("GET", "/v1/models") as r:
            data = json.load(r).get("data") or []
        return str(data[0]["id"]) if data else "default"

    # -- one request ---------------------------------------------------------------------------
    def _body(self, prompt: BenchPrompt, params: SamplingParams) -> dict:
        body = {"model": self.model, "messages": prompt.messages or [{"role": "user", "content": prompt.text}],
                "max_tokens": prompt.max_tokens, "temperature": params.temperature, "stream": self.stream}
        if prompt.turn is not None:  # a conversation: later turns may reuse the server's prompt cache
            body["cache_prompt"] = prompt.cache_prompt
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if prompt.schema is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "answer", "schema": prompt.schema, "strict": True}}
        if not params.greedy:
            # top_k/min_p are llama-server/vLLM extensions; OpenAI-style servers ignore them
            body.update(top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
            if params.seed is not None:
                body["seed"] = params.seed
        return body

    def run(self, prompt: BenchPrompt, params: SamplingParams) -> Generation:
        body = self._body(prompt, params)
        t0 = time.perf_counter()
        if self.stream:
            text, finish, usage, timings, first, last, pieces = self._stream(body)
        else:
            with self._request("POST", "/v1/chat/completions", body) as r:
                answer = json.load(r)
            last = time.perf_counter()
            choice = (answer.get("choices") or [{}])[0]
            text = (choice.get("message") or {}).get("content") or ""
            finish, usage, timings = choice.get("finish_reason"), answer.get("usage"), answer.get("timings")
            first = pieces = None
        return _generation(text, finish, usage or {}, timings, t0, first, last, pieces)

    def _stream(self, body: dict):
        parts, finish, usage, timings, first, last = [], None, None, None, None, None
        with self._request("POST", "/v1/chat/completions", body) as r:
            for raw in r:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise ServerError(f"stream error: {chunk['error']}")
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                    if piece:
                        last = time.perf_counter()
                        first = first or last
                        parts.append(piece)
                    finish = choice.get("finish_reason") or finish
        return "".join(parts), finish, usage, timings, first, last or time.perf_counter(), len(parts)


def _generation(text: str, finish: str | None, usage: dict, timings: dict | None, t0: float,
                first: float | None, last: float, pieces: int | None) -> Generation:
    """Assemble a :class:`Generation` from what the server reported (times in s).

    ``pieces``: streamed content chunks, the token count of last resort (about one token
    per chunk on llama-server and vLLM) when the server sends neither usage nor timings.
    """
    timings = timings or {}
    prompt_n = usage.get("prompt_tokens", timings.get("prompt_n", 0))
    completion_n = usage.get("completion_tokens", timings.get("predicted_n"))
    if completion_n is None:
        completion_n = pieces if pieces is not None else 0
    gen = Generation(text=text, token_ids=None, prompt_tokens=int(prompt_n), completion_tokens=int(completion_n),
                     ttft_ms=None if first is None else 1e3 * (first - t0), total_ms=1e3 * (last - t0),
                     finish_reason=finish)
    if timings.get("predicted_ms") and timings.get("predicted_n"):
        gen.decode_ms, gen.decode_tokens = float(timings["predicted_ms"]), int(timings["predicted_n"])
        gen.decode_source = "server"
    if "draft_n" in timings:
        gen.spec = SpecCounts(draft_n=int(timings["draft_n"]), draft_n_accepted=int(timings.get("draft_n_accepted", 0)),
                              acceptance_length=timings.get("acceptance_length"))
    return gen
