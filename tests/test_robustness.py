"""The rewriting policies on inputs beyond plain fit(): mixed precision, a
recurrent model (control flow) and a user's own GradientTape loop. Each is
either rewritten with bit-identical results or passed through with a report
that says why; none fails (fresh processes, op determinism on)."""

import pytest

from conftest import train_family, train_worker

POLICIES = ("recompute", "swap+recompute")
SMALL_SWAPS = ("--swap-min-bytes", "4096")    # batch 8: small activations


def _assert_identical(base, weights, result, got, what):
    assert result["losses"] == base["losses"], what
    assert got.keys() == weights.keys()
    for k in weights:
        assert got[k].tobytes() == weights[k].tobytes(), (what, k)
    assert not [r for r in result["reports"] if r["action"] == "error"], what


@pytest.mark.slow
@pytest.mark.parametrize("family, precision", [
    ("resnet", "mixed_bfloat16"), ("transformer", "mixed_bfloat16"),
    ("resnet", "mixed_float16")])
def test_mixed_precision_is_rewritten_and_identical(fresh_python, tmp_path, family,
                                                    precision):
    flags = ("--mixed-precision", precision)
    base, weights = train_family(fresh_python, tmp_path / "base.npz", family, *flags)
    for policy in POLICIES:
        result, got = train_family(fresh_python, tmp_path / "p.npz", family, *flags,
                                   "--sntf", policy, *SMALL_SWAPS)
        _assert_identical(base, weights, result, got, (family, policy))
        training = [r for r in result["reports"] if r["training"]]
        # Keras' loss-scale optimizer (mixed_float16) applies the gradients
        # under a tf.cond: detected through its Switch, the step is
        # rewritten around the conditional (sntf/graph.py).
        assert training, result["reports"]
        if policy == "swap+recompute":
            assert any(r["action"] == "rewritten" for r in training), training
        else:
            # Rewritten, or a plan the analysis rejected, with the figures.
            assert all(r["action"] == "rewritten" or "would not fall" in r["reason"]
                       or "already rewritten" in r["reason"] for r in training), training


def _train_model(fresh_python, out, model, *flags):
    return train_worker(fresh_python, out, "--model", model, *flags)


@pytest.mark.slow
def test_recurrent_model_is_identical_and_says_what_it_did(fresh_python, tmp_path):
    base, weights = _train_model(fresh_python, tmp_path / "base.npz", "lstm")
    for policy in POLICIES:
        result, got = _train_model(fresh_python, tmp_path / "p.npz", "lstm",
                                   "--sntf", policy, *SMALL_SWAPS)
        _assert_identical(base, weights, result, got, policy)
        for r in result["reports"]:
            if r["training"] and r["action"] != "rewritten":
                assert r["reason"], r        # passed through, with the reason


@pytest.mark.slow
@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_custom_gradient_tape_loop_is_rewritten_and_identical(fresh_python, tmp_path,
                                                              model):
    base, weights = _train_model(fresh_python, tmp_path / "base.npz", model,
                                 "--custom-loop")
    for policy in POLICIES:
        result, got = _train_model(fresh_python, tmp_path / "p.npz", model,
                                   "--custom-loop", "--sntf", policy, *SMALL_SWAPS)
        _assert_identical(base, weights, result, got, (model, policy))
        training = [r for r in result["reports"] if r["training"]]
        assert training, result["reports"]
        if model == "cnn" and policy == "swap+recompute":
            assert any(r["action"] == "rewritten" for r in training), training
        elif model == "cnn":
            # Rewritten, or a plan the analysis rejected, with the figures.
            assert all(r["action"] == "rewritten" or "would not fall" in r["reason"]
                       for r in training), training
