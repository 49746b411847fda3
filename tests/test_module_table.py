"""docs/design.md's module table is the code's: one row per module, its docstring's first line
(``python scripts/module_table.py`` rewrites it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("module_table", ROOT / "scripts" / "module_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_design_md_lists_every_module_as_the_code_describes_it():
    mt = _script()
    page = mt.DOC.read_text(encoding="utf-8")
    assert mt.render(page) == page, "docs/design.md's module table is stale: run python scripts/module_table.py"


def test_every_module_has_a_docstring():
    assert "(no module docstring)" not in _script().table()
