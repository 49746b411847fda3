"""``flashdraft bench`` under JSON schemas: the ``json-schema`` prompt set, the answer
checker, the timed constraint, and the whole bench on a tiny model.

The tiny target's tokenizer has one token per printable ASCII character except space (no
whitespace tokens at all): a random model can then write any JSON the schemas need, but
cannot fill an answer with the whitespace JSON allows between tokens, so every answer ends
well within the token cap and must satisfy its schema.
"""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from flashdraft.bench.constrained import TimedConstraint, schema_grammar
from flashdraft.bench.schema_check import check_answer, unsupported_keywords
from flashdraft.cli import main
from flashdraft.constraints import Constraint, TokenizerInfo
from flashdraft.prompts import load_prompt_set
from flashdraft.targets.torch import Target

OURS = ["none", "dflash", "dflash-adaptive", "ngram", "ngram-adaptive", "hybrid", "hybrid-adaptive"]


def _json_tokenizer() -> PreTrainedTokenizerFast:
    chars = [chr(c) for c in range(33, 127)]  # "!" .. "~": byte-level pieces are the characters themselves
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
    out.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return out


def _json_model(vocab: int):
    torch.manual_seed(11)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         eos_token_id=0, pad_token_id=0, bos_token_id=0, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():  # peaked, so drafts are sometimes accepted and sometimes not
        model.lm_head.weight.mul_(8.0)
    return model.eval()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("json-target")
    tok = _json_tokenizer()
    _json_model(len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


# ---------------------------------------------------------------- the prompt set


def test_json_schema_set_is_well_formed():
    items = load_prompt_set("json-schema")
    assert 10 <= len(items) <= 20
    assert len({i["id"] for i in items}) == len(items)
    kinds = set()
    for item in items:
        schema = item["schema"]
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        assert set(schema["required"]) == set(schema["properties"])
        assert not unsupported_keywords(schema), item["id"]
        assert item["task"] in item["prompt"] and json.dumps(schema) in item["prompt"]
        schema_grammar(schema)  # compiles
        text = json.dumps(schema)
        kinds |= {k for k in ("enum", "array", "number", "integer", "boolean", '"object"') if k in text}
        if any(p.get("type") == "object" for p in schema["properties"].values()):
            kinds.add("nested")
    assert kinds >= {"enum", "array", "number", "integer", "boolean", "nested"}
    assert len(load_prompt_set("json-schema", limit=3)) == 3


# ---------------------------------------------------------------- the answer checker

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "tag", "xs"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                         "tag": {"type": "string", "enum": ["a", "b"]},
                         "xs": {"type": "array", "items": {"type": "number", "multipleOf": 0.01}, "maxItems": 2},
                         "name": {"type": "string", "maxLength": 3, "pattern": "^[a-z]+$"}}}


@pytest.mark.parametrize("text,why", [
    ('{"n": 3, "tag": "a", "xs": [1.5]}', None),
    ('{"n": 3, "tag": "a", "xs": [], "name": "abc"}', None),
    ('{"n": 3, "tag": "a", "xs": [1.5]', "not JSON"),
    ('{"n": 3, "tag": "c", "xs": []}', "$.tag"),
    ('{"n": 10, "tag": "a", "xs": []}', "maximum"),
    ('{"n": true, "tag": "a", "xs": []}', "$.n"),
    ('{"tag": "a", "xs": []}', "missing required 'n'"),
    ('{"n": 1, "tag": "a", "xs": [1, 2, 3]}', "maxItems"),
    ('{"n": 1, "tag": "a", "xs": ["1"]}', "$.xs[0]"),
    ('{"n": 1, "tag": "a", "xs": [0.29, 12]}', None),
    ('{"n": 1, "tag": "a", "xs": [0.219]}', "multiple of 0.01"),
    ('{"n": 1, "tag": "a", "xs": [], "z": 0}', "unexpected key 'z'"),
    ('{"n": 1, "tag": "a", "xs": [], "name": "abcd"}', "maxLength"),
    ('{"n": 1, "tag": "a", "xs": [], "name": "A"}', "does not match"),
])
def test_answer_checker(text, why):
    got = check_answer(text, SCHEMA)
    assert got is None if why is None else why in got


def test_unsupported_keywords_are_named():
    assert unsupported_keywords(SCHEMA) == set()
    assert unsupported_keywords({"type": "object", "properties": {"a": {"$ref": "#/x", "format": "date"}}}) == {
        "$ref", "format"}


# ---------------------------------------------------------------- the timed constraint


def test_timed_constraint_masks_like_the_plain_one_and_counts_each_call_once(target_dir):
    target = Target.load(str(target_dir))
    info, grammar = TokenizerInfo.for_target(target), schema_grammar(SCHEMA)
    plain, timed = Constraint(info, grammar), TimedConstraint(info, grammar)
    tokens = target.encode('{"n":3,')
    logits_a = torch.zeros(len(tokens) + 1, target.vocab_size)
    logits_b = logits_a.clone()
    plain.apply(logits_a, tokens)
    timed.apply(logits_b, tokens)
    assert torch.equal(logits_a, logits_b)
    assert torch.equal(plain.here(), timed.here())
    timed.advance(tokens)
    # apply() calls unpack() inside: counted once, as apply
    assert timed.cost.calls == {"apply": 1, "here": 1, "advance": 1}
    assert timed.cost.total_ms > 0 and timed.cost.setup_ms > 0
    assert set(timed.cost.by_role()) == {"verify", "draft", "advance"}


# ---------------------------------------------------------------- the bench


def _bench(*args) -> int:
    threads = torch.get_num_threads()
    try:
        return main(["bench", *args])
    finally:
        torch.set_num_threads(threads)


def test_bench_on_the_json_schema_set_every_contender_valid_and_identical(target_dir, tmp_path, capsys):
    out = tmp_path / "json.json"
    rc = _bench("-m", str(target_dir), "-md", "random:1", "--configs", ",".join(OURS + ["hf"]),
                "--prompts", "json-schema", "--limit", "3", "--max-tokens", "400", "--repeats", "1",
                "--threads", "1", "--warmup-tokens", "2", "--spec-draft-n-max", "6", "--json-out", str(out))
    assert rc == 0
    doc = json.loads(out.read_text())
    assert all(p["schema"] for p in doc["prompts"])
    runs = doc["runs"]
    assert {r["config"] for r in runs} == set(OURS)  # hf cannot take the grammar: skipped, not run free
    assert doc["skipped"] == [{"config": "hf", "prompt_sets": ["json-schema"], "reason": doc["skipped"][0]["reason"]}]
    assert "grammar" in doc["skipped"][0]["reason"]
    assert len(runs) == len(OURS) * 3
    for r in runs:
        assert r["error"] is None and r["constrained"] and r["finish_reason"] == "stop", r
        assert r["schema_violation"] is None, r
        assert r["grammar"]["total_ms"] > 0 and r["grammar"]["ms_per_token"] > 0
        if r["config"] != "none":
            assert r["same_as_baseline"] is True, f"{r['config']} changed the constrained greedy answer"
    texts = {}
    for o in doc["outputs"]:
        texts.setdefault(o["prompt_id"], set()).add(o["text"])
    assert all(len(t) == 1 for t in texts.values())
    drafted = {s["config"]: s["draft_n"] for s in doc["summary"]}
    assert drafted["dflash"] > 0 and drafted["ngram"] > 0
    for s in doc["summary"]:
        assert s["constrained"] and s["schema_violations"] == 0
        assert s["grammar_ms_per_token"]["median"] > 0 and 0 < s["grammar_share"]["median"] < 1
    report = capsys.readouterr().out
    assert "mask ms/token" in report and "Not run on constrained sets:" in report and "`hf` on json-schema" in report


def test_bench_jsonl_schema_and_free_prompts_mix(target_dir, tmp_path):
    """A .jsonl line with a ``schema`` is constrained; the other lines are not, and a peer
    that cannot take a grammar still runs them."""
    prompts = tmp_path / "mixed.jsonl"
    prompts.write_text(json.dumps({"id": "free", "prompt": "abc"}) + "\n"
                       + json.dumps({"id": "held", "prompt": "n?", "schema": SCHEMA}) + "\n")
    out = tmp_path / "mixed.json"
    assert _bench("-m", str(target_dir), "--configs", "none,ngram,hf", "--prompts", str(prompts),
                  "--max-tokens", "60", "--repeats", "1", "--threads", "1", "--warmup-tokens", "2",
                  "--json-out", str(out)) == 0
    doc = json.loads(out.read_text())
    ran = {(r["config"], r["prompt_id"]): r for r in doc["runs"]}
    assert set(ran) == {("none", "free"), ("ngram", "free"), ("hf", "free"), ("none", "held"), ("ngram", "held")}
    assert not ran[("none", "free")]["constrained"] and ran[("none", "free")]["grammar"] is None
    assert ran[("none", "held")]["grammar"] is not None
    assert check_answer(next(o["text"] for o in doc["outputs"] if o["prompt_id"] == "held"), SCHEMA) is None


def test_a_schema_the_checker_cannot_judge_is_refused(target_dir, tmp_path, capsys):
    prompts = tmp_path / "ref.jsonl"
    prompts.write_text(json.dumps({"prompt": "x", "schema": {"type": "object", "$ref": "#/a"}}) + "\n")
    assert _bench("-m", str(target_dir), "--configs", "none", "--prompts", str(prompts), "--repeats", "1") == 1
    assert "$ref" in capsys.readouterr().err


def test_url_mode_sends_the_schema_as_response_format():
    from flashdraft.bench.contender import BenchPrompt
    from flashdraft.bench.remote import RemoteServer
    from flashdraft.sampling import SamplingParams

    server = object.__new__(RemoteServer)  # no server to ask for its model list
    server.model, server.stream = "m", False
    held = BenchPrompt("p", "s", "text", None, 32, schema=SCHEMA, grammar=schema_grammar(SCHEMA))
    body = server._body(held, SamplingParams())
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    assert "response_format" not in server._body(BenchPrompt("q", "s", "text", None, 32), SamplingParams())
    assert RemoteServer.takes_constraint
