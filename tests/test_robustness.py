"""The rewriting policies on inputs beyond plain fit(): mixed precision, a
recurrent model (control flow) and a user's own GradientTape loop. Each is
either rewritten with bit-identical results or passed through with a report
that says why; none fails (fresh processes, op determinism on)."""

import pytest

from conftest import TF_KERNELS_ENV, assert_identical, train_family, train_worker

POLICIES = ("recompute", "swap+recompute")
SMALL_SWAPS = ("--swap-min-bytes", "4096")    # batch 8: small activations


@pytest.mark.slow
@pytest.mark.parametrize("family, precision", [
    ("transformer", "mixed_bfloat16"), ("resnet", "mixed_float16")])
def test_mixed_precision_is_rewritten_and_identical(fresh_python, tmp_path, family,
                                                    precision):
    flags = ("--mixed-precision", precision)
    base, weights = train_family(fresh_python, tmp_path / "base.npz", family, *flags)
    for policy in POLICIES:
        result, got = train_family(fresh_python, tmp_path / "p.npz", family, *flags,
                                   "--sntf", policy, *SMALL_SWAPS)
        assert_identical((base, weights), (result, got), (family, policy))
        training = [r for r in result["reports"] if r["training"]]
        # Keras' loss-scale optimizer (mixed_float16) applies the gradients
        # under a tf.cond: detected through its Switch, the step is
        # rewritten around the conditional (sntf.graph.regions).
        assert training, result["reports"]
        last = training[-1]
        assert last["action"] == "rewritten", last
        assert last["swapped"] or last["recomputed"], last
        if (family, precision, policy) == ("resnet", "mixed_float16", "recompute"):
            # Under the loss-scale optimizer's tf.cond, recomputation plans
            # below TensorFlow's own graph only with the weight gradients
            # run first (in the executor's order it planned higher).
            assert "so that recompute lowers the peak" in last["reason"], last["reason"]


def _train_model(fresh_python, out, model, *flags, env=None):
    return train_worker(fresh_python, out, "--model", model, *flags, env=env)


@pytest.mark.slow
def test_recurrent_model_is_identical_and_says_what_it_did(fresh_python, tmp_path):
    base, weights = _train_model(fresh_python, tmp_path / "base.npz", "lstm")
    for policy in POLICIES:
        result, got = _train_model(fresh_python, tmp_path / "p.npz", "lstm",
                                   "--sntf", policy, *SMALL_SWAPS)
        assert_identical((base, weights), (result, got), policy)
        # The LSTM's step is a while loop, which the pass does not model: it
        # is passed through, and the report says why.
        training = [r for r in result["reports"] if r["training"]]
        assert training and all(r["action"] == "unchanged" for r in training)
        assert "control flow present (a loop)" in training[-1]["reason"], training


@pytest.mark.slow
@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_custom_gradient_tape_loop_is_rewritten_and_identical(fresh_python, tmp_path,
                                                              model):
    # TensorFlow's own convolutions: the small CNN needs a rewritten graph.
    tf_kernels = TF_KERNELS_ENV
    base, weights = _train_model(fresh_python, tmp_path / "base.npz", model,
                                 "--custom-loop", env=tf_kernels)
    for policy in POLICIES:
        result, got = _train_model(fresh_python, tmp_path / "p.npz", model,
                                   "--custom-loop", "--sntf", policy, *SMALL_SWAPS,
                                   env=tf_kernels)
        assert_identical((base, weights), (result, got), (model, policy))
        training = [r for r in result["reports"] if r["training"]]
        assert training, result["reports"]
        last = training[-1]
        if model == "cnn":
            assert last["action"] == "rewritten", last
            assert (last["swapped"] if policy == "swap+recompute"
                    else last["recomputed"]), last
        else:
            # Dense layers with ReLU are fused ops (no cheap tensor), and the
            # activations at batch 8 are below the swap threshold.
            assert last["action"] == "unchanged", last
            assert "nothing to recompute" in last["reason"], last["reason"]
