"""sntf's startup hook: switches sntf on in a Python process started with
SNTF_POLICY or SNTF_BUDGET set, with no change to the script.

Installing sntf puts a one-line `sntf-startup.pth` in site-packages (the
mechanism coverage.py uses to measure subprocesses). Python runs that line
at every start; it imports this module only when SNTF_POLICY or SNTF_BUDGET
is set. Importing sntf then reads them (sntf/__init__.py) and sets the
switch; the op library and the graph plugin load right after the script
imports TensorFlow, so the script's own TF_* settings still apply.

A malformed value must not stop Python from starting (pip, tools and every
other program of the environment start here too): it is reported on one
line, and `import sntf` in the script raises the same ValueError again.
"""

import sys

ENV_VARIABLES = ("SNTF_POLICY", "SNTF_BUDGET")
PTH_NAME = "sntf-startup.pth"
# Runs at every interpreter start: cheap when no variable is set, and
# harmless when this module has been removed.
PTH_LINE = ("import os, importlib.util; "
            "any(os.environ.get(v, '').strip() for v in ('SNTF_POLICY', 'SNTF_BUDGET')) "
            "and importlib.util.find_spec('sntf_startup') is not None "
            "and __import__('sntf_startup').start()\n")


_started = []


def start() -> None:
    """Imports sntf, which enables itself from the environment; reports a
    failure on one line instead of raising. Runs once per process: some
    Python builds process a venv's site-packages, and so its .pth files,
    twice."""
    if _started:
        return
    _started.append(True)
    try:
        import sntf  # noqa: F401
    except Exception as e:  # noqa: BLE001 - Python must start regardless
        sys.stderr.write(f"sntf: not enabled in this process: {type(e).__name__}: "
                         f"{e}\n")
