"""Gradient accumulation is training (issue #41, part 1).

A micro-step that adds its gradients into accumulator variables writes no
weight: training detection must see it as a training step whatever writes
the gradient (AssignAddVariableOp, AssignVariableOp, ResourceScatterAdd, an
optimizer's apply op, with Identity ops in between or not), and sntf must
rewrite it with results identical to TensorFlow alone.

Hand-built graphs (tests/graphs.py, gradient_write_step) are checked
in-process; random steps (sntf.testing.fuzz_cases, each writer) and the
issue's Keras micro-step run in fresh processes.
"""

from __future__ import annotations

import json
import textwrap

import pytest

import graphs
from sntf import graph

MARKED = [m for m in graphs.GRADIENT_MARKERS if m != "none"]


def _index(graph_def):
    return graph.build_index(graph_def)


@pytest.mark.parametrize("identity", [False, True])
@pytest.mark.parametrize("writer", graphs.GRADIENT_WRITERS)
@pytest.mark.parametrize("marker", MARKED)
def test_gradients_written_into_other_variables_are_training(marker, writer, identity):
    graph_def, grads = graphs.gradient_write_step(writer, marker, identity)
    g = _index(graph_def)
    info = graph.detect_training(g)
    assert info.training is True, info
    weight, gradient = grads[0]
    assert info.trained_variables == (weight,)
    assert info.gradient_ops == (gradient,)
    assert info.updated_variables == len(grads)
    assert info.reason.startswith(f"variable {weight!r} has a weight gradient "
                                  f"({gradient!r}) written into variable "
                                  f"'{graphs.ACC_PREFIX}0'"), info.reason
    # The planner sees a forward and a backward pass, as in the same step
    # applying SGD to its weights.
    phases = dict(zip(g.names, graph.classify_phases(g)))
    assert phases[gradient] == graph.BACKWARD
    assert phases[graphs.X] == graph.FORWARD
    assert graph.weight_consumers(g)


@pytest.mark.parametrize("marker", MARKED)
def test_accumulation_is_labelled_as_the_same_step_applying_sgd(marker):
    """Phases of an accumulation step equal those of the step that writes
    each gradient into its own weight (the step sntf already rewrote)."""
    graph_def, grads = graphs.gradient_write_step("assign_add", marker)
    accumulated = _index(graph_def)
    for node in graph_def.node:
        if node.op == "AssignAddVariableOp":
            k = int(node.name[len(graphs.ACC_PREFIX):].split("/")[0])
            node.op = "AssignSubVariableOp"
            node.input[0] = grads[k][0]
    applied = _index(graph_def)
    assert graph.detect_training(applied).training
    same = [n for n in applied.names if not n.startswith(graphs.ACC_PREFIX + "0")
            and not n.startswith(graphs.ACC_PREFIX + "1")]
    phase_a = dict(zip(accumulated.names, graph.classify_phases(accumulated)))
    phase_b = dict(zip(applied.names, graph.classify_phases(applied)))
    assert {n: phase_a[n] for n in same} == {n: phase_b[n] for n in same}


@pytest.mark.parametrize("writer", graphs.GRADIENT_WRITERS)
def test_a_backward_pass_without_reverse_mode_evidence_is_not_training(writer):
    """The documented limit (docs/troubleshooting.md): one linear layer under
    a squared loss, accumulated, has a gradient of plain arithmetic, as
    an evaluation step's residual block has; neither counts."""
    graph_def, _ = graphs.gradient_write_step(writer, "none")
    info = graph.detect_training(_index(graph_def))
    assert info == graph.TrainingInfo(
        False, "1 variable(s) updated, none from a gradient (metrics or state "
        "updates only)", updated_variables=1)


def test_metric_updates_after_a_residual_block_stay_not_training():
    # The write-anywhere rule must not make an evaluation step training.
    info = graph.detect_training(_index(graphs.forward_with_residual_and_metric()))
    assert info.training is False
    info = graph.detect_training(_index(graphs.metrics_only()))
    assert info.training is False


# ------------------------------------------------------------ fresh processes

FUZZ_WRITERS = textwrap.dedent("""
    import json
    from hypothesis import given, seed, settings
    from sntf.testing import fuzz, fuzz_cases

    drawn = []

    @seed(41)
    @settings(max_examples=200, database=None, deadline=None)
    @given(fuzz_cases.case_specs(policies=("swap+recompute", "recompute")))
    def collect(spec):
        if len(drawn) < 8 and spec["kind"] == "conv" and spec["batch"] >= 4:
            drawn.append(spec)

    collect()
    harness = fuzz.Harness()
    writers = [w for w in fuzz_cases.WRITERS if w != "sub"]
    cases = []
    for k, spec in enumerate(drawn):
        spec = dict(spec, writer=writers[k % len(writers)], budget=None, loop=0)
        outcome = harness.run_case(spec)
        training = [(r["action"], r["reason"]) for r in harness.sntf.reports()
                    if r["training"]]
        cases.append({"writer": spec["writer"], "problems": outcome["problems"],
                      "reference_error": outcome.get("reference_error"),
                      "training": training, "rewritten": outcome["rewritten"]})
    print("RESULT " + json.dumps(cases))
    """)


@pytest.mark.slow
def test_random_accumulation_steps_are_training_and_identical(fresh_python):
    """Random fuzz steps (sntf.testing.fuzz_cases) that write their gradients
    with each accumulating writer: every one is seen as a training graph, and
    its results (outputs, gradients, weights and accumulators) are bitwise
    those of TensorFlow alone."""
    run = fresh_python(FUZZ_WRITERS, timeout=900, env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    cases = run.result()
    ran = [c for c in cases if c["reference_error"] is None]
    assert len(ran) >= 6, cases
    assert {c["writer"] for c in ran} == {"accumulate", "assign", "scatter", "apply"}
    for case in ran:
        assert case["problems"] == [], case
        assert case["training"], case
        assert all("not a training graph" not in reason
                   for _, reason in case["training"]), case
    assert any(c["rewritten"] for c in ran), cases


MICRO_STEP = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    import keras

    tf.config.experimental.enable_op_determinism()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if sys.argv[1] == "sntf":
        import sntf
        sntf.enable("swap+recompute", swap_min_bytes=0, min_gain=0.0)
    keras.utils.set_random_seed(41)
    model = keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(4)])
    loss_fn = keras.losses.MeanSquaredError()

    # The issue's micro-step, returning its loss.
    acc = [tf.Variable(tf.zeros_like(v), trainable=False)
           for v in model.trainable_variables]

    @tf.function
    def micro(x, y):
        with tf.GradientTape() as t:
            loss = loss_fn(y, model(x, training=True))
        for a, g in zip(acc, t.gradient(loss, model.trainable_variables)):
            a.assign_add(g)
        return loss

    # A second function applies the accumulated gradients (SGD).
    @tf.function
    def apply():
        for v, a in zip(model.trainable_variables, acc):
            v.assign_sub(0.1 * a / 2.0)
            a.assign(tf.zeros_like(a))

    x = tf.constant(np.linspace(-1, 1, 8 * 16 * 16 * 3,
                                dtype=np.float32).reshape(8, 16, 16, 3))
    y = tf.constant(np.linspace(1, -1, 8 * 4, dtype=np.float32).reshape(8, 4))
    losses, sums = [], []
    for step in range(2):
        for i in range(2):
            losses.append(float(micro(x[i::2], y[i::2])))
        sums.append([a.numpy().tobytes().hex() for a in acc])
        apply()
    result = {"losses": losses, "accumulated": sums,
              "weights": [v.numpy().tobytes().hex() for v in model.trainable_variables]}
    if sys.argv[1] == "sntf":
        result["reports"] = [
            {"training": r["training"], "action": r["action"], "reason": r["reason"],
             "swapped": len(r["swapped"] or ()), "recomputed": len(r["recomputed"] or ())}
            for r in sntf.reports()]
        result["summary"] = sntf.summary()
    print("RESULT " + json.dumps(result))
    """)


@pytest.mark.slow
def test_gradient_accumulation_step_is_rewritten_and_identical(fresh_python, tmp_path):
    """The issue's Keras micro-step under swap+recompute: recognized as
    training, rewritten (activations swapped), and bit for bit what
    TensorFlow alone computes (op determinism, one inter-op thread)."""
    script = tmp_path / "micro_step.py"
    script.write_text(MICRO_STEP)
    # TensorFlow's own convolutions: their im2col scratch is what makes
    # swapping this small step lower its peak (tests/conftest.py).
    env = {"TF_ENABLE_ONEDNN_OPTS": "0"}
    base = fresh_python(args=[str(script), "alone"], env=env).result()
    run = fresh_python(args=[str(script), "sntf"], env=env).result()
    reports = run.pop("reports")
    summary = run.pop("summary")
    assert run == base
    assert len(set(base["losses"])) > 1, base["losses"]
    training = [r for r in reports if r["training"]]
    assert training, (summary, reports)
    rewritten = [r for r in training if r["action"] == "rewritten"]
    assert rewritten and rewritten[0]["swapped"] > 0, json.dumps(reports, indent=1)
    assert "written into variable" in rewritten[0]["reason"], rewritten[0]
    assert "0 training graph(s)" not in summary, summary
