"""A deep residual network keeps its savings with op determinism on, and
its results are TensorFlow's up to the order of the sums TensorFlow adds as
their terms arrive.

A pre-activation ResNet deep enough that Grappler's memory optimizer turns
its largest gradient sums into accumulators, whose additions TensorFlow
orders at run time (sntf.graph.accumulations). sntf rewrites it under every
policy and holds those additions to one order: the verifier finds every op
the same from identical inputs but for those sums, the losses stay within
float rounding of TensorFlow's, and under TensorFlow's default inter-op
pool two runs give the same weights, bit for bit (TensorFlow's own do not).
Whether a rewritten graph's AddNs forward the inputs TensorFlow's do is
checked on the corpus' graphs (tests/test_sums_corpus.py); the same network
at both oneDNN settings and more depths, widths and batches is in
benchmarks/identity_sweep.py.
"""

import os

import numpy as np
import pytest

from conftest import REPO

WORKER = os.path.join(REPO, "sntf", "testing", "workers", "resnet_identity.py")
POLICIES = ("swap", "recompute", "swap+recompute")


def _train(fresh_python, blocks, policy, *flags, steps=2):
    """One run at the user's default oneDNN setting (on)."""
    return fresh_python(args=[WORKER, "--blocks", str(blocks), "--batch", "32",
                              "--steps", str(steps), "--policy", policy, *flags],
                        env={"TF_ENABLE_ONEDNN_OPTS": "1"}, timeout=900).result(0)


@pytest.mark.slow
def test_thirty_blocks_are_rewritten_under_every_policy_with_their_sums_in_one_order(
        fresh_python):
    base = _train(fresh_python, 30, "none")
    for policy in POLICIES:
        flags = ("--verify",) if policy == "swap+recompute" else ()
        run = _train(fresh_python, 30, policy, *flags)
        report = run["report"]
        sums = report["order_dependent_sums"]
        assert sums["accumulations"] > 0 and sums["code"] is None, (policy, report)
        assert report["action"] == "rewritten", (policy, report["reason"])
        assert report["swapped"] + report["recomputed"] > 0, (policy, report)
        assert report["planned_peak_bytes"] < report["predicted_peak_bytes"], policy
        # The same terms in another order: float rounding, not another step.
        np.testing.assert_allclose(run["losses"], base["losses"], rtol=1e-5,
                                   err_msg=policy)
        if flags:
            verified = run["verify"]
            assert verified["verdict"] in ("identical", "identical_up_to_sum_order"), \
                verified["text"]
            assert verified["ok"], verified["text"]


@pytest.mark.slow
def test_exact_sums_leaves_the_deep_network_unchanged_and_identical(fresh_python):
    base = _train(fresh_python, 30, "none", steps=1)
    run = _train(fresh_python, 30, "swap+recompute", "--exact-sums", steps=1)
    assert (run["losses"], run["digest"]) == (base["losses"], base["digest"])
    assert run["report"]["action"] == "unchanged"
    assert "exact_sums=True" in run["report"]["reason"]


@pytest.mark.slow
def test_under_the_default_pool_two_runs_give_the_same_weights(fresh_python):
    """TensorFlow's own step adds its accumulators' terms in whatever order
    threads deliver them; sntf's holds them to one order."""
    runs = [_train(fresh_python, 30, "swap+recompute", "--pool") for _ in range(2)]
    for run in runs:
        assert run["report"]["action"] == "rewritten", run["report"]["reason"]
        assert run["report"]["order_dependent_sums"]["accumulations"] > 0
    assert runs[0]["digest"] == runs[1]["digest"]
    assert runs[0]["losses"] == runs[1]["losses"]
