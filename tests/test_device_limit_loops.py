"""The device's allocator limit binds the plan in every training loop, not
only in fit(): train_on_batch and a custom tf.function step with a
GradientTape reach the pass with the limit read (sntf.runtime.limit_hooks).
And where the executor's order does not fit the limit, the plan is held to
a memory-aware order that does (sntf.planner.fit._under_limit)."""

import os

import pytest

from conftest import REPO, TF_KERNELS_ENV, WORKERS
from sntf import config, passes
from sntf.testing import corpus

MIB = 1 << 20
# The 10-block network peaks at about 129 MiB under TensorFlow alone
# (batch 32, oneDNN off); sntf plans it near 40 MB.
LIMIT_MIB = 52


def _train(fresh_python, loop, use_sntf, limit_mib=None):
    env = dict(TF_KERNELS_ENV)
    if limit_mib is not None:
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(limit_mib)
    args = [os.path.join(WORKERS, "limit_loops.py"), "--loop", loop]
    return fresh_python(args=args + (["--sntf"] if use_sntf else []), env=env).result()


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["fit", "train_on_batch", "custom"])
def test_every_training_loop_trains_under_the_device_limit(fresh_python, loop):
    limited = _train(fresh_python, loop, True, LIMIT_MIB)
    report = limited["report"]
    # The limit was read before the step's graph reached the pass.
    assert report["device_limit_bytes"] == LIMIT_MIB * MIB, report
    assert report["action"] == "rewritten", report["reason"]
    assert not limited["oom"], report
    assert limited["peak"] <= LIMIT_MIB * MIB
    unlimited = _train(fresh_python, loop, False)
    assert unlimited["peak"] > 2 * LIMIT_MIB * MIB
    assert (limited["losses"], limited["digest"]) == (unlimited["losses"],
                                                      unlimited["digest"])


@pytest.mark.slow
def test_tensorflow_alone_runs_out_of_memory_under_that_limit(fresh_python):
    assert _train(fresh_python, "train_on_batch", False, LIMIT_MIB)["oom"]


def _limited_report(limit_bytes, pin_order=True):
    entry = corpus.load(os.path.join(REPO, "tests", "corpus", "graphs",
                                     "deep-preact50-limit.json.gz"))
    state = config.State(enabled=True, policy="auto", budget=None,
                         options=config.parse_options({"pin_order": pin_order}))
    env = passes.Environment(
        threads=entry.threads, onednn=entry.onednn, runtime_batch=entry.runtime_batch,
        device_memory=lambda device: entry.device_memory_bytes,
        in_use=lambda device: entry.in_use_bytes,
        allocator_limit=lambda device: limit_bytes)
    props = entry.properties
    return passes.run_pass(entry.graph, entry.fetch, entry.preserve, state,
                           lambda names: {n: props[n] for n in names if n in props},
                           env, defer=False).report


@pytest.mark.slow
def test_a_plan_that_runs_out_in_the_executors_order_is_held_to_a_lower_one():
    """50 blocks, batch 32, oneDNN off, captured under a 269 MiB limit
    (TensorFlow's peak: 449 MiB). In the executor's order swap+recompute
    plans 142 MB, which runs out under 135 MiB; held to a memory-aware
    order it plans within 1.5 times the lower bound and fits."""
    report = _limited_report(135 * MIB)
    assert report["device_limit_fits"] is True, report["reason"]
    assert "held to a memory-aware order" in report["reason"]
    assert report["planned_peak_bytes"] <= 1.5 * report["lower_bound_bytes"]
    # Where the user turned order edges off, nothing can hold that order.
    unpinned = _limited_report(135 * MIB, pin_order=False)
    assert "held to a memory-aware order" not in unpinned["reason"]
    assert unpinned["device_limit_fits"] is False
