"""The graph pass: parse -> index -> detect -> analyze -> plan -> rewrite -> report.

`run_pass` is a pure function of its arguments: the switch state and what
it may read of the process around it (the Environment) are passed in, and
what it wants done outside the graph (a warning to log) comes back in the
result. It never raises for a graph: internal failures
come back as a result whose graph is None (meaning "leave the graph
unchanged") and whose report says why.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Callable, Optional, Sequence

from sntf import analysis, config, graph, planner, report as reports, rewrite
from sntf.analysis import Analyzed, tensor_cache
from sntf.analysis.breakdown import breakdown
from sntf.graph.identity import graph_key
from sntf.planner import budget as budget_planning
from sntf.planner import heuristics
from sntf.planner.room import Room

# Re-exported: the report's actions and its schema.
UNCHANGED, REWRITTEN, SKIPPED, ERROR = (reports.UNCHANGED, reports.REWRITTEN,
                                        reports.SKIPPED, reports.ERROR)
DEFERRED = reports.DEFERRED
new_report = reports.new_report

PropertiesFn = Callable[[Sequence[str]], dict]


@dataclasses.dataclass(frozen=True)
class Environment:
    """What the pass may read of the process around it, handed in.

    Attributes:
      threads: intra-op threads of the device (convolution scratch sizes).
      onednn: whether TensorFlow's oneDNN graph rewrites run (they pair
        forward ops with their gradients).
      runtime_batch: the batch of the input Keras' fit() is feeding, or None.
      device_memory: device ("CPU:0", "GPU:1") -> the memory its allocator
        may hand out, in bytes (budget fractions resolve against it).
      allocator_limit: device name -> its TensorFlow allocator's byte
        limit, or None where none was read (budget "auto" on the CPU binds
        only under such a limit: TF_CPU_BFC_MEM_LIMIT_IN_MB).
      allocator_grows: device name -> whether its BFC allocator grows by
        regions (the CPU's; a GPU's under memory growth) rather than taking
        its whole limit at once.
      in_use: device name -> its allocator's bytes in use now, or None
        where the allocator keeps no statistics.
      xla_auto_jit: whether XLA auto-clustering may compile the graph after
        the pass (then a rewrite would change how XLA clusters and rounds).
      inter_op_threads: the inter-op threads the user set, or None for
        TensorFlow's default pool. With one, the executor runs a step in
        one order on its own, and the order edges (pin_order) are left out
        where a budget or a device limit binds the plan.
      op_determinism: whether TensorFlow's op determinism is on (the user
        asked for results that repeat bit for bit).
      watch: called with the report of a training graph the pass goes on
        to plan, which the pass then fills as it goes (a progress display
        follows it), or None.
    """

    threads: int = 1
    onednn: bool = True
    runtime_batch: Optional[int] = None
    device_memory: Callable[[str], int] = lambda device: 0
    allocator_limit: Callable[[str], Optional[int]] = lambda device: None
    allocator_grows: Callable[[str], bool] = lambda device: True
    in_use: Optional[Callable[[str], Optional[int]]] = None
    xla_auto_jit: bool = False
    inter_op_threads: Optional[int] = None
    op_determinism: bool = False
    watch: Optional[Callable[[dict], None]] = None


@dataclasses.dataclass
class PassResult:
    """What the pass returns.

    Attributes:
      graph_def: a new GraphDef, or None for "leave the graph unchanged".
      report: the report (see sntf.report.new_report).
      key: the graph's identity across Grappler's two iterations (None when
        the graph could not be parsed).
      deferred: a training graph left for Grappler's last iteration.
      warnings: messages to log once.
    """

    graph_def: Optional[object]
    report: dict
    key: Optional[bytes] = None
    deferred: bool = False
    warnings: tuple = ()


def run_pass(graph_bytes: bytes, fetch: Sequence[str], preserve: Sequence[str],
             state: config.State, properties: Optional[PropertiesFn] = None,
             env: Optional[Environment] = None, defer: bool = False) -> PassResult:
    """Runs sntf's graph pass on one serialized GraphDef.

    Grappler's meta-optimizer runs every optimizer twice per graph, sntf's
    last in each iteration. A graph sntf rewrote in the first iteration
    would go through TensorFlow's optimizers once more, and they act on what
    the rewrite changed (the arithmetic optimizer reassociates a product
    whose factor lost a reader to a recomputed clone, changing the bits of
    the result). So the plugin asks the first call to defer: a training
    graph sntf would act on goes back unchanged (PassResult.deferred) and is
    rewritten the second time.

    Args:
      graph_bytes: the serialized GraphDef Grappler handed over.
      fetch: fetch node names.
      preserve: nodes-to-preserve names.
      state: the switch state (policy, budget, options) for this call.
      properties: callable returning serialized static output properties per
        node name; only valid during the Grappler callback.
      env: what the pass may read of the process (default: Environment()).
      defer: leave a training graph the policy would act on for a later call.

    Returns:
      A PassResult. Its graph_def is None when the graph must go back unchanged.
    """
    start = time.perf_counter()
    report = reports.new_report()
    report["policy"] = state.policy
    report["fetch"] = list(fetch)
    try:
        from tensorflow.core.framework import graph_pb2

        with reports.timed(report, "parse"):
            graph_def = graph_pb2.GraphDef.FromString(graph_bytes)
        key = graph_key(graph_def, fetch)
        with reports.timed(report, "index"):
            index = graph.build_index(graph_def, fetch, preserve)
        report["nodes"] = len(index)
        report["graph"] = graph.name_hint(index)
        report["devices"] = sorted({d for d in index.devices if d})
        result = _run(graph_def, index, state, report, properties, env or Environment(),
                      defer)
        result.key = key
        return _finish(result, start)
    except Exception as e:  # noqa: BLE001 - the pass must never fail a graph
        report["action"] = ERROR
        report["reason"] = f"{type(e).__name__}: {e}"
        report["error"] = traceback.format_exc(limit=8)
        return _finish(PassResult(None, report), start)


def _finish(result: PassResult, start: float) -> PassResult:
    result.report["pass_seconds"] = time.perf_counter() - start
    return result


XLA_AUTO_JIT = ("XLA auto-clustering is on (TF_XLA_FLAGS --tf_xla_auto_jit or "
                "tf.config.optimizer.set_jit): it clusters the graph after sntf's "
                "pass, and a rewritten graph would cluster and round differently, "
                "so sntf leaves it alone; turn auto-clustering off to use sntf")


def _skip_reason(graph_def, index, report: dict, env: Environment
                 ) -> tuple[Optional[str], str]:
    """(why the pass does not act on this graph at all, or None; why it is a
    training graph). The report's field skip gets the first as a code."""
    if index.sntf_nodes:
        report["training"] = True
        report["skip"] = "already_rewritten"
        return (f"already rewritten by sntf ({len(index.sntf_nodes)} "
                "sntf nodes); the pass is idempotent"), ""
    with reports.timed(report, "detect"):
        info = graph.detect_training(index)
    report["training"] = info.training
    if not info.training:
        report["action"] = SKIPPED
        report["skip"] = "not_training"
        return f"not a training graph: {info.reason}", info.reason
    if graph.xla_compiled(graph_def):
        report["action"] = SKIPPED
        report["skip"] = "xla_compiled"
        return ("XLA-compiled graph: custom ops cannot run inside "
                "an XLA cluster, so sntf leaves it alone"), info.reason
    if env.xla_auto_jit:
        report["action"] = SKIPPED
        report["skip"] = "xla_auto_jit"
        return XLA_AUTO_JIT, info.reason
    return None, info.reason


def _run(graph_def, index, state: config.State, report: dict,
         properties: Optional[PropertiesFn], env: Environment, defer: bool) -> PassResult:
    skip, why_training = _skip_reason(graph_def, index, report, env)
    if skip is not None:
        report["reason"] = skip
        return PassResult(None, report)
    if defer and (state.policy != "off" or state.options.identity_rewrite):
        report["deferred"] = True
        _explain(report, why_training, (DEFERRED,))
        return PassResult(None, report, deferred=True)
    if env.watch is not None:
        # Only a training graph the pass goes on to plan can take long.
        env.watch(report)
    original = graph_def
    with reports.timed(report, "sums"):
        sums = rewrite.hold_before_planning(graph_def, index, _onednn(env, index),
                                            env.op_determinism, state.options.exact_sums)
    report["order_dependent_sums"] = sums.fields()
    if sums.code is not None:
        report["action"] = UNCHANGED
        _explain(report, why_training, (sums.note(),))
        if state.options.keep_graphs:
            report.update(original_graph=graph_def, rewritten_graph=graph_def)
        return PassResult(None, report)
    graph_def, index = sums.graph_def, sums.index
    base = _analyze(graph_def, index, state, properties, env, report)
    # Resolved once per pass (a GPU graph's fraction asks for the GPU's memory).
    budget = _budget_bytes(state, index, env)
    outcome = _plan(base, graph_def, index, state, env, budget, report)
    rewritten = outcome.planned.graph_def if outcome.planned is not None else None
    if rewritten is not None and outcome.cache_headroom is not None:
        rewritten = rewrite.set_cache_limits(rewritten, outcome.plan.cache_budget,
                                             outcome.cache_headroom)
    result = PassResult(None, report, warnings=outcome.warnings)
    plan = _record_plan(outcome, base, budget, report)
    held = sums
    if rewritten is not None:
        with reports.timed(report, "sums"):
            sums = rewrite.hold_after_planning(
                rewritten, outcome.planned.index, base.index, base.facts.timeline.steps,
                _onednn(env, index), sums)
        report["order_dependent_sums"] = sums.fields()
        rewritten = sums.graph_def if sums.code is None else None
        if rewritten is None:
            plan = dataclasses.replace(plan, notes=plan.notes + (sums.note(
                "plan dropped" if _held_alone(held, env) else "graph left unchanged"),))
            report.update(planned_peak_bytes=report.get("predicted_peak_bytes"),
                          swapped=[], recomputed=[])
    if rewritten is None and base is not None and state.policy != "off" \
            and _held_alone(held, env):
        # The user asked for repeatable results, which TensorFlow's graph
        # does not give: its accumulators go back held to one order.
        rewritten = held.graph_def
        report["order_dependent_sums"] = held.fields()
        # First: it is what the graph goes back with.
        plan = dataclasses.replace(plan, summary="", notes=(
            HELD_ALONE.format(held.accumulations),) + plan.lines)
    graph_def = original
    handed = rewritten if rewritten is not None else graph_def
    if state.options.keep_graphs:
        report.update(original_graph=graph_def, rewritten_graph=handed,
                      analysis_result=base.facts if base else None,
                      planned_analysis_result=(outcome.planned.facts
                                               if outcome.planned else None),
                      properties=base.props if base else None)
    report["per_device"] = reports.per_device(
        index, base.facts if base else None,
        outcome.planned.facts if outcome.planned else None, plan, handed)
    if rewritten is not None or state.options.identity_rewrite:
        report["action"] = REWRITTEN
        _explain(report, why_training, plan.lines or ("plan applied",))
        result.graph_def = handed
    else:
        report["action"] = UNCHANGED
        _explain(report, why_training, plan.lines)
    return result


def _explain(report: dict, why_training: str, notes) -> None:
    """The report's reason for a training graph: why it is one, then what
    was done with it (its notes, also kept apart for readers of the report)."""
    report["training_reason"] = why_training
    report["notes"] = list(notes)
    report["reason"] = f"training graph ({why_training}); " + "; ".join(notes)


HELD_ALONE = ("order-dependent sums held to one order ({} edge(s) between additions of "
              "Grappler accumulators), as op determinism asks: TensorFlow adds them in "
              "the order their terms arrive")


def _held_alone(held, env: Environment) -> bool:
    """Whether a graph whose plan changes nothing still goes back with its
    accumulators held to one order: under op determinism, where it has
    such edges."""
    return env.op_determinism and held.code is None and held.accumulations > 0


def _plan(base: Optional[Analyzed], graph_def, index, state: config.State,
          env: Environment, budget: Optional[int], report: dict) -> planner.Outcome:
    """The policy's outcome (an identity plan where the analysis failed)."""
    if state.policy == "off":
        with reports.timed(report, "rewrite"):
            if base is None:
                return planner.Outcome(planner.identity_plan("off", planner.policies.OFF_NOTE))
            return planner.plan("off", base, _context(state, env, Room(), index, report))
    if base is None:
        return planner.Outcome(planner.identity_plan(
            state.policy, "no analysis: graph left unchanged"))
    room = _room(state, base, index, env, budget, report)
    if room.limit is not None:
        report["device_limit_bytes"] = room.limit
    # A budget's or a device limit's "fits" is judged on the prediction, so
    # it must be of an order the run reaches: the executor's.
    free = not room.binds
    # One inter-op thread runs a step in one order of its own. Held to the
    # executor's order as the analysis emulates it, the main example (a
    # budget) measured higher (71.8 MiB against 68.0 unchained). Without a
    # budget the plan may hold a memory-aware order, which that thread does
    # not follow on its own, and the emulation is not always its order: the
    # zoo's GPT at oneDNN off measured 55.6-56.5 MiB unchained against
    # 42.1 planned, and 39.0-39.2 held (planned 40.6). So one thread is
    # chained too where nothing binds the plan.
    ctx = _context(state, env, room, index, report, memory_order=free,
                   pin_order=state.options.pin_order and (free or env.inter_op_threads != 1))
    return planner.plan(state.policy, base, ctx, report["graph"])


def _context(state: config.State, env: Environment, room: Room, index, report: dict,
             **search) -> planner.Context:
    return planner.Context(
        evaluate=rewrite.evaluator(env.threads, _onednn(env, index)),
        options=planner.context.Options(
            recompute_mode=state.options.recompute_mode,
            swap_min_bytes=state.options.swap_min_bytes,
            budget_behaviour=state.options.budget_behaviour,
            min_gain=state.options.min_gain, pin_order=state.options.pin_order),
        device=planner.context.Device(bandwidth=_link_bandwidth(state, index),
                                      onednn=env.onednn, pool=env.inter_op_threads != 1),
        room=room, search=planner.context.Search(**search),
        instruments=planner.context.Instruments(report["stage_seconds"]))


def _record_plan(outcome: planner.Outcome, base: Optional[Analyzed],
                 budget: Optional[int], report: dict) -> planner.Plan:
    """Fills the report from the plan."""
    plan = outcome.plan
    if outcome.fit is not None:
        report.update(outcome.fit.fields())
    if base is not None:
        # The plan is chosen on the graph alone. What the device holds
        # outside it shapes the allocator's layout for it, so the reported
        # peaks are modelled on top of that (analysis.memory.device_series):
        # the graph's share of what the device reports.
        outside = report.get("outside_bytes") or 0
        facts = analysis.with_outside(base.facts, outside)
        planned = outcome.planned
        shown = analysis.with_outside(planned.facts, outside) if planned else facts
        plan = dataclasses.replace(
            plan, predicted_peak_bytes=facts.budget_peak_bytes,
            planned_peak_bytes=shown.budget_peak_bytes,
            lower_bound_bytes=facts.lower_bound_bytes)
        report["predicted_peak_bytes"] = plan.predicted_peak_bytes
        report["planned_peak_bytes"] = plan.planned_peak_bytes
        if (planned is not None and outcome.cache_headroom and outcome.cache_headroom > 0
                and not planned.facts.device_timelines):
            report["cached_peak_bytes"] = tensor_cache.cached_peak(
                planned.index, shown, outcome.cache_headroom)
        report["budget_bytes"] = budget
        if budget is not None:
            # The headroom the plan and what the device holds outside the
            # graph leave for cuDNN's workspace: reported, never set.
            # TensorFlow reads TF_CUDNN_WORKSPACE_LIMIT_IN_MB once per process
            # (a function-level static in ConvolveScratchSize), so a value
            # set from the pass, after the first convolution, has no effect,
            # and writing os.environ here races with other threads' getenv.
            # Its DnnScratchAllocator allocates without retry and skips an
            # algorithm whose workspace does not fit: the workspace cannot
            # run the step out of memory.
            report["cudnn_workspace_limit_mb"] = budget_planning.cudnn_workspace_limit_mb(
                budget - (report["outside_bytes"] or 0), plan.planned_peak_bytes)
    report["swapped"] = plan.tensors(planner.SWAP)
    report["recomputed"] = plan.tensors(planner.RECOMPUTE)
    report["plan"] = plan.to_dict()
    final = outcome.planned or base
    if final is not None:
        report["peak_breakdown"] = breakdown(final.index, final.facts)
    return plan


def _analyze(graph_def, index, state: config.State, properties: Optional[PropertiesFn],
             env: Environment, report: dict) -> Optional[Analyzed]:
    """Runs the analysis; on failure the report says why and planning goes on
    without it (the plan then changes nothing)."""
    if properties is None:
        report["analysis_error"] = "no static properties were handed over"
        return None
    try:
        with reports.timed(report, "shapes"):
            props = analysis.decode_properties(properties(list(index.names)))
        batch = state.options.batch_size
        source = "option batch_size" if batch is not None else None
        if batch is None and analysis.has_unknown_dims(props):
            batch = env.runtime_batch
            if batch is not None:
                source = "the input Keras fit() feeds"
            else:
                report["analysis_error"] = (
                    "the batch dimension is unknown in this graph; sizes assume "
                    "a batch of 1 (pass sntf.enable(..., batch_size=N))")
        report["batch_source"] = source
        with reports.timed(report, "analysis"):
            base = analysis.analyze_graph(graph_def, index, props, batch, env.threads,
                                          _onednn(env, index))
    except Exception as e:  # noqa: BLE001 - the analysis must not fail the graph
        report["analysis_error"] = f"{type(e).__name__}: {e}"
        return None
    if env.in_use is not None:
        report["outside_bytes"] = _outside_bytes(index, base.facts, env.in_use)
    report["batch"] = batch
    report["predicted_peak_bytes"] = base.facts.budget_peak_bytes
    report["lower_bound_bytes"] = base.facts.lower_bound_bytes
    report["analysis"] = base.facts.summary()
    return base


def _onednn(env: Environment, index) -> bool:
    """Whether oneDNN's kernels run this graph's convolutions (they serve
    the CPU only; a GPU graph's convolutions are TensorFlow's own)."""
    return env.onednn and not _on_gpu(index)


def _room(state: config.State, base: Analyzed, index, env: Environment,
          budget: Optional[int], report: dict) -> Room:
    """The room the step has on its device: the budget, and for policy
    "auto" the device allocator's limit where it has one (a GPU's, or the
    CPU's under TF_CPU_BFC_MEM_LIMIT_IN_MB). What the device holds outside
    the graph counts where either binds the plan; without, the plan is
    chosen on the graph alone."""
    device = graph_device(index)
    limit = env.allocator_limit(device) if state.policy == "auto" else None
    binds = budget is not None or bool(limit)
    outside = (report.get("outside_bytes") or 0) if binds else 0
    return Room.of(base.facts, budget, state.options.budget_margin, outside, device,
                   limit or None, env.allocator_grows(device) if limit else False)


def graph_device(index) -> str:
    """The device whose memory a graph's budget is about: its first GPU
    ("GPU:1" for a graph placed on /device:GPU:1), else "CPU:0"."""
    for device in index.devices:
        upper = (device or "").upper()
        if "GPU:" in upper:
            index_text = upper.rsplit("GPU:", 1)[1].split("/")[0]
            return f"GPU:{int(index_text)}" if index_text.isdigit() else "GPU:0"
    return "CPU:0"


def _on_gpu(index) -> bool:
    """Whether any node of the graph is placed on a GPU."""
    return any(graph.on_gpu(d) for d in set(index.devices) if d)


def _budget_bytes(state: config.State, index, env: Environment) -> Optional[int]:
    """The user's budget in bytes for this graph's device (None without one,
    and for budget "auto" on a CPU graph whose allocator has no limit)."""
    if state.budget is None:
        return None
    if state.budget.bytes is not None:
        return state.budget.bytes      # asking the device's memory would be for nothing
    device = graph_device(index)
    if state.budget.auto and device.startswith("CPU"):
        limit = env.allocator_limit(device)
        return state.budget.resolve(limit) if limit else None
    return state.budget.resolve(env.device_memory(device))


def _link_bandwidth(state: config.State, index) -> float:
    """Bytes per second between device and host pool: the option, else PCIe
    4 x16 on a GPU graph, else the cost model's memory bandwidth (on CPU a
    swap is a host memcpy). A constant, never a rate measured at run time:
    the same graph gets the same plan in every process."""
    if state.options.link_bandwidth is not None:
        return float(state.options.link_bandwidth)
    if _on_gpu(index):
        return heuristics.PCIE4_X16_BYTES_PER_SECOND
    return analysis.DEFAULT_COST_MODEL.bytes_per_second


def _outside_bytes(index, facts, in_use) -> Optional[int]:
    """Device bytes in use that this graph's step does not account for: the
    allocator's bytes in use now, less the variables the graph reads (which
    the analysis counts as persistent). None when the allocator keeps no
    statistics."""
    try:
        current = in_use(graph_device(index))
    except Exception:  # noqa: BLE001 - statistics are an aid, never a failure
        return None
    if current is None:
        return None
    return max(0, int(current) - facts.variable_bytes)
