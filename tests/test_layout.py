"""The code's shape: stages small enough to read, dependencies pointing one
way, and no cycles between the package, its tests and its tools."""

import ast
import os

import pytest

from conftest import REPO

SNTF = os.path.join(REPO, "sntf")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
# What each stage may import from sntf: graph <- analysis <- planner <-
# rewrite <- passes; only the runtime layer touches TensorFlow's runtime.
ALLOWED = {
    # sntf._graph_walks: the topological and the executor's order, native,
    # without TensorFlow; sntf._bfc_model: the allocator model's step, alike.
    "sntf.graph": {"sntf.graph", "sntf._graph_walks"},
    "sntf.analysis": {"sntf.graph", "sntf.analysis", "sntf._bfc_model",
                      "sntf._graph_walks"},
    "sntf.planner": {"sntf.graph", "sntf.analysis", "sntf.planner"},
    "sntf.rewrite": {"sntf.graph", "sntf.analysis", "sntf.planner", "sntf.rewrite"},
    "sntf.report": {"sntf.graph", "sntf.planner"},
    "sntf.passes": {"sntf.graph", "sntf.analysis", "sntf.planner", "sntf.rewrite",
                    "sntf.report", "sntf.config"},
    "sntf.config": {"sntf.sizes"},
    "sntf.sizes": set(),
}
PURE_STAGES = ("sntf.graph", "sntf.analysis", "sntf.planner", "sntf.rewrite",
               "sntf.report", "sntf.passes", "sntf.config", "sntf.sizes")


def _python_files(root):
    for folder, _, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def _module(path: str) -> str:
    rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path: str, top_level_only: bool = False) -> set:
    """Modules a file imports (every import, or only those at module level)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_no_module_or_function_is_too_long():
    long_modules, long_functions = [], []
    for path in _python_files(SNTF):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if text.count("\n") > MAX_MODULE_LINES:
            long_modules.append((_module(path), text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append((_module(path), node.name, length))
    assert not long_modules, long_modules
    assert not long_functions, long_functions


@pytest.mark.parametrize("stage", sorted(ALLOWED))
def test_stages_import_only_the_stages_below_them(stage):
    allowed = ALLOWED[stage] | {stage}
    for path in _python_files(SNTF):
        module = _module(path)
        if module != stage and not module.startswith(stage + "."):
            continue
        used = {m for m in _imports(path) if m == "sntf" or m.startswith("sntf.")}
        wrong = {m for m in used if m != "sntf"
                 and not any(m == a or m.startswith(a + ".") for a in allowed)}
        assert not wrong, (module, sorted(wrong))


def test_the_pure_stages_do_not_import_tensorflow_at_module_level():
    for path in _python_files(SNTF):
        module = _module(path)
        if not module.startswith(PURE_STAGES):
            continue
        heavy = {m for m in _imports(path, top_level_only=True)
                 if m.split(".")[0] in ("tensorflow", "keras", "numpy")}
        assert not heavy, (module, heavy)


def _mentions(path: str, folder: str) -> bool:
    """Whether a file imports from, or puts on sys.path, the repository's
    `folder` (running it as a script in a subprocess is not importing it)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""])
            if any(n.split(".")[0] == folder for n in names):
                return True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "insert"
                and any(isinstance(a, ast.Constant) and a.value == folder
                        for a in ast.walk(node))):
            return True
    return False


def test_no_cycles_between_tests_tools_and_benchmarks():
    tests = list(_python_files(os.path.join(REPO, "tests")))
    benchmarks = list(_python_files(os.path.join(REPO, "benchmarks")))
    package = list(_python_files(SNTF))
    assert not [p for p in tests if _mentions(p, "benchmarks") or _mentions(p, "tools")]
    assert not [p for p in benchmarks if _mentions(p, "tests")]
    assert not [p for p in package if _mentions(p, "tests")
                or _mentions(p, "benchmarks") or _mentions(p, "tools")]


def test_the_cycle_check_sees_imports_and_path_inserts(tmp_path):
    importing = tmp_path / "a.py"
    importing.write_text("from benchmarks import deeper\n")
    inserting = tmp_path / "b.py"
    inserting.write_text("import os, sys\nsys.path.insert(0, os.path.join('x', 'tools'))\n")
    running = tmp_path / "c.py"
    running.write_text("import subprocess\nsubprocess.run(['python', 'tools/x.py'])\n")
    assert _mentions(str(importing), "benchmarks")
    assert _mentions(str(inserting), "tools")
    assert not _mentions(str(running), "tools")
