"""The llama-server bench peers: answer parsing, a missing binary, and our drafter in llama.cpp's
DFlash path (``--spec-type draft-dflash``).

The tests that start llama-server skip with the reason when the binary is absent (``make
llama-peer`` builds it; CI does not).
"""

import json
from pathlib import Path

import pytest
import torch

from flashdraft.bench import llama_server as ls
from flashdraft.bench.contender import BenchPrompt, Unavailable
from flashdraft.drafters.dflash_format import dflash_weight_shapes, save_gguf
from flashdraft.sampling import SamplingParams
from tiny_gguf import write_tiny_gguf

RECORDED = Path(__file__).parent / "data" / "llama_server_completion.json"
BINARY = ls.find_binary()
needs_binary = pytest.mark.skipif(BINARY is None, reason=f"no llama-server binary ({ls.INSTALL_HINT})")


def test_parse_completion_on_a_recorded_answer():
    # recorded from llama-server (llama-cpp-python 0.3.36's llama.cpp) with --spec-type
    # draft-dflash and the shipped drafter; EOS 2 is appended here to check that it is dropped
    answer = json.loads(RECORDED.read_text())
    recorded = list(answer["tokens"])
    answer["tokens"] = recorded + [2]
    g = ls.parse_completion(answer, {2}, lambda ids: " ".join(map(str, ids)), wall_ms=1234.0)
    t = answer["timings"]
    assert g.token_ids == recorded and g.completion_tokens == len(recorded)
    assert g.text == " ".join(map(str, recorded))
    assert g.decode_source == "server" and g.decode_tokens == t["predicted_n"]
    assert g.decode_tokens_per_s == pytest.approx(1e3 * t["predicted_n"] / t["predicted_ms"])
    assert g.ttft_ms == pytest.approx(t["prompt_ms"]) and g.total_ms == 1234.0
    assert g.prompt_tokens == answer["tokens_evaluated"]
    assert g.finish_reason == "length"  # the recording stopped at n_predict
    assert g.spec.draft_n == t["draft_n"] > 0 and g.spec.draft_n_accepted == t["draft_n_accepted"] > 0


def test_an_answer_without_timings_is_an_error():
    with pytest.raises(ls.LlamaServerError, match="timings"):
        ls.parse_completion({"tokens": [1, 2], "content": "x"}, set(), str, wall_ms=1.0)


def test_completion_body_sends_token_ids_and_our_sampling_filters():
    prompt = BenchPrompt("p", "set", "text", [5, 6, 7], max_tokens=9)
    greedy = ls.completion_body(prompt, SamplingParams())
    assert greedy["prompt"] == [5, 6, 7] and greedy["n_predict"] == 9 and greedy["temperature"] == 0
    assert greedy["cache_prompt"] is False and greedy["return_tokens"] is True and "top_k" not in greedy
    sampled = ls.completion_body(prompt, SamplingParams(temperature=0.7, top_k=64, top_p=0.95, min_p=0.05, seed=3))
    assert (sampled["top_k"], sampled["top_p"], sampled["min_p"], sampled["seed"]) == (64, 0.95, 0.05, 3)


def test_a_missing_binary_is_a_row_that_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv(ls.BINARY_ENV, str(tmp_path / "nowhere" / "llama-server"))
    got = ls.build_llama_server("llama-server-dflash", target=None, model=None, threads=1, ctx_size=512,
                                dflash_path=None)
    assert isinstance(got, Unavailable) and "make llama-peer" in got.reason


def _tiny_drafter(vocab: int, hidden: int) -> tuple[dict, dict]:
    """A random 1-layer drafter for the tiny GGUF target (tests/tiny_gguf.py), with a reduced
    draft vocabulary of the even token ids."""
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": hidden // 4, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "vocab_size": vocab, "num_hidden_layers": 1, "num_target_layers": 4, "block_size": 4,
        "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": [0, 2]},
    }
    gen = torch.Generator().manual_seed(0)
    state = {n: 0.1 * torch.randn(s, generator=gen) for n, s in dflash_weight_shapes(config).items()}
    for n in state:
        if n.endswith("norm.weight"):
            state[n] = torch.ones_like(state[n])
    state["d2t"] = torch.arange(0, vocab, 2, dtype=torch.int64)
    return config, state


def _complete(server: ls.LlamaServerProcess, ids: list[int], n: int) -> dict:
    return server.post("/completion", {"prompt": ids, "n_predict": n, "temperature": 0, "cache_prompt": False,
                                       "return_tokens": True})


@needs_binary
def test_the_converted_drafter_loads_in_llama_cpp_dflash_and_keeps_greedy_output(tmp_path):
    target = write_tiny_gguf(tmp_path / "target.gguf")
    config, state = _tiny_drafter(vocab=64, hidden=64)
    bare, full = tmp_path / "bare.gguf", tmp_path / "drafter.gguf"
    save_gguf(bare, config, state, arch="dflash")  # no tokenizer, no head: what we wrote before
    save_gguf(full, config, state, arch="dflash", target_gguf=target)
    ids = [5, 9, 17, 3, 22, 41, 5, 9]

    # without the target's tokenizer llama.cpp refuses the drafter at load
    with pytest.raises(ls.LlamaServerError):
        ls.LlamaServerProcess(BINARY, target, 1, 256, ["--spec-type", "draft-dflash", "-md", str(bare)]).close()

    _assert_dflash_keeps_greedy_text(target, full, ids)


@needs_binary
@pytest.mark.real
def test_the_shipped_drafter_gets_tokens_accepted_in_llama_server(tmp_path):
    from transformers import AutoTokenizer

    from flashdraft.engine import DEFAULT_DRAFTER_DIR
    from flashdraft.targets.torch import default_model_path

    gguf = default_model_path()
    path, block = ls.dflash_gguf(str(DEFAULT_DRAFTER_DIR), gguf, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    text = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a string."}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    server = ls.LlamaServerProcess(BINARY, gguf, 1, 2048, ["--spec-type", "draft-dflash", "-md", str(path),
                                                           "--spec-draft-n-max", str(block - 1)])
    try:
        t = _complete(server, ids, 64)["timings"]
    finally:
        server.close()
    assert t["draft_n"] > 0 and t["draft_n_accepted"] > 0


def test_tau_of_a_mode_that_drafts_the_whole_block():
    # 10 steps of 7 drafts, 12 accepted: 10 steps yield 22 tokens
    assert ls.tau_fixed_drafts(70, 12, 7) == pytest.approx(2.2)


@needs_binary
def test_a_dflash2_drafter_loads_in_llama_cpp_and_keeps_greedy_output(tmp_path):
    """Our DFlash2 layout (convolutions + selector, module note 7 of dflash_format) is read by
    llama.cpp's DFlash2 path: it loads, drafts through its selector lattice, and the output
    stays the target's."""
    from flashdraft.drafters.dflash_format import dflash2_config

    target = write_tiny_gguf(tmp_path / "target.gguf")
    config, state = _tiny_drafter(vocab=64, hidden=64)
    config = dflash2_config(config, top_k=4, rank=8)
    gen = torch.Generator().manual_seed(1)
    for n, s in dflash_weight_shapes(config).items():
        if n not in state:
            state[n] = 0.1 * torch.randn(s, generator=gen)
    path = tmp_path / "drafter2.gguf"
    save_gguf(path, config, state, arch="dflash", target_gguf=target)
    ids = [5, 9, 17, 3, 22, 41, 5, 9]
    _assert_dflash_keeps_greedy_text(target, path, ids)


def _assert_dflash_keeps_greedy_text(target, drafter, ids: list[int]) -> None:
    """llama-server with ``drafter`` (random weights) drafts, and its verified greedy text is
    plain llama-server's."""
    plain = ls.LlamaServerProcess(BINARY, target, 1, 256, [])
    try:
        want = _complete(plain, ids, 24)
    finally:
        plain.close()
    spec = ls.LlamaServerProcess(BINARY, target, 1, 256, ["--spec-type", "draft-dflash", "-md", str(drafter),
                                                          "--spec-draft-n-max", "3"])
    try:
        got = _complete(spec, ids, 24)
    finally:
        spec.close()
    assert got["timings"].get("draft_n", 0) > 0, f"llama.cpp loaded {drafter} but never drafted"
    assert got["tokens"] == want["tokens"]  # random drafts, verified: the target's greedy text
