"""The dump tool as users get it: the `sntf-dump` command an install puts on
the PATH, tools/sntf_dump in a clone (built in place or installed from), and
matplotlib as the optional extra "plot". No TensorFlow is started here."""

import ast
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

SETUP = os.path.join(REPO, "setup.py")
LAUNCHER = os.path.join(REPO, "tools", "sntf_dump")
COMMAND = "sntf-dump"
TARGET = "sntf.tools.dump:main"

# Reports, from a fresh interpreter that sees only what is installed (no
# PYTHONPATH, not started in the clone), where its sntf is and what its
# metadata declares.
PROBE = textwrap.dedent("""
    import glob, importlib.metadata as md, importlib.util, json, os, sysconfig
    info = {"installed": False}
    try:
        dist = md.distribution("sntf")
    except md.PackageNotFoundError:
        dist = None
    spec = importlib.util.find_spec("sntf")
    if dist is not None and spec is not None:
        package = list(spec.submodule_search_locations)[0]
        commands = {ep.name: ep.value for ep in dist.entry_points
                    if ep.group == "console_scripts"}
        loaded = {ep.name: callable(ep.load()) for ep in dist.entry_points
                  if ep.group == "console_scripts"}
        info = {"installed": True, "package": package,
                "libraries": sorted(glob.glob(os.path.join(package, "_sntf_ops*.so"))),
                "commands": commands, "callable": loaded,
                "scripts": sysconfig.get_path("scripts")}
    print(json.dumps(info))
""")


def _installed_env() -> dict:
    """The environment of a user's shell: no PYTHONPATH to the clone, no
    SNTF_* switch."""
    env = dict(os.environ)
    for name in ("PYTHONPATH", "SNTF_POLICY", "SNTF_BUDGET"):
        env.pop(name, None)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _run(args: list, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=120, env=_installed_env(), cwd=cwd)


def _describe(run: subprocess.CompletedProcess) -> str:
    return (f"rc={run.returncode}\nstdout:\n{run.stdout[-2000:]}\n"
            f"stderr:\n{run.stderr[-2000:]}")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """What the probe says about the sntf installed in this interpreter."""
    run = _run(["-c", PROBE], cwd=str(tmp_path_factory.mktemp("probe")))
    assert run.returncode == 0, _describe(run)
    return json.loads(run.stdout.strip().splitlines()[-1])


def _built_installed(installed: dict) -> dict:
    """Skips unless this interpreter has an sntf installed, built and at
    least as new as setup.py (bootstrap.sh rebuilds when setup.py is newer)."""
    if not installed["installed"]:
        pytest.skip("sntf is not installed in this interpreter")
    if not installed["libraries"]:
        pytest.skip(f"the installed sntf ({installed['package']}) is not built")
    if os.path.getmtime(SETUP) > os.path.getmtime(installed["libraries"][0]):
        pytest.skip("sntf was installed before setup.py last changed: re-run "
                    "bash tools/bootstrap.sh")
    return installed


def _setup_keyword(name: str):
    """The literal value setup.py passes as setup(name=...), with the
    module-level constants it names put in."""
    tree = ast.parse(open(SETUP, encoding="utf-8").read(), filename=SETUP)
    constants = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            constants[node.targets[0].id] = node.value

    class PutConstants(ast.NodeTransformer):
        def visit_Name(self, node):
            return self.visit(constants[node.id]) if node.id in constants else node

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            for keyword in node.keywords:
                if keyword.arg == name:
                    return ast.literal_eval(PutConstants().visit(keyword.value))
    return None


def _requirement_names(path: str) -> list:
    names = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                names.append(line.split(";")[0].split("[")[0].split("<")[0]
                             .split(">")[0].split("=")[0].strip().lower())
    return names


@pytest.fixture(scope="module")
def dump():
    """sntf.tools.dump, imported here; it sets TF_* measurement variables at
    import, which the later tests' fresh processes must not inherit."""
    saved = dict(os.environ)
    try:
        module = importlib.import_module("sntf.tools.dump")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return module


# ---------------------------------------------------------------- setup.py
def test_setup_declares_the_command(dump):
    scripts = (_setup_keyword("entry_points") or {}).get("console_scripts", [])
    declared = {s.split("=", 1)[0].strip(): s.split("=", 1)[1].strip() for s in scripts}
    assert declared.get(COMMAND) == TARGET, scripts
    module, attr = TARGET.split(":")
    assert module == dump.__name__ and callable(getattr(dump, attr))


def test_matplotlib_is_the_optional_extra_plot():
    extras = _setup_keyword("extras_require") or {}
    assert [r.lower() for r in extras.get("plot", [])] == ["matplotlib"], extras
    assert "matplotlib" not in [str(r).lower() for r in _setup_keyword("install_requires")]
    assert "matplotlib" not in _requirement_names(os.path.join(REPO, "requirements.txt"))
    assert "matplotlib" in _requirement_names(os.path.join(REPO, "requirements-test.txt"))


def test_installed_sntf_has_the_command(installed):
    info = _built_installed(installed)
    assert info["commands"].get(COMMAND) == TARGET, info
    assert info["callable"][COMMAND], info
    script = os.path.join(info["scripts"], COMMAND)
    assert os.access(script, os.X_OK), f"no executable {script}"
    run = subprocess.run([script, "--help"], capture_output=True, text=True,
                         timeout=120, env=_installed_env(), cwd=info["scripts"])
    assert run.returncode == 0, _describe(run)
    assert "--model" in run.stdout and COMMAND in run.stdout


# ---------------------------------------------------------------- main()
def test_main_help(dump, capsys):
    assert dump.main([COMMAND, "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--batch", "--policy", "--budget", "--out"):
        assert flag in out
    assert COMMAND in out and "tools/sntf_dump" in out


def _run_main_without_training(dump, monkeypatch, tmp_path) -> int:
    model = tmp_path / "m.py"
    model.write_text("def build_model():\n    pass\n")
    monkeypatch.setattr(dump, "run", lambda settings: 0)
    return dump.main([COMMAND, "--model", str(model), "--batch", "2",
                      "--out", str(tmp_path / "out")])


def test_without_matplotlib_says_how_to_get_the_picture(dump, monkeypatch, tmp_path,
                                                        capsys):
    # A None entry in sys.modules makes `import matplotlib` fail.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert dump.plot_library_missing()
    assert _run_main_without_training(dump, monkeypatch, tmp_path) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "matplotlib is not installed" in lines[0]
    assert "timeline.png" in lines[0]
    assert "pip install 'sntf[plot]'" in lines[0] and "'.[plot]'" in lines[0]


def test_with_matplotlib_says_nothing(dump, monkeypatch, tmp_path, capsys):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed")
    assert not dump.plot_library_missing()
    assert _run_main_without_training(dump, monkeypatch, tmp_path) == 0
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- tools/sntf_dump
def _fake_clone(root) -> str:
    """A clone whose sntf/ is unbuilt source: its dump tool only says so."""
    (root / "tools").mkdir(parents=True)
    shutil.copy2(LAUNCHER, root / "tools" / "sntf_dump")
    tools = root / "sntf" / "tools"
    tools.mkdir(parents=True)
    (root / "sntf" / "__init__.py").write_text("")
    (tools / "__init__.py").write_text("")
    (tools / "dump.py").write_text(
        "def main():\n    print('THE CLONE SOURCE TREE')\n    return 0\n")
    return str(root / "tools" / "sntf_dump")


def test_launcher_help_without_pythonpath(tmp_path):
    run = _run([LAUNCHER, "--help"], cwd=str(tmp_path))
    assert run.returncode == 0, _describe(run)
    assert "--model" in run.stdout


def test_launcher_prefers_the_installed_sntf_to_an_unbuilt_clone(installed, tmp_path):
    # A `pip install .` from a clone leaves the clone's sntf/ without its
    # compiled libraries: the launcher must run the installed package.
    _built_installed(installed)
    launcher = _fake_clone(tmp_path / "clone")
    run = _run([launcher, "--help"], cwd=str(tmp_path))
    assert run.returncode == 0, _describe(run)
    assert "THE CLONE SOURCE TREE" not in run.stdout
    assert "--model" in run.stdout


def test_launcher_uses_the_clone_when_nothing_is_installed(tmp_path):
    # -S: no site-packages, so no installed sntf; the clone's own tree runs.
    launcher = _fake_clone(tmp_path / "clone")
    run = _run(["-S", launcher, "--help"], cwd=str(tmp_path))
    assert run.returncode == 0, _describe(run)
    assert run.stdout.strip() == "THE CLONE SOURCE TREE"
