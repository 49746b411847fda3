"""Prompt sets (flashdraft.prompts) and training-data regeneration (flashdraft.train.data).

Fast: the real data files are parsed (≈1 s), the regeneration tests use a tiny
random-config llama with the real SmolLM2 tokenizer (≈7 s to load once).
"""

import json
from pathlib import Path

import pytest
import torch

from flashdraft import prompts as P
from flashdraft.train import data as D


@pytest.fixture(scope="module")
def train_prompts():
    return D.training_prompts(with_stats=True)


# ----------------------------------------------------------------- prompts


def test_sharegpt_tolerant_parse_keeps_records():
    records, stats = P.load_sharegpt(with_stats=True)
    assert stats["records"] > 15_000  # 17,671 on the packaged (truncated) file
    assert 5_000 < stats["kept"] == len(records)
    assert len({r["id"] for r in records}) == len(records)
    for r in records[:500]:
        assert 20 <= len(r["text"]) <= 400 and r["text"].isascii()
        assert not r["text"].endswith("Share Prompt")


def test_iter_json_array_records_stops_at_truncation():
    text = '[ {"a": 1}, {"b": [1, 2]},\n {"c": "unterminated'
    assert [r for r, _ in P.iter_json_array_records(text)] == [{"a": 1}, {"b": [1, 2]}]
    assert [r for r, _ in P.iter_json_array_records('[{"a": 1}]')] == [{"a": 1}]
    with pytest.raises(ValueError):
        list(P.iter_json_array_records('{"a": 1}'))


def test_humaneval_and_seed_sets():
    he = P.load_prompt_set("humaneval")
    assert len(he) == 164
    assert he[0]["id"] == "HumanEval/0"
    assert he[0]["prompt"] == P.HUMANEVAL_CHAT_TEMPLATE.format(prompt=he[0]["raw_prompt"])
    seed = P.load_prompt_set("seed")
    assert [s["prompt"] for s in seed] == P.SEED_PROMPTS and len(seed) == 3
    assert len(P.load_prompt_set("humaneval", limit=5)) == 5


def test_heldout_is_fixed_and_mixed():
    held = P.load_prompt_set("sharegpt-heldout")
    assert len(held) == 200
    assert [h["id"] for h in held] == P.sharegpt_heldout_ids()
    n_code = sum(h["is_code"] for h in held)
    assert 40 <= n_code <= 60


def test_load_prompt_set_unknown_name_and_jsonl(tmp_path):
    with pytest.raises(ValueError, match="seed.*humaneval.*sharegpt-heldout"):
        P.load_prompt_set("no-such-set")
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello there"}\n\n{"id": "x", "prompt": "second"}\n')
    items = P.load_prompt_set(str(path))
    assert [i["prompt"] for i in items] == ["hello there", "second"]
    assert items[1]["id"] == "x" and items[0]["id"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError):
        P.load_prompt_set(str(bad))


def test_is_code_prompt_examples():
    assert P.is_code_prompt("Write a Python function that reverses a string")
    assert P.is_code_prompt("why does my SELECT * FROM users WHERE id = 1 fail?")
    assert not P.is_code_prompt("What are some places to visit in Lisbon in spring?")


# ----------------------------------------------------------------- training prompts


def test_heldout_disjoint_from_training(train_prompts):
    items, _ = train_prompts
    train_ids = {p["id"] for p in items}
    assert len(train_ids) == len(items)
    assert not train_ids & set(P.sharegpt_heldout_ids())
    held_texts = {P.normalize_text(h["prompt"]) for h in P.sharegpt_heldout()}
    assert not held_texts & {P.normalize_text(p["prompt"]) for p in items}


def test_no_humaneval_or_seed_prompt_in_training(train_prompts):
    items, _ = train_prompts
    texts = {P.normalize_text(p["prompt"]) for p in items}
    for he in P.load_humaneval():
        assert P.normalize_text(he["prompt"]) not in texts
        assert P.normalize_text(he["raw_prompt"]) not in texts
    for s in P.SEED_PROMPTS:
        assert P.normalize_text(s) not in texts
    block = D.eval_blocklist()
    assert not [p["id"] for p in items if block.matches(p["prompt"])]
    # the template tasks are far from HumanEval and the seed prompts, not just below 0.5
    assert not [t["id"] for t in D.template_code_prompts() if block.matches(t["prompt"], threshold=0.2)]
    assert block.matches(P.SEED_PROMPTS[0].replace("5 tests", "five tests"))


def test_training_prompts_mix_code_and_prose(train_prompts):
    items, stats = train_prompts
    assert stats["total"] == len(items) > 6_000
    assert 0.37 <= stats["code"] / stats["total"] <= 0.43
    for n in (10, 50, 256, 1000, 3000):
        share = sum(p["is_code"] for p in items[:n]) / n
        assert 0.3 <= share <= 0.5, (n, share)
    assert all(P.is_code_prompt(t["prompt"]) for t in D.template_code_prompts())
    assert items == D.training_prompts()  # deterministic


def test_interleave_prefixes():
    code = [{"c": i} for i in range(4)]
    prose = [{"p": i} for i in range(10)]
    out = D.interleave(code, prose, 0.4)
    assert len(out) == 14 and out[:5].count({"c": 0}) == 1
    assert sum("c" in o for o in out[:5]) == 2
    with pytest.raises(ValueError):
        D.interleave(code, prose, 1.5)


# ----------------------------------------------------------------- regeneration


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    d, f = D.default_model_location()
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, initializer_range=0.5,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    return LlamaForCausalLM(cfg).eval()


TINY_PROMPTS = [
    {"id": "a", "prompt": "Hi"},
    {"id": "b", "prompt": "Write a haiku about autumn leaves falling on a quiet pond."},
    {"id": "c", "prompt": "How do I write Go code that merges overlapping time intervals?"},
    {"id": "d", "prompt": "Explain photosynthesis to a ten year old."},
]


def read_shards(out: Path) -> list[dict]:
    recs = []
    for shard in sorted(out.glob("shard-*.jsonl")):
        recs += [json.loads(line) for line in shard.read_text().splitlines()]
    return recs


def test_regenerate_writes_shards_and_resumes(tmp_path, tokenizer):
    model = tiny_llama()
    kw = dict(max_new_tokens=8, batch_size=2, shard_size=3, model=model, tokenizer=tokenizer, progress=False)
    m1 = D.regenerate(None, None, tmp_path, TINY_PROMPTS[:2], **kw)
    assert m1["counts"]["done"] == 2
    first = read_shards(tmp_path)
    assert [r["id"] for r in first] == ["a", "b"]  # same length order here
    # simulate a kill in the middle of writing a line
    with open(tmp_path / "shard-00000.jsonl", "a") as f:
        f.write('{"id": "c", "prompt": "How do')

    m2 = D.regenerate(None, None, tmp_path, TINY_PROMPTS, **kw)
    recs = read_shards(tmp_path)
    assert sorted(r["id"] for r in recs) == ["a", "b", "c", "d"]  # no duplicates, broken line gone
    assert recs[:2] == first  # earlier results untouched
    assert (tmp_path / "shard-00001.jsonl").exists()  # a restart starts a new shard
    assert m2["counts"] == {**m2["counts"], "prompts": 4, "done": 4}
    assert m2["counts"]["response_tokens"] == sum(len(r["response_ids"]) for r in recs)

    for r in recs:
        prompt = next(p["prompt"] for p in TINY_PROMPTS if p["id"] == r["id"])
        assert r["prompt"] == prompt
        assert r["prompt_ids"] == D.encode_chat(tokenizer, prompt)  # no padding kept
        assert 1 <= len(r["response_ids"]) <= 8
        if r["finish"] == "length":
            assert len(r["response_ids"]) == 8 and 2 not in r["response_ids"]
        else:
            assert r["finish"] == "eos" and r["response_ids"].index(2) == len(r["response_ids"]) - 1

    # a third run has nothing to do and writes nothing
    D.regenerate(None, None, tmp_path, TINY_PROMPTS, **kw)
    assert len(read_shards(tmp_path)) == 4
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["state"] == "complete" and manifest["settings"]["max_new_tokens"] == 8
    assert manifest["eos_token_ids"] == [2]

    # other settings in the same directory are refused
    with pytest.raises(ValueError, match="max_new_tokens"):
        D.regenerate(None, None, tmp_path, TINY_PROMPTS, **{**kw, "max_new_tokens": 9})
    with pytest.raises(ValueError, match="unique"):
        D.regenerate(None, None, tmp_path / "x", TINY_PROMPTS + TINY_PROMPTS[:1], **kw)


def test_batched_left_padded_generation_matches_single(tokenizer):
    model = tiny_llama(seed=1)
    encs = [D.encode_chat(tokenizer, p["prompt"]) for p in TINY_PROMPTS]
    batched = D._generate_batch(model, encs, 2, [2], 6)
    single = [D._generate_batch(model, [e], 2, [2], 6)[0] for e in encs]
    assert batched == single


class _FakeGenerator:
    """Stands in for a model: returns a fixed generate() output."""

    def __init__(self, out):
        self.out = out

    def generate(self, input_ids, attention_mask, generation_config):
        assert input_ids.shape == (2, 3)
        assert attention_mask.tolist() == [[0, 1, 1], [1, 1, 1]]  # left padding
        return self.out


def test_generate_batch_strips_padding_and_after_eos():
    prompt = [[7, 8], [5, 6, 7]]
    out = torch.tensor([
        [2, 7, 8, 10, 11, 2, 2],  # pad, prompt, 10 11 EOS, padding
        [5, 6, 7, 12, 13, 14, 15],  # no EOS: runs to max_new_tokens
    ])
    res = D._generate_batch(_FakeGenerator(out), prompt, pad_id=2, eos_ids=[2], max_new_tokens=4)
    assert res == [([10, 11, 2], "eos"), ([12, 13, 14, 15], "length")]
