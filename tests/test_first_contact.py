"""What a new user meets first, through a real ``flashdraft serve`` on the packaged SmolLM2
with the shipped DFlash drafter (as ``make serve`` starts it): the request log on the
terminal, ``max_tokens: -1``, tool calls and JSON schemas holding only the schema's keys,
and the README's own request examples run verbatim (only the port changed).

README examples: every fenced ``bash`` block whose first line starts with ``curl`` and every
``python`` block that imports ``openai`` is run, so examples added later are tested too.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from test_server import ServerProcess, post

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[1]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
PARIS = [{"role": "user", "content": "What's the weather like in Paris today?"}]
SHORT = [{"role": "user", "content": "Name three colors."}]  # greedy: a short answer ending on EOS


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(["--spec-type", "dflash", "-c", "2048"], tmp_path_factory.mktemp("first") / "server.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def wait_for_log(server, pattern: str, after: int, timeout: float = 10.0) -> re.Match:
    """The first match of ``pattern`` in the server's log past character ``after``."""
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(pattern, server.log()[after:], re.M)
        if m or time.monotonic() > deadline:
            assert m, f"{pattern!r} not in the log:\n{server.log()[after:][-3000:]}"
            return m
        time.sleep(0.1)


# ------------------------------------------------------------------ the request log

NUM = r"([\d.]+)"


def test_request_log_shows_each_request_and_its_timings(server):
    start = len(server.log())
    r = post(server, "/v1/chat/completions", {"messages": SHORT, "max_tokens": 40, "temperature": 0})
    assert r.status_code == 200
    t = r.json()["timings"]
    m = wait_for_log(server, rf"request: POST /v1/chat/completions 200 {NUM} ms", start)
    assert float(m[1]) > 0
    log = server.log()[start:]
    prompt = re.search(rf"slot 0: prompt eval time = +{NUM} ms / +(\d+) tokens \( +{NUM} ms per token, +{NUM} "
                       r"tokens per second\)", log)
    decode = re.search(rf"slot 0: +eval time = +{NUM} ms / +(\d+) tokens \( +{NUM} ms per token, +{NUM} "
                       r"tokens per second\)", log)
    draft = re.search(rf"slot 0: draft acceptance rate = {NUM} \( +(\d+) accepted / +(\d+) drafted\), tau {NUM}",
                      log)
    assert prompt and decode and draft, log
    # the same numbers as the response's timings
    assert int(prompt[2]) == t["prompt_n"] and float(prompt[1]) == pytest.approx(t["prompt_ms"], abs=0.006)
    assert float(prompt[4]) == pytest.approx(t["prompt_per_second"], abs=0.006)
    assert int(decode[2]) == t["predicted_n"] and float(decode[1]) == pytest.approx(t["predicted_ms"], abs=0.006)
    assert float(decode[4]) == pytest.approx(t["predicted_per_second"], abs=0.006)
    assert (int(draft[2]), int(draft[3])) == (t["draft_n_accepted"], t["draft_n"])
    assert float(draft[4]) == pytest.approx(t["acceptance_length"], abs=0.006) and t["acceptance_length"] >= 1.0
    # a refused request is logged with its status; health polls are not (they would bury the rest)
    assert post(server, "/v1/chat/completions", {"messages": []}).status_code == 400
    wait_for_log(server, r"request: POST /v1/chat/completions 400 ", start)
    assert "GET /health" not in server.log()


def test_json_log_file(tmp_path):
    """``--log-format json --log-file F``: every line of F is a JSON object; the generation
    record carries the response's timings (plain decoding: no draft fields, τ not reported)."""
    path = tmp_path / "log.jsonl"
    s = ServerProcess(["--spec-type", "none", "--log-format", "json", "--log-file", str(path)],
                      tmp_path / "stderr.log")
    try:
        s.wait_ready()
        r = post(s, "/completion", {"prompt": "1, 2, 3,", "n_predict": 6, "temperature": 0})
        assert r.status_code == 200
        deadline = time.monotonic() + 10
        while '"event": "request"' not in path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        s.stop()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert all({"time", "level", "logger", "message"} <= set(rec) for rec in records)
    gen = next(rec for rec in records if rec.get("event") == "generation")
    req = next(rec for rec in records if rec.get("event") == "request" and rec["path"] == "/completion")
    assert req["method"] == "POST" and req["status"] == 200 and req["ms"] > 0
    t = r.json()["timings"]
    assert {k: gen[k] for k in t} == t and "draft_n" not in gen and gen["finish_reason"] == "length"
    assert any("Uvicorn running" in rec["message"] or "startup" in rec["message"] for rec in records)


# ------------------------------------------------------------------ max_tokens: -1

@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": SHORT, "max_tokens": -1}),
    ("/v1/chat/completions", {"messages": SHORT, "max_completion_tokens": -1}),
    ("/v1/completions", {"prompt": "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
                         "max_tokens": -1}),
    ("/completion", {"prompt": "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
                     "n_predict": -1}),
], ids=["chat-max_tokens", "chat-max_completion_tokens", "completions", "completion"])
def test_minus_one_means_until_a_stop(server, path, body):
    r = post(server, path, {**body, "temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    finish = out["stop_type"] if path == "/completion" else out["choices"][0]["finish_reason"]
    assert finish in ("stop", "eos")  # ended by the model, not cut
    assert 0 < out["timings"]["predicted_n"] < 2048 and out["timings"]["acceptance_length"] >= 1.0


# ------------------------------------------------------------------ tool calls and schemas

@pytest.mark.parametrize("temperature", [0.0, None], ids=["greedy", "server-default"])
def test_required_tool_call_is_one_call_with_the_schemas_keys(client, temperature):
    extra = {} if temperature is None else {"temperature": temperature}
    out = client.chat.completions.create(model="any", messages=PARIS, tools=[WEATHER], tool_choice="required",
                                         max_tokens=120, **extra)
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert set(json.loads(calls[0].function.arguments)) <= {"city"}


def test_parallel_default_follows_the_chat_template(server):
    """SmolLM2's template renders only ``content``: it cannot write two calls, so the default
    is false (hence one call above); a template that writes calls can."""
    from tiny import tiny_tokenizer

    from flashdraft.server.tools import supports_parallel_tool_calls

    smol = httpx.get(server.url + "/props", timeout=30).json()["chat_template"]
    writes_calls = ("{% for m in messages %}{{ m.content }}{% for c in m.tool_calls or [] %}"
                    "<call>{{ c.function.name }}</call>{% endfor %}{% endfor %}")
    tok = tiny_tokenizer()
    assert "im_start" in smol and supports_parallel_tool_calls(tok, smol) is False
    assert supports_parallel_tool_calls(tok, writes_calls) is True
    assert supports_parallel_tool_calls(tok, None) is False  # a built-in template (--no-jinja)
    # asking for parallel calls is still allowed
    r = post(server, "/v1/chat/completions", {"messages": PARIS, "tools": [WEATHER], "tool_choice": "required",
                                              "parallel_tool_calls": True, "max_tokens": 120, "temperature": 0})
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "length":  # the greedy answer may repeat the call past max_tokens
        assert choice["message"]["content"].startswith('{"tool_calls": [{"name": "get_weather"')
    else:
        assert len(choice["message"]["tool_calls"]) >= 1


def test_json_schema_admits_only_named_keys_unless_allowed(server):
    closed = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": closed}}
    msgs = [{"role": "user", "content": "Describe a red apple as JSON with many fields."}]
    r = post(server, "/v1/chat/completions", {"messages": msgs, "response_format": fmt, "max_tokens": 60,
                                              "temperature": 0})
    assert r.status_code == 200
    assert set(json.loads(r.json()["choices"][0]["message"]["content"])) == {"color"}


# ------------------------------------------------------------------ the README's examples

def readme_examples() -> list[tuple[str, str]]:
    """``(language, code)`` of the README's runnable request examples: ``bash`` blocks whose
    first line starts with ``curl`` and ``python`` blocks that import ``openai``."""
    text = (ROOT / "README.md").read_text()
    out = []
    for lang, code in re.findall(r"^```(bash|python)\n(.*?)^```", text, re.M | re.S):
        if (lang == "bash" and code.lstrip().startswith("curl")) or (lang == "python" and "from openai" in code):
            out.append((lang, code))
    return out


EXAMPLES = readme_examples()


def test_readme_has_the_examples():
    kinds = " ".join(code for _, code in EXAMPLES)
    assert sum(lang == "bash" for lang, _ in EXAMPLES) >= 1 and "stream=True" in kinds and "tools=" in kinds
    assert sum("from openai" in code for _, code in EXAMPLES) >= 3


@pytest.mark.parametrize("lang,code", EXAMPLES, ids=[f"{lang}-{i}" for i, (lang, _) in enumerate(EXAMPLES)])
def test_readme_example_runs(server, lang, code):
    code = code.replace("http://127.0.0.1:8080", server.url)
    cmd = ["bash", "-c", "set -o pipefail\n" + code] if lang == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    out = done.stdout.strip()
    assert out, done.stderr
    if lang == "bash" and "| jq" in code:  # jq's object: every field it picks is there
        picked = json.loads(out)
        assert picked and all(v is not None for v in picked.values()), picked
        assert picked.get("text") and (picked.get("tps") or 0) > 0
    if "tool_calls" in code:  # prints the call's function: get_weather with only its schema's keys
        assert "get_weather" in out
        args = json.loads(re.search(r"arguments='(.*?)'", out)[1])
        assert set(args) == {"city"}
    elif "stream=True" in code:
        assert len(out) > 10
