"""llama-server parity of ``flashdraft serve``: its flags, CORS, ``/slots``; the tiny in-process server.

(Shapes of the generation endpoints are tested against the real model in ``test_server.py``.)
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from inproc import metric_values, new_generator, serve

from flashdraft.server import llama_flags
from flashdraft.server.cli import build_parser, engine_config_from_args, ignored_flags, main, settings_from_args
from flashdraft.server.state import CorsSettings

#: the flags that ended the process before (llama-server accepts them all)
LLAMA_ONLY = ("--no-jinja --no-slots --offline --verbose --chat-template chatml --chat-template-file {tpl} "
              "--context-shift --no-ui --tags a,b --cors-origins http://a.test --tools all --ui-mcp-proxy "
              "--media-path /tmp --backend_sampling --embedding --reranking --pooling mean --slot-save-path /tmp "
              "--swa-full --models-max 4 --no-models-autoload --no-webui")


def test_llama_server_flags_parse_and_take_effect(tmp_path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    args = build_parser().parse_args(LLAMA_ONLY.format(tpl=tpl).split())
    s = settings_from_args(args)
    assert s.chat_template == ("jinja", tpl.read_text())  # the file wins over --chat-template
    assert (s.slots_endpoint, s.webui, args.verbose) == (False, False, True)
    assert s.cors.origins == ["http://a.test"] and s.tags == ["a", "b"]
    assert args.context_shift  # a flag of its own now (test_context_shift.py)
    assert set(ignored_flags(args)) == {
        "--offline", "--tools all", "--ui-mcp-proxy", "--media-path /tmp",
        "--backend_sampling", "--embedding", "--reranking", "--pooling mean", "--slot-save-path /tmp",
        "--swa-full", "--models-max 4", "--no-models-autoload"}
    assert settings_from_args(build_parser().parse_args(["--no-jinja"])).chat_template == ("builtin", None)
    assert settings_from_args(build_parser().parse_args(["--chat-template", "llama3"])).chat_template == (
        "builtin", "llama3")


@pytest.mark.parametrize("given,ours", [("draft-simple", "draft"), ("draft-dflash", "dflash"),
                                        ("ngram-simple", "ngram"), ("ngram-map-k", "ngram"), ("ngram-mod", "ngram"),
                                        ("draft-dflash,ngram-simple", "hybrid"), ("dflash", "dflash"),
                                        ("none", "none")])
def test_llama_cpp_spec_type_names(given, ours):
    args = build_parser().parse_args(["--spec-type", given, "-md", "d.gguf"])
    assert engine_config_from_args(args).spec_type == ours


def test_unknown_spec_type_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--spec-type", "draft-eagle3"])
    assert e.value.code == 2 and "draft-dflash" in capsys.readouterr().err


def test_answer_changing_flags_are_refused_by_name_unless_neutral(caplog):
    neutral = build_parser().parse_args("--repeat-penalty 1.0 --presence-penalty 0.0 --mirostat 0".split())
    assert llama_flags.refused(neutral) == []
    for flags, name in ((["--lora", "a.gguf"], "--lora"), (["--repeat-penalty", "1.1"], "--repeat-penalty"),
                        (["-hf", "org/model"], "-hf"), (["--grammar", "root ::= x"], "--grammar")):
        caplog.clear()
        assert main(["--port", "1", *flags]) == 1  # before binding or loading
        assert any(r.getMessage().startswith(name) and "not supported" in r.getMessage() for r in caplog.records)


def test_bad_template_and_key_files_end_the_start_with_a_message(caplog, tmp_path):
    for flags, words in ((["--chat-template-file", str(tmp_path / "none.jinja")], "chat-template-file"),
                         (["--api-key-file", str(tmp_path / "none.txt")], "api-key-file"),
                         (["--chat-template-kwargs", "[1]"], "JSON object")):
        caplog.clear()
        assert main(["--port", "1", *flags]) == 1
        assert any(words in r.getMessage() for r in caplog.records), flags


def test_several_hosts_each_get_a_listening_socket():
    from flashdraft.server.cli import _bind

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    hosts = ["127.0.0.1"]
    if socket.has_ipv6:
        try:
            with socket.socket(socket.AF_INET6) as s6:
                s6.bind(("::1", 0))
            hosts.append("::1")
        except OSError:
            pass  # no IPv6 loopback on this machine: the IPv4 half still runs
    socks = [_bind(h, port) for h in hosts]
    try:
        for h in hosts:
            with socket.create_connection((h, port), timeout=5):
                pass
        with pytest.raises(OSError):
            _bind("127.0.0.1", port)  # taken
    finally:
        for s in socks:
            s.close()


def test_cors_preflight_needs_no_key_and_every_answer_carries_the_headers():
    with serve(new_generator(), api_key="k", cors=CorsSettings()) as url:
        pre = httpx.options(url + "/v1/chat/completions", headers={
            "Origin": "http://app.test", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] in ("*", "http://app.test")
        assert "POST" in pre.headers["access-control-allow-methods"]
        denied = httpx.post(url + "/tokenize", json={"content": "t5"}, headers={"Origin": "http://app.test"})
        assert denied.status_code == 401 and "access-control-allow-origin" in denied.headers
        assert httpx.get(url + "/v1/models").status_code == 200  # public, as in llama-server
        ok = httpx.post(url + "/tokenize", json={"content": "t5"},
                        headers={"Origin": "http://app.test", "Authorization": "Bearer k"})
        assert ok.status_code == 200 and "access-control-allow-origin" in ok.headers


def test_cors_origins_restrict():
    with serve(new_generator(), cors=CorsSettings(origins=["http://good.test"])) as url:
        good = httpx.get(url + "/health", headers={"Origin": "http://good.test"})
        bad = httpx.get(url + "/health", headers={"Origin": "http://evil.test"})
        assert good.headers.get("access-control-allow-origin") == "http://good.test"
        assert "access-control-allow-origin" not in bad.headers


def test_slots_endpoint_and_no_slots():
    with serve(new_generator()) as url:
        r = httpx.post(url + "/completion", json={"prompt": "t5 t9 t17", "n_predict": 4, "temperature": 0})
        assert r.status_code == 200
        slots = httpx.get(url + "/slots").json()
        assert [s["id"] for s in slots] == [0] and slots[0]["n_cached"] == 3 + 4 - 1
        assert slots[0]["n_ctx"] == 256 and slots[0]["is_processing"] is False
    with serve(new_generator(), slots_endpoint=False) as url:
        r = httpx.get(url + "/slots")
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


def test_server_defaults_for_cache_prompt_and_ignore_eos():
    with serve(new_generator(), cache_prompt=False) as url:
        body = {"prompt": "t5 t9 t17 t3", "n_predict": 3, "temperature": 0}
        httpx.post(url + "/completion", json=body)
        again = httpx.post(url + "/completion", json=body).json()
        assert again["timings"]["cache_n"] == 0
        asked = httpx.post(url + "/completion", json={**body, "cache_prompt": True}).json()
        assert asked["timings"]["cache_n"] == 3


def test_prompt_forms_batches_mixed_and_objects():
    with serve(new_generator()) as url:
        def completion(prompt, **kw):
            return httpx.post(url + "/completion", timeout=60,
                              json={"prompt": prompt, "n_predict": 4, "temperature": 0, **kw})

        one = [completion(p).json()["content"] for p in ("t5 t9 t17", "t3 t4")]
        batch = completion(["t5 t9 t17", "t3 t4"]).json()
        assert [r["index"] for r in batch] == [0, 1] and [r["content"] for r in batch] == one
        assert [r["content"] for r in completion([[5, 9, 17], {"prompt_string": "t3 t4"}]).json()] == one
        assert completion([5, " t9", 17]).json()["content"] == one[0]  # ids mixed with text: one prompt
        assert completion({"prompt_string": "t5 t9 t17"}).json()["content"] == one[0]
        oai = httpx.post(url + "/v1/completions", timeout=60,
                         json={"prompt": ["t5 t9 t17", [3, 4]], "max_tokens": 4, "temperature": 0}).json()
        assert [c["text"] for c in oai["choices"]] == one and [c["index"] for c in oai["choices"]] == [0, 1]
        assert oai["usage"]["completion_tokens"] == sum(c["timings"]["predicted_n"] for c in oai["choices"])
        for bad, words in (({"prompt_string": 1}, "prompt_string"),
                           ({"prompt_string": "x", "multimodal_data": ["aGk="]}, "multimodal"),
                           (["t1"] * 65, "--max-batch-prompts"), ([], "non-empty"), ([["t1", 2.5]], "prompt[0]")):
            r = completion(bad)
            assert r.status_code == 400 and words in r.json()["error"]["message"], (bad, r.text)
        r = completion(["t5", "t6"], stream=True)
        assert r.status_code == 400 and "one prompt" in r.json()["error"]["message"]
        r = completion(["t5", [70000]])
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]"
        assert completion("t5").status_code == 200  # still serving


def test_context_is_split_across_slots():
    args = build_parser().parse_args(["-c", "4096", "-np", "4"])
    assert engine_config_from_args(args).ctx_size == 1024
    assert engine_config_from_args(build_parser().parse_args(["-c", "4096"])).ctx_size == 4096


def test_ctx_size_0_is_the_models_training_context(tmp_path):
    """llama-server's ``-c 0``: the context the model was trained for, from the GGUF's
    ``{arch}.context_length`` (the default SmolLM2 GGUF: 8192) or a transformers directory's
    config.json; split across slots as any -c; a model that names none gets 4096."""
    import json

    from flashdraft.targets.load import FALLBACK_CONTEXT, training_context

    assert engine_config_from_args(build_parser().parse_args(["-c", "0"])).ctx_size == 8192
    assert engine_config_from_args(build_parser().parse_args(["-c", "0", "-np", "2"])).ctx_size == 4096
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert training_context(tmp_path) == 2048
    (tmp_path / "config.json").write_text("{}")
    assert training_context(tmp_path) == FALLBACK_CONTEXT
    with pytest.raises(SystemExit):
        build_parser().parse_args(["-c", "-1"])


def test_chat_prefill_verbose_choices_apply_template_and_token_count():
    with serve(new_generator()) as url:
        def chat(messages, **kw):
            return httpx.post(url + "/v1/chat/completions", timeout=60,
                              json={"messages": messages, "max_tokens": 4, "temperature": 0, **kw})

        user = [{"role": "user", "content": "t5 t9"}]
        # a trailing assistant message is continued: the prompt is the turns before + its text
        prefill = chat(user + [{"role": "assistant", "content": "t17"}], verbose=True).json()
        assert prefill["__verbose"]["prompt"] == "t5 t9 t17"
        plain = httpx.post(url + "/completion", json={"prompt": "t5 t9 t17", "n_predict": 4, "temperature": 0}).json()
        assert prefill["choices"][0]["message"]["content"] == plain["content"]
        explicit = chat(user + [{"role": "assistant", "content": "t17"}], add_generation_prompt=False,
                        continue_final_message=True).json()
        assert explicit["choices"][0]["message"]["content"] == plain["content"] and "__verbose" not in explicit
        both = chat(user + [{"role": "assistant", "content": "t17"}], continue_final_message=True)
        assert both.status_code == 400 and both.json()["error"]["param"] == "add_generation_prompt"
        # n choices: each decoded on its own; greedy ones agree, usage sums them
        two = chat(user, n=2).json()
        assert [c["index"] for c in two["choices"]] == [0, 1]
        assert two["choices"][0]["message"] == two["choices"][1]["message"]
        assert two["usage"]["completion_tokens"] == sum(c["timings"]["predicted_n"] for c in two["choices"])
        seeded = chat(user, n=3, temperature=1.0, seed=7, max_tokens=8).json()
        again = chat(user, n=3, temperature=1.0, seed=7, max_tokens=8).json()
        assert [c["message"] for c in seeded["choices"]] == [c["message"] for c in again["choices"]]
        assert len({c["message"]["content"] for c in seeded["choices"]}) > 1  # seed + k per choice
        streamed = chat(user, n=2, stream=True)
        assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "n"
        assert chat(user, n=17).status_code == 400
        oai = httpx.post(url + "/v1/completions", json={"prompt": ["t5 t9", "t3"], "n": 2, "max_tokens": 3,
                                                        "temperature": 0}).json()
        assert len(oai["choices"]) == 4 and oai["choices"][0]["text"] == oai["choices"][1]["text"]
        # the template alone, and the prompt's token count
        applied = httpx.post(url + "/apply-template", json={"messages": user})
        assert applied.status_code == 200 and applied.json() == {"prompt": "t5 t9 "}
        count = httpx.post(url + "/v1/chat/completions/input_tokens", json={"messages": user}).json()
        assert count == {"object": "response.input_tokens", "input_tokens": two["usage"]["prompt_tokens"]}
        assert httpx.post(url + "/apply-template", json={"messages": []}).status_code == 400
    with serve(new_generator(), verbose=True) as url:  # -v: every answer carries __verbose
        body = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "t5"}],
                                                              "max_tokens": 2}).json()
        assert body["__verbose"]["prompt"] == "t5" and body["__verbose"]["tokens_evaluated"] == 1


def test_aliases_and_tags_in_models():
    with serve(new_generator(), alias="tinyllama-2,fim,code", tags=["chat", "fim", "small"]) as url:
        entry = httpx.get(url + "/models").json()["data"][0]
        assert set(entry["aliases"]) == {"tinyllama-2", "fim", "code"} and entry["tags"] == ["chat", "fim", "small"]
        assert entry["id"] == "code"  # the first alias in sorted order, as llama-server
        answer = httpx.post(url + "/v1/completions", json={"prompt": "t5", "max_tokens": 1, "model": "fim"}).json()
        assert answer["model"] == "code"


def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/completions", headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                        "Access-Control-Request-Headers": "Authorization"})


def test_cors_defaults_are_llama_servers_and_localhost_is_a_pattern():
    with serve(new_generator(), api_key="k", cors=CorsSettings()) as url:
        r = _preflight(url, "web.mydomain.fr")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "web.mydomain.fr"
        assert r.headers["access-control-allow-credentials"] == "true"
        assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    with serve(new_generator(), cors=CorsSettings(origins=["localhost"])) as url:
        for origin in ("http://localhost", "http://localhost:8080", "http://127.0.0.1:3000", "http://[::1]:3000"):
            assert _preflight(url, origin).headers.get("access-control-allow-origin") == origin, origin
        for origin in ("http://evil.com", "http://notlocalhost", "http://localhost.evil.com"):
            refused = _preflight(url, origin)  # llama-server: 200, no Allow-Origin (the browser refuses)
            assert refused.status_code == 200 and "access-control-allow-origin" not in refused.headers, origin


def test_completion_response_fields_and_prompt():
    with serve(new_generator()) as url:
        body = {"prompt": "t5 t9", "n_predict": 3, "temperature": 0}
        whole = httpx.post(url + "/completion", json=body).json()
        assert whole["prompt"] == "t5 t9" and "generation_settings" in whole
        picked = httpx.post(url + "/completion", json={
            **body, "response_fields": ["content", "generation_settings/n_predict", "prompt", "no/such"]}).json()
        assert picked == {"content": whole["content"], "generation_settings/n_predict": 3, "prompt": "t5 t9"}


def _events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_timings_per_token_on_every_streamed_chunk():
    with serve(new_generator()) as url:
        chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "t5 t9"}], "max_tokens": 6, "temperature": 0, "stream": True,
            "timings_per_token": True})
        events = _events(chat)
        assert "timings" not in events[0] and events[0]["choices"][0]["delta"]["role"] == "assistant"
        content = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
        counts = [e["timings"]["predicted_n"] for e in content]
        assert counts and counts == sorted(counts) and counts[-1] <= 6
        assert all(e["timings"]["prompt_n"] > 0 for e in content)
        plain = _events(httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "t5 t9"}], "max_tokens": 6, "temperature": 0, "stream": True}))
        assert not any("timings" in e for e in plain if e["choices"])  # only the final usage chunk
        llama = _events(httpx.post(url + "/completion", timeout=60, json={
            "prompt": "t5 t9", "n_predict": 4, "temperature": 0, "stream": True, "timings_per_token": True}))
        assert all("timings" in e for e in llama)


def test_post_sampling_probs_come_from_the_sampling_distribution():
    with serve(new_generator()) as url:
        def probs(**kw):
            r = httpx.post(url + "/completion", timeout=60, json={"prompt": "t5 t9", "n_predict": 5, "n_probs": 10,
                                                                  "post_sampling_probs": True, **kw})
            assert r.status_code == 200, r.text
            return r.json()["completion_probabilities"]

        for tok in probs(temperature=1.0, top_k=3, seed=1):
            assert 0.0 < tok["prob"] <= 1.0 and "logprob" not in tok
            assert 1 <= len(tok["top_probs"]) <= 3  # top-k 3: every other token has probability 0
            assert sum(p["prob"] for p in tok["top_probs"]) == pytest.approx(1.0, abs=1e-5)
            assert tok["id"] in [p["id"] for p in tok["top_probs"]]
        for tok in probs(temperature=0):  # greedy: all the mass on the chosen token
            assert tok["prob"] == 1.0 and [p["id"] for p in tok["top_probs"]] == [tok["id"]]
        full = httpx.post(url + "/completion", json={"prompt": "t5 t9", "n_predict": 2, "n_probs": 10,
                                                     "temperature": 0}).json()["completion_probabilities"]
        assert len(full[0]["top_logprobs"]) == 10 and "logprob" in full[0]  # without the flag: the full softmax


def test_unprefixed_routes_are_llama_servers():
    with serve(new_generator()) as url:
        native = httpx.post(url + "/completions", json={"prompt": "t5 t9", "n_predict": 3, "temperature": 0}).json()
        same = httpx.post(url + "/completion", json={"prompt": "t5 t9", "n_predict": 3, "temperature": 0}).json()
        assert native["content"] == same["content"] and native["stop"] is True  # /completions is /completion
        chat = httpx.post(url + "/chat/completions", json={"messages": [{"role": "user", "content": "t5"}],
                                                           "max_tokens": 2}).json()
        assert chat["object"] == "chat.completion"


def test_n_tokens_max_is_declared_a_counter_as_in_llama_server():
    with serve(new_generator(), metrics=True) as url:
        httpx.post(url + "/completion", json={"prompt": "t5 t9", "n_predict": 2, "temperature": 0})
        text = httpx.get(url + "/metrics").text
        assert "# TYPE llamacpp:n_tokens_max counter" in text
        assert metric_values(url)["llamacpp:n_tokens_max"] >= 3  # 2 prompt tokens + the answer


def test_per_request_speculative_settings():
    """llama-server's ``speculative.n_max`` caps the draft tokens per step (at the server's);
    ``speculative.n_min`` / ``p_min`` are accepted (verification keeps the answer whatever is
    drafted); out-of-range values are a 400 naming the field."""
    prompt = " ".join(["t5 t9 t17 t3"] * 6)
    with serve(new_generator()) as url:
        def ask(**extra):
            r = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": 24, "temperature": 0, **extra})
            return r.status_code, r.json()
        code, plain = ask()
        assert code == 200 and plain["timings"]["draft_n"] > 0
        code, one = ask(**{"speculative.n_max": 1, "speculative.n_min": 0, "speculative.p_min": 0.0})
        assert code == 200 and one["content"] == plain["content"]
        assert one["timings"]["draft_depth"] <= 1.0 < plain["timings"]["draft_depth"]
        code, none = ask(**{"speculative.n_max": 0})
        assert code == 200 and none["timings"]["draft_n"] == 0 and none["content"] == plain["content"]
        code, bad = ask(**{"speculative.p_min": 2})
        assert code == 400 and "speculative.p_min" in json.dumps(bad)
