"""Building a prompt (parse, chat template, tokens, grammar) runs off the event loop: while
one request's prompt is being built (seconds for a 5 MB body), ``/health`` and other
requests are still answered. The build is held by the test, not timed."""

from __future__ import annotations

import threading

import httpx
from inproc import new_generator, serve

from flashdraft.server import jobs


def test_health_answers_while_a_prompt_is_being_built(monkeypatch):
    entered, release = threading.Event(), threading.Event()
    real_build = jobs.build

    def held_build(req, state):
        entered.set()
        release.wait(30)
        return real_build(req, state)

    monkeypatch.setattr(jobs, "build", held_build)
    with serve(new_generator()) as url:
        answers = []
        body = {"model": "tiny", "messages": [{"role": "user", "content": "t5 t9 t17"}], "max_tokens": 3,
                "temperature": 0}
        t = threading.Thread(target=lambda: answers.append(
            httpx.post(url + "/v1/chat/completions", json=body, timeout=60)))
        t.start()
        try:
            assert entered.wait(20)
            health = httpx.get(url + "/health", timeout=5)  # the held build must not block it
            assert health.status_code == 200 and not release.is_set()
            assert httpx.get(url + "/v1/models", timeout=5).status_code == 200
        finally:
            release.set()
            t.join(60)
        assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["message"]["content"]
