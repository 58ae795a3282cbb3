"""The report the pass gives for every graph: its schema, and the parts of it
built from a plan."""

from __future__ import annotations

import contextlib
import time

from sntf.graph import names
from sntf.planner.plan import RECOMPUTE, SWAP

# Report actions.
UNCHANGED = "unchanged"        # looked at, deliberately left as is
REWRITTEN = "rewritten"        # a new graph went back to TensorFlow
SKIPPED = "skipped"            # not a graph sntf acts on
ERROR = "error"                # the pass failed; the graph went back unchanged
ACTIONS = (UNCHANGED, REWRITTEN, SKIPPED, ERROR)

DEFERRED = ("deferred to Grappler's last iteration (sntf rewrites a graph after "
            "TensorFlow's own optimizers have run on it for the last time)")


def new_report(name: str = "", nodes: int = 0) -> dict:
    """A report with every public key present; None where not yet known."""
    return {
        "graph": name,
        "training": False,
        "nodes": nodes,
        "action": UNCHANGED,
        "reason": "",
        # For a training graph, the reason's parts: why it is one, and the
        # notes on what was done with it.
        "training_reason": None,
        "notes": [],
        # The pass waits for Grappler's last iteration to plan the graph.
        "deferred": False,
        # Why the pass did not act on the graph at all, as a code:
        # "not_training", "xla_compiled", "xla_auto_jit", "already_rewritten".
        "skip": None,
        "policy": None,
        "predicted_peak_bytes": None,
        "planned_peak_bytes": None,
        "lower_bound_bytes": None,
        "pass_seconds": 0.0,
        "swapped": None,
        "recomputed": None,
        "fetch": [],
        "devices": [],
        # A graph on several devices (tf.distribute replicas): device ->
        # {nodes, predicted_peak_bytes, planned_peak_bytes, swapped,
        # recomputed}, what the pass found and did on each.
        "per_device": {},
        "error": None,
        "invocations": 1,
        "batch": None,
        # Where an unknown batch dimension was resolved from: "option
        # batch_size", "the input Keras fit() feeds", or None.
        "batch_source": None,
        "stage_seconds": {},
        "analysis": None,
        "analysis_error": None,
        "cudnn_workspace_limit_mb": None,
        # Policy "auto" with a budget: the budget in bytes, whether the plan
        # fits it, the least planned peak sntf could reach (when it does
        # not), and the plan's predicted extra seconds per step.
        "budget_bytes": None,
        "budget_fits": None,
        # Where a budget or a device limit binds the plan: how the plan
        # stands against them (sntf.planner.plan.FIT_CODES), and the planned
        # peak a budget's plan must not exceed (the budget less its margin,
        # what the device holds outside the graph and the allocator's slack).
        "fit": None,
        "budget_target_bytes": None,
        # With the tensor cache: the device peak predicted with the cache
        # keeping swapped tensors within its headroom (planned_peak_bytes
        # counts every swap as a copy).
        "cached_peak_bytes": None,
        "achievable_peak_bytes": None,
        "predicted_seconds_added": None,
        # Device bytes in use outside this graph when it was planned (the
        # allocator's bytes in use less the graph's variables), where the
        # allocator keeps statistics; the peaks above are modelled on it.
        "outside_bytes": None,
        # What holds the planned peak up: the bytes live there by kind, with
        # the largest buffers named (sntf.analysis.breakdown).
        "peak_breakdown": None,
        # The sums TensorFlow orders at run time (sntf.graph.accumulations):
        # {"accumulations", "pins", "lost", "code"}; code is
        # "order_dependent_sum" where they kept the graph unchanged.
        "order_dependent_sums": None,
    }


@contextlib.contextmanager
def timed(report: dict, stage: str):
    """Adds the wall time of a stage to report["stage_seconds"], where the
    stage is the last key while it runs (a progress display reads it)."""
    seconds = report["stage_seconds"]
    seconds[stage] = seconds.pop(stage, 0.0)
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[stage] = time.perf_counter() - start


def per_device(index, facts, planned, plan, rewritten) -> dict:
    """Device -> the pass's figures and actions there, for a graph placed on
    several devices (one replica per device under tf.distribute).

    Args:
      index: the original graph's index.
      facts: its Analysis, or None.
      planned: the rewritten graph's Analysis, or None.
      plan: the Plan.
      rewritten: the graph handed back: under "swap+recompute" a swapped
        tensor may be a recomputed clone's, a node only that graph has.

    Returns:
      The per-device dict (empty for a graph on one device).
    """
    devices = sorted({d for d in index.devices if d})
    if len(devices) < 2:
        return {}
    device_of = {node.name: node.device for node in rewritten.node}

    def on(device, tensors):
        return [t for t in tensors if device_of.get(names.split_tensor(t)[0]) == device]

    before = facts.device_peak_bytes if facts is not None else {}
    after = (planned or facts).device_peak_bytes if facts is not None else {}
    return {device: {
        "nodes": sum(1 for d in index.devices if d == device),
        "predicted_peak_bytes": before.get(device),
        "planned_peak_bytes": after.get(device, before.get(device)),
        "swapped": on(device, plan.tensors(SWAP)),
        "recomputed": on(device, plan.tensors(RECOMPUTE)),
    } for device in devices}
