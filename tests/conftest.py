"""Shared fixtures: running code in a fresh Python process.

The Grappler plugin cannot be unregistered and the CPU allocator's peak
cannot be reset, so anything that enables sntf or measures memory runs in a
subprocess of its own.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
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


def pytest_configure(config):
    """Names the run before pytest-xdist starts its workers, so that the
    baselines they share can be removed when it ends."""
    if not hasattr(config, "workerinput") and hasattr(config.option, "testrunuid"):
        import uuid

        config.option.testrunuid = config.option.testrunuid or uuid.uuid4().hex


def pytest_unconfigure(config):
    run = getattr(config.option, "testrunuid", None)
    if run and not hasattr(config, "workerinput"):
        shutil.rmtree(os.path.join(tempfile.gettempdir(), f"sntf-baselines-{run}"),
                      ignore_errors=True)


@pytest.fixture
def fresh_python():
    return run_python


def train_worker(fresh_python, out, *args, steps=3, batch=8, env=None):
    """Runs sntf/testing/workers/train_keras.py (args: --family F or --model M, and
    flags) in a fresh process, with `env` on top of the suite's; returns (its
    RESULT dict, {weight: array}).

    A run without sntf (no --sntf flag, no env) is a baseline several tests
    share: the first to need it trains it, the others read its result from
    the suite's baseline folder. Baselines repeat bit for bit across
    processes (docs/tensorflow.md), so reading one is as good as training
    it again, and the suite saves about twenty fresh processes."""
    import numpy as np

    command = [os.path.join(WORKERS, "train_keras.py"), *args, "--batch", str(batch),
               "--steps", str(steps)]
    cached = _baseline_path(command) if env is None and "--sntf" not in args else None
    if cached is not None and os.path.exists(cached + ".npz"):
        with open(cached + ".json") as f:
            result = json.load(f)
        shutil.copyfile(cached + ".npz", str(out))
    else:
        result = fresh_python(args=command + ["--out", str(out)], env=env).result()
        if cached is not None:
            _store_baseline(cached, result, str(out))
    with np.load(out) as data:
        return result, {k: data[k].copy() for k in data.files}


def _baseline_path(command: list):
    """Where this test run keeps a baseline's result, or None outside a
    pytest-xdist run (the folder is per run: PYTEST_XDIST_TESTRUNUID)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return None
    folder = os.path.join(tempfile.gettempdir(), f"sntf-baselines-{run}")
    os.makedirs(folder, exist_ok=True)
    settings = sorted((k, v) for k, v in _env().items() if k.startswith(("TF_", "SNTF_")))
    key = hashlib.sha256(json.dumps([command[1:], settings]).encode()).hexdigest()[:24]
    return os.path.join(folder, key)


def _store_baseline(path: str, result: dict, npz: str) -> None:
    """Writes a baseline's files, each to a temporary file of this process's
    own and then by rename, the weights last: a reader that sees the
    weights sees complete files, and two workers that trained the same
    baseline at once each write whole files."""
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path + ".json")
    fd, tmp = tempfile.mkstemp(dir=folder)
    os.close(fd)
    shutil.copyfile(npz, tmp)
    os.replace(tmp, path + ".npz")


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
