"""Hostile configuration (issue #7, part 5), each in a fresh process.

Already covered elsewhere, and not repeated here:
  tests/test_config.py  malformed budgets/policies/options/environment values
                        parsed in-process (0, negative, NaN, 1e400, '150%',
                        unknown units, unknown policies, unknown options)
  tests/test_plugin.py  bad budgets and policies given to enable(); unknown
                        option (TypeError); SNTF_POLICY='fastest' and
                        SNTF_BUDGET='lots' at import; enable()/disable() from
                        four threads (policy "off"); a copy of the plugin
                        loaded after enable(), from TF_PLUGGABLE_DEVICE_LIBRARY_PATH
                        and from a tensorflow-plugins folder; a forked child;
                        a foreign plugin file detected (in-process)
  tests/test_host_pool.py  malformed SNTF_HOST_POOL_LIMIT (a warning)

Added here: budgets of 0 / negative / unparsable / beyond memory in the
environment at import; enable() budgets of 1 MiB (the smallest) and far
beyond memory while training; calls before any enable(); two threads enabling different
policies while a third trains; a copy of the plugin loaded before sntf is
imported or enabled; a real foreign CPU graph plugin auto-loaded by
TensorFlow; a host pool limit below a swapped tensor (a fallback and a
warning). Every case must end with a clear exception or warning and a
normal exit (never SIGABRT).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap

import pytest

from sntf.runtime import native as _native

# A small convolutional training step (relu, moments, a second conv): graphs
# that recompute and swap act on. Returns (losses, weights as hex).
TRAIN = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import tensorflow as tf

    def train(steps=3):
        tf.config.experimental.enable_op_determinism()
        k1 = tf.Variable(tf.random.stateless_normal([3, 3, 3, 8], seed=[1, 2]) * 0.3)
        k2 = tf.Variable(tf.random.stateless_normal([3, 3, 8, 8], seed=[3, 4]) * 0.3)
        w = tf.Variable(tf.random.stateless_normal([8, 4], seed=[5, 6]) * 0.3)
        x = tf.constant(np.linspace(-1, 1, 8 * 16 * 16 * 3,
                                    dtype=np.float32).reshape(8, 16, 16, 3))
        y = tf.constant(np.linspace(1, -1, 8 * 4, dtype=np.float32).reshape(8, 4))
        variables = [k1, k2, w]

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                h = tf.nn.relu(tf.nn.conv2d(x, k1, 1, "SAME"))
                mean, var = tf.nn.moments(h, [0, 1, 2])
                h = (h - mean) * tf.math.rsqrt(var + 1e-3)
                h = tf.nn.relu(tf.nn.conv2d(h, k2, 1, "SAME"))
                loss = tf.reduce_mean(tf.square(tf.reduce_mean(h, [1, 2]) @ w - y))
            for v, g in zip(variables, tape.gradient(loss, variables)):
                v.assign_sub(0.1 * g)
            return loss

        losses = [float(step()) for _ in range(steps)]
        return [losses, [v.numpy().tobytes().hex() for v in variables]]

    def training_reports(sntf):
        return [(r["action"], r["reason"]) for r in sntf.reports() if r["training"]]

    def swapped(sntf):
        return [t for r in sntf.reports() if r["training"] for t in r["swapped"] or ()]
    """)


def _script(body: str) -> str:
    return TRAIN + "\n" + textwrap.dedent(body)


def _exited_normally(run) -> None:
    """No signal (SIGABRT from a CHECK failure shows as a negative code)."""
    assert run.returncode in (0, 1), (run.returncode, run.stderr[-3000:])


@pytest.fixture(scope="module")
def baseline():
    from conftest import run_python

    return run_python(_script('print("RESULT " + json.dumps(train()))')).result()


@pytest.fixture(scope="module")
def baseline_without_onednn():
    from conftest import run_python

    return run_python(_script('print("RESULT " + json.dumps(train()))'),
                      env={"TF_ENABLE_ONEDNN_OPTS": "0"}).result()


# ------------------------------------------------------ environment at import


@pytest.mark.parametrize("variable, value, words", [
    ("SNTF_BUDGET", "0", "invalid budget '0'"),
    ("SNTF_BUDGET", "-5GB", "invalid budget"),
    ("SNTF_BUDGET", "0%", "(0, 100]"),
    ("SNTF_BUDGET", "NaN", "invalid budget"),
    ("SNTF_BUDGET", "1e400", "invalid budget"),
    ("SNTF_POLICY", "swap-recompute", "unknown policy"),
    ("SNTF_POLICY", "r\u00e9compute \U0001F680", "unknown policy"),
    ("SNTF_POLICY", "x" * 100_000, "unknown policy"),
])
def test_malformed_environment_fails_the_import_clearly(fresh_python, variable, value,
                                                        words):
    env = {variable: value}
    if variable == "SNTF_BUDGET":
        env["SNTF_POLICY"] = "off"
    run = fresh_python("import sntf", env=env)
    _exited_normally(run)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: ") and f"{variable}=" in last, last[:500]
    assert words in last, last[:500]


def test_budget_beyond_memory_in_environment_warns_and_works(fresh_python):
    run = fresh_python(_script("""
        import sntf
        losses, weights = train()
        print("RESULT " + json.dumps({"enabled": sntf.enabled(), "losses": losses}))
        """), env={"SNTF_POLICY": "off", "SNTF_BUDGET": "100TB"})
    _exited_normally(run)
    assert run.result()["enabled"] is True
    assert "exceeds device memory" in run.stderr and "can never bind" in run.stderr


# -------------------------------------------------------- enable() at run time


@pytest.mark.slow
def test_extreme_budgets_and_calls_before_enable(fresh_python, baseline):
    """The smallest (1 MiB) and beyond-memory budgets rewrite and train identically;
    disable/reports/stats before any enable() and a failed enable() leave
    sntf usable."""
    run = fresh_python(_script("""
        import logging
        import sntf
        early = {"reports": sntf.reports(), "enabled": sntf.enabled()}
        sntf.disable()
        try:
            sntf.enable(policy="swap+recompute", budget=-1)
        except ValueError as e:
            early["bad_budget"] = str(e)
        early["enabled_after_failure"] = sntf.enabled()
        runs = {}
        for budget in (2**20, 2**62):
            sntf.enable(policy="swap+recompute", budget=budget, swap_min_bytes=0)
            before = len(sntf.reports())
            runs[str(budget)] = {"result": train(),
                                 "reports": [(r["action"], r["reason"])
                                             for r in sntf.reports()[before:]
                                             if r["training"]]}
        print("RESULT " + json.dumps({"early": early, "runs": runs}))
        """))
    _exited_normally(run)
    result = run.result()
    early = result["early"]
    assert early["reports"] == [] and early["enabled"] is False
    assert "invalid budget -1" in early["bad_budget"]
    assert early["enabled_after_failure"] is False
    for budget, got in result["runs"].items():
        assert got["result"] == baseline, budget
        assert got["reports"] and all(a != "error" for a, _ in got["reports"]), got
        assert any(a == "rewritten" for a, _ in got["reports"]), (budget, got["reports"])
    assert "exceeds device memory" in run.stderr       # the 2**62 budget


@pytest.mark.slow
def test_two_threads_enabling_different_policies_while_training(fresh_python, baseline):
    run = fresh_python(_script("""
        import threading
        import sntf
        sntf.enable(policy="off")
        errors, stop = [], threading.Event()
        settings = [dict(policy="swap+recompute", swap_min_bytes=0),
                    dict(policy="recompute", recompute_mode="memory", budget="1MiB"),
                    dict(policy="swap", swap_min_bytes=0, budget=0.5),
                    dict(policy="off", identity_rewrite=True)]
        def flip(offset):
            i = offset
            try:
                while not stop.is_set():
                    sntf.enable(**settings[i % len(settings)])
                    i += 1
                    if i % 7 == 0:
                        sntf.disable()
            except Exception as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=flip, args=(k,)) for k in (0, 2)]
        [t.start() for t in threads]
        try:
            results = [train() for _ in range(4)]
        finally:
            stop.set()
            [t.join() for t in threads]
        print("RESULT " + json.dumps({"errors": errors, "results": results,
              "actions": sorted({r["action"] for r in sntf.reports()})}))
        """))
    _exited_normally(run)
    result = run.result()
    assert result["errors"] == []
    # Whatever policy each graph met, the results are TensorFlow's.
    assert all(r == baseline for r in result["results"])
    assert "error" not in result["actions"], result["actions"]


# ------------------------------------------------- plugin libraries and paths


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before import sntf", "before enable"])
def test_plugin_copy_loaded_from_another_path_is_adopted(fresh_python, tmp_path,
                                                         baseline, when):
    copy = tmp_path / "copy_of_sntf_plugin.so"
    shutil.copy(_native.plugin_library_path(), copy)
    load = f"load_library.load_pluggable_device_library({str(copy)!r})"
    run = fresh_python(_script(f"""
        from tensorflow.python.framework import load_library
        {load if when == "before import sntf" else ""}
        import sntf
        from sntf.runtime import plugin
        {load if when == "before enable" else ""}
        before = plugin.registered_path()
        sntf.enable(policy="swap+recompute", swap_min_bytes=0)
        print("RESULT " + json.dumps({{"before": before, "result": train(),
              "registered": sntf.stats()["plugin"]["registered"],
              "reports": training_reports(sntf)}}))
        """))
    _exited_normally(run)
    result = run.result()
    # The copy registered first; sntf uses it instead of registering its own
    # (a second CPU graph optimizer would abort TensorFlow).
    assert result["before"] == result["registered"] == str(copy)
    assert result["result"] == baseline
    assert any(a == "rewritten" for a, _ in result["reports"]), result["reports"]


VENDOR_PLUGIN = r"""
#include "tensorflow/c/experimental/grappler/grappler.h"
#include "tensorflow/c/tf_status.h"

static void optimize(void* optimizer, const TF_Buffer* graph,
                     const TF_GrapplerItem* item, TF_Buffer* out, TF_Status* status) {
  TF_SetStatus(status, TF_ABORTED, "vendor optimizer: nothing to do");
}

void TF_InitGraph(TP_OptimizerRegistrationParams* params, TF_Status* status) {
  params->major_version = GO_MAJOR;
  params->minor_version = GO_MINOR;
  params->patch_version = GO_PATCH;
  params->device_type = "CPU";
  params->optimizer_configs->struct_size = TP_OPTIMIZER_CONFIGS_STRUCT_SIZE;
  params->optimizer->struct_size = TP_OPTIMIZER_STRUCT_SIZE;
  params->optimizer->optimize_func = optimize;
  TF_SetStatus(status, TF_OK, "");
}
"""


@pytest.fixture(scope="module")
def vendor_site(tmp_path_factory):
    """A site-packages folder whose tensorflow-plugins holds a real foreign
    graph plugin: a no-op optimizer registered for the CPU device type."""
    import sysconfig

    tf_dir = os.path.join(sysconfig.get_paths()["purelib"], "tensorflow")
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None or not os.path.isdir(os.path.join(tf_dir, "include")):
        pytest.skip("no C compiler or TensorFlow headers")
    site = tmp_path_factory.mktemp("vendor") / "site-packages"
    folder = site / "tensorflow-plugins"
    folder.mkdir(parents=True)
    source = site.parent / "vendor.c"
    source.write_text(VENDOR_PLUGIN)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-w", f"-I{tf_dir}/include",
                    str(source), "-o", str(folder / "libvendor_graph.so"),
                    f"-L{tf_dir}", "-l:libtensorflow_framework.so.2",
                    f"-Wl,-rpath,{tf_dir}"], check=True, capture_output=True)
    return str(site)


@pytest.mark.slow
def test_foreign_cpu_graph_plugin_is_refused_without_abort(fresh_python, vendor_site,
                                                           baseline):
    env = {"PYTHONPATH": vendor_site}
    # The hazard is real: registering sntf's optimizer next to the vendor's
    # aborts TensorFlow (a CHECK failure, SIGABRT).
    direct = fresh_python(f"""
        import tensorflow as tf
        from tensorflow.python.framework import load_library
        load_library.load_pluggable_device_library({_native.plugin_library_path()!r})
        """, env=env)
    assert direct.returncode < 0, (direct.returncode, direct.stderr[-2000:])
    run = fresh_python(_script("""
        import sntf
        try:
            sntf.enable(policy="swap+recompute")
            error = None
        except RuntimeError as e:
            error = str(e)
        print("RESULT " + json.dumps({"error": error, "enabled": sntf.enabled(),
                                      "result": train()}))
        """), env=env)
    _exited_normally(run)
    result = run.result()
    assert result["error"] and "libvendor_graph.so" in result["error"]
    assert "another TensorFlow graph plugin" in result["error"]
    assert result["enabled"] is False
    assert result["result"] == baseline     # training goes on without sntf


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["swap", "auto"])
def test_host_pool_limit_below_a_swapped_tensor_falls_back_and_trains(
        fresh_python, baseline_without_onednn, policy):
    """A 4 KiB host pool cannot hold the 64 KiB activations the step swaps:
    the swapped tensors stay in ordinary memory, training goes on with the
    same results, and one warning names the pool, its limit and the way to
    raise it, through Python's logging even when TensorFlow's C++ log is
    silenced. "auto" under a budget swaps through the tensor cache ops,
    whose host copies fall back the same way."""
    # The step is small: its 200 KiB budget is below what enable() accepts,
    # so it goes into the switch state directly.
    budget = ("; from sntf import config; config.set_state(dataclasses.replace("
              "config.current(), budget=config.Budget(bytes=200 << 10)))"
              if policy == "auto" else "")
    run = fresh_python(_script(f"""
        import dataclasses
        import sntf
        sntf.enable(policy={policy!r}, swap_min_bytes=0, host_pool_limit=4096,
                    min_gain=0.0){budget}
        result = train()
        print("RESULT " + json.dumps({{"result": result, "swapped": swapped(sntf),
                                      "swap": sntf.stats()["swap"]}}))
        """), env={"TF_CPP_MIN_LOG_LEVEL": "3",    # TensorFlow's log silenced
                   # TensorFlow's own convolutions: their im2col scratch is what
                   # makes swapping this small step lower its peak (under oneDNN
                   # the plan would not fall, and nothing would be swapped).
                   "TF_ENABLE_ONEDNN_OPTS": "0"})
    _exited_normally(run)
    assert run.returncode == 0, run.stderr[-3000:]
    result = run.result()
    assert result["swapped"], result
    assert result["result"] == baseline_without_onednn
    swap = result["swap"]
    assert swap["pool_fallbacks"] > 0 and swap["failed_ops"] == 0, swap
    warnings = [line for line in run.stderr.splitlines()
                if "could not hold" in line]
    assert len(warnings) == 1, run.stderr[-3000:]
    assert warnings[0].startswith("the host pool (host pool limit 4096 bytes) could not "
                                  "hold "), warnings[0]
    assert "SNTF_HOST_POOL_LIMIT" in warnings[0] and "training goes on" in warnings[0]
