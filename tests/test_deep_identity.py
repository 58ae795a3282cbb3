"""Deep residual networks train identically with and without sntf.

A pre-activation ResNet deep enough that Grappler's memory optimizer turns
its largest gradient sums into accumulators, whose additions TensorFlow
orders at run time (sntf.graph.accumulations), and one shallower that is
rewritten with its AddN sums held in order. (Whether each AddN forwards the
input it forwards in TensorFlow's graph is checked on the corpus' graphs,
tests/test_sums_corpus.py: on this network the rewrite leaves them so even
without the edges.)"""

import os

import pytest

from conftest import REPO

WORKER = os.path.join(REPO, "sntf", "testing", "workers", "resnet_identity.py")
POLICIES = ("swap", "recompute", "swap+recompute")


def _train(fresh_python, blocks, policy, onednn="1"):
    return fresh_python(args=[WORKER, "--blocks", str(blocks), "--batch", "32",
                              "--steps", "3", "--policy", policy],
                        env={"TF_ENABLE_ONEDNN_OPTS": onednn}, timeout=900).result(0)


@pytest.mark.slow
@pytest.mark.parametrize("onednn", ["1", "0"])
def test_thirty_blocks_train_identically_under_every_policy(fresh_python, onednn):
    base = _train(fresh_python, 30, "none", onednn)
    for policy in POLICIES:
        run = _train(fresh_python, 30, policy, onednn)
        assert (run["losses"], run["digest"]) == (base["losses"], base["digest"]), policy
        sums = run["report"]["order_dependent_sums"]
        # Its accumulators' order is TensorFlow's run-time choice: with op
        # determinism on, the graph goes back as it was, and says why.
        assert sums["accumulations"] > 0 and sums["code"] == "order_dependent_sum"
        assert run["report"]["action"] == "unchanged"


@pytest.mark.slow
def test_residual_sums_held_in_order_keep_a_rewritten_graph_identical(fresh_python):
    base = _train(fresh_python, 12, "none", "0")
    for policy in POLICIES:
        run = _train(fresh_python, 12, policy, "0")
        assert run["report"]["action"] == "rewritten", policy
        assert run["report"]["order_dependent_sums"]["pins"] > 0
        assert (run["losses"], run["digest"]) == (base["losses"], base["digest"]), policy
