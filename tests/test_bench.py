"""``flashdraft bench`` on tiny random models: every configuration runs and the JSON has its schema.

Smoke tests only: no timing assertions (tiny models on a shared CPU say nothing about speed).
The tiny target and a tiny draft model are saved with a pass-through chat template, so the
command loads them with ``-m DIR`` exactly as a user's model; prompts are word-level token
strings ("t5 t9 ...") whose greedy continuation contains no EOS.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch

from flashdraft.bench.measure import Generation, SpecCounts, counts_from_timings
from flashdraft.bench.stats import RunRecord, summarize
from flashdraft.cli import main
from flashdraft.generate import Timings
from tiny import tiny_model, tiny_tokenizer

PROMPTS = [{"id": "p0", "prompt": "t5 t9 t17 t3 t22 t41 t5 t9 t17"}]
LOCAL_CONFIGS = ["none", "default", "dflash", "dflash-adaptive", "dflash-cost", "ngram", "ngram-adaptive", "ngram-cost",
                 "ngram-standing-cost", "ngram-latest-cost", "ngram-fullprobe-cost",
                 "suffix", "suffix-adaptive", "hybrid", "hybrid-adaptive", "hybrid-cost", "hybrid-suffix", "hybrid-suffix-adaptive", "dflash-gated-adaptive",
                 "hybrid-gated-adaptive", "draft", "draft-adaptive", "self-draft", "self-draft-adaptive", "hf", "hf-lookup",
                 "hf-dflash", "hf-draft"]
RUN_KEYS = {"config", "prompt_set", "prompt_id", "temperature", "repeat", "error", "prompt_tokens", "cached_tokens",
            "completion_tokens", "ttft_ms", "total_ms", "decode_ms", "decode_tokens", "decode_tokens_per_s",
            "decode_source", "finish_reason", "spec", "same_as_baseline", "constrained", "schema_violation",
            "grammar"}
SUMMARY_KEYS = {"prompt_set", "temperature", "config", "runs", "errors", "prompt_tokens", "completion_tokens",
                "decode_tokens_per_s", "speedup", "ttft_ms", "decode_source", "acceptance_length", "draft_n",
                "draft_n_accepted", "acceptance_rate", "per_position_acceptance", "accepted_hist",
                "same_as_baseline", "constrained", "schema_violations", "grammar_ms_per_token", "grammar_share",
                "grammar_ms_per_token_by_role", "same_as_own_plain", "draft_ms_per_drafted", "draft_ms_per_token"}


def _save(path, seed: int, layers: int):
    model, tok = tiny_model(seed=seed, layers=layers), tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return {"target": _save(d / "target", 0, 4), "draft": _save(d / "draft", 1, 1), "prompts": str(prompts),
            "dir": d}


def _bench(*args) -> int:
    threads = torch.get_num_threads()
    try:
        return main(["bench", *args])
    finally:
        torch.set_num_threads(threads)  # --threads is process-wide


def test_every_local_configuration_runs(files, capsys):
    out, png = files["dir"] / "local.json", files["dir"] / "local.png"
    rc = _bench("-m", files["target"], "-md", "random:1", "--draft-model", files["draft"], "--self-draft-layers", "2",
                "--prompts", files["prompts"], "--max-tokens", "12", "--repeats", "2", "--temperature", "0,0.7",
                "--threads", "1", "--warmup-tokens", "2", "--json-out", str(out),
                *(["--plot", str(png)] if _has_matplotlib() else []))
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "flashdraft.bench/1"
    assert {"created", "command", "machine", "versions", "git", "settings", "baseline", "configs", "prompts",
            "runs", "summary", "per_prompt", "outputs"} <= set(doc)
    assert {"cpu", "cpu_count", "torch_threads"} <= set(doc["machine"])
    assert {"torch", "transformers", "flashdraft"} <= set(doc["versions"]) and "commit" in doc["git"]
    assert doc["baseline"] == "none"

    available = {c["name"] for c in doc["configs"] if c["available"]}
    assert available == set(LOCAL_CONFIGS)
    for c in doc["configs"]:  # llama.cpp: not installed, or not a GGUF target: said, not hidden
        assert c["available"] or c["reason"]

    assert len(doc["runs"]) == len(LOCAL_CONFIGS) * 2 * 2 * len(PROMPTS)
    for r in doc["runs"]:
        assert set(r) == RUN_KEYS, r
        assert r["error"] is None and r["completion_tokens"] > 0 and r["ttft_ms"] is not None
        speculative = r["config"] not in ("none", "hf")
        assert (r["spec"] is not None) == speculative, r["config"]
        if r["temperature"] == 0 and r["config"] != "none":
            assert r["same_as_baseline"] is True, f"{r['config']} is not lossless at T=0"

    assert len(doc["summary"]) == len(LOCAL_CONFIGS) * 2
    for s in doc["summary"]:
        assert set(s) == SUMMARY_KEYS
        assert s["completion_tokens"] > 0 and s["decode_tokens_per_s"]["n"] == 2
    speedups = {s["config"]: s["speedup"] for s in doc["summary"] if s["temperature"] == 0}
    assert speedups["none"]["median"] == pytest.approx(1.0)

    report = capsys.readouterr().out
    assert "| config |" in report and "hf-dflash" in report and "Not run:" in report
    if _has_matplotlib():
        assert png.stat().st_size > 0


def test_unknown_configuration_is_an_error(files, capsys):
    assert _bench("-m", files["target"], "--configs", "none,warp-drive") == 1
    assert "warp-drive" in capsys.readouterr().err
    assert _bench("-m", files["target"], "--configs", "none,dflash@0") == 1


def test_fixed_depth_configurations(files):
    """dflash@N runs the DFlash drafter at a fixed depth N, ordered after dflash, lossless."""
    from flashdraft.bench.runner import parse_configs
    assert parse_configs("dflash-adaptive,dflash@4,none,dflash@1,dflash") == [
        "none", "dflash", "dflash@1", "dflash@4", "dflash-adaptive"]
    out = files["dir"] / "depths.json"
    assert _bench("-m", files["target"], "-md", "random:1", "--configs", "none,dflash@1,dflash@3",
                  "--prompts", files["prompts"], "--max-tokens", "10", "--repeats", "1", "--threads", "1",
                  "--warmup-tokens", "2", "--json-out", str(out)) == 0
    doc = json.loads(out.read_text())
    runs = {r["config"]: r for r in doc["runs"]}
    assert set(runs) == {"none", "dflash@1", "dflash@3"}
    assert all(r["same_as_baseline"] for n, r in runs.items() if n != "none")
    # depth N never drafts more than N tokens per step
    for name, n in (("dflash@1", 1), ("dflash@3", 3)):
        spec = runs[name]["spec"]
        assert spec["draft_n"] > 0 and spec["drafted_per_position"][n - 1] > 0
        assert not any(spec["drafted_per_position"][n:])


def test_hf_dflash_adapter_drafts_like_ours():
    """transformers' DFlash drafter holding our weights computes the same block as ours."""
    from transformers.cache_utils import DFlashCache

    from flashdraft.bench.hf_dflash import hf_dflash_assistant
    from flashdraft.drafters.dflash import DFlashDrafter, random_dflash_model
    from flashdraft.targets.torch import Target

    target = Target(tiny_model(), tiny_tokenizer())
    ours = random_dflash_model(target.model, num_layers=2, block_size=8)
    with torch.no_grad():
        for p in ours.parameters():  # move norms away from 1 so a mis-mapped weight shows
            p.add_(0.05 * torch.randn_like(p))
    theirs = hf_dflash_assistant(ours)
    target.set_feature_layers(ours.target_layer_ids)
    prompt = torch.tensor([5, 9, 17, 3, 22, 41, 5, 9, 17])
    with torch.inference_mode():
        _, features = target.forward(prompt, target.new_cache())
        drafter = DFlashDrafter(ours, target.embed_tokens, target.lm_head)
        n_ctx = len(prompt) - 1  # the last prompt token is the anchor
        drafter.commit(n_ctx, features[:-1])
        block = torch.full((ours.block_size,), ours.mask_token_id)
        block[0] = prompt[-1]
        x = target.embed_tokens(block)[None]
        positions = torch.arange(n_ctx, n_ctx + ours.block_size)[None]
        mine = ours(x, positions, [drafter.cache.window(i, None) for i in range(len(ours.layers))])
        cache = DFlashCache(config=theirs.config)
        cache.set_previous_accepted_tokens(n_ctx)
        hf = theirs(noise_embeds=x, context_hidden_states=features[:-1][None],
                    position_ids=torch.arange(0, n_ctx + ours.block_size)[None], past_key_values=cache)
    torch.testing.assert_close(hf.last_hidden_state, mine, rtol=1e-5, atol=1e-5)


def test_counters_from_engine_timings():
    # 4 steps: prefill (no draft), then drafts of 3 accepting 2, of 3 accepting 0, of 2 accepting 2
    t = Timings(predicted_n=1 + 3 + 1 + 3, n_steps=1, draft_n=8, draft_n_accepted=4,
                accepted_per_position=[2, 2, 0], drafted_per_position=[3, 3, 1])
    for produced in (3, 1, 3):  # each verify step counts itself in n_steps
        t.count_step(produced)
    assert t.n_steps == 4
    c = counts_from_timings(t)
    assert c.accepted_hist == [1, 0, 2]  # verify steps only: the prefill's token is none
    assert c.tau() == pytest.approx(7 / 3) == pytest.approx(t.acceptance_length)


def test_summary_pairs_speedup_per_pass_and_checks_equality():
    def rec(config, repeat, tokens, ms, ids):
        g = Generation(text="", token_ids=ids, prompt_tokens=3, completion_tokens=len(ids), ttft_ms=10.0,
                       total_ms=10.0 + ms, spec=SpecCounts(steps=1, accepted_hist=[1]) if config == "x" else None)
        g.decode_tokens = tokens
        return RunRecord(config, "s", "p", 0.0, repeat, g)

    records = [rec("none", 0, 10, 1000, [1, 2]), rec("x", 0, 10, 500, [1, 2]),
               rec("none", 1, 10, 2000, [1, 2]), rec("x", 1, 10, 1000, [1, 3])]
    summary, per_prompt = summarize(records, ["none", "x"], "none")
    x = next(s for s in summary if s["config"] == "x")
    assert x["speedup"]["median"] == pytest.approx(2.0) and x["speedup"]["min"] == pytest.approx(2.0)
    assert x["decode_tokens_per_s"]["min"] == pytest.approx(10.0)
    assert x["same_as_baseline"] == {"equal": 1, "compared": 2}
    assert len(per_prompt) == 2


# ---------------------------------------------------------------- --url against a real server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(files):
    """Our HTTP server on the tiny target (ngram drafter), uvicorn in a thread."""
    import uvicorn

    from flashdraft.drafters.ngram import NgramDrafter
    from flashdraft.generate import SpeculativeGenerator
    from flashdraft.server.app import create_app
    from flashdraft.server.state import ServerSettings
    from flashdraft.targets.torch import Target

    target = Target.load(files["target"])
    app = create_app(SpeculativeGenerator(target, NgramDrafter(), ctx_size=256, n_draft=4),
                     ServerSettings(alias="tiny", spec_type="ngram", api_key="k"))
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.skip("uvicorn did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


def test_url_mode_reads_server_timings(files, server):
    out = files["dir"] / "url.json"
    rc = _bench("--url", server, "--api-key", "k", "--prompts", files["prompts"], "--max-tokens", "8",
                "--repeats", "2", "--warmup-tokens", "1", "--json-out", str(out))
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["mode"] == "url" and doc["configs"][0]["kind"] == "server"
    assert doc["baseline"] == doc["configs"][0]["name"]
    for r in doc["runs"]:
        assert r["error"] is None, r["error"]
        assert r["completion_tokens"] == 8 and r["prompt_tokens"] == 9
        assert r["decode_source"] == "server" and r["ttft_ms"] is not None
        assert r["spec"] is not None and r["spec"]["draft_n"] >= r["spec"]["draft_n_accepted"]
    assert doc["summary"][0]["same_as_baseline"] == {"equal": 1, "compared": 1}  # deterministic at T=0


def test_url_mode_reports_a_wrong_key(files, server, capsys):
    assert _bench("--url", server, "--api-key", "wrong", "--prompts", files["prompts"]) == 1
    assert "401" in capsys.readouterr().err


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


def test_peers_add_their_configurations_and_an_absent_peer_says_how_to_install(files, capsys, monkeypatch):
    from flashdraft.bench.runner import parse_configs
    assert parse_configs("none,dflash", "llama") == ["none", "dflash", "llamacpp", "llamacpp-lookup"]
    with pytest.raises(ValueError, match="unknown --peers vllm"):
        parse_configs("none", "vllm")
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert _bench("-m", files["target"], "--configs", "none", "--peers", "llama", "--prompts", files["prompts"],
                  "--max-tokens", "4", "--repeats", "1", "--threads", "1") == 1
    err = capsys.readouterr().err
    assert "--peers" in err and "llama-cpp-python" in err


def test_a_llama_server_peer_that_cannot_run_is_a_row_with_its_error(files, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHDRAFT_LLAMA_SERVER", str(tmp_path / "absent" / "llama-server"))
    out = tmp_path / "r.json"
    assert _bench("-m", files["target"], "--configs", "none", "--peers", "llama-server", "--prompts", files["prompts"],
                  "--max-tokens", "4", "--repeats", "1", "--threads", "1", "--warmup-tokens", "0",
                  "--json-out", str(out)) == 0
    report = capsys.readouterr().out
    for name in ("llama-server", "llama-server-lookup", "llama-server-dflash"):
        assert f"| {name}: not run (no llama-server binary (make llama-peer" in report
    configs = {c["name"]: c for c in json.loads(out.read_text())["configs"]}
    assert not configs["llama-server-dflash"]["available"] and "make llama-peer" in configs["llama-server-dflash"]["reason"]
