"""The chat page at ``GET /`` in a real headless Chromium (Debian's ``chromium``, driven by
Playwright; no browser is ever downloaded).

The server is ours, in a thread, on the tiny random target (see ``inproc.py``) with a pause
between steps so that streaming and the stop button can be watched. Skipped, with the
reason, only where Chromium or Playwright is not installed (``.ci/run`` installs both).
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import tomllib
from pathlib import Path

import httpx
import pytest
import torch
from inproc import PROMPT, metric_values, new_generator, serve, wait_for

from flashdraft.server import webui

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "flashdraft" / "server" / "static"
CHROMIUM = os.environ.get("FLASHDRAFT_CHROMIUM", "/usr/bin/chromium")
#: the flags that keep Chromium from phoning home on a machine without a network
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
#: Chromium's console note for a 4xx answer (the error test causes one on purpose)
EXPECTED_4XX = "Failed to load resource: the server responded with a status of 4"
STEP_DELAY = 0.05  # s between steps: a 24-token answer streams for about half a second


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server():
    generator = new_generator(delay=STEP_DELAY)
    with serve(generator, metrics=True) as url:
        yield url, generator


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        pytest.skip(f"Chromium is not installed ({CHROMIUM}; on Debian: apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright for Python is not installed (pip install -e '.[test]')")
    executable = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser, server):
    """A fresh page on the chat UI; fails the test on any console error (a CSP violation,
    a script error, a request to somewhere else) except the browser's note of a 4xx answer,
    which the error test causes on purpose."""
    context = browser.new_context()
    p = context.new_page()
    problems: list[str] = []

    def on_console(m) -> None:
        if m.type == "error" and not m.text.startswith(EXPECTED_4XX):
            problems.append(m.text)

    p.on("console", on_console)
    p.on("pageerror", lambda e: problems.append(str(e)))
    p.goto(server[0] + "/")
    yield p
    context.close()
    assert not problems, problems


def settings(page, **values) -> None:
    """Open the settings panel and fill fields as a user would."""
    if page.locator("#settings").get_attribute("open") is None:
        page.click("#settings summary")
    for name, value in values.items():
        page.fill(f"#{name}", str(value))


def expect():
    from playwright.sync_api import expect as _expect
    return _expect


# -- the files -------------------------------------------------------------------------------

def test_page_and_assets_are_served_offline(server):
    url = server[0]
    r = httpx.get(url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    for name, media in webui.FILES.items():
        f = httpx.get(f"{url}/static/{name}")
        assert f.status_code == 200 and f.headers["content-type"] == media
        assert f.content == (STATIC / name).read_bytes()
        # nothing loaded from another host (no CDN): no absolute URLs in src/href/fetch
        assert not re.search(r"""(src|href|fetch\()\s*=?\s*["']https?://""", f.text), name
    for bad in ("/static/nope.js", "/static/..%2Fapp.py", "/static/"):
        r = httpx.get(url + bad)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", bad


def test_page_can_be_turned_off():
    with serve(new_generator(), webui=False) as url:
        r = httpx.get(url + "/")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert httpx.get(url + "/static/chat.js").status_code == 404


def test_package_data_ships_every_page_file():
    """An installed (non-editable) wheel carries the page: pyproject's package-data globs
    cover every file in static/, and the server serves exactly those files."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["flashdraft"]
    files = sorted(p.relative_to(ROOT / "flashdraft").as_posix() for p in STATIC.rglob("*") if p.is_file())
    assert files, "static/ is empty"
    for f in files:
        assert any(fnmatch.fnmatch(f, g) and "/" not in f[len("server/static/"):] for g in globs), f
    assert set(webui.FILES) == {Path(f).name for f in files}


# -- in the browser ----------------------------------------------------------------------------

def test_prompt_streams_text_and_shows_the_servers_stats(page, server):
    url, _ = server
    expect()(page.locator("#model")).to_contain_text("tiny · ngram")
    settings(page, temperature=0, max_tokens=24)
    page.fill("#prompt", PROMPT)
    page.press("#prompt", "Enter")

    answer = page.locator(".msg.assistant").last
    # streamed: text is on screen while the answer is still marked as streaming
    expect()(page.locator(".msg.assistant.streaming .content")).to_have_text(re.compile(r"\S"), timeout=20_000)
    assert page.is_enabled("#stop") and not page.is_enabled("#send")
    expect()(answer).to_have_class(re.compile(r"\bdone\b"), timeout=30_000)
    assert page.is_enabled("#send") and not page.is_enabled("#stop")

    # the same request through the API: same text, same draft counters
    ref = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 24}).json()
    t = ref["timings"]
    assert answer.locator(".content").inner_text() == ref["choices"][0]["message"]["content"]
    stats = {s.get_attribute("data-stat"): s.locator("b").inner_text()
             for s in answer.locator(".stats [data-stat]").all()}
    assert float(stats["tps"].split()[0]) > 0
    assert stats["tokens"] == "24"
    assert stats["draft"].startswith(f"{t['draft_n_accepted']} / {t['draft_n']}") and t["draft_n"] > 0
    assert stats["tau"] == f"{t['acceptance_length']:.2f}"


def test_conversation_is_multi_turn(page, server):
    _, generator = server
    settings(page, temperature=0, max_tokens=4)
    for prompt in ("t1 t2 t3", "t4 t5 t6"):
        page.fill("#prompt", prompt)
        page.click("#send")
        expect()(page.locator(".msg.assistant").last).to_have_class(re.compile(r"\bdone\b"), timeout=30_000)
    first_answer = page.locator(".msg.assistant .content").first.inner_text()
    sent = generator.target.decode(generator.started[-1])
    assert sent.split() == "t1 t2 t3".split() + first_answer.split() + "t4 t5 t6".split()
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0


def test_stop_button_ends_the_answer_and_frees_the_server(page, server):
    url, _ = server
    settings(page, temperature=0, max_tokens=200)  # about 5 s of streaming: stopped long before
    before = metric_values(url)
    page.fill("#prompt", PROMPT)
    page.click("#send")
    expect()(page.locator(".msg.assistant.streaming .content")).to_have_text(re.compile(r"\S"), timeout=20_000)
    page.click("#stop")
    answer = page.locator(".msg.assistant").last
    expect()(answer).to_have_class(re.compile(r"\bstopped\b"), timeout=5_000)
    assert answer.locator(".note").inner_text() == "stopped"
    assert page.is_enabled("#send")

    key = 'flashdraft_requests_total{endpoint="chat",status="cancelled"}'
    took = wait_for(lambda: (m := metric_values(url)).get(key, 0) > before.get(key, 0)
                    and m["llamacpp:requests_processing"] == 0, timeout=5)
    assert took < 1.0, f"the slot was freed only after {took:.2f} s"
    ok = httpx.post(url + "/v1/chat/completions", timeout=60,
                    json={"messages": [{"role": "user", "content": "t1"}], "max_tokens": 2})
    assert ok.status_code == 200


def test_server_errors_are_shown_in_the_answer(page):
    settings(page, max_tokens=100000)  # more than the context: a 400 with the numbers
    page.fill("#prompt", "t1 t2")
    page.click("#send")
    answer = page.locator(".msg.assistant").last
    expect()(answer).to_have_class(re.compile(r"\berror\b"), timeout=20_000)
    assert "larger than the context size (256 tokens)" in answer.locator(".note").inner_text()


def test_api_key_from_the_settings_is_sent(browser):
    with serve(new_generator(), api_key="sesame") as url:
        assert httpx.get(url + "/").status_code == 200  # the page itself is public
        assert httpx.get(url + "/props").status_code == 401
        context = browser.new_context()
        page = context.new_page()
        page.goto(url + "/")
        expect()(page.locator("#model")).to_contain_text("Invalid API key")
        settings(page, api_key="sesame", temperature=0, max_tokens=3)
        page.locator("#api_key").dispatch_event("change")
        expect()(page.locator("#model")).to_contain_text("tiny · ngram")
        page.fill("#prompt", PROMPT)
        page.click("#send")
        expect()(page.locator(".msg.assistant").last).to_have_class(re.compile(r"\bdone\b"), timeout=30_000)
        context.close()
