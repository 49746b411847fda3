"""The ``edits`` prompt set (flashdraft.prompts.load_edits, scripts/make_edits_set.py).

Fast: reads the committed asset; the token budget loads the SmolLM2 tokenizer (≈8 s).
"""

import ast
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from flashdraft import prompts as P

ROOT = Path(__file__).resolve().parent.parent
#: the context the set is sized for, and the answer it leaves room for
CTX, ANSWER = 4096, 512
KINDS = {"rename-function", "rename-variable", "add-docstrings", "fix-bug", "to-fstrings",
         "to-comprehensions", "add-type-hints"}


@pytest.fixture(scope="module")
def edits():
    return P.load_prompt_set("edits")


def _code(prompt: str) -> str:
    m = re.search(r"```python\n(.*?)```", prompt, re.S)
    assert m, "no fenced python block"
    return m.group(1)


def test_edits_loads_with_unique_ids_and_every_kind(edits):
    assert 20 <= len(edits) <= 30
    ids = [e["id"] for e in edits]
    assert len(set(ids)) == len(ids) and all(i.startswith("edits/") for i in ids)
    assert {e["kind"] for e in edits} == KINDS
    assert "edits" in P.PROMPT_SET_NAMES
    assert [e["id"] for e in P.load_prompt_set("edits", limit=8)] == ids[:8]
    # a --limit prefix has both sources
    assert len({e["licence"] for e in edits[:8]}) == len({e["licence"] for e in edits}) == 2


def test_every_prompt_shows_a_parsable_file_and_asks_for_all_of_it(edits):
    for e in edits:
        code = _code(e["prompt"])
        ast.parse(code)
        assert len(code.splitlines()) >= 15, e["id"]
        assert "whole file" in e["prompt"]
        assert f"Here is `{e['file']}`" in e["prompt"]


def test_every_source_is_attributed_with_a_compatible_licence(edits):
    for e in edits:
        if e["licence"].startswith("MIT"):
            assert re.fullmatch(r"HumanEval canonical solutions (HumanEval/\d+, ){3}HumanEval/\d+", e["source"]), e
        else:
            assert e["licence"].startswith("Apache-2.0"), e
            m = re.fullmatch(r"flashdraft (\S+\.py)( lines \d+-\d+)? at commit [0-9a-f]{7,40}", e["source"])
            assert m, e
            assert e["file"] == m.group(1)


def test_named_bugs_are_in_the_shown_file(edits):
    for e in (e for e in edits if e["kind"] == "fix-bug"):
        buggy = re.search(r"the line `(.+?)` is wrong", e["prompt"]).group(1)
        assert buggy in _code(e["prompt"]), e["id"]


def test_every_prompt_fits_the_context_with_its_answer(edits):
    try:
        from flashdraft.targets.torch import default_model_path
        gguf = default_model_path()
    except FileNotFoundError:
        pytest.skip("the packaged SmolLM2 model is not installed")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    sizes = {}
    for e in edits:
        text = tok.apply_chat_template([{"role": "user", "content": e["prompt"]}], add_generation_prompt=True,
                                       tokenize=False)
        sizes[e["id"]] = len(tok.encode(text, add_special_tokens=False))
    over = {k: v for k, v in sizes.items() if v + ANSWER > CTX}
    assert not over, over
    # the shown files are the size an answer can return in full, mostly
    assert sorted(sizes.values())[len(sizes) // 2] <= 1200, sizes


def test_generator_writes_the_committed_asset():
    script = ROOT / "scripts" / "make_edits_set.py"
    spec = importlib.util.spec_from_file_location("make_edits_set", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    have = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{mod.REPO_COMMIT}^{{commit}}"],
                          capture_output=True)
    if have.returncode != 0:
        pytest.skip(f"commit {mod.REPO_COMMIT} not in this clone (shallow?)")
    assert mod.main(["--check"]) == 0


def test_preparing_helpers():
    import importlib.util as u
    spec = u.spec_from_file_location("make_edits_set", ROOT / "scripts" / "make_edits_set.py")
    mod = u.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = 'def f(a: int, b: "str" = "x") -> list[int]:\n    """Doc."""\n    return [a] if a < 2 else []\n'
    assert mod.strip_type_hints(src).splitlines()[0] == 'def f(a, b = "x"):'
    assert '"""' not in mod.strip_docstrings(src)
    shown, func, buggy, right = mod.inject_bug(src)
    assert (func, buggy, right) == ("f", "return [a] if a <= 2 else []", "return [a] if a < 2 else []")
    fs, n = mod.fstrings_to_percent('x = 3\ny = f"a {x!r} b {x:.2f} 100%"\n')
    assert n == 1 and fs.splitlines()[1] == 'y = "a %r b %.2f 100%%" % (x, x)'
    assert eval(fs.splitlines()[1].split(" = ", 1)[1], {"x": 3}) == f"a {3!r} b {3:.2f} 100%"
