"""End to end: a Keras CNN with BatchNormalization and Dropout, unchanged,
trained with and without sntf in fresh processes, compared bit for bit."""

import os

import numpy as np
import pytest

from conftest import WORKERS, assert_identical

STEPS = 5


def _train(fresh_python, tmp_path, tag, *flags):
    out = tmp_path / f"{tag}.npz"
    run = fresh_python(args=[os.path.join(WORKERS, "train_keras.py"), "--model",
                             "cnn", "--steps", str(STEPS), "--evaluate", "--out",
                             str(out), *flags])
    result = run.result()
    with np.load(out) as data:
        weights = {k: data[k].copy() for k in data.files}
    return result, weights


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import run_python

    tmp = tmp_path_factory.mktemp("e2e")
    return {
        "baseline": _train(run_python, tmp, "baseline"),
        "off": _train(run_python, tmp, "off", "--sntf", "off"),
        "identity": _train(run_python, tmp, "identity", "--sntf", "off",
                           "--identity-rewrite"),
        # Rewritten graphs, in the fast subset too: swaps (through the
        # tensor cache under a budget) and recomputations.
        "swap+recompute": _train(run_python, tmp, "swap", "--sntf", "swap+recompute",
                                 "--swap-min-bytes", "4096"),
        # At batch 64 the CNN's activations outgrow a 2 MiB budget.
        "baseline64": _train(run_python, tmp, "baseline64", "--batch", "64"),
        "budget": _train(run_python, tmp, "budget", "--batch", "64", "--sntf", "auto",
                         "--swap-min-bytes", "4096", "--budget", str(2 << 20)),
        "recompute": _train(run_python, tmp, "recompute", "--sntf", "recompute",
                            "--recompute-mode", "memory"),
    }


def _assert_bit_identical(a, b):
    assert len(a[0]["losses"]) == STEPS
    assert_identical(a, b)


def test_policy_off_is_bit_identical(runs):
    _assert_bit_identical(runs["baseline"], runs["off"])


def test_identity_rewrite_through_full_pipeline_is_bit_identical(runs):
    _assert_bit_identical(runs["baseline"], runs["identity"])
    training = [r for r in runs["identity"][0]["reports"] if r["training"]]
    assert training and all(r["action"] == "rewritten" for r in training)


@pytest.mark.parametrize("name, swapped, recomputed", [
    ("swap+recompute", True, None), ("budget", True, None), ("recompute", False, True)])
def test_rewritten_graphs_train_bit_identically(runs, name, swapped, recomputed):
    """Runs whose training graph sntf rewrote, compared bit for bit: the
    reports must show the rewrite, so that a pass-through cannot pass."""
    assert_identical(runs["baseline64" if name == "budget" else "baseline"],
                     runs[name], name)
    result, _ = runs[name]
    rewritten = [r for r in result["reports"]
                 if r["training"] and r["action"] == "rewritten"]
    assert rewritten, result["reports"]
    if swapped is not None:
        assert bool(rewritten[-1]["swapped"]) is swapped, rewritten[-1]
    if recomputed is not None:
        assert bool(rewritten[-1]["recomputed"]) is recomputed, rewritten[-1]
    moved = result["stats"]["swap"]
    if name == "budget":
        # Under a budget, swaps go through the tensor cache.
        assert moved["cache_hits"] + moved["cache_misses"] > 0, moved
    elif swapped:
        assert moved["swap_out_ops"] > 0 and moved["failed_ops"] == 0, moved


def test_training_changed_the_weights(runs):
    # Guards the comparisons above: they must compare a run that learned.
    result, _ = runs["baseline"]
    assert len(set(result["losses"])) > 1


def test_reports_classify_train_data_metrics_and_predict_functions(runs):
    result, _ = runs["off"]
    reports, phases = result["reports"], result["phases"]
    fit = reports[:phases["fit"]]
    evaluate = reports[phases["fit"]:phases["evaluate"]]
    predict = reports[phases["evaluate"]:phases["predict"]]
    train = [r for r in fit if r["training"]]
    assert train, fit
    assert all(r["nodes"] > 200 for r in train)
    # tf.data functions: small graphs with no variables, in every phase.
    data = [r for r in reports if r["reason"].endswith("no variable is updated")
            and r["nodes"] < 20]
    assert data and not any(r["training"] for r in data)
    # evaluate(): metric updates, no gradient -> not training.
    assert evaluate and not any(r["training"] for r in evaluate)
    assert any("none from a gradient" in r["reason"] for r in evaluate)
    # predict(): no updates at all -> not training.
    assert predict and not any(r["training"] for r in predict)
    # Non-training graphs are skipped, with the reason given.
    assert all(r["action"] == "skipped" for r in evaluate + predict)
