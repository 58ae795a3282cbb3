"""Shared fixtures: running code in a fresh Python process.

The Grappler plugin cannot be unregistered and the CPU allocator's peak
cannot be reset, so anything that enables sntf or measures memory runs in a
subprocess of its own.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "workers")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: heavier end-to-end cases (run by .ci/run; deselect "
        "with -m 'not slow')")


def _env(extra=None):
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.pop("SNTF_POLICY", None)
    env.pop("SNTF_BUDGET", None)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    if extra:
        env.update(extra)
    return env


class Completed:
    """Result of a fresh-process run."""

    def __init__(self, proc):
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr

    def result(self):
        """The JSON object printed on the last line starting with 'RESULT '."""
        for line in reversed(self.stdout.splitlines()):
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise AssertionError(f"no RESULT line; rc={self.returncode}\n"
                             f"stdout:\n{self.stdout[-3000:]}\n"
                             f"stderr:\n{self.stderr[-3000:]}")


def run_python(code=None, args=None, env=None, timeout=600, cwd=None):
    """Runs a code snippet (or a script with args) in a fresh interpreter."""
    if code is not None:
        command = [sys.executable, "-c", textwrap.dedent(code)]
    else:
        command = [sys.executable] + list(args)
    proc = subprocess.run(command, capture_output=True, text=True,
                          timeout=timeout, env=_env(env), cwd=cwd or REPO)
    return Completed(proc)


@pytest.fixture
def fresh_python():
    return run_python


def train_worker(fresh_python, out, *args, steps=3, batch=8):
    """Runs tests/workers/train_keras.py (args: --family F or --model M, and
    flags) in a fresh process; returns (its RESULT dict, {weight: array})."""
    import numpy as np

    run = fresh_python(args=[os.path.join(WORKERS, "train_keras.py"), *args,
                             "--batch", str(batch), "--steps", str(steps),
                             "--out", str(out)])
    result = run.result()
    with np.load(out) as data:
        return result, {k: data[k].copy() for k in data.files}


def train_family(fresh_python, out, family, *flags, steps=3, batch=8):
    """train_worker for a family of sntf.models."""
    return train_worker(fresh_python, out, "--family", family, *flags,
                        steps=steps, batch=batch)
