"""The graph pass: GraphDef in -> index -> training detection -> Plan -> GraphDef out.

`run_pass` is a pure function of its arguments (the switch state is passed
in). It never raises for a graph: internal failures come back as a result
whose graph is None (meaning "leave the graph unchanged") and whose report
says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import time
import traceback
from typing import Callable, Optional, Sequence

from sntf import analysis, config, graph, names, planner, rewrite

# Report actions.
UNCHANGED = "unchanged"        # looked at, deliberately left as is
REWRITTEN = "rewritten"        # a new graph went back to TensorFlow
SKIPPED = "skipped"            # not a graph sntf acts on
ERROR = "error"                # the pass failed; the graph went back unchanged

PropertiesFn = Callable[[Sequence[str]], dict]
# device name ("CPU:0", "GPU:0") -> bytes its allocator has in use now, or None.
InUseFn = Callable[[str], Optional[int]]


@dataclasses.dataclass
class PassResult:
    """What the pass returns: a new GraphDef (or None for "unchanged") and a report."""

    graph_def: Optional[object]
    report: dict
    # Identity of the graph across Grappler's two iterations (None when the
    # graph could not be parsed); see graph_key.
    key: Optional[bytes] = None
    # A training graph left for Grappler's last iteration (see run_pass).
    deferred: bool = False


DEFERRED = ("deferred to Grappler's last iteration (sntf rewrites a graph after "
            "TensorFlow's own optimizers have run on it for the last time)")


# Name scopes of nodes that Grappler's own optimizers create or rename.
GRAPPLER_SCOPES = ("ConstantFolding/", "ArithmeticOptimizer/", "LayoutOptimizer",
                   "DependencyOptimizer/", "Remapper/", "ScopedAllocator",
                   "LoopOptimizer/", "MemoryOptimizer/", "AutoMixedPrecision/")


def graph_key(graph_def, fetch: Sequence[str]) -> bytes:
    """Identity of "the same graph" across Grappler's two iterations.

    The second iteration sees the graph after other optimizers touched it, so
    its bytes differ; the names of its computing nodes do not, except for
    constants and nodes those optimizers generate under their own scopes.
    A graph they did change structurally gets a second report, which is the
    honest outcome.
    """
    stable = sorted(n.name for n in graph_def.node
                    if n.op not in ("Const", "HostConst")
                    and not n.name.startswith(GRAPPLER_SCOPES))
    h = hashlib.blake2b(digest_size=16)
    for part in list(fetch) + ["|"] + stable:
        h.update(part.encode("utf-8", "replace") + b"\0")
    return h.digest()


def new_report(name: str = "", nodes: int = 0) -> dict:
    """A report with every public key present; None where not yet known."""
    return {
        "graph": name,
        "training": False,
        "nodes": nodes,
        "action": UNCHANGED,
        "reason": "",
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
        "achievable_peak_bytes": None,
        "predicted_seconds_added": None,
        # With a budget: device bytes in use outside this graph when it was
        # planned (the allocator's bytes in use less the graph's variables).
        "outside_bytes": None,
    }


@contextlib.contextmanager
def _timed(report: dict, stage: str):
    """Adds the wall time of a stage to report["stage_seconds"]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        report["stage_seconds"][stage] = time.perf_counter() - start


def _finish(report: dict, start: float, graph_def=None) -> PassResult:
    report["pass_seconds"] = time.perf_counter() - start
    return PassResult(graph_def=graph_def, report=report)


def run_pass(graph_bytes: bytes, fetch: Sequence[str], preserve: Sequence[str],
             state: config.State,
             properties: Optional[PropertiesFn] = None,
             in_use: Optional[InUseFn] = None, defer: bool = False) -> PassResult:
    """Runs sntf's graph pass on one serialized GraphDef.

    Grappler's meta-optimizer runs every optimizer twice per graph, sntf's
    last in each iteration. A graph sntf rewrote in the first iteration went
    through TensorFlow's optimizers once more, and they act on what the
    rewrite changed: the arithmetic optimizer's MinimizeBroadcasts stage,
    for one, reassociates a product whose factor lost its second reader to a
    recomputed clone ((rsqrt * x) * gamma became (rsqrt * gamma) * x), so
    results were no longer bitwise those of TensorFlow, and oneDNN's rewrite
    then found "nodes in a cycle" in one such graph. So the plugin asks the
    first call to defer: a training graph sntf would act on goes back
    unchanged (PassResult.deferred) and is rewritten the second time.

    Args:
      graph_bytes: the serialized GraphDef Grappler handed over.
      fetch: fetch node names.
      preserve: nodes-to-preserve names.
      state: the switch state (policy, budget, options) for this call.
      properties: callable returning serialized static output properties per
        node name; only valid during the Grappler callback.
      in_use: callable giving a device allocator's bytes in use now; with a
        budget, what the device holds outside this graph (input pipelines,
        other models) is taken off the budget the plan must fit.
      defer: leave a training graph the policy would act on for a later call.

    Returns:
      A PassResult. Its graph_def is None when the graph must go back unchanged.
    """
    start = time.perf_counter()
    report = new_report()
    report["policy"] = state.policy
    report["fetch"] = list(fetch)
    try:
        from tensorflow.core.framework import graph_pb2

        with _timed(report, "parse"):
            graph_def = graph_pb2.GraphDef.FromString(graph_bytes)
        key = graph_key(graph_def, fetch)
        with _timed(report, "index"):
            index = graph.build_index(graph_def, fetch, preserve)
        report["nodes"] = len(index)
        report["graph"] = graph.name_hint(index)
        report["devices"] = sorted({d for d in index.devices if d})
        result = _plan_and_rewrite(graph_def, index, state, report, start, properties,
                                   in_use, defer)
        return dataclasses.replace(result, key=key)
    except Exception as e:  # noqa: BLE001 - the pass must never fail a graph
        report["action"] = ERROR
        report["reason"] = f"{type(e).__name__}: {e}"
        report["error"] = traceback.format_exc(limit=8)
        return _finish(report, start)


def decode_properties(raw: dict) -> dict:
    """Serialized OpInfo.TensorProperties per node -> [(dtype, shape or None)].

    Args:
      raw: node name -> list of serialized TensorProperties (one per output).

    Returns:
      node name -> list of (DataType enum, dims with -1 for unknown, or None
      for an unknown rank).
    """
    from tensorflow.core.grappler.costs import op_performance_data_pb2 as perf

    decoded = {}
    for name, outputs in raw.items():
        items = []
        for data in outputs:
            p = perf.OpInfo.TensorProperties.FromString(data)
            shape = None if p.shape.unknown_rank else tuple(d.size for d in p.shape.dim)
            items.append((p.dtype, shape))
        decoded[name] = items
    return decoded


def _analyze(index: graph.GraphIndex, state: config.State,
             properties: Optional[PropertiesFn], report: dict):
    """Runs the analysis; on failure the report says why and planning goes on
    without it (the plan then changes nothing)."""
    if properties is None:
        report["analysis_error"] = "no static properties were handed over"
        return None, None
    try:
        with _timed(report, "shapes"):
            props = decode_properties(properties(list(index.names)))
        batch = state.options.batch_size
        source = "option batch_size" if batch is not None else None
        if batch is None and analysis.has_unknown_dims(props):
            batch = config.runtime_batch()
            if batch is not None:
                source = "the input Keras fit() feeds"
            else:
                report["analysis_error"] = (
                    "the batch dimension is unknown in this graph; sizes assume "
                    "a batch of 1 (pass sntf.enable(..., batch_size=N))")
        report["batch_source"] = source
        with _timed(report, "analysis"):
            facts = analysis.analyze(index, props, batch=batch)
    except Exception as e:  # noqa: BLE001 - the analysis must not fail the graph
        report["analysis_error"] = f"{type(e).__name__}: {e}"
        return None, None
    report["batch"] = batch
    report["predicted_peak_bytes"] = facts.budget_peak_bytes
    report["lower_bound_bytes"] = facts.lower_bound_bytes
    report["analysis"] = facts.summary()
    return facts, props


def _on_gpu(index: graph.GraphIndex) -> bool:
    """Whether any node of the graph is placed on a GPU."""
    return any("GPU" in d.upper() for d in index.devices if d)


def _budget_bytes(state: config.State, index: graph.GraphIndex) -> Optional[int]:
    """The user's budget in bytes for this graph's device (None without one,
    and for budget "auto" on a CPU graph)."""
    if state.budget is None:
        return None
    gpu = _on_gpu(index)
    if state.budget.auto and not gpu:
        return None
    return state.budget.resolve(config.device_memory_bytes(gpu=gpu))


def _link_bandwidth(state: config.State, index: graph.GraphIndex) -> float:
    """Bytes per second between device and host pool: the option, else PCIe
    4 x16 on a GPU graph, else the cost model's memory bandwidth (on CPU a
    swap is a host memcpy).

    A constant, not a rate measured at run time: a measured memcpy rate
    swung between 6.4 and 7.9 GB/s with the load on this 2-core machine,
    and the U-Net's budget plan, whose prefetch distances it sets, between
    51.2 and 59.0 MiB planned, so the same graph was rewritten differently
    from one process to the next.
    """
    if state.options.link_bandwidth is not None:
        return float(state.options.link_bandwidth)
    if _on_gpu(index):
        return PCIE4_X16_BYTES_PER_SECOND
    return analysis.DEFAULT_COST_MODEL.bytes_per_second


PCIE4_X16_BYTES_PER_SECOND = 25e9


@dataclasses.dataclass
class _Planned:
    """A plan applied to a graph: the rewritten graph, its index and analysis."""

    graph_def: object
    index: graph.GraphIndex
    facts: object


def _planned(plan: planner.Plan, graph_def, before: graph.GraphIndex, props,
             batch) -> Optional[_Planned]:
    """Applies `plan` to `graph_def` and analyzes the result (None when the
    plan changes nothing). A malformed or cyclic result raises GraphError."""
    result = rewrite.apply_plan(graph_def, plan)
    if not result.modified:
        return None
    new_index = _validate(result.graph_def, before)
    return _Planned(result.graph_def, new_index,
                    analysis.analyze(new_index, _with_generated(props, new_index),
                                     batch=batch))


def _onednn_enabled() -> bool:
    """Whether TensorFlow's oneDNN graph rewrites run (TF_ENABLE_ONEDNN_OPTS;
    on by default on x86 Linux). Unknown counts as on: the swap planner
    then keeps oneDNN's forward/gradient pairs intact."""
    try:
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except Exception:  # noqa: BLE001 - a private API; the safe answer
        return True


def _protected(index: graph.GraphIndex) -> frozenset:
    return frozenset(index.fetch) | frozenset(index.preserve)


def _swap_plan(index: graph.GraphIndex, facts, props, state: config.State,
               cache_budget: Optional[int]) -> planner.Plan:
    """The swap plan of an analyzed graph (with a budget, through the
    run-time tensor cache)."""
    dtypes, shapes = {}, {}
    for name, outs in props.items():
        if name in index.index:
            for port, (dtype, shape) in enumerate(outs):
                dtypes[(index.node(name), port)] = dtype
                shapes[(index.node(name), port)] = shape
    plan = planner.plan_swap(index, facts, dtypes, state.options.swap_min_bytes,
                             _link_bandwidth(state, index), _protected(index), shapes,
                             workspace_pairs=_onednn_enabled())
    return dataclasses.replace(plan, cache_budget=cache_budget)


def _stage_plan(kind: str, graph_def, index: graph.GraphIndex, facts, props,
                state: config.State, cache_budget: Optional[int]):
    """One planning stage ("recompute" or "swap") on an analyzed graph.

    Returns:
      (plan, _Planned of the plan or None when the plan changes nothing).
    """
    if kind == "recompute":
        if state.options.recompute_mode == "auto":
            chosen = _auto_recompute(graph_def, index, facts, props, _protected(index))
        elif state.options.recompute_mode == "memory":
            chosen = _memory_recompute(graph_def, index, facts, props, _protected(index))
        else:
            chosen = _lowest_recompute(graph_def, index, facts, props, "speed",
                                       _protected(index))
        return _updates_in_place(*chosen, graph_def, index, props, facts.batch)
    plan = _swap_plan(index, facts, props, state, cache_budget)
    return plan, _planned(plan, graph_def, index, props, facts.batch)


# An update held back by its reads' readers keeps its gradient a little
# longer: planned 1-10 KiB higher on ResNet-14, DenseNet and the 178-layer
# ResNet. The allocator model cannot see the copies the edges avoid
# (measured 20-25 MiB on DenseNet from the second step), so a plan this
# much higher is still taken; VGG's memory-centric plan came out 1.0 MiB
# higher and measured 1.1 MiB higher (51.7 -> 52.8), and is not.
UPDATE_ORDER_SLACK_BYTES = 64 << 10


def _updates_in_place(plan: planner.Plan, planned: Optional[_Planned], graph_def,
                      index: graph.GraphIndex, props, batch):
    """A recompute plan with its variable updates ordered after the readers
    of their reads (planner.plan_update_order), unless that plans higher.

    The allocator model starts each step from the same state, so it cannot
    see what the edges prevent (variables copied to new buffers mid-step,
    fragmenting the steps after the first); it can see an update held back
    past the planned peak (see UPDATE_ORDER_SLACK_BYTES).

    Returns:
      (plan, _Planned of the plan or None), as _stage_plan.
    """
    if planned is None:
        return plan, planned
    orders = planner.plan_update_order(planned.index)
    if not orders:
        return plan, planned
    ordered = dataclasses.replace(
        plan, orders=tuple(plan.orders) + orders,
        notes=(f"{plan.notes[0]}, {len(orders)} edge(s) ordering variable updates after "
               "their reads' readers", *plan.notes[1:]))
    ordered_planned = _planned(ordered, graph_def, index, props, batch)
    if (ordered_planned.facts.budget_peak_bytes
            > planned.facts.budget_peak_bytes + UPDATE_ORDER_SLACK_BYTES):
        return plan, planned
    return ordered, ordered_planned


def _auto_recompute(graph_def, index: graph.GraphIndex, facts, props,
                    protected: frozenset):
    """Superneurons' cost-aware rule on the planned timeline.

    Every segment starts speed-centric (one recomputation, kept through its
    backward readers). The speed plan is analyzed; the segments whose clones
    are live at its planned peak are switched to memory-centric (one
    recomputation per reader, freed right after), which is kept only if the
    planned peak falls.

    Returns:
      (plan, _Planned of the plan or None), as _stage_plan.
    """
    speed, planned = _lowest_recompute(graph_def, index, facts, props, "speed",
                                       protected)
    if planned is None:
        # Keep the planner's own reason ("control flow present: not
        # recomputed"); its count note ("recompute (speed): 0 tensor(s)") is not one.
        why = "; ".join(n for n in speed.notes if not n.startswith("recompute (")
                        ) or "nothing to recompute"
        return dataclasses.replace(speed, notes=(f"recompute (auto): {why}",)), None
    peak = planned.facts.peak_step
    at_peak = set()
    for b, (start, end) in planned.facts.intervals.items():
        source = names.recompute_source(planned.index.names[b[0]])
        if source and start <= peak <= end:
            at_peak.add(source)
    memory_tensors = frozenset(r.tensor for r in speed.recomputes
                               if any(node in at_peak for node in r.chain))
    note = f"recompute (auto): {len(speed.recomputes)} tensor(s), speed-centric"
    if memory_tensors:
        mixed, mixed_planned = _lowest_recompute(graph_def, index, facts, props,
                                                 "speed", protected, memory_tensors)
        if (mixed_planned is not None and mixed_planned.facts.budget_peak_bytes
                < planned.facts.budget_peak_bytes):
            note += (f", {len(memory_tensors)} live at the planned peak made "
                     "memory-centric")
            return dataclasses.replace(mixed, notes=(note,)), mixed_planned
    return dataclasses.replace(speed, notes=(note,)), planned


def _lowest_recompute(graph_def, index: graph.GraphIndex, facts, props, mode: str,
                      protected: frozenset, memory_tensors: frozenset = frozenset(),
                      segment_checkpoints: int = 0):
    """The recompute plan of `mode` whose planned peak is lower, of two.

    Where a clone is released decides how long it and the gradients its
    readers wait on stay alive, and the executor's pool (which runs the
    most recently deferred op first) makes the best release point hard to
    pick locally. The planner picks them on the predicted executor order,
    and again on the order that takes each node's consumers last first;
    both plans are analyzed and the lower planned peak is kept. (Measured:
    on a 178-layer ResNet the first plan's peak is 151.5 MiB, the second's
    125.6; on DenseNet the first is lower.)

    Returns:
      (plan, _Planned of the plan or None when it changes nothing).
    """
    candidates = []
    for order in (None, analysis.schedule(index, consumers_last_first=True)):
        plan = planner.plan_recompute(index, facts, mode, protected, memory_tensors,
                                      order=order,
                                      segment_checkpoints=segment_checkpoints)
        candidates.append((plan, _planned(plan, graph_def, index, props, facts.batch)))
    return _lowest_planned(candidates)


def _lowest_planned(candidates: list):
    """Of (plan, _Planned or None) pairs, the plan that changes the graph
    with the lowest planned peak (the first if none changes it)."""
    changed = [c for c in candidates if c[1] is not None]
    if not changed:
        return candidates[0]
    return min(changed, key=lambda c: c[1].facts.budget_peak_bytes)


# Memory-centric recomputation also plans re-running checkpoint ops
# (convolutions, matmuls) in segments of up to this many (the planner's
# segment_checkpoints) and keeps the plan planned lowest. Measured on a
# 178-layer ResNet (planned): 124.0 MiB with segments of 2, 95.0 with 3,
# with the weight gradients ordered first 71.3 and 66.0, against 125.6
# under the paper's rule.
MEMORY_SEGMENTS = (2, 3)


def _memory_recompute(graph_def, index: graph.GraphIndex, facts, props,
                      protected: frozenset):
    """Memory-centric recomputation, never planned above speed-centric.

    One recomputation per backward reader frees each clone right after its
    reader. Plans are made under the paper's rule (checkpoint ops' outputs
    kept) and with checkpoint ops re-run in segments (MEMORY_SEGMENTS, with
    the weight gradients ordered first, see _segmented_recompute); the one
    planned lowest is kept. Its planned peak can still come out above the
    speed-centric plan's (measured: VGG's memory-centric plan had fewer live
    bytes at its peak, and a higher peak in the allocator model's terms,
    where a 22.5 MiB scratch buffer lands); then the speed-centric plan is
    the one applied, with a note.

    Returns:
      (plan, _Planned of the plan or None), as _stage_plan.
    """
    candidates = [_lowest_recompute(graph_def, index, facts, props, "memory",
                                    protected)]
    candidates += [_segmented_recompute(graph_def, index, facts, props, protected, k)
                   for k in MEMORY_SEGMENTS]
    memory, planned = _lowest_planned(candidates)
    if planned is None:
        return memory, None
    speed, speed_planned = _lowest_recompute(graph_def, index, facts, props, "speed",
                                             protected)
    if (speed_planned is not None and speed_planned.facts.budget_peak_bytes
            < planned.facts.budget_peak_bytes):
        note = (f"recompute (memory): {len(speed.recomputes)} tensor(s), "
                f"speed-centric: its planned peak "
                f"({speed_planned.facts.budget_peak_bytes} bytes) is below the "
                f"memory-centric one ({planned.facts.budget_peak_bytes} bytes)")
        return dataclasses.replace(speed, notes=(note, *speed.notes[1:])), speed_planned
    return memory, planned


def _segmented_recompute(graph_def, index: graph.GraphIndex, facts, props,
                         protected: frozenset, per_segment: int):
    """Memory-centric recomputation that re-runs checkpoint ops too.

    Only each segment's input is kept (planner.plan_recompute's
    segment_checkpoints). The recomputed graph then also gets the weight
    gradients ordered before the input gradients of the same output
    gradients (planner.plan_gradient_order), where that plans lower:
    deferred by the executor, they kept both their gradients and their
    recomputed inputs alive to the end of the backward pass.

    Returns:
      (plan, _Planned of the plan or None), as _stage_plan.
    """
    plan, planned = _lowest_recompute(graph_def, index, facts, props, "memory",
                                      protected, segment_checkpoints=per_segment)
    if planned is None:
        return plan, None
    note = (f"recompute (memory): {len(plan.recomputes)} tensor(s), checkpoint ops "
            f"re-run in segments of up to {per_segment}")
    plan = dataclasses.replace(plan, notes=(note, *plan.notes[1:]))
    orders = planner.plan_gradient_order(planned.index)
    if orders:
        ordered = dataclasses.replace(plan, orders=orders, notes=(
            f"{note}, {len(orders)} weight gradient edge(s) ordered first",
            *plan.notes[1:]))
        ordered_planned = _planned(ordered, graph_def, index, props, facts.batch)
        if ordered_planned.facts.budget_peak_bytes < planned.facts.budget_peak_bytes:
            return ordered, ordered_planned
    return plan, planned


STAGES = {"recompute": ("recompute",), "swap": ("swap",),
          "swap+recompute": ("recompute", "swap"),
          # Without a budget "auto" goes as low as it can (with one, see
          # _fit_budget).
          "auto": ("recompute", "swap")}


def _best_rewrite(graph_def, index: graph.GraphIndex, facts, props,
                  state: config.State, report: dict, budget: Optional[int]):
    """Plans, rewrites and re-analyzes, stage by stage (recompute, then swap
    over the recomputed graph); keeps a stage only if it lowers the predicted
    peak (a stage that would not is dropped, with the reason). Policy "auto"
    with a budget (in bytes, for this graph's device) goes to _fit_budget.

    Returns:
      (plan, rewrite result, Analysis of the rewritten graph or None).
    """
    stages = STAGES.get(state.policy, ())
    if not stages:
        plan = planner.make_plan(state.policy)
        with _timed(report, "rewrite"):
            return plan, rewrite.apply_plan(graph_def, plan), None
    if facts is None:
        plan = planner.identity_plan(state.policy, "no analysis: graph left unchanged")
        return plan, rewrite.apply_plan(graph_def, plan), None
    if state.policy == "auto" and budget is not None:
        return _fit_budget(graph_def, index, facts, props, state, budget, report)
    start = _Planned(graph_def, index, facts)
    current, decisions, notes, recomputes, swaps = _run_stages(
        stages, start, props, state, report, budget)
    if len(stages) > 1:
        # Recomputing first can leave the swap planner less to move
        # (measured: recompute then swap planned ResNet-14 at 54.0 MiB and
        # measured 55.4; swap alone planned 41.0, measured 47.8); the
        # last stage alone is kept when it plans lower.
        alone = _run_stages(stages[-1:], start, props, state, report, budget)
        if alone[0].facts.budget_peak_bytes < current.facts.budget_peak_bytes:
            notes = alone[2] + [
                f"{' then '.join(stages)} planned {current.facts.budget_peak_bytes} "
                f"bytes, {stages[-1]} alone {alone[0].facts.budget_peak_bytes}: "
                f"{stages[-1]} alone applied"]
            current, decisions, _, recomputes, swaps = alone
    modified = current.graph_def is not graph_def
    rewritten = current.graph_def
    cache_budget = budget if swaps else None
    if cache_budget is not None:
        outside = report.get("outside_bytes") or 0
        rewritten = _cache_thresholds(rewritten, current.facts, cache_budget, outside)
        notes.append(_cache_note(current.facts, cache_budget, outside))
    plan = planner.Plan(policy=state.policy, decisions=tuple(decisions),
                        notes=tuple(notes), recomputes=recomputes, swaps=swaps,
                        cache_budget=cache_budget)
    final = rewrite.RewriteResult(graph_def=rewritten, modified=modified)
    return plan, final, (current.facts if modified else None)


def _run_stages(stages, current: _Planned, props, state: config.State, report: dict,
                budget: Optional[int]):
    """Plans, rewrites and re-analyzes stage by stage, from `current`; a
    stage is kept only if it lowers the planned peak.

    Returns:
      (final _Planned, decisions, notes, recomputes, swaps).
    """
    decisions, notes, recomputes, swaps = [], [], (), ()
    for kind in stages:
        with _timed(report, f"plan_{kind}"):
            plan, planned = _stage_plan(kind, current.graph_def, current.index,
                                        current.facts,
                                        _with_generated(props, current.index),
                                        state, budget)
        if planned is None:
            notes.extend(plan.notes)
            continue
        if planned.facts.budget_peak_bytes >= current.facts.budget_peak_bytes:
            count = len(plan.recomputes) + len(plan.swaps)
            notes.append(f"{kind}: {count} tensor(s) planned but not applied: the "
                         f"predicted peak would not fall "
                         f"({current.facts.budget_peak_bytes} -> "
                         f"{planned.facts.budget_peak_bytes} bytes)")
            continue
        current = planned
        decisions.extend(plan.decisions)
        notes.extend(plan.notes)
        recomputes, swaps = recomputes + plan.recomputes, swaps + plan.swaps
    return current, decisions, notes, recomputes, swaps


BUDGET_BEHAVIOURS = ("best_effort", "unchanged")


class _Selections:
    """Planned peaks of option selections for the budget planner.

    A selection's recomputations are applied first and its swaps planned
    over the recomputed graph (clones then read swapped-in checkpoints), as
    in "swap+recompute". Each recompute set's graph is kept, so trying swap
    subsets over one recompute set rewrites the recomputation once.
    """

    def __init__(self, graph_def, index, facts, props, state, recompute_plan,
                 budget: int):
        self._base = _Planned(graph_def, index, facts)
        self._props, self._state = props, state
        self._recompute = recompute_plan
        self._budget = budget
        self._recomputed: dict = {}
        self.results: dict = {}      # frozenset(options) -> (plan, _Planned)

    def _recompute_stage(self, tensors: frozenset):
        if tensors not in self._recomputed:
            plan = _subset(self._recompute, tensors)
            planned = None
            if tensors:
                planned = _planned(plan, self._base.graph_def, self._base.index,
                                   self._props, self._base.facts.batch)
            planned = planned or self._base
            swaps = _swap_plan(planned.index, planned.facts,
                               _with_generated(self._props, planned.index),
                               self._state, self._budget)
            self._recomputed[tensors] = (plan, planned, swaps)
        return self._recomputed[tensors]

    def peak(self, selection: tuple) -> int:
        """Planned peak with `selection` applied (and its plan kept)."""
        recompute = frozenset(t for o in selection if o.action == planner.RECOMPUTE
                              for t in o.tensors)
        swap = frozenset(t for o in selection if o.action == planner.SWAP
                         for t in o.tensors)
        plan, planned, swaps = self._recompute_stage(recompute)
        swap_plan = _subset(swaps, swap)
        if swap:
            planned = _planned(swap_plan, planned.graph_def, planned.index,
                               _with_generated(self._props, planned.index),
                               self._base.facts.batch) or planned
        combined = dataclasses.replace(
            plan, decisions=plan.decisions + swap_plan.decisions,
            swaps=swap_plan.swaps, cache_budget=self._budget if swap else None)
        self.results[frozenset(selection)] = (combined, planned)
        return planned.facts.budget_peak_bytes

    def excess(self, selection: tuple, budget: int) -> int:
        """Bytes over `budget` summed over the planned timeline's steps (the
        selection's peak must have been computed)."""
        planned = self.results[frozenset(selection)][1]
        return sum(max(0, b - budget) for b in planned.facts.budget_timeline)


def _subset(plan: planner.Plan, tensors: frozenset) -> planner.Plan:
    """The part of a plan that decides `tensors`."""
    return dataclasses.replace(
        plan, decisions=tuple(d for d in plan.decisions if d.tensor in tensors),
        recomputes=tuple(r for r in plan.recomputes if r.tensor in tensors),
        swaps=tuple(s for s in plan.swaps if s.tensor in tensors))


def budget_options(index: graph.GraphIndex, facts, recompute_plan: planner.Plan,
                   swap_plan: planner.Plan) -> list:
    """The budget planner's options: per buffer the backward pass keeps, its
    recomputation (every recomputed tensor living in it) and its swap.

    Args:
      index, facts: the graph and its analysis.
      recompute_plan, swap_plan: every recomputation and swap the planners
        found on that graph.

    Returns:
      A list of sntf.budget.Option.
    """
    from sntf import budget as budget_planner

    def unit(tensor: str):
        node, _, port = tensor.rpartition(":")
        return facts.buffer_of((index.node(node), int(port)))

    grouped: dict = {}
    for d in recompute_plan.decisions:
        grouped.setdefault(unit(d.tensor), []).append(d)
    options = [budget_planner.Option(
        unit=u, action=planner.RECOMPUTE, tensors=tuple(d.tensor for d in ds),
        bytes_saved=sum(d.bytes_saved or 0 for d in ds),
        seconds=sum(d.seconds_added or 0.0 for d in ds))
        for u, ds in grouped.items()]
    options += [budget_planner.Option(
        unit=unit(d.tensor), action=planner.SWAP, tensors=(d.tensor,),
        bytes_saved=d.bytes_saved or 0, seconds=d.seconds_added or 0.0)
        for d in swap_plan.decisions]
    return options


def budget_search(graph_def, index: graph.GraphIndex, facts, props,
                  state: config.State, budget: int):
    """What the budget planner searches over, for one analyzed graph.

    Args:
      graph_def, index, facts: the graph, its index and its analysis.
      props: static properties per node name (decoded).
      state: the switch state (options: recompute_mode, swap_min_bytes,
        link_bandwidth).
      budget: the byte budget.

    Returns:
      (options, selections): the sntf.budget.Option list, and a _Selections
      whose peak(selection) rewrites and analyzes the graph with a selection
      (and keeps each result in selections.results).
    """
    mode = "memory" if state.options.recompute_mode == "memory" else "speed"
    recompute, _ = _lowest_recompute(graph_def, index, facts, props, mode,
                                     _protected(index))
    swaps = _swap_plan(index, facts, props, state, budget)
    options = budget_options(index, facts, recompute, swaps)
    return options, _Selections(graph_def, index, facts, props, state, recompute,
                                budget)


def _outside_bytes(index: graph.GraphIndex, facts, in_use: InUseFn) -> Optional[int]:
    """Device bytes in use that this graph's step does not account for: the
    allocator's bytes in use now, less the variables the graph reads (which
    the analysis counts as persistent). None when the allocator keeps no
    statistics."""
    try:
        current = in_use("GPU:0" if _on_gpu(index) else "CPU:0")
    except Exception:  # noqa: BLE001 - statistics are an aid, never a failure
        return None
    if current is None:
        return None
    return max(0, int(current) - facts.variable_bytes)


def _fit_budget(graph_def, index: graph.GraphIndex, facts, props,
                state: config.State, budget: int, report: dict):
    """Policy "auto" with a budget: the least predicted extra time whose
    planned peak fits the budget less its margin (option budget_margin),
    by sntf.budget.greedy over every buffer's options.

    A budget that no plan reaches is reported and warned about once, with
    the least planned peak found; then the option budget_behaviour decides:
    "best_effort" applies that plan, "unchanged" leaves the graph alone.

    Returns:
      (plan, rewrite result, Analysis of the rewritten graph or None), as
      _best_rewrite.
    """
    from sntf import budget as budget_planner

    # The plan must fit under the budget less the analysis' error margin,
    # less what the device already holds outside this graph and less the
    # allocator's slack for the largest scratch buffer.
    outside = report.get("outside_bytes") or 0
    slack = allocator_slack(facts)
    target = int(budget * (1.0 - state.options.budget_margin)) - outside - slack
    with _timed(report, "plan_auto"):
        options, selections = budget_search(graph_def, index, facts, props, state,
                                            budget)
        choice = budget_planner.greedy(
            options, selections.peak, target, excess_of=selections.excess,
            small_graph=len(index.names) <= budget_planner.SMALL_GRAPH_NODES)
    plan, planned = selections.results[frozenset(choice.options)]
    report["budget_fits"] = choice.fits
    report["predicted_seconds_added"] = choice.seconds
    counts = {a: sum(1 for o in choice.options if o.action == a)
              for a in (planner.RECOMPUTE, planner.SWAP)}
    note = (f"auto: budget {budget} bytes (plan target {target} bytes: margin "
            f"{state.options.budget_margin:g}, {outside} bytes held outside the "
            f"graph, {slack} bytes of allocator slack), predicted peak "
            f"{facts.budget_peak_bytes} -> planned {choice.peak} bytes with "
            f"{counts[planner.RECOMPUTE]} buffer(s) recomputed and "
            f"{counts[planner.SWAP]} swapped of {len(options)} option(s), "
            f"{choice.seconds * 1e3:.3f} ms predicted extra per step, "
            f"{choice.evaluations} plan(s) evaluated")
    if not choice.fits:
        report["achievable_peak_bytes"] = choice.peak
        behaviour = state.options.budget_behaviour
        warning = (f"sntf: budget {budget} bytes cannot be met for graph "
                   f"{report['graph'] or '?'} (plan target {target} bytes, "
                   f"budget_margin {state.options.budget_margin:g}): the least "
                   "planned peak is "
                   f"{choice.peak} bytes (lower bound of any plan "
                   f"{facts.lower_bound_bytes} bytes); "
                   + ("applying that plan (budget_behaviour='best_effort')"
                      if behaviour == "best_effort" else
                      "graph left unchanged (budget_behaviour='unchanged')"))
        _warn_once(warning)
        note += f"; {warning[len('sntf: '):]}"
        if behaviour == "unchanged":
            plan = planner.identity_plan("auto", note)
            return plan, rewrite.RewriteResult(graph_def=graph_def, modified=False), None
    plan = dataclasses.replace(plan, policy="auto", notes=(note,))
    if planned is not None and planned.graph_def is not graph_def:
        # As in the recompute stage: swaps and clones keep reads alive too.
        # Three fresh runs each at 0.7x TensorFlow's peak, without and with
        # the edges: U-Net 60.1-61.8 -> 59.0-59.9 MiB, Transformer
        # 32.8-34.0 -> 32.8, ResNet-14 47.5-47.6 -> 47.4.
        plan, planned = _updates_in_place(plan, planned, graph_def, index, props,
                                          facts.batch)
        rewritten = planned.graph_def
        if plan.swaps:
            rewritten = _cache_thresholds(rewritten, planned.facts, budget, outside)
            plan = dataclasses.replace(plan, notes=plan.notes + (
                _cache_note(planned.facts, budget, outside),))
        return plan, rewrite.RewriteResult(graph_def=rewritten, modified=True), planned.facts
    return plan, rewrite.RewriteResult(graph_def=graph_def, modified=False), None


def allocator_slack(facts) -> int:
    """Headroom a budget plan leaves for the allocator's rounding: the
    largest scratch buffer's bytes.

    TensorFlow's BFC allocator serves a request from the best-fitting free
    chunk and splits it only when it is at least twice the request, so a
    request may take up to twice its bytes; which chunk it gets depends on
    the allocator's history, which the pass cannot see (its model replays
    one step from an empty allocator). Measured: the main example's CNN, in
    its first step, served a 27 MiB conv filter-gradient scratch buffer from
    a 52 MiB chunk (the process peaked 26 MiB above every later step); the
    im2col scratch of convolution backprops is the largest single request
    in such graphs.
    """
    return max((n for b, n in facts.tensor_bytes.items()
                if b[1] == analysis.SCRATCH_PORT), default=0)


_warned: set = set()


def _warn_once(message: str) -> None:
    """Logs a warning the first time this exact message comes up."""
    if message not in _warned and len(_warned) < 1000:
        _warned.add(message)
        logging.getLogger("sntf").warning(message)


def _cache_thresholds(graph_def, facts, budget: int, outside: int = 0):
    """Sets each SnCacheOut's run-time limits from the plan.

    The planned peak assumes every swap copies, so cached tensors may use
    only the headroom budget - planned peak: kept within it, they raise no
    step of the plan above the budget, wherever that step lies. Each
    SnCacheOut gets the budget (its live-bytes test, a guard for a plan that
    under-estimates) and that headroom (its cap on the device's cached
    bytes); a budget below the planned peak leaves no headroom, and every
    swap copies. `outside` is what the device holds outside the graph; the
    headroom also leaves the allocator's slack, as budget targets do
    (allocator_slack).
    """
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    headroom = _cache_headroom(facts, budget, outside)
    for node in out.node:
        if node.op == names.CACHE_OUT_OP:
            node.attr["budget"].i = budget
            node.attr["headroom"].i = max(0, headroom)
    return out


def _cache_headroom(facts, budget: int, outside: int) -> int:
    """Bytes of swapped tensors the cache may keep on the device (negative:
    none)."""
    return budget - outside - allocator_slack(facts) - facts.budget_peak_bytes


def _cache_note(facts, budget: int, outside: int = 0) -> str:
    peak = facts.budget_peak_bytes
    headroom = _cache_headroom(facts, budget, outside)
    held = f" - {outside} held outside the graph" if outside else ""
    slack = allocator_slack(facts)
    slack_text = f" - {slack} allocator slack" if slack else ""
    if headroom < 0:
        return (f"budget {budget} bytes{held}{slack_text} is below the planned peak "
                f"{peak} bytes: every swap copies")
    return (f"tensor cache: up to {headroom} bytes of swapped tensors stay on the "
            f"device (budget {budget}{held}{slack_text} - planned peak {peak})")


CUDNN_WORKSPACE_ENV = "TF_CUDNN_WORKSPACE_LIMIT_IN_MB"
# Below this cuDNN is left its smallest algorithms only; 0 would forbid any
# workspace and fail some convolutions outright.
MIN_CUDNN_WORKSPACE_MB = 32


def _per_device(index: graph.GraphIndex, facts, planned, plan, rewritten) -> dict:
    """Device -> the pass's figures and actions there, for a graph placed on
    several devices (one replica per device under tf.distribute).

    `rewritten` is the graph handed back: under "swap+recompute" a swapped
    tensor may be a recomputed clone's, a node only that graph has.
    """
    devices = sorted({d for d in index.devices if d})
    if len(devices) < 2:
        return {}
    device_of = {node.name: node.device for node in rewritten.node}

    def on(device, tensors):
        return [t for t in tensors if device_of.get(t.rsplit(":", 1)[0]) == device]

    before = facts.device_peak_bytes if facts is not None else {}
    after = (planned or facts).device_peak_bytes if facts is not None else {}
    return {device: {
        "nodes": sum(1 for d in index.devices if d == device),
        "predicted_peak_bytes": before.get(device),
        "planned_peak_bytes": after.get(device, before.get(device)),
        "swapped": on(device, plan.tensors(planner.SWAP)),
        "recomputed": on(device, plan.tensors(planner.RECOMPUTE)),
    } for device in devices}


def cudnn_workspace_limit_mb(budget: int, planned_peak: int) -> int:
    """The cuDNN workspace limit a budget leaves: the headroom between the
    planned peak and the budget, in MiB, at least MIN_CUDNN_WORKSPACE_MB.

    Args:
      budget: the device budget in bytes.
      planned_peak: the planned peak of the rewritten graph in bytes.

    Returns:
      The limit in MiB for TF_CUDNN_WORKSPACE_LIMIT_IN_MB.
    """
    return max(MIN_CUDNN_WORKSPACE_MB, (budget - planned_peak) >> 20)


def _set_cudnn_workspace_limit(limit_mb: int) -> None:
    """Sets TensorFlow's cuDNN workspace limit for convolution kernels built
    from now on (they read the variable when constructed); a value the user
    set is left alone."""
    if os.environ.get(CUDNN_WORKSPACE_ENV, "") not in ("", _cudnn_set_by_sntf[0]):
        return
    os.environ[CUDNN_WORKSPACE_ENV] = str(limit_mb)
    if _cudnn_set_by_sntf[0] != str(limit_mb):
        logging.getLogger("sntf").info("sntf: %s=%d (budget headroom over the "
                                       "planned peak)", CUDNN_WORKSPACE_ENV, limit_mb)
    _cudnn_set_by_sntf[0] = str(limit_mb)


_cudnn_set_by_sntf = [""]


def _validate(graph_def, before: graph.GraphIndex) -> graph.GraphIndex:
    """Indexes a rewritten graph; a malformed or cyclic result is an error
    (the pass then hands the original graph back)."""
    fetch = [before.names[i] for i in before.fetch]
    preserve = [before.names[i] for i in before.preserve]
    index = graph.build_index(graph_def, fetch, preserve)
    if index.has_cycles and not before.has_cycles:
        raise graph.GraphError("the rewrite created a cycle")
    missing = set(fetch) - set(index.names)
    if missing:
        raise graph.GraphError(f"the rewrite lost fetch nodes {sorted(missing)}")
    return index


def _with_generated(props: dict, index: graph.GraphIndex) -> dict:
    """Static properties extended to sntf's nodes: a recomputed clone has its
    source's outputs, a swap node the one tensor it moves."""
    extended = dict(props)
    for name in index.names:
        if name in extended:
            continue
        source = names.recompute_source(name)
        if source in props:
            extended[name] = props[source]
            continue
        swapped = names.swap_source(name)
        if swapped is not None:
            node, port = swapped
            node = names.recompute_source(node) or node
            if node in props and port < len(props[node]):
                extended[name] = [props[node][port]]
    return extended


def _plan_and_rewrite(graph_def, index: graph.GraphIndex, state: config.State,
                      report: dict, start: float,
                      properties: Optional[PropertiesFn] = None,
                      in_use: Optional[InUseFn] = None,
                      defer: bool = False) -> PassResult:
    if index.sntf_nodes:
        report["action"] = UNCHANGED
        report["reason"] = (f"already rewritten by sntf ({len(index.sntf_nodes)} "
                            "sntf nodes); the pass is idempotent")
        report["training"] = True
        return _finish(report, start)
    with _timed(report, "detect"):
        info = graph.detect_training(index)
    report["training"] = info.training
    if not info.training:
        report["action"] = SKIPPED
        report["reason"] = f"not a training graph: {info.reason}"
        return _finish(report, start)
    if graph.xla_compiled(graph_def):
        report["action"] = SKIPPED
        report["reason"] = ("XLA-compiled graph: custom ops cannot run inside "
                            "an XLA cluster, so sntf leaves it alone")
        return _finish(report, start)
    if defer and (state.policy != "off" or state.options.identity_rewrite):
        report["reason"] = f"training graph ({info.reason}); {DEFERRED}"
        return dataclasses.replace(_finish(report, start), deferred=True)
    facts, props = _analyze(index, state, properties, report)
    # Resolved once per pass (a GPU graph's fraction asks the CUDA runtime).
    budget = _budget_bytes(state, index)
    if facts is not None and budget is not None and in_use is not None:
        report["outside_bytes"] = _outside_bytes(index, facts, in_use)
    plan, result, planned = _best_rewrite(graph_def, index, facts, props, state,
                                          report, budget)
    if facts is not None:
        plan = dataclasses.replace(
            plan, predicted_peak_bytes=facts.budget_peak_bytes,
            planned_peak_bytes=(planned or facts).budget_peak_bytes,
            lower_bound_bytes=facts.lower_bound_bytes)
        report["planned_peak_bytes"] = plan.planned_peak_bytes
        report["budget_bytes"] = budget
        if budget is not None:
            # The workspace gets the headroom left by the plan and by what
            # the device holds outside the graph.
            limit = cudnn_workspace_limit_mb(
                budget - (report["outside_bytes"] or 0), plan.planned_peak_bytes)
            report["cudnn_workspace_limit_mb"] = limit
            if _on_gpu(index):
                _set_cudnn_workspace_limit(limit)
    if state.options.keep_graphs:
        report["original_graph"] = graph_def
        report["rewritten_graph"] = result.graph_def
        report["analysis_result"] = facts
        report["planned_analysis_result"] = planned
        report["properties"] = props
    report["swapped"] = plan.tensors(planner.SWAP)
    report["recomputed"] = plan.tensors(planner.RECOMPUTE)
    report["per_device"] = _per_device(index, facts, planned, plan, result.graph_def)
    report["plan"] = plan.to_dict()
    if result.modified or state.options.identity_rewrite:
        report["action"] = REWRITTEN
        report["reason"] = (f"training graph ({info.reason}); "
                            + "; ".join(plan.notes or ("plan applied",)))
        return _finish(report, start, result.graph_def)
    report["action"] = UNCHANGED
    report["reason"] = f"training graph ({info.reason}); " + "; ".join(plan.notes)
    return _finish(report, start)
