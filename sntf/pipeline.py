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


@dataclasses.dataclass
class PassResult:
    """What the pass returns: a new GraphDef (or None for "unchanged") and a report."""

    graph_def: Optional[object]
    report: dict
    # Identity of the graph across Grappler's two iterations (None when the
    # graph could not be parsed); see graph_key.
    key: Optional[bytes] = None


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
        "error": None,
        "invocations": 1,
        "batch": None,
        "stage_seconds": {},
        "analysis": None,
        "analysis_error": None,
        "cudnn_workspace_limit_mb": None,
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
             properties: Optional[PropertiesFn] = None) -> PassResult:
    """Runs sntf's graph pass on one serialized GraphDef.

    Args:
      graph_bytes: the serialized GraphDef Grappler handed over.
      fetch: fetch node names.
      preserve: nodes-to-preserve names.
      state: the switch state (policy, budget, options) for this call.
      properties: callable returning serialized static output properties per
        node name; only valid during the Grappler callback. Unused until the
        analysis stage needs shapes.

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
        result = _plan_and_rewrite(graph_def, index, state, report, start, properties)
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
        if batch is None and analysis.has_unknown_dims(props):
            report["analysis_error"] = (
                "the batch dimension is unknown in this graph; sizes assume a "
                "batch of 1 (pass sntf.enable(..., batch_size=N))")
        with _timed(report, "analysis"):
            facts = analysis.analyze(index, props, batch=batch)
    except Exception as e:  # noqa: BLE001 - the analysis must not fail the graph
        report["analysis_error"] = f"{type(e).__name__}: {e}"
        return None, None
    report["batch"] = batch
    report["predicted_peak_bytes"] = facts.predicted_peak_bytes
    report["lower_bound_bytes"] = facts.lower_bound_bytes
    report["analysis"] = facts.summary()
    return facts, props


def _on_gpu(index: graph.GraphIndex) -> bool:
    """Whether any node of the graph is placed on a GPU."""
    return any("GPU" in d.upper() for d in index.devices if d)


def _budget_bytes(state: config.State) -> Optional[int]:
    """The user's budget in bytes (None without one)."""
    if state.budget is None:
        return None
    return state.budget.resolve(config.device_memory_bytes())


def _link_bandwidth(state: config.State, index: graph.GraphIndex) -> float:
    """Bytes per second between device and host pool: the option, else PCIe
    4 x16 on a GPU graph, else the measured memcpy rate of this machine."""
    if state.options.link_bandwidth is not None:
        return float(state.options.link_bandwidth)
    if _on_gpu(index):
        return PCIE4_X16_BYTES_PER_SECOND
    return memcpy_bandwidth()


PCIE4_X16_BYTES_PER_SECOND = 25e9
_memcpy_rate: list = []


def memcpy_bandwidth() -> float:
    """Host memcpy rate (bytes/s), measured once per process on 32 MiB."""
    if not _memcpy_rate:
        import numpy as np

        src = np.ones(32 << 20, dtype=np.uint8)
        dst = np.empty_like(src)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - start)
        _memcpy_rate.append(src.nbytes / max(best, 1e-6))
    return _memcpy_rate[0]


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


def _stage_plan(kind: str, graph_def, index: graph.GraphIndex, facts, props,
                state: config.State, cache_budget: Optional[int]):
    """One planning stage ("recompute" or "swap") on an analyzed graph.

    Returns:
      (plan, _Planned of the plan or None when the plan changes nothing).
    """
    protected = frozenset(index.fetch) | frozenset(index.preserve)
    if kind == "recompute":
        if state.options.recompute_mode == "auto":
            return _auto_recompute(graph_def, index, facts, props, protected)
        plan = planner.plan_recompute(index, facts, state.options.recompute_mode,
                                      protected)
    else:
        dtypes, shapes = {}, {}
        for name, outs in props.items():
            if name in index.index:
                for port, (dtype, shape) in enumerate(outs):
                    dtypes[(index.node(name), port)] = dtype
                    shapes[(index.node(name), port)] = shape
        plan = planner.plan_swap(index, facts, dtypes, state.options.swap_min_bytes,
                                 _link_bandwidth(state, index), protected, shapes)
        # With a budget the swaps go through the run-time tensor cache.
        plan = dataclasses.replace(plan, cache_budget=cache_budget)
    return plan, _planned(plan, graph_def, index, props, facts.batch)


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
    speed = planner.plan_recompute(index, facts, "speed", protected)
    planned = _planned(speed, graph_def, index, props, facts.batch)
    if planned is None:
        return dataclasses.replace(speed, notes=("recompute (auto): nothing to recompute",)), None
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
        mixed = planner.plan_recompute(index, facts, "speed", protected, memory_tensors)
        mixed_planned = _planned(mixed, graph_def, index, props, facts.batch)
        if (mixed_planned is not None and mixed_planned.facts.predicted_peak_bytes
                < planned.facts.predicted_peak_bytes):
            note += (f", {len(memory_tensors)} live at the planned peak made "
                     "memory-centric")
            return dataclasses.replace(mixed, notes=(note,)), mixed_planned
    return dataclasses.replace(speed, notes=(note,)), planned


STAGES = {"recompute": ("recompute",), "swap": ("swap",),
          "swap+recompute": ("recompute", "swap")}


def _best_rewrite(graph_def, index: graph.GraphIndex, facts, props,
                  state: config.State, report: dict):
    """Plans, rewrites and re-analyzes, stage by stage (recompute, then swap
    over the recomputed graph); keeps a stage only if it lowers the predicted
    peak (a stage that would not is dropped, with the reason).

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
    budget = _budget_bytes(state)
    current = _Planned(graph_def, index, facts)
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
        if planned.facts.predicted_peak_bytes >= current.facts.predicted_peak_bytes:
            count = len(plan.recomputes) + len(plan.swaps)
            notes.append(f"{kind}: {count} tensor(s) planned but not applied: the "
                         f"predicted peak would not fall "
                         f"({current.facts.predicted_peak_bytes} -> "
                         f"{planned.facts.predicted_peak_bytes} bytes)")
            continue
        current = planned
        decisions.extend(plan.decisions)
        notes.extend(plan.notes)
        recomputes, swaps = recomputes + plan.recomputes, swaps + plan.swaps
    modified = current.graph_def is not graph_def
    rewritten = current.graph_def
    cache_budget = budget if swaps else None
    if cache_budget is not None:
        rewritten = _cache_thresholds(rewritten, current.index, current.facts, cache_budget)
        notes.append(_cache_note(current.facts, cache_budget))
    plan = planner.Plan(policy=state.policy, decisions=tuple(decisions),
                        notes=tuple(notes), recomputes=recomputes, swaps=swaps,
                        cache_budget=cache_budget)
    final = rewrite.RewriteResult(graph_def=rewritten, modified=modified)
    return plan, final, (current.facts if modified else None)


def _cache_thresholds(graph_def, index: graph.GraphIndex, facts, budget: int):
    """Sets each SnCacheOut's run-time threshold from the planned timeline.

    The planned peak assumes every swap copies. Keeping a tensor on the
    device adds its bytes to every later step, so the cache may keep tensors
    only within the headroom budget - planned peak. At run time a swap-out
    compares the allocator's live bytes with the live bytes planned at its
    step: threshold = budget - planned peak + planned live at that step, so
    "live + tensor <= threshold" means "what the cache already keeps, plus
    this tensor, fits the headroom". A budget below the planned peak leaves
    no headroom: every swap copies.
    """
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    step_of = {node: s for s, node in enumerate(facts.schedule)}
    headroom = budget - facts.predicted_peak_bytes
    for node in out.node:
        if node.op == names.CACHE_OUT_OP:
            live = facts.timeline.device_bytes[step_of[index.node(node.name)]]
            # No headroom: anything kept would add to a peak already over.
            node.attr["budget"].i = headroom + live if headroom >= 0 else 0
    return out


def _cache_note(facts, budget: int) -> str:
    headroom = budget - facts.predicted_peak_bytes
    if headroom < 0:
        return (f"budget {budget} bytes is below the planned peak "
                f"{facts.predicted_peak_bytes} bytes: every swap copies")
    return (f"tensor cache: up to {headroom} bytes of swapped tensors stay on the "
            f"device (budget {budget} - planned peak {facts.predicted_peak_bytes})")


CUDNN_WORKSPACE_ENV = "TF_CUDNN_WORKSPACE_LIMIT_IN_MB"
# Below this cuDNN is left its smallest algorithms only; 0 would forbid any
# workspace and fail some convolutions outright.
MIN_CUDNN_WORKSPACE_MB = 32


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
                      properties: Optional[PropertiesFn] = None) -> PassResult:
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
    facts, props = _analyze(index, state, properties, report)
    plan, result, planned = _best_rewrite(graph_def, index, facts, props, state, report)
    if facts is not None:
        plan = dataclasses.replace(
            plan, predicted_peak_bytes=facts.predicted_peak_bytes,
            planned_peak_bytes=(planned or facts).predicted_peak_bytes,
            lower_bound_bytes=facts.lower_bound_bytes)
        report["planned_peak_bytes"] = plan.planned_peak_bytes
        if state.budget is not None:
            limit = cudnn_workspace_limit_mb(_budget_bytes(state), plan.planned_peak_bytes)
            report["cudnn_workspace_limit_mb"] = limit
            if _on_gpu(index):
                _set_cudnn_workspace_limit(limit)
    if state.options.keep_graphs:
        report["original_graph"] = graph_def
        report["rewritten_graph"] = result.graph_def
        report["analysis_result"] = facts
        report["planned_analysis_result"] = planned
    report["swapped"] = plan.tensors(planner.SWAP)
    report["recomputed"] = plan.tensors(planner.RECOMPUTE)
    report["plan"] = plan.to_dict()
    if result.modified or state.options.identity_rewrite:
        report["action"] = REWRITTEN
        report["reason"] = (f"training graph ({info.reason}); "
                            + "; ".join(plan.notes or ("plan applied",)))
        return _finish(report, start, result.graph_def)
    report["action"] = UNCHANGED
    report["reason"] = f"training graph ({info.reason}); " + "; ".join(plan.notes)
    return _finish(report, start)
