"""sntf under tf.distribute (issue #7, part 1).

MirroredStrategy over two logical CPU devices of one process, and
MultiWorkerMirroredStrategy with two worker processes on loopback ports,
each trained with and without sntf in fresh processes (op determinism on)
and compared bit for bit. The sntf runs keep their GraphDefs
(keep_graphs=True) and sntf/testing/workers/train_distributed.py checks each
rewritten graph with `check_placement`: every node sntf adds sits on the
device of the tensor it serves, no new edge crosses devices, and the
collective all-reduce nodes are exactly as TensorFlow built them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, WORKERS, _env, assert_identical

WORKER = os.path.join(WORKERS, "train_distributed.py")
from sntf.testing.workers import train_distributed as td  # noqa: E402
# Small VGG (3 conv stages of 8/16/16 channels), two steps of a global batch
# of 16: a full forward/backward/all-reduce/Adam graph per replica in seconds.
MODEL = ("--family", "vgg", "--depth", "1", "--small", "--steps", "2",
         "--batch", "16")
SMALL_SWAPS = ("--swap-min-bytes", "4096")   # the activations here are small
WORKER_TIMEOUT = 300                          # seconds, per multi-worker run


def _weights(path) -> dict:
    with np.load(path) as data:
        return {k: data[k].copy() for k in data.files}


def _assert_placement_clean(placement: dict, what) -> None:
    """No sntf node off its tensor's device, no new cross-device edge, and
    the all-reduce nodes untouched."""
    for key in ("served_mismatch", "input_crossing", "trigger_crossing",
                "unknown_source", "collectives_changed", "collectives_generated"):
        assert placement[key] == [], (what, key, placement[key][:5])
    # The check is meaningful only where collectives exist to be protected.
    assert placement["collectives"] >= 1, (what, placement)
    assert "CollectiveReduceV2" in placement["collective_ops"], placement


def _rewritten(result: dict, what) -> list[dict]:
    reports = result["reports"]
    assert not [r for r in reports if r["action"] == "error"], (what, reports)
    done = [r for r in reports if r["action"] == "rewritten"]
    assert done, (what, [(r["action"], r["reason"]) for r in reports])
    # Grappler's second iteration sees sntf's own nodes: idempotent.
    for r in reports:
        if r["action"] != "rewritten":
            assert "already rewritten" in r["reason"] or r["action"] == "unchanged", r
    return done


# ------------------------------------------------------------ the checker


def _node(graph, name, op, device, inputs=(), role=None):
    node = graph.node.add()
    node.name, node.op, node.device = name, op, device
    node.input.extend(inputs)
    if role:
        from sntf.graph import names

        names.mark(node, role)
    return node


def test_check_placement_flags_crossings_and_touched_collectives():
    """The placement checker itself: it must notice each kind of violation
    (otherwise the distributed tests below could never fail)."""
    from tensorflow.core.framework import graph_pb2

    from sntf.graph import names

    d0, d1 = "/device:CPU:0", "/device:CPU:1"
    original = graph_pb2.GraphDef()
    _node(original, "x", "Placeholder", d0)
    _node(original, "relu", "Relu", d0, ["x"])
    _node(original, "grad", "ReluGrad", d0, ["relu", "relu"])
    _node(original, "other", "ReluGrad", d1, ["x", "x"])
    _node(original, "allreduce", "CollectiveReduceV2", d0, ["grad"])
    good = graph_pb2.GraphDef()
    good.CopyFrom(original)
    _node(good, names.swap_out_name("relu", 0), "SnSwapOut", d0, ["relu"],
          names.ROLE_SWAP_OUT)
    _node(good, names.swap_in_name("relu", 0), "SnSwapIn", d0,
          [names.swap_out_name("relu", 0), "^x"], names.ROLE_SWAP_IN)
    good.node[2].input[1] = names.swap_in_name("relu", 0)
    clean = td.check_placement(original, good)
    assert clean["sntf_nodes"] == {d0: {"swap_out": 1, "swap_in": 1}}
    for key in ("served_mismatch", "input_crossing", "trigger_crossing",
                "collectives_changed", "collectives_generated", "unknown_source"):
        assert clean[key] == [], key
    assert clean["collectives"] == 1

    bad = graph_pb2.GraphDef()
    bad.CopyFrom(good)
    bad.node[-1].device = d1                          # swap-in on the other device
    bad.node[3].input.append("^" + names.swap_in_name("relu", 0))  # d1 -> d1 ok
    bad.node[2].input.append("^other")                 # grad (d0) waits on d1
    bad.node[4].input.append("^x")                     # the all-reduce touched
    clone = _node(bad, names.recompute_name("allreduce"), "CollectiveReduceV2", d0,
                  ["grad"], names.ROLE_RECOMPUTE)
    del clone  # a recomputed collective: never allowed
    found = td.check_placement(original, bad)
    assert [m[0] for m in found["served_mismatch"]] == [names.swap_in_name("relu", 0)]
    assert found["input_crossing"] and found["input_crossing"][0][0] == "grad"
    assert ["grad", "other"] == found["trigger_crossing"][0][:2]
    assert found["collectives_changed"] == ["allreduce"]
    assert found["collectives_generated"] == [names.recompute_name("allreduce")]


# ------------------------------------------- the rewrite on two devices


def _two_devices():
    """relu (CPU:1) read by a forward op on CPU:0 and by gradients on both."""
    from tensorflow.core.framework import graph_pb2

    d0, d1 = "/device:CPU:0", "/device:CPU:1"
    g = graph_pb2.GraphDef()
    _node(g, "x", "Placeholder", d0)
    _node(g, "relu", "Relu", d1, ["x"])
    _node(g, "forward", "Square", d0, ["relu"])
    _node(g, "trigger0", "Identity", d0, ["x"])
    _node(g, "trigger1", "Identity", d1, ["x"])
    _node(g, "grad1", "ReluGrad", d1, ["trigger1", "relu"])
    for node in g.node:
        node.attr["T"].type = 1
    return g, d0, d1


def _swap_plan(trigger: str):
    from sntf import planner

    return planner.Plan(policy="swap", swaps=(planner.Swap(
        tensor="relu:0", dtype=1, shape=(4,), forward_readers=("forward",),
        groups=(planner.SwapGroup(consumers=(("grad1", 1),), trigger=trigger),)),))


def test_rewrite_refuses_a_trigger_on_another_device():
    """A control edge from another device deadlocked a two-device step
    (found by benchmarks/fuzz_pass.py); the rewrite refuses such a plan, so the
    pass hands the graph back unchanged with the reason."""
    from sntf import planner, rewrite

    g, _, _ = _two_devices()
    with pytest.raises(ValueError, match="plan crosses devices.*trigger0"):
        rewrite.apply_plan(g, _swap_plan("trigger0"))
    recompute = planner.Plan(policy="recompute", recomputes=(planner.Recompute(
        tensor="relu:0", chain=("relu",),
        groups=(planner.RecomputeGroup(consumers=(("grad1", 1),),
                                       trigger="trigger0"),)),))
    with pytest.raises(ValueError, match="plan crosses devices"):
        rewrite.apply_plan(g, recompute)


def test_rewrite_keeps_swap_edges_on_the_tensors_device():

    from sntf import rewrite
    from sntf.graph import names

    g, d0, d1 = _two_devices()
    out = rewrite.apply_plan(g, _swap_plan("trigger1")).graph_def
    nodes = {n.name: n for n in out.node}
    swap_in = nodes[names.swap_in_name("relu", 0)]
    assert swap_in.device == d1 and "^trigger1" in swap_in.input
    assert nodes["grad1"].input[1] == swap_in.name
    # The forward reader on CPU:0 reads relu through Send/Recv already: no
    # control edge from the swap-out on CPU:1 is added to it.
    assert list(nodes["forward"].input) == ["relu"]
    placement = td.check_placement(g, out)
    assert not (placement["served_mismatch"] or placement["input_crossing"]
                or placement["trigger_crossing"]), placement


# ------------------------------------------------------- MirroredStrategy


def _mirrored(fresh_python, out, *flags) -> tuple[dict, dict]:
    # TensorFlow's own convolutions: this two-replica step is small, and
    # under oneDNN (no im2col scratch) no plan lowers its peak, so nothing
    # would be rewritten for the replicas to be checked on.
    run = fresh_python(args=[WORKER, "--strategy", "mirrored", *MODEL,
                             "--out", str(out), *flags],
                       env={"TF_ENABLE_ONEDNN_OPTS": "0"})
    return run.result(), _weights(out)


@pytest.fixture(scope="module")
def mirrored_baseline(tmp_path_factory):
    from conftest import run_python

    out = tmp_path_factory.mktemp("mirrored") / "base.npz"
    return _mirrored(run_python, out)


@pytest.mark.slow
@pytest.mark.parametrize("policy, flags", [
    ("swap+recompute", SMALL_SWAPS),
    ("recompute", ("--recompute-mode", "memory")),
])
def test_mirrored_strategy_rewrites_every_replica_identically(
        fresh_python, tmp_path, mirrored_baseline, policy, flags):
    result, weights = _mirrored(fresh_python, tmp_path / "p.npz", "--sntf", policy,
                                *flags)
    assert result["replicas"] == mirrored_baseline[0]["replicas"] == 2
    assert_identical(mirrored_baseline, (result, weights), policy)
    for report in _rewritten(result, policy):
        # One graph holds both replicas (Grappler optimizes the function
        # before partitioning it by device); it covers both devices ...
        devices = report["devices"]
        assert len(devices) == 2 and {d[-5:] for d in devices} == {"CPU:0", "CPU:1"}, \
            devices
        placement = report["placement"]
        _assert_placement_clean(placement, policy)
        # ... and each replica's part of it was rewritten on its own device.
        assert sorted(placement["sntf_nodes"]) == sorted(devices), placement
        # swap+recompute applies swapping alone where that plans lower, and
        # says so in the report.
        assert report["recomputed"] or "alone applied" in report["reason"], report
        for device, roles in placement["sntf_nodes"].items():
            if report["recomputed"]:
                assert roles.get("recompute", 0) > 0, (device, roles)
            if policy == "swap+recompute":
                assert roles.get("swap_out", 0) > 0 and roles.get("swap_in", 0) > 0, \
                    (device, roles)
        assert report["swapped"] or policy == "recompute"
        # The report says the same per device: each replica's own peaks,
        # planned below predicted, and the tensors rewritten there.
        per_device = report["per_device"]
        assert sorted(per_device) == sorted(devices), per_device
        for device, figures in per_device.items():
            assert bool(figures["recomputed"]) == bool(report["recomputed"]), figures
            assert set(figures["recomputed"]) <= set(report["recomputed"]), figures
            assert bool(figures["swapped"]) == (policy == "swap+recompute"), figures
            assert 0 < figures["planned_peak_bytes"] < figures["predicted_peak_bytes"] \
                < report["predicted_peak_bytes"], (device, figures)
        assert sorted(t for f in per_device.values() for t in f["recomputed"]) == \
            sorted(report["recomputed"])


# ---------------------------------------------- MultiWorkerMirroredStrategy


def run_workers(out_dir, *flags, workers: int = 2,
                timeout: float = WORKER_TIMEOUT) -> list[tuple[dict, dict]]:
    """Starts `workers` MultiWorkerMirroredStrategy processes on loopback
    ports, waits for all of them (killing every one on timeout or when one
    fails, so that none is left waiting for its peers), and returns each
    worker's (RESULT dict, weights)."""
    ports = td.free_ports(workers)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs, logs = [], []
    try:
        for i in range(workers):
            # oneDNN's graph rewrites off, as in every measurement: with
            # them on, the swap planner keeps MaxPool outputs (paired with
            # their gradients, optable.WORKSPACE_PAIRS), and this small
            # model's other swaps would not lower its peak, so nothing of
            # the swap path would run across workers.
            env = _env({"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CONFIG": json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": i}})})
            log = open(os.path.join(out_dir, f"worker{i}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, "--strategy", "multiworker", *MODEL,
                 "--out", os.path.join(out_dir, f"w{i}.npz"), *flags],
                stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise AssertionError(f"workers still running after {timeout} s")
            if any(p.poll() not in (None, 0) for p in procs):
                break            # one failed: its peers would wait forever
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    results = []
    for i, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        text = log.read()
        log.close()
        assert p.returncode == 0, f"worker {i} rc={p.returncode}\n{text[-4000:]}"
        line = [l for l in text.splitlines() if l.startswith("RESULT ")]
        assert line, text[-4000:]
        results.append((json.loads(line[-1][len("RESULT "):]),
                        _weights(os.path.join(out_dir, f"w{i}.npz"))))
    return results


@pytest.mark.slow
def test_multi_worker_mirrored_strategy_is_rewritten_and_identical(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "sntf").mkdir()
    base = run_workers(str(tmp_path / "base"))
    runs = run_workers(str(tmp_path / "sntf"), "--sntf", "swap+recompute",
                       *SMALL_SWAPS)
    for i, (b, r) in enumerate(zip(base, runs)):
        assert b[0]["replicas"] == r[0]["replicas"] == 2
        assert_identical(b, r, f"worker {i}")
        # The replicas stay in sync: every worker ends with the same trained
        # weights (BatchNormalization's moving statistics are per replica).
        assert r[0]["trainable"]
        for k in r[0]["trainable"]:
            assert r[1][k].tobytes() == runs[0][1][k].tobytes(), (i, k)
        for report in _rewritten(r[0], f"worker {i}"):
            # Each worker's graph is its own replica, on its own task's device.
            assert len(report["devices"]) == 1, report["devices"]
            assert f"/task:{i}/" in report["devices"][0], report["devices"]
            placement = report["placement"]
            _assert_placement_clean(placement, f"worker {i}")
            assert sorted(placement["sntf_nodes"]) == report["devices"]
            roles = placement["sntf_nodes"][report["devices"][0]]
            assert roles.get("swap_out", 0) > 0, report["reason"]
            assert (roles.get("recompute", 0) > 0
                    or "alone applied" in report["reason"]), report["reason"]
