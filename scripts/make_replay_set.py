#!/usr/bin/env python
"""Build the ``replay`` bench prompt set (flashdraft/assets/replay_prompts.jsonl) from the
coding agents' recorded traffic in tests/data/agents (scripts/agents_check.sh --dump-requests).

Each conversation becomes its turns in order, each turn the whole history so far as chat
messages, so turn k's prompt begins with turn k-1's (the prompt cache's case):

- aider: its one recorded request holds a growing history (system, then user/assistant
  pairs); turn k is the system message and the first k user messages with the answers between.
- Claude Code: its two Messages requests (the task, then the task, its answer and the next
  user turn). Content blocks are joined as text; the tool definitions are left out (the
  server renders them as a preamble; the bench tokenises messages with the chat template).

    python scripts/make_replay_set.py
"""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AGENTS = ROOT / "tests" / "data" / "agents"
OUT = ROOT / "flashdraft" / "assets" / "replay_prompts.jsonl"


def text_of(content) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(b.get("text", "") if b.get("type") == "text" else json.dumps(b) for b in content)


def aider() -> list[list[dict]]:
    body = json.loads((AGENTS / "aider" / "000020-POST-v1_chat_completions.json").read_text())["body"]
    msgs = [{"role": m["role"], "content": text_of(m["content"])} for m in body["messages"]]
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    return [msgs[: i + 1] for i in users]


def claude() -> list[list[dict]]:
    turns = []
    for name in ("000009-POST-v1_messages.json", "000010-POST-v1_messages.json"):
        body = json.loads((AGENTS / "claude" / name).read_text())["body"]
        system = [{"role": "system", "content": text_of(body["system"])}] if body.get("system") else []
        turns.append(system + [{"role": m["role"], "content": text_of(m["content"])} for m in body["messages"]])
    return turns


def main() -> None:
    lines = []
    for conv, turns in (("aider", aider()), ("claude", claude())):
        for k, messages in enumerate(turns, start=1):
            if k > 1:  # a later turn must extend the earlier one, or the prompt cache has nothing to reuse
                assert messages[: len(turns[k - 2])] == turns[k - 2], (conv, k)
            lines.append({"id": f"replay/{conv}/{k}", "conversation": conv, "turn": k, "messages": messages,
                          "prompt": messages[-1]["content"],
                          "source": f"tests/data/agents/{conv} (recorded by scripts/agents_check.sh)",
                          "licence": "Apache-2.0 (flashdraft)"})
    OUT.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    print(f"wrote {len(lines)} turns of 2 conversations to {OUT}")


if __name__ == "__main__":
    main()
