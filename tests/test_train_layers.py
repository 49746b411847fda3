"""flashdraft.train has one direction: no module imports, even lazily, one that imports it back.

Data (shards, prompts, features, regeneration) at the bottom, the walk and its statistics
above them, the loop and evaluation on top. Function-level imports count too: a lazy import
hides a cycle from Python, not from a reader following a training run from the data up.
"""

import ast
from pathlib import Path

import pytest

import flashdraft.train
from flashdraft.train import data

TRAIN_DIR = Path(flashdraft.train.__file__).parent


def train_import_graph(root: Path = TRAIN_DIR) -> dict[str, set[str]]:
    """``{module: modules of flashdraft.train it imports}``, read from the source with ``ast``."""
    modules = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in modules:
        tree = ast.parse((root / f"{name}.py").read_text(), filename=name)
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:  # `from .x import y` / `from . import x`
                    deps.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
                elif node.module == "flashdraft.train":
                    deps.update(a.name for a in node.names)
                elif (node.module or "").startswith("flashdraft.train."):
                    deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("flashdraft.train."):
                        deps.add(a.name.split(".")[2])
        graph[name] = (deps & modules) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None if the graph is acyclic (depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_lazy_cycle(tmp_path):
    # the checker itself: a cycle closed by an import inside a function is found
    (tmp_path / "a.py").write_text("from flashdraft.train.b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from flashdraft.train import c\n")
    (tmp_path / "c.py").write_text("def g():\n    import flashdraft.train.a\n")
    (tmp_path / "d.py").write_text("from .a import x\nfrom . import b\n")
    graph = train_import_graph(tmp_path)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "b"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    graph["c"] = set()
    assert find_cycle(graph) is None


def test_train_imports_are_acyclic():
    graph = train_import_graph()
    assert {"shards", "stats", "walk", "loop", "evaluate"} <= set(graph)
    assert find_cycle(graph) is None, f"import cycle in flashdraft.train: {' -> '.join(find_cycle(graph))}"


def test_data_layer_imports_nothing_above_it():
    graph = train_import_graph()
    assert graph["shards"] == set()
    assert graph["stats"] == set()
    # the walk reads data, never the loop or the evaluation that sit on top of it
    assert not graph["walk"] & {"loop", "evaluate", "cli"}


def test_code_templates_are_read_from_the_data_file():
    tm = data.code_templates()
    prompts = data.template_code_prompts()
    n = (len(tm["generic_tasks"]) * len(tm["languages"]) + len(tm["python_tasks"])) * len(tm["phrasings"])
    assert len(prompts) == n and len({p["id"] for p in prompts}) == n
    first = prompts[0]
    assert first["id"] == f"tmpl/g000-p0-{tm['languages'][0]}"
    assert first["prompt"] == tm["phrasings"][0].format(lang=tm["languages"][0], task=tm["generic_tasks"][0])


def test_bad_template_file_is_a_clear_error(tmp_path, monkeypatch):
    bad = tmp_path / "t.toml"
    bad.write_text('generic_tasks = ["x"]\npython_tasks = ["y"]\nlanguages = ["Go"]\nphrasings = ["no slots"]\n')
    monkeypatch.setattr(data, "TEMPLATES_PATH", bad)
    data.code_templates.cache_clear()
    try:
        with pytest.raises(ValueError, match="phrasings"):
            data.code_templates()
        bad.write_text('generic_tasks = []\n')
        data.code_templates.cache_clear()
        with pytest.raises(ValueError, match="generic_tasks"):
            data.code_templates()
    finally:
        data.code_templates.cache_clear()
