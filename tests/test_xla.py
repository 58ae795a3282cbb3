"""Keras' jit_compile="auto" must not bypass sntf (docs/tensorflow.md, "Keras"), tested on
CPU by making Keras believe an accelerator is present (fresh processes)."""

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
x, y = models.make_data("vgg", 16)
models_built[0].fit(x, y, batch_size=8, verbose=0)
reports = []
if policy != "none":
    reports = [{"action": r["action"], "reason": r["reason"]}
               for r in sntf.reports() if r["training"] or "XLA" in r["reason"]]
print("RESULT " + json.dumps({"jit": [bool(m.jit_compile) for m in models_built],
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
    assert r["jit"] == [True, True] and r["warnings"] == []
    # The XLA-compiled step is one cluster: Grappler's plugins never see its
    # training graph, so no report of one exists at all.
    assert r["reports"] == [], r["reports"]
