"""The plugin shim and the public switch, each scenario in a fresh process."""

import shutil

import pytest

import sntf
from sntf import config
from sntf.runtime import native as _native
from sntf.runtime import plugin

# A tiny training step used by the subprocess scenarios: returns the loss of
# a few SGD steps so that results can be compared with and without sntf.
TRAIN = """
import json, os, sys
import numpy as np
import tensorflow as tf

def train(steps=3):
    tf.config.experimental.enable_op_determinism()
    tf.random.set_seed(0)
    w = tf.Variable(tf.random.stateless_normal([8, 4], seed=[1, 2]))
    x = tf.constant(np.linspace(-1, 1, 32 * 8, dtype=np.float32).reshape(32, 8))
    y = tf.constant(np.linspace(1, -1, 32 * 4, dtype=np.float32).reshape(32, 4))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.nn.relu(x @ w) - y))
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss

    losses = [float(step()) for _ in range(steps)]
    return losses, w.numpy().tobytes().hex()
"""


def _script(body):
    return TRAIN + "\n" + body


# ---------------------------------------------------------------- user input


@pytest.mark.parametrize("budget", [0, -1, 1.5, "abc", "12XB", True, "-5GB", [1]])
def test_bad_budget_is_a_value_error_naming_it(budget):
    with pytest.raises(ValueError) as e:
        sntf.enable(policy="off", budget=budget)
    assert repr(budget) in str(e.value)
    assert "accepted forms" in str(e.value)


@pytest.mark.parametrize("policy", ["fast", "", None, 3, "swap-recompute"])
def test_bad_policy_is_a_value_error_listing_policies(policy):
    with pytest.raises(ValueError) as e:
        sntf.enable(policy=policy)
    assert "'swap+recompute'" in str(e.value) and "'off'" in str(e.value)


def test_every_policy_enables(fresh_python):
    # In a fresh process: enabling loads the plugin, which this process keeps.
    run = fresh_python("""
        import json, sntf
        from sntf import config
        states = []
        for policy in config.POLICIES:
            sntf.enable(policy=policy)
            states.append([sntf.enabled(), config.current().policy])
        sntf.disable()
        states.append([sntf.enabled(), config.current().policy])
        print("RESULT " + json.dumps(states))
    """)
    assert run.result() == [[True, p] for p in config.POLICIES] + [[False, "off"]]


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError) as e:
        sntf.enable(policy="off", budjet="1GB")
    assert "budjet" in str(e.value) and "identity_rewrite" in str(e.value)


def test_foreign_graph_plugin_is_detected_without_loading_it(tmp_path, monkeypatch):
    folder = tmp_path / "tensorflow-plugins"
    folder.mkdir()
    (folder / "libvendor.so").write_bytes(b"\x7fELF....TF_InitGraph....")
    shutil.copy(_native.plugin_library_path(), folder / "sntf_copy.so")
    monkeypatch.setattr(plugin, "_plugin_dirs", lambda: [str(folder)])
    assert plugin.foreign_graph_plugins() == [str(folder / "libvendor.so")]


# ------------------------------------------------------ fresh-process runs


def test_enable_twice_toggle_and_identical_training(fresh_python):
    baseline = fresh_python(_script("""
losses, w = train()
print("RESULT " + json.dumps({"losses": losses, "w": w}))
""")).result()
    run = fresh_python(_script("""
import sntf
sntf.enable(policy="off")
sntf.enable(policy="off")              # a second enable only flips the switch
sntf.disable(); sntf.enable(policy="off", identity_rewrite=True)
losses, w = train()
sntf.disable()
assert not sntf.enabled()
n = len(sntf.reports())
tf.function(lambda: tf.constant(1.0) * 2)()   # not handed to the pass now
stats = sntf.stats()
print("RESULT " + json.dumps({"losses": losses, "w": w,
      "reports": sntf.reports(), "after_disable": len(sntf.reports()) - n,
      "registered": stats["plugin"]["registered"]}))
""")).result()
    assert run["losses"] == baseline["losses"]
    assert run["w"] == baseline["w"]
    training = [r for r in run["reports"] if r["training"]]
    assert training, run["reports"]
    assert all(r["action"] == "rewritten" for r in training)
    assert run["after_disable"] == 0
    assert run["registered"].endswith(".so")
    keys = {"graph", "training", "nodes", "action", "reason", "predicted_peak_bytes",
            "planned_peak_bytes", "lower_bound_bytes", "pass_seconds", "swapped",
            "recomputed"}
    assert all(keys <= set(r) for r in run["reports"])


def test_environment_variables_enable_at_import(fresh_python):
    run = fresh_python(_script("""
import sntf
losses, w = train()
print("RESULT " + json.dumps({"enabled": sntf.enabled(),
      "training": [r["training"] for r in sntf.reports()]}))
"""), env={"SNTF_POLICY": "off", "SNTF_BUDGET": "512MiB"})
    r = run.result()
    assert r["enabled"] is True
    assert True in r["training"]


@pytest.mark.parametrize("variable,value", [("SNTF_POLICY", "fastest"),
                                            ("SNTF_BUDGET", "lots")])
def test_malformed_environment_is_a_value_error_naming_the_variable(
        fresh_python, variable, value):
    run = fresh_python("import sntf", env={variable: value})
    assert run.returncode == 1
    assert "ValueError" in run.stderr
    assert f"{variable}={value!r}" in run.stderr


def test_second_registration_from_another_path_stays_inactive(fresh_python, tmp_path):
    copy = tmp_path / "another_copy.so"
    shutil.copy(_native.plugin_library_path(), copy)
    run = fresh_python(_script(f"""
import sntf
from sntf.runtime import native as _native
from tensorflow.python.framework import load_library
sntf.enable(policy="off")
load_library.load_pluggable_device_library(_native.plugin_library_path())  # same path: no-op
load_library.load_pluggable_device_library({str(copy)!r})   # TensorFlow would abort on a 2nd CPU optimizer
load_library.load_pluggable_device_library({str(tmp_path)!r})  # the folder form, a third time
losses, w = train()
print("RESULT " + json.dumps({{"losses": losses,
      "invocations": [r["invocations"] for r in sntf.reports() if r["training"]]}}))
"""))
    r = run.result()
    assert len(r["losses"]) == 3
    assert r["invocations"] and max(r["invocations"]) <= 2  # one pass, not two
    # Each later load (same path, copy, folder) registers an inactive duplicate.
    assert run.stderr.count("stays inactive") == 3, run.stderr[-2000:]


def test_library_auto_loaded_through_environment_path(fresh_python):
    path = _native.plugin_library_path()
    run = fresh_python(_script("""
import tensorflow as tf              # loads the plugin from the variable below
import sntf
from sntf.runtime import plugin
before = plugin.registered_path()
sntf.enable(policy="off")
losses, w = train()
print("RESULT " + json.dumps({"before": before,
      "training": [r["training"] for r in sntf.reports()]}))
"""), env={"TF_PLUGGABLE_DEVICE_LIBRARY_PATH": path})
    r = run.result()
    assert r["before"] == path
    assert True in r["training"]


def test_library_auto_loaded_from_tensorflow_plugins_folder(fresh_python, tmp_path):
    site = tmp_path / "site-packages"
    folder = site / "tensorflow-plugins"
    folder.mkdir(parents=True)
    copy = folder / "libsntf_plugin.so"
    shutil.copy(_native.plugin_library_path(), copy)
    run = fresh_python(_script("""
import tensorflow as tf
import sntf
from sntf.runtime import plugin
before = plugin.registered_path()
sntf.enable(policy="off")
losses, w = train()
print("RESULT " + json.dumps({"before": before,
      "training": [r["training"] for r in sntf.reports()]}))
"""), env={"PYTHONPATH": str(site)})
    r = run.result()
    assert r["before"] == str(copy)
    assert True in r["training"]


def test_failure_inside_the_pass_leaves_graphs_unchanged_and_logs_once(fresh_python):
    baseline = fresh_python(_script("""
losses, w = train()
print("RESULT " + json.dumps({"losses": losses, "w": w}))
""")).result()
    run = fresh_python(_script("""
import sntf
from sntf import graph
def broken(*args, **kwargs):
    raise RuntimeError("injected failure")
graph.detect_training = broken
sntf.enable(policy="off", identity_rewrite=True)
losses, w = train()
@tf.function
def other():
    return tf.reduce_sum(tf.ones([3]))
other()
print("RESULT " + json.dumps({"losses": losses, "w": w, "reports": sntf.reports()}))
"""))
    r = run.result()
    assert r["losses"] == baseline["losses"] and r["w"] == baseline["w"]
    errors = [x for x in r["reports"] if x["action"] == "error"]
    assert len(errors) >= 2
    assert all("injected failure" in x["reason"] for x in errors)
    assert all(x["error"] and "Traceback" in x["error"] for x in errors)
    assert run.stderr.count("injected failure") == 1, run.stderr[-2000:]


def test_failure_of_the_entry_point_itself_is_contained(fresh_python):
    baseline = fresh_python(_script("""
losses, w = train()
print("RESULT " + json.dumps({"losses": losses, "w": w}))
""")).result()
    run = fresh_python(_script("""
import sntf
from sntf.runtime import plugin
sntf.enable(policy="off")
def broken(*args):
    raise RuntimeError("entry point failure")   # (a KeyboardInterrupt is passed on: test_hostile_interrupt.py)
plugin._optimize = broken          # the shim calls whatever is found here
losses, w = train()
print("RESULT " + json.dumps({"losses": losses, "w": w,
      "plugin": sntf.stats()["plugin"]}))
"""))
    r = run.result()
    assert r["losses"] == baseline["losses"] and r["w"] == baseline["w"]
    assert r["plugin"]["native_errors"] >= 1
    assert "entry point failure" in r["plugin"]["last_native_error"]
    assert run.stderr.count("sntf: graph pass failed") == 1


def test_static_output_properties_reach_the_pass(fresh_python):
    run = fresh_python(_script("""
import sntf
from sntf import passes
from tensorflow.core.grappler.costs import op_performance_data_pb2 as perf
seen = {}
original = passes.run_pass
def spy(graph_bytes, fetch, preserve, state, properties=None, in_use=None,
        **kwargs):
    from tensorflow.core.framework import graph_pb2
    g = graph_pb2.GraphDef.FromString(graph_bytes)
    names = [n.name for n in g.node if n.op in ("MatMul", "_FusedMatMul", "Relu")]
    if names and properties is not None:
        props = properties(names)
        for name, outputs in props.items():
            p = perf.OpInfo.TensorProperties.FromString(outputs[0])
            seen[name] = [d.size for d in p.shape.dim]
        seen["_fetch"] = list(fetch)
    spy.late = properties
    return original(graph_bytes, fetch, preserve, state, properties, in_use,
                    **kwargs)
passes.run_pass = spy
sntf.enable(policy="off")
losses, w = train()
try:
    spy.late(["x"])
    late = "no error"
except RuntimeError as e:
    late = str(e)
print("RESULT " + json.dumps({"seen": seen, "late": late}))
"""))
    r = run.result()
    shapes = [v for k, v in r["seen"].items() if not k.startswith("_")]
    assert [32, 4] in shapes, r["seen"]
    assert "only valid during the Grappler callback" in r["late"]


def test_enable_from_two_threads_at_once(fresh_python):
    run = fresh_python(_script("""
import threading
import sntf
errors = []
def worker():
    try:
        for _ in range(20):
            sntf.enable(policy="off")
            sntf.disable()
        sntf.enable(policy="off")
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=worker) for _ in range(4)]
[t.start() for t in threads]; [t.join() for t in threads]
losses, w = train()
print("RESULT " + json.dumps({"errors": errors, "enabled": sntf.enabled(),
      "training": [r["training"] for r in sntf.reports()]}))
"""))
    r = run.result()
    assert r["errors"] == [] and r["enabled"] is True
    assert True in r["training"]


def test_forked_child_is_registered_and_enable_does_not_abort(fresh_python, tmp_path):
    site = tmp_path / "site-packages"
    folder = site / "tensorflow-plugins"
    folder.mkdir(parents=True)
    shutil.copy(_native.plugin_library_path(), folder / "libsntf_plugin.so")
    run = fresh_python(_script("""
import os
import sntf
from sntf.runtime import plugin
pid = os.fork()
if pid == 0:
    # The child inherits TensorFlow's optimizer registry: loading sntf's own
    # copy here would register a second CPU optimizer and abort.
    try:
        sntf.enable(policy="off")
        losses, w = train()
        ok = plugin.registered_path().endswith("libsntf_plugin.so") and len(losses) == 3
    except BaseException as e:
        ok = False
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("RESULT " + json.dumps({"child_status": status}))
"""), env={"PYTHONPATH": str(site)})
    assert run.result()["child_status"] == 0, run.stderr[-2000:]


def test_budget_without_policy_means_auto(fresh_python):
    run = fresh_python("""
        import json, sntf
        from sntf import config
        state = config.current()
        print("RESULT " + json.dumps([state.enabled, state.policy, state.budget.bytes]))
    """, env={"SNTF_BUDGET": "1GB"})
    assert run.result() == [True, "auto", 10**9], run.stderr[-2000:]


def test_clear_reports_starts_every_thread_afresh():
    from sntf import passes

    plugin.clear_reports()
    first = passes.new_report("g")
    plugin._record(first, b"key", 10)
    plugin.clear_reports()
    again = passes.new_report("g")
    plugin._record(again, b"key", 10)     # same graph key, but a new generation
    assert plugin.reports() == [again]
    assert again["invocations"] == 1
    plugin._record(passes.new_report("g"), b"key", 10)   # second iteration
    assert len(plugin.reports()) == 1 and plugin.reports()[0]["invocations"] == 2
    plugin.clear_reports()
