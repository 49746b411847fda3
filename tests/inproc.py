"""Our HTTP server on a tiny random target, uvicorn in a thread: real HTTP in a second.

For the browser, bad-input, fuzz and fault tests: they test the HTTP layer, the queue and
cancellation, which do not depend on the model. Prompts are word-level token strings
("t5 t9 ..."); the chat template joins the messages' contents with spaces.
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import uvicorn
from tiny import tiny_model, tiny_tokenizer

from flashdraft.drafters.ngram import NgramDrafter
from flashdraft.generate import SpeculativeGenerator
from flashdraft.server.app import create_app
from flashdraft.server.state import ServerSettings
from flashdraft.targets.torch import Target

#: greedy continuation of this prompt has no EOS for a long while (see test_bench.py)
PROMPT = "t5 t9 t17 t3 t22 t41 t5 t9 t17"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def chat_target() -> Target:
    """The tiny llama target with a pass-through chat template."""
    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return Target(tiny_model(), tok, name="tiny")


class PacedGenerator(SpeculativeGenerator):
    """Records every prompt it starts and sleeps ``delay`` s between steps, so a test can
    act while a request is still running (the tiny model would finish in milliseconds)."""

    def __init__(self, *a, delay: float = 0.0, **kw):
        super().__init__(*a, **kw)
        self.delay = delay
        self.started: list[list[int]] = []

    def generate(self, request, *a, **kw):
        self.started.append(list(request.prompt_ids))
        for i, step in enumerate(super().generate(request, *a, **kw)):
            if i and self.delay:
                time.sleep(self.delay)
            yield step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(generator: SpeculativeGenerator, apps: list | None = None, **settings) -> Iterator[str]:
    """Run ``create_app(generator)`` on a free loopback port; yields its base URL (and
    appends the app to ``apps`` when given, for tests that reach into its state)."""
    app = create_app(generator, ServerSettings(**{"alias": "tiny", "spec_type": "ngram", **settings}))
    if apps is not None:
        apps.append(app)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                        timeout_graceful_shutdown=2))
    thread = threading.Thread(target=srv.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


def new_generator(delay: float = 0.0, ctx_size: int = 256) -> PacedGenerator:
    return PacedGenerator(chat_target(), NgramDrafter(), ctx_size=ctx_size, n_draft=4, delay=delay)


def metric_values(url: str) -> dict[str, float]:
    """``/metrics`` as ``{"name{labels}": value}``."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_for(predicate, timeout: float, interval: float = 0.02) -> float:
    """Poll ``predicate()`` until true; returns the seconds it took. Raises TimeoutError."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - t0
