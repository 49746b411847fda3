"""docs/design.md's module table, written from the code: one row per module of flashdraft/,
its docstring's first sentence.

    python scripts/module_table.py           # rewrite the table in docs/design.md
    python scripts/module_table.py --check   # exit 1 if the table is not what the code says

The table sits between the two marker lines; the rest of the page is hand-written.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "design.md"
START, END = "<!-- modules: written by scripts/module_table.py -->", "<!-- /modules -->"


def first_sentence(path: Path) -> str:
    """The module docstring's first line, or a note that it has none (so the table shows it)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    return doc.strip().split("\n")[0].replace("|", "\\|") if doc else "(no module docstring)"


def table() -> str:
    """The markdown table of every ``flashdraft/**/*.py`` but ``__init__.py`` files without docstrings."""
    rows = ["| module | what it is |", "| --- | --- |"]
    for path in sorted((ROOT / "flashdraft").rglob("*.py")):
        if path.name == "__init__.py" and not ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))):
            continue
        rows.append(f"| `{path.relative_to(ROOT).as_posix()}` | {first_sentence(path)} |")
    return "\n".join(rows)


def render(page: str) -> str:
    """``page`` with the text between the markers replaced by :func:`table`.

    Raises:
        ValueError: the markers are missing.
    """
    if START not in page or END not in page:
        raise ValueError(f"{DOC} has no {START} ... {END} block")
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="only check; exit 1 if the table is stale")
    args = p.parse_args()
    page = DOC.read_text(encoding="utf-8")
    new = render(page)
    if args.check:
        if new != page:
            print(f"{DOC.relative_to(ROOT)}: the module table is stale; run python scripts/module_table.py",
                  file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
