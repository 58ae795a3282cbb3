"""End to end: a Keras CNN with BatchNormalization and Dropout, unchanged,
trained with and without sntf in fresh processes, compared bit for bit."""

import os

import numpy as np
import pytest

from conftest import WORKERS

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
    }


def _assert_bit_identical(a, b):
    (ra, wa), (rb, wb) = a, b
    assert len(ra["losses"]) == STEPS
    assert ra["losses"] == rb["losses"]
    assert sorted(wa) == sorted(wb)
    for k in wa:
        assert wa[k].dtype == wb[k].dtype
        assert wa[k].tobytes() == wb[k].tobytes(), f"weight {k} differs"


def test_policy_off_is_bit_identical(runs):
    _assert_bit_identical(runs["baseline"], runs["off"])


def test_identity_rewrite_through_full_pipeline_is_bit_identical(runs):
    _assert_bit_identical(runs["baseline"], runs["identity"])
    training = [r for r in runs["identity"][0]["reports"] if r["training"]]
    assert training and all(r["action"] == "rewritten" for r in training)


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
