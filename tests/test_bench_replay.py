"""The ``replay`` bench set (coding agents' recorded conversations, turn by turn): each later
turn extends the one before it, ``--limit`` counts conversations, and the bench runs a later
turn from the prompt cache its conversation's previous turn left, a first turn afresh."""

from __future__ import annotations

import json

import torch
from tiny import tiny_model, tiny_tokenizer

from flashdraft.cli import main
from flashdraft.prompts import PROMPT_SET_NAMES, load_prompt_set


def test_each_turn_extends_the_one_before_and_limit_counts_conversations():
    items = load_prompt_set("replay")
    assert "replay" in PROMPT_SET_NAMES
    convs = list(dict.fromkeys(i["conversation"] for i in items))
    assert convs == ["aider", "claude"]
    for conv in convs:
        turns = [i for i in items if i["conversation"] == conv]
        assert [t["turn"] for t in turns] == list(range(1, len(turns) + 1)) and len(turns) >= 2
        for a, b in zip(turns, turns[1:]):
            assert b["messages"][: len(a["messages"])] == a["messages"] and len(b["messages"]) > len(a["messages"])
    assert {i["conversation"] for i in load_prompt_set("replay", limit=1)} == {"aider"}
    assert len(load_prompt_set("replay", limit=1)) == sum(i["conversation"] == "aider" for i in items)


def test_a_later_turn_runs_from_the_prompt_cache(tmp_path):
    model, tok = tiny_model(seed=0, layers=2), tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    model.save_pretrained(tmp_path / "t")
    tok.save_pretrained(tmp_path / "t")
    history = [{"role": "system", "content": "you edit files"}, {"role": "user", "content": "fix add"}]
    later = history + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "and sub"}]
    lines = [{"id": "c/1", "conversation": "c", "turn": 1, "messages": history, "prompt": "fix add"},
             {"id": "c/2", "conversation": "c", "turn": 2, "messages": later, "prompt": "and sub"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "-m", str(tmp_path / "t"), "--configs", "none,ngram", "--prompts", str(tmp_path / "p.jsonl"),
                   "-n", "6", "--repeats", "2", "-t", "1", "--warmup-tokens", "2",
                   "--json-out", str(tmp_path / "out.json")])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    runs = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert len(runs) == 8
    for r in runs:
        # turn 1 afresh in both passes (pass 2 comes after turn 2 of pass 1); turn 2 from turn 1's cache
        assert (r["cached_tokens"] > 0) == (r["prompt_id"] == "c/2"), r
        assert r["cached_tokens"] < r["prompt_tokens"]
