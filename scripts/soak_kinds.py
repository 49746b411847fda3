"""The requests of ``scripts/soak.py``: what each kind sends and how its answer is checked.

Every request is greedy (temperature 0), so each answer must equal the reference answer
the same server gave to the same body before the load, one request at a time: text, token
count (``usage.completion_tokens == timings.predicted_n``) and, for tool calls, the calls.
Bodies (``Specs``): chat and text-completion prompts, a second chat turn that repeats the
first turn (its prefix is in some slot's prompt cache), a tool call (``tools`` with a
function schema, ``tool_choice: required``: the arguments must be a JSON object with the
schema's required string), and a JSON-schema answer (``response_format``: it must parse
and match the schema).

Ways of sending (``Kinds.run``): ``full`` (one JSON answer), ``stream`` (server-sent
events: one finish chunk, ``[DONE]`` last, nothing after it), ``disconnect`` (a stream left
after 1-3 events), ``cancel`` (a non-streamed request whose socket is closed after a short
wait) and ``burst`` (a full request sent with many others at once). A 503 ``queue_full`` is
the server's documented overload answer: counted as ``rejected``, not as an error.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

CHAT, CMPL = "/v1/chat/completions", "/v1/completions"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ANSWER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
                 "required": ["city", "population"], "additionalProperties": False}
FOLLOW_UP = "Now say that again in one short sentence."
#: constrained answers get at least this many tokens, so they can end (a cut JSON cannot parse)
CONSTRAINED_TOKENS = 64


@dataclass
class Outcome:
    """One request's result. ``status``: ``ok`` | ``rejected`` (503 queue_full) | ``error`` |
    ``lost`` (no answer within the timeout) | ``corrupted`` (an answer that differs from the
    reference or breaks the protocol)."""

    kind: str
    key: str
    status: str = "ok"
    latency_s: float | None = None
    detail: str = ""
    http_status: int | None = None
    cache_n: int = 0
    validated: str = ""


@dataclass
class Answer:
    """What is compared with the reference."""

    text: str
    tokens: int
    calls: list | None = None
    finish: str | None = None
    cache_n: int = field(default=0, compare=False)  # differs with the slots' cache state, by design


class BadAnswer(Exception):
    """The answer is not what the protocol or the schema promises."""


@dataclass
class Specs:
    """The request bodies, by key; ``constrained`` keys are only sent non-streamed."""

    bodies: dict[str, tuple[str, dict]] = field(default_factory=dict)
    constrained: set[str] = field(default_factory=set)

    @classmethod
    def build(cls, prompts: list[str], max_tokens: int, structured: bool) -> "Specs":
        """Chat and completion bodies for each prompt (and a tool and a JSON-schema one)."""
        s = cls()
        for i, p in enumerate(prompts):
            s.bodies[f"chat{i}"] = (CHAT, {"messages": [{"role": "user", "content": p}], "max_tokens": max_tokens})
            s.bodies[f"cmpl{i}"] = (CMPL, {"prompt": p, "max_tokens": max_tokens})
        if structured:
            n = max(max_tokens, CONSTRAINED_TOKENS)
            s.bodies["tool"] = (CHAT, {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                                       "tools": [WEATHER], "tool_choice": "required", "max_tokens": n})
            s.bodies["json"] = (CHAT, {"messages": [{"role": "user", "content": "Name a big city and its population."}],
                                       "response_format": {"type": "json_schema", "json_schema": {
                                           "name": "city", "schema": ANSWER_SCHEMA}}, "max_tokens": n})
            s.constrained = {"tool", "json"}
        return s

    def add_second_turns(self, prompts: list[str], refs: dict[str, Answer], max_tokens: int) -> None:
        """``turn{i}``: the first chat turn with its reference answer, then a follow-up; the
        first turn's tokens are a prefix some slot's prompt cache holds after ``chat{i}``."""
        for i, p in enumerate(prompts):
            messages = [{"role": "user", "content": p}, {"role": "assistant", "content": refs[f"chat{i}"].text},
                        {"role": "user", "content": FOLLOW_UP}]
            self.bodies[f"turn{i}"] = (CHAT, {"messages": messages, "max_tokens": max_tokens})


def check_structured(key: str, a: Answer) -> str:
    """Validate a tool-call or JSON-schema answer; returns what was checked. Raises BadAnswer."""
    if key == "tool":
        if not a.calls:
            raise BadAnswer(f"no tool call (finish {a.finish})")
        for c in a.calls:
            args = json.loads(c["function"]["arguments"])
            if c["function"]["name"] != "get_weather" or not isinstance(args, dict) or \
                    not isinstance(args.get("city"), str):
                raise BadAnswer(f"tool call does not fit the schema: {c['function']}")
        return "tool_call"
    if key == "json":
        value = json.loads(a.text)
        if not isinstance(value, dict) or set(value) != {"city", "population"} or \
                not isinstance(value["city"], str) or type(value["population"]) is not int:
            raise BadAnswer(f"JSON does not match the schema: {a.text[:120]!r}")
        return "json_schema"
    return ""


def parse_full(path: str, body: dict) -> Answer:
    """An :class:`Answer` from a non-streamed body. Raises BadAnswer, KeyError, ValueError."""
    choice = body["choices"][0]
    if path == CHAT:
        msg = choice["message"]
        calls = [{"function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                 for c in msg.get("tool_calls") or []] or None
        text = msg.get("content") or ""
    else:
        text, calls = choice["text"], None
    tokens, predicted = body["usage"]["completion_tokens"], body["timings"]["predicted_n"]
    if tokens != predicted:
        raise BadAnswer(f"usage.completion_tokens {tokens} != timings.predicted_n {predicted}")
    return Answer(text, tokens, calls, choice["finish_reason"], body["timings"].get("cache_n", 0))


class Kinds:
    """Sends one request of a kind and checks it against the references."""

    def __init__(self, url: str, specs: Specs, api_key: str | None, timeout: float):
        self.url, self.specs, self.timeout = url, specs, timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.refs: dict[str, Answer] = {}
        self._local = threading.local()

    def http(self) -> httpx.Client:
        """One keep-alive client per thread, as separate real clients would have."""
        if not hasattr(self._local, "client"):
            self._local.client = httpx.Client(base_url=self.url, headers=self.headers, timeout=self.timeout)
        return self._local.client

    def body(self, key: str, stream: bool) -> tuple[str, dict]:
        path, body = self.specs.bodies[key]
        return path, {**body, "temperature": 0, "stream": stream}

    def reference(self, key: str) -> Answer:
        """The answer to ``key`` alone on the server. Raises on anything but a valid 200."""
        path, body = self.body(key, False)
        r = self.http().post(path, json=body)
        r.raise_for_status()
        a = parse_full(path, r.json())
        check_structured(key, a)
        return a

    def run(self, kind: str, key: str, rng: random.Random) -> Outcome:
        """Send ``key`` the ``kind`` way; never raises."""
        out = Outcome(kind, key)
        t0 = time.perf_counter()
        try:
            if kind in ("full", "burst"):
                self._full(out)
            elif kind == "cancel":
                self._cancel(out, rng.uniform(0.05, 1.0))
            else:
                self._stream(out, rng.randint(1, 3) if kind == "disconnect" else None)
        except httpx.TimeoutException as e:
            out.status, out.detail = "lost", f"timeout: {e!r}"
        except httpx.HTTPError as e:
            out.status, out.detail = "error", f"{type(e).__name__}: {e}"
        except (BadAnswer, ValueError, KeyError, IndexError, TypeError) as e:  # unparsable or wrong answer
            out.status, out.detail = "corrupted", f"{type(e).__name__}: {e}"
        except OSError as e:  # the raw socket of a cancel
            out.status, out.detail = "error", f"{type(e).__name__}: {e}"
        if out.status == "ok" and kind in ("full", "stream", "burst"):
            out.latency_s = time.perf_counter() - t0
        return out

    def _refused(self, out: Outcome, r: httpx.Response) -> bool:
        """Record a non-200 answer; True when there was one."""
        out.http_status = r.status_code
        if r.status_code == 200:
            return False
        try:
            code = r.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        if r.status_code == 503 and code == "queue_full":
            out.status, out.detail = "rejected", "503 queue_full"
        else:
            out.status, out.detail = "error", f"HTTP {r.status_code} {code}: {r.text[:200]}"
        return True

    def _compare(self, out: Outcome, a: Answer) -> None:
        ref = self.refs[out.key]
        out.cache_n = a.cache_n
        if (a.text, a.tokens, a.calls) != (ref.text, ref.tokens, ref.calls):
            raise BadAnswer(f"differs from the reference: {a.text[:80]!r} ({a.tokens} tokens, calls {a.calls}) vs "
                            f"{ref.text[:80]!r} ({ref.tokens} tokens)")
        out.validated = check_structured(out.key, a)

    def _full(self, out: Outcome) -> None:
        path, body = self.body(out.key, False)
        r = self.http().post(path, json=body)
        if not self._refused(out, r):
            self._compare(out, parse_full(path, r.json()))

    def _stream(self, out: Outcome, keep_events: int | None) -> None:
        path, body = self.body(out.key, True)
        parts, finishes, done, events, tokens, predicted, cache_n, finish = [], 0, False, 0, -1, -2, 0, None
        with self.http().stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                self._refused(out, r)
                return
            out.http_status = 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if done:
                    raise BadAnswer("data after [DONE]")
                if line[6:] == "[DONE]":
                    done = True
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    raise BadAnswer(f"error event: {ev['error']}")
                events += 1
                if ev.get("usage") and ev.get("timings"):  # the chat stream's own chunk after the finish
                    # chunk, or (/v1/completions, as llama-server) the finish chunk itself
                    tokens, predicted = ev["usage"]["completion_tokens"], ev["timings"]["predicted_n"]
                    cache_n = ev["timings"].get("cache_n", 0)
                if not ev["choices"]:
                    continue
                choice = ev["choices"][0]
                parts.append((choice["delta"].get("content") if path == CHAT else choice["text"]) or "")
                if choice["finish_reason"] is not None:
                    finishes, finish = finishes + 1, choice["finish_reason"]
                if keep_events is not None and events >= keep_events:
                    return  # leaving mid-stream on purpose: closing the response drops the connection
        if keep_events is not None:
            return  # the answer was shorter than the events we meant to keep
        if not done or finishes != 1 or tokens != predicted:
            raise BadAnswer(f"stream ended badly: [DONE] {done}, finish chunks {finishes}, usage {tokens}, "
                            f"timings {predicted}")
        self._compare(out, Answer("".join(parts), tokens, None, finish, cache_n))

    def _cancel(self, out: Outcome, after_s: float) -> None:
        """A non-streamed request whose client gives up: the socket closes after ``after_s``."""
        path, body = self.body(out.key, False)
        u = urlparse(self.url)
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in self.headers.items()) + "\r\n")
        with socket.create_connection((u.hostname, u.port), timeout=10) as s:
            s.sendall(head.encode() + data)
            time.sleep(after_s)
