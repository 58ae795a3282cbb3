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


# Prose the planner writes for people: plan notes and summaries, reasons'
# text, warnings. Code decides on codes and fields, never on this prose.
PROSE = {"notes", "lines", "summary", "text", "reason", "warning", "warnings"}
STRING_TESTS = {"startswith", "endswith", "find", "rfind", "index", "split",
                "partition", "rpartition", "match", "search", "fullmatch", "findall"}


def _mentions_prose(node, bound: set) -> bool:
    """Whether an expression reads prose: an attribute of a PROSE name, a
    report's entry of one (report["reason"], report.get("notes")), or a
    name bound to prose."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in PROSE:
            return True
        if isinstance(sub, ast.Name) and sub.id in bound:
            return True
        key = (sub.slice if isinstance(sub, ast.Subscript) else
               sub.args[0] if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
               and sub.func.attr == "get" and sub.args else None)
        if isinstance(key, ast.Constant) and key.value in PROSE:
            return True
    return False


def _prose_parses(tree) -> list:
    """(line, source) of each string test on prose: a string method or a
    regular expression called on it, or `in` over it, including names bound
    by iterating over prose."""
    bound = set()
    for node in ast.walk(tree):
        loops = ([(g.target, g.iter) for g in node.generators]
                 if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp))
                 else [(node.target, node.iter)] if isinstance(node, ast.For) else [])
        for target, it in loops:
            if _mentions_prose(it, set()) and isinstance(target, ast.Name):
                bound.add(target.id)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in STRING_TESTS and (
                    _mentions_prose(node.func.value, bound)
                    or any(_mentions_prose(a, bound) for a in node.args[1:2])):
                found.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn))
                                                 for op in node.ops):
            left_is_text = isinstance(node.left, ast.Constant) and isinstance(
                node.left.value, str)
            if left_is_text and any(_mentions_prose(c, bound) for c in node.comparators):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_planner_and_the_pass_never_parse_their_own_prose():
    """Decisions, fits and plans carry codes and fields; their prose is for
    the report. A stage that tests the text of a note or reason breaks when
    the wording changes, so none does."""
    offenders = []
    roots = [os.path.join(SNTF, d) for d in ("planner", "rewrite", "analysis", "graph")]
    files = [f for r in roots for f in _python_files(r)]
    files += [os.path.join(SNTF, "passes.py"), os.path.join(SNTF, "runtime", "plugin.py")]
    for path in files:
        with open(path) as f:
            tree = ast.parse(f.read())
        offenders += [(os.path.relpath(path, REPO), *hit) for hit in _prose_parses(tree)]
    assert not offenders, offenders


def test_the_prose_check_sees_string_tests_on_notes():
    """The check above finds the forms it forbids."""
    caught = _prose_parses(ast.parse(
        'why = "; ".join(n for n in plan.notes if not n.startswith("recompute ("))\n'
        'ok = "fits" in outcome.reason\n'
        'm = re.match(r"x", report.warning)\n'
        'held = report["reason"].startswith("held")\n'
        'ok = any("fits" in n for n in report.get("notes") or ())\n'))
    assert sorted(line for line, _ in caught) == [1, 2, 3, 4, 5], caught
    assert not _prose_parses(ast.parse(
        'why = "; ".join(plan.notes)\nok = outcome.fit.code == "fits"\n'
        'name.startswith("sntf/")\n'))
