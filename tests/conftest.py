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
WORKERS = os.path.join(REPO, "sntf", "testing", "workers")
# TensorFlow's own CPU kernels, for a test that needs a small model's graph
# rewritten: oneDNN's convolutions take no im2col scratch from TensorFlow's
# allocator, and that scratch is what a plan lowers there. The BFC allocator
# keeps the peak the workers read.
TF_KERNELS_ENV = {"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPU_ALLOCATOR_USE_BFC": "true"}


def _env(extra=None):
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # TensorFlow turns its oneDNN rewrites (and the oneDNN CPU allocator,
    # which keeps the statistics get_memory_info reads) on by default only
    # on CPUs with AVX-512 VNNI, BF16 or AMX. Fresh processes run with them
    # on, as on those machines, so that a test means the same on every
    # machine; a test that needs them off says so.
    env.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
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

    def result(self, returncode: int = 0):
        """The JSON object printed on the last line starting with 'RESULT ',
        from a child that exited with `returncode` (None: any)."""
        found = None
        for line in reversed(self.stdout.splitlines()):
            if line.startswith("RESULT "):
                found = json.loads(line[len("RESULT "):])
                break
        if found is None or (returncode is not None and self.returncode != returncode):
            raise AssertionError(
                f"{'no RESULT line' if found is None else 'unexpected exit status'}; "
                f"rc={self.returncode} (expected {returncode})\n"
                f"stdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-3000:]}")
        return found


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


def train_worker(fresh_python, out, *args, steps=3, batch=8, env=None):
    """Runs sntf/testing/workers/train_keras.py (args: --family F or --model M, and
    flags) in a fresh process, with `env` on top of the suite's; returns (its
    RESULT dict, {weight: array})."""
    import numpy as np

    run = fresh_python(args=[os.path.join(WORKERS, "train_keras.py"), *args,
                             "--batch", str(batch), "--steps", str(steps),
                             "--out", str(out)], env=env)
    result = run.result()
    with np.load(out) as data:
        return result, {k: data[k].copy() for k in data.files}


def train_family(fresh_python, out, family, *flags, steps=3, batch=8, env=None):
    """train_worker for a family of sntf.models."""
    return train_worker(fresh_python, out, "--family", family, *flags,
                        steps=steps, batch=batch, env=env)


def assert_identical(base, run, what="") -> None:
    """A run trained exactly as its baseline did: the same losses, the same
    weights byte for byte (names, dtypes, bytes), and no error report.

    Args:
      base, run: (RESULT dict with "losses" and optionally "reports",
        {weight name: numpy array}) of the baseline and of the run.
      what: a label for the failure message.
    """
    (rb, wb), (r, w) = base, run
    assert rb["losses"] and len(set(rb["losses"])) > 1 or len(rb["losses"]) == 1, (
        "the baseline did not train", rb["losses"])
    assert r["losses"] == rb["losses"], (what, rb["losses"], r["losses"])
    assert wb and sorted(w) == sorted(wb), (what, sorted(wb), sorted(w))
    for k in wb:
        assert w[k].dtype == wb[k].dtype, (what, k)
        assert w[k].tobytes() == wb[k].tobytes(), (what, k)
    errors = [rep for rep in (r.get("reports") or []) if rep.get("action") == "error"]
    assert not errors, (what, errors)
