"""A deep residual network trains identically with and without sntf.

A pre-activation ResNet deep enough that Grappler's memory optimizer turns
its largest gradient sums into accumulators, whose additions TensorFlow
orders at run time (sntf.graph.accumulations). Whether a rewritten graph's
AddNs forward the inputs TensorFlow's do is checked on the corpus' graphs
(tests/test_sums_corpus.py); the same network at both oneDNN settings and
more depths, widths and batches is in benchmarks/identity_sweep.py.
"""

import os

import pytest

from conftest import REPO

WORKER = os.path.join(REPO, "sntf", "testing", "workers", "resnet_identity.py")
POLICIES = ("swap", "recompute", "swap+recompute")


def _train(fresh_python, blocks, policy):
    """One run at the user's default oneDNN setting (on)."""
    return fresh_python(args=[WORKER, "--blocks", str(blocks), "--batch", "32",
                              "--steps", "2", "--policy", policy],
                        env={"TF_ENABLE_ONEDNN_OPTS": "1"}, timeout=900).result(0)


@pytest.mark.slow
def test_thirty_blocks_train_identically_under_every_policy(fresh_python):
    base = _train(fresh_python, 30, "none")
    for policy in POLICIES:
        run = _train(fresh_python, 30, policy)
        assert (run["losses"], run["digest"]) == (base["losses"], base["digest"]), policy
        sums = run["report"]["order_dependent_sums"]
        # Its accumulators' order is TensorFlow's run-time choice: with op
        # determinism on, the graph goes back as it was, and says why.
        assert sums["accumulations"] > 0 and sums["code"] == "order_dependent_sum"
        assert run["report"]["action"] == "unchanged"
