"""XLA and sntf: Keras' jit_compile="auto" must not bypass sntf
(docs/tensorflow.md, "Keras"), tested on CPU by making Keras believe an
accelerator is present; and under XLA auto-clustering the pass leaves
graphs alone, so training stays identical (fresh processes)."""

import pytest

SCRIPT = """
import json, logging, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf

real = tf.config.list_physical_devices

class FakeGpu:
    name = "/physical_device:GPU:0"
    device_type = "GPU"

# Keras asks for all physical devices to decide jit_compile="auto".
tf.config.list_physical_devices = lambda *a: real(*a) + ([FakeGpu()] if not a else [])
import keras

policy, jit = sys.argv[1], sys.argv[2]
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("sntf").addHandler(handler)
if policy != "none":
    import sntf
    sntf.enable(policy=policy, batch_size=8)
from sntf import models

jit = {"auto": "auto", "true": True}[jit]
models_built = [models.build("vgg", jit_compile=jit) for _ in range(2)]
# Keras resolves jit_compile="auto" when the model is compiled; only a run
# with sntf on trains, for the reports (an XLA-compiled fit takes a minute).
if policy not in ("none", "off"):
    x, y = models.make_data("vgg", 16)
    models_built[0].fit(x, y, batch_size=8, verbose=0)
reports = []
if policy != "none":
    reports = [{"action": r["action"], "reason": r["reason"]}
               for r in sntf.reports() if r["training"] or "XLA" in r["reason"]]
print("RESULT " + json.dumps({"jit": [m.jit_compile for m in models_built],
      "warnings": [m for m in records if "jit_compile" in m], "reports": reports}))
"""


def _run(fresh_python, policy, jit="auto"):
    return fresh_python(args=["-c", SCRIPT, policy, jit]).result()


@pytest.mark.slow
def test_auto_jit_resolves_false_while_sntf_rewrites(fresh_python):
    # Keras alone XLA-compiles the step when it sees an accelerator.
    assert _run(fresh_python, "none")["jit"] == [True, True]
    r = _run(fresh_python, "recompute")
    assert r["jit"] == [False, False]
    assert len(r["warnings"]) == 1 and "sntf.disable()" in r["warnings"][0]
    assert any(rep["action"] == "rewritten" for rep in r["reports"]), r["reports"]
    # Policy "off" changes nothing, XLA included.
    assert _run(fresh_python, "off")["jit"] == [True, True]


@pytest.mark.slow
def test_explicit_jit_is_honoured_and_not_rewritten(fresh_python):
    r = _run(fresh_python, "recompute", "true")
    # Honoured: no "resolved to False"; the one warning says sntf cannot see it.
    assert r["jit"] == [True, True] and len(r["warnings"]) == 1, r["warnings"]
    assert "is compiled with jit_compile=True" in r["warnings"][0]
    # The XLA-compiled step is one cluster: Grappler's plugins never see its
    # training graph, so no report of one exists at all.
    assert r["reports"] == [], r["reports"]


@pytest.mark.parametrize("flags, on", [
    ("", False), ("--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit", True),
    ("--tf_xla_auto_jit=1", True), ("--tf_xla_auto_jit=0", False),
    ("--tf_xla_auto_jit=-1", False), ("--tf_xla_cpu_global_jit", False)])
def test_auto_clustering_is_read_from_the_xla_flags(flags, on):
    from sntf.runtime import xla

    assert xla.auto_clustering_on({"TF_XLA_FLAGS": flags}) is on


def test_the_pass_leaves_a_graph_alone_under_auto_clustering():
    import graphs
    from sntf import config, passes

    state = config.State(enabled=True, policy="swap+recompute")
    data = graphs.train_mlp().SerializeToString()
    env = passes.Environment(xla_auto_jit=True)
    result = passes.run_pass(data, ["identity_retval"], [], state, env=env)
    assert result.graph_def is None and result.report["training"]
    assert result.report["action"] == "skipped"
    assert result.report["reason"] == passes.XLA_AUTO_JIT


AUTO_JIT = """
import json, os, sys
os.environ["TF_XLA_FLAGS"] = "--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit"
import numpy as np
import tensorflow as tf
import keras
if sys.argv[1] == "sntf":
    import sntf
    sntf.enable()
from sntf import models
tf.config.experimental.enable_op_determinism()
keras.utils.set_random_seed(5)
model = models.build("vgg", 1, jit_compile=False)
x, y = models.make_data("vgg", 24)
history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
reports = []
if sys.argv[1] == "sntf":
    reports = [[r["action"], r["reason"]] for r in sntf.reports() if r["training"]]
print("RESULT " + json.dumps({"loss": history.history["loss"],
      "weights": [np.asarray(w).tobytes().hex() for w in model.get_weights()],
      "reports": reports}))
"""


@pytest.mark.slow
def test_auto_clustered_training_is_identical_and_left_alone(fresh_python):
    base = fresh_python(args=["-c", AUTO_JIT, "none"]).result()
    run = fresh_python(args=["-c", AUTO_JIT, "sntf"]).result()
    assert run["loss"] == base["loss"] and run["weights"] == base["weights"]
    assert run["reports"] and all(action == "skipped" and "auto-clustering" in reason
                                  for action, reason in run["reports"]), run["reports"]
