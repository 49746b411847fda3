"""Prompt sets (flashdraft.prompts) and the training prompts and model location (flashdraft.train.data).

Fast: the real data files are parsed (≈1 s).
"""


import pytest

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

