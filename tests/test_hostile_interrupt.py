"""Ctrl-C during the graph pass (issue #41, part 2), each in a fresh process.

The pass runs inside TensorFlow's Grappler callback, which no Python
exception may cross. A KeyboardInterrupt there used to be recorded as a
failed pass, and fit() ran on, unrewritten, out of the user's reach. Now the
graph goes back unchanged and the interrupt is raised again where fit()
runs: fit() ends with KeyboardInterrupt (or the process exits with the code
of a signal handler's sys.exit), and the process never aborts.
"""

from __future__ import annotations

import textwrap

import pytest

FIT = textwrap.dedent("""
    import json, os, signal, sys, time
    # Ctrl-C as in a terminal: a process started in the background (a CI
    # runner, a shell's `&`) inherits SIGINT ignored, and Python then raises
    # no KeyboardInterrupt for it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import numpy as np
    import tensorflow as tf
    import keras
    import sntf
    from sntf import passes

    sntf.enable("swap+recompute")
    how = sys.argv[1]
    original = passes.run_pass
    calls = []

    def interrupted(graph_bytes, fetch, preserve, state, *args, **kwargs):
        calls.append(1)
        if how == "raise":
            raise KeyboardInterrupt
        if how == "sigint":
            # A real Ctrl-C arriving while a slow pass plans a large graph.
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        if how == "exit":
            sys.exit(3)
        return original(graph_bytes, fetch, preserve, state, *args, **kwargs)

    passes.run_pass = interrupted
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = np.ones((64, 8), np.float32)
    y = np.ones((64, 1), np.float32)
    outcome = "finished"
    start = time.time()
    try:
        model.fit(x, y, epochs=50, batch_size=8, verbose=0)
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    print("RESULT " + json.dumps({
        "outcome": outcome, "calls": len(calls), "seconds": time.time() - start,
        "errors": [r["reason"] for r in sntf.reports() if r["action"] == "error"]}))
    """)


@pytest.mark.parametrize("how", ["raise", "sigint"])
def test_an_interrupted_pass_ends_fit(fresh_python, tmp_path, how):
    script = tmp_path / "fit.py"
    script.write_text(FIT)
    run = fresh_python(args=[str(script), how], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = run.result()
    assert result["calls"] >= 1, result
    assert result["outcome"] == "KeyboardInterrupt", result
    # Not a failure of the pass: nothing recorded as one.
    assert result["errors"] == [], result
    assert "KeyboardInterrupt while the graph pass ran: graph left unchanged" in run.stderr, run.stderr[-3000:]


def test_a_pass_calling_sys_exit_exits_with_its_code(fresh_python, tmp_path):
    """A signal handler's sys.exit(3) during the pass (a preemption handler)
    exits the process with status 3, as it would anywhere else in fit()."""
    script = tmp_path / "fit.py"
    script.write_text(FIT)
    run = fresh_python(args=[str(script), "exit"], timeout=300)
    assert run.returncode == 3, (run.returncode, run.stderr[-3000:])
    assert "RESULT" not in run.stdout, run.stdout[-3000:]
    assert "SystemExit while the graph pass ran: graph left unchanged" in run.stderr, run.stderr[-3000:]
