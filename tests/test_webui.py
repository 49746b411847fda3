"""The chat page at ``GET /`` in a real headless Chromium (Debian's ``chromium``, driven by
Playwright; no browser is ever downloaded).

The server is ours, in a thread, on the tiny random target (see ``inproc.py``) with a pause
between steps so that streaming and the stop button can be watched. The tiny model only
says random token words, so the Markdown tests answer from the browser's side instead:
Playwright intercepts ``/v1/chat/completions`` and replies with a hand-written stream in
the server's shape. Skipped, with the reason, only where Chromium or Playwright is not
installed (``.ci/run`` installs both).
"""

from __future__ import annotations

import hashlib
import json
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
VENDOR = STATIC / "vendor"
#: the versions scripts/vendor_webui.sh pins; VENDOR.json must say the same
PINS = {"marked": "18.2.1", "dompurify": "3.5.0", "@highlightjs/cdn-assets": "11.12.0"}
MEDIA = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".LICENSE": "text/plain; charset=utf-8", ".json": "application/json"}
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
    which the error test causes on purpose. The clipboard is open to it, for the Copy tests."""
    context = browser.new_context(permissions=["clipboard-read", "clipboard-write"])
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


def sse(text: str, pieces: int = 4) -> str:
    """``text`` as the server streams it: content deltas (cut mid-word, mid-fence), then the
    chunk with no choices that carries usage and timings, then ``[DONE]``."""
    step = max(1, -(-len(text) // pieces))
    chunks = [{"object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": text[i:i + step]}, "finish_reason": None}]}
        for i in range(0, len(text), step)]
    chunks.append({"object": "chat.completion.chunk", "choices": [],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10},
                   "timings": {"prompt_n": 3, "prompt_ms": 1.0, "predicted_n": 7, "predicted_ms": 10.0,
                               "predicted_per_second": 700.0, "draft_n": 4, "draft_n_accepted": 2,
                               "acceptance_length": 1.5}})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def answer_with(page, text: str, sent: list | None = None):
    """Make every chat request of ``page`` answer ``text``; appends each request's body to
    ``sent`` when given."""
    def reply(route) -> None:
        if sent is not None:
            sent.append(route.request.post_data_json)
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=sse(text))

    page.route("**/v1/chat/completions", reply)


def ask(page, prompt: str = "t1"):
    """Send ``prompt``; returns the answer's locator once it is done."""
    page.fill("#prompt", prompt)
    page.click("#send")
    answer = page.locator(".msg.assistant").last
    expect()(answer).to_have_class(re.compile(r"\bdone\b"), timeout=20_000)
    return answer


# -- the files -------------------------------------------------------------------------------

def test_page_and_assets_are_served_offline(server):
    url = server[0]
    r = httpx.get(url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "unsafe-" not in csp
    for name, media in webui.FILES.items():
        f = httpx.get(f"{url}/static/{name}")
        assert f.status_code == 200 and f.headers["content-type"] == media
        assert f.content == (STATIC / name).read_bytes()
        # nothing loaded from another host (no CDN): no absolute URLs in src/href/fetch
        if not name.startswith("vendor/"):  # the libraries' own text is checked by its hash
            assert not re.search(r"""(src|href|fetch\()\s*=?\s*["']https?://""", f.text), name
    for bad in ("/static/nope.js", "/static/..%2Fapp.py", "/static/", "/static/vendor/",
                "/static/vendor/marked.umd.js.map", "/static/vendor/nope.js"):
        r = httpx.get(url + bad)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", bad


def test_page_can_be_turned_off():
    with serve(new_generator(), webui=False) as url:
        r = httpx.get(url + "/")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert httpx.get(url + "/static/chat.js").status_code == 404


def test_package_data_ships_every_page_file():
    """An installed (non-editable) wheel carries the page: pyproject's package-data globs,
    expanded as setuptools does (from the package folder, ``*`` within one folder), cover
    every file under static/, vendor/ included, and the server serves exactly those files."""
    package = ROOT / "flashdraft"
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["flashdraft"]
    shipped = {p for g in globs for p in package.glob(g) if p.is_file()}
    files = sorted(p for p in STATIC.rglob("*") if p.is_file())
    assert any(p.parent == STATIC for p in files) and any(p.parent == VENDOR for p in files)
    assert not [p.relative_to(package).as_posix() for p in files if p not in shipped]
    assert set(webui.FILES) == {p.relative_to(STATIC).as_posix() for p in files}


def test_vendored_libraries_match_their_manifest(server):
    """The checked-in libraries are the pinned releases, byte for byte (VENDOR.json holds the
    sha256 of what scripts/vendor_webui.sh copied), each package's licence ships with them,
    and the page loads them from this server with the right media types."""
    url = server[0]
    manifest = json.loads((VENDOR / "VENDOR.json").read_text())["files"]
    assert {p.name for p in VENDOR.iterdir()} == set(manifest) | {"VENDOR.json"}
    for name, entry in manifest.items():
        assert entry["version"] == PINS[entry["package"]], name
        data = (VENDOR / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], f"{name} differs from {entry}"
        r = httpx.get(f"{url}/static/vendor/{name}")
        assert r.status_code == 200 and r.content == data, name
        assert r.headers["content-type"] == MEDIA[Path(name).suffix], name
        assert r.headers["x-content-type-options"] == "nosniff"
    assert {e["package"] for e in manifest.values() if e["source"] == "LICENSE"} == set(PINS)
    page = httpx.get(url + "/").text
    for name in ("purify.min.js", "marked.umd.js", "highlight.min.js", "github.min.css"):
        assert f'"/static/vendor/{name}"' in page, name


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
    page.fill("#prompt", "t1 " * 300)  # more than the context: a 400 with the numbers
    page.click("#send")
    answer = page.locator(".msg.assistant").last
    expect()(answer).to_have_class(re.compile(r"\berror\b"), timeout=20_000)
    assert "the context size is 256" in answer.locator(".note").inner_text()


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


# -- Markdown answers (the stream is the test's, see answer_with) -----------------------------

CODE = 'def add(a, b):\n    """Sum."""\n    return a + b  # <not a tag>'
MARKDOWN = f"""Use **add**, with `inline` code:

```python
{CODE}
```

```
SELECT name FROM users WHERE id = 1;
```

```nosuchlanguage
plain words
```

- one
- two

| a | b |
|---|---|
| 1 | 2 |
"""


def test_answer_is_markdown_with_highlighted_code(page):
    sent: list = []
    answer_with(page, MARKDOWN, sent)
    answer = ask(page, "t1 t2")
    content = answer.locator(".content")
    assert content.locator("strong").inner_text() == "add"
    assert content.locator(":not(pre) > code").inner_text() == "inline"
    assert content.locator("ul > li").all_inner_texts() == ["one", "two"]
    assert content.locator("table td").all_inner_texts() == ["1", "2"]

    python = content.locator("pre code.language-python")
    expect()(python).to_have_class(re.compile(r"\bhljs\b"))
    assert {"def", "return"} <= set(python.locator(".hljs-keyword").all_inner_texts())
    assert python.locator(".hljs-comment").inner_text() == "# <not a tag>"
    assert python.text_content().rstrip("\n") == CODE
    # no language, or one highlight.js lacks: guessed, not an error (the fixture checks the console)
    assert content.locator("pre code.hljs").count() == 3
    assert content.locator("pre > button.copy").all_inner_texts() == ["Copy"] * 3
    assert answer.locator('.stats [data-stat="tokens"] b').inner_text() == "7"

    # the next turn sends the answer as it came, Markdown and all, not the rendered text
    ask(page, "t3")
    assert sent[1]["messages"][1] == {"role": "assistant", "content": MARKDOWN}
    # a user's message stays plain text
    page.fill("#prompt", "**not bold**")
    page.click("#send")
    expect()(page.locator(".msg.user").last.locator(".content")).to_have_text("**not bold**")


def test_copy_button_copies_the_code(page):
    answer_with(page, MARKDOWN)
    button = ask(page).locator("pre:has(code.language-python) button.copy")
    button.click()
    expect()(button).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == CODE
    expect()(button).to_have_text("Copy", timeout=5_000)


def test_copy_works_without_the_clipboard_api(page):
    """Plain http from another host has no navigator.clipboard: the page copies through a
    selected textarea; the spy records what was selected when "copy" ran."""
    page.context.add_init_script("""
        Object.defineProperty(Navigator.prototype, "clipboard", { get: () => undefined });
        const execCommand = document.execCommand.bind(document);
        document.execCommand = (command, ...rest) => {
          const el = document.activeElement;
          if (command === "copy") window.copied = el.value.slice(el.selectionStart, el.selectionEnd);
          return execCommand(command, ...rest);
        };
    """)
    page.reload()
    answer_with(page, MARKDOWN)
    button = ask(page).locator("pre:has(code.language-python) button.copy")
    button.click()
    expect()(button).to_have_text("Copied")
    assert page.evaluate("window.copied") == CODE
    assert page.locator("textarea.offscreen").count() == 0


def test_html_in_an_answer_stays_inert(page):
    """Model output is text: markup in it is shown, not parsed, and nothing in it runs or
    makes the browser fetch anything."""
    hostile = ('Hi <img src=x onerror="window.pwned=1"> <b>there</b>\n\n'
               "<script>window.pwned=2</script>\n\n"
               '<div onmouseover="window.pwned=3">block</div>\n\n'
               "[click](javascript:window.pwned=4) ![pic](http://example.invalid/p.png)")
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    answer_with(page, hostile)
    content = ask(page).locator(".content")
    content.hover()
    assert content.locator("img, script, b, div, iframe, style").count() == 0
    text = content.inner_text()
    for shown in ('<img src=x onerror="window.pwned=1">', "<script>window.pwned=2</script>", "<b>there</b>"):
        assert shown in text
    hrefs = [a.get_attribute("href") for a in content.locator("a").all()]
    assert hrefs == [None, "http://example.invalid/p.png"]  # the javascript: URL is dropped
    assert content.locator("a[href]").get_attribute("rel") == "noopener noreferrer"
    content.locator("a", has_text="click").click()
    assert page.evaluate("window.pwned") is None
    assert not [u for u in requests if u.endswith("/x") or "example.invalid" in u], requests


def test_answers_are_plain_text_without_the_libraries(page):
    """A page whose vendor scripts did not load still chats, showing answers as text."""
    page.route("**/static/vendor/*.js", lambda route: route.fulfill(status=404, body=""))
    page.reload()
    answer_with(page, MARKDOWN)
    content = ask(page).locator(".content")
    assert content.text_content() == MARKDOWN
    assert content.locator("pre, strong").count() == 0
