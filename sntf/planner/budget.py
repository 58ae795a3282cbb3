"""Planning under a memory budget: per buffer, keep, recompute or swap, so
that the planned peak fits at the least predicted extra time.

The options come from the recompute and swap planners; the search
(sntf.planner.search) picks among them by planned peaks, each found by
trying the selection with Context.evaluate.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from sntf.graph import names
from sntf.planner import heuristics, search
from sntf.planner.context import Context, protected
from sntf.planner.modes import gradient_ordered, updates_in_place
from sntf.planner.plan import RECOMPUTE, SWAP, Plan, acting, identity_plan, subset
from sntf.planner.backward import backward_read_by_buffer
from sntf.planner.swap import default_min_bytes, plan_swap, tensor_properties, threshold_at_peak

BUDGET_BEHAVIOURS = ("best_effort", "unchanged")


def swap_stage(base, ctx: Context, cache_budget: Optional[int] = None,
               min_bytes: Optional[int] = None) -> Plan:
    """The swap plan of an analyzed graph (with a budget, its swaps are
    conditional on the device's memory at run time); min_bytes: the
    threshold, else the user's (ctx.options.swap_min_bytes)."""
    if min_bytes is None:
        min_bytes = ctx.options.swap_min_bytes
    dtypes, shapes = tensor_properties(base.index, base.props)
    plan = plan_swap(base.index, base.facts, dtypes, min_bytes, ctx.device.bandwidth,
                     protected(base.index), shapes, workspace_pairs=ctx.device.onednn)
    return dataclasses.replace(plan, cache_budget=cache_budget)


def lowest_swap(base, ctx: Context):
    """The swap stage: the swap plan planned lowest of its thresholds.

    ctx.options.swap_min_bytes when the user set it; else the default threshold
    (swap.default_min_bytes), and where that came down for a network of
    small tensors, the usual one too: the swap-ins of more, smaller tensors
    can crowd the backward pass and plan higher. Where the chosen plan's
    peak still holds kept activations below its threshold (a U-Net's
    half-MiB skips), the threshold reaching them is tried as well; its
    plan stands only if it plans lower.

    Returns:
      (plan, the rewritten graph analyzed or None).
    """
    threshold = ctx.options.swap_min_bytes
    if threshold is None:
        threshold = default_min_bytes(
            base.facts, backward_read_by_buffer(base.index, base.facts))
    tried = [threshold]
    if ctx.options.swap_min_bytes is None and threshold < heuristics.SWAP_MIN_BYTES:
        tried.append(heuristics.SWAP_MIN_BYTES)
    best = None
    for min_bytes in reversed(tried):   # the usual threshold wins a tie
        best = _lower_swap(best, base, ctx, min_bytes)
    reach = (threshold_at_peak(best[1].index, best[1].facts, best[2])
             if ctx.options.swap_min_bytes is None and best[1] is not None else None)
    if reach is not None:
        best = _lower_swap(best, base, ctx, reach)
    return best[:2]


def _lower_swap(best: Optional[tuple], base, ctx: Context, min_bytes: int) -> tuple:
    """(plan, planned, threshold): the swap plan at min_bytes where it plans
    lower than best's (or best is None), else best."""
    plan = swap_stage(base, ctx, ctx.budget, min_bytes)
    planned = ctx.evaluate(plan, base)
    if best is None or (planned is not None and (
            best[1] is None or planned.peak < best[1].peak)):
        return plan, planned, min_bytes
    return best


def cudnn_workspace_limit_mb(budget: int, planned_peak: int) -> int:
    """The cuDNN workspace limit a budget suggests (reported; sntf sets
    none): the headroom between the planned peak and the budget, in MiB, at
    least MIN_CUDNN_WORKSPACE_MB.

    Args:
      budget: the device budget in bytes.
      planned_peak: the planned peak of the rewritten graph in bytes.

    Returns:
      The limit in MiB.
    """
    return max(heuristics.MIN_CUDNN_WORKSPACE_MB, (budget - planned_peak) >> 20)


class Selections:
    """Planned peaks of option selections for the budget search.

    A selection's recomputations are applied first and its swaps planned
    over the recomputed graph (clones then read swapped-in checkpoints), as
    in "swap+recompute". Each recompute set's graph is kept, so trying swap
    subsets over one recompute set rewrites the recomputation once.
    """

    def __init__(self, base, ctx: Context, recompute_plan: Plan, budget: int):
        self._base, self._ctx = base, ctx
        self._recompute = recompute_plan
        self._budget = budget
        self._recomputed: dict = {}
        self.results: dict = {}      # frozenset(options) -> (plan, analyzed graph)

    def _recompute_stage(self, tensors: frozenset):
        if tensors not in self._recomputed:
            plan = subset(self._recompute, tensors)
            planned = self._ctx.evaluate(plan, self._base) if tensors else None
            planned = planned or self._base
            swaps = swap_stage(planned, self._ctx, self._budget)
            self._recomputed[tensors] = (plan, planned, swaps)
        return self._recomputed[tensors]

    def peak(self, selection: tuple) -> int:
        """Planned peak with `selection` applied (and its plan kept)."""
        recompute = frozenset(t for o in selection if o.action == RECOMPUTE
                              for t in o.tensors)
        swap = frozenset(t for o in selection if o.action == SWAP for t in o.tensors)
        plan, planned, swaps = self._recompute_stage(recompute)
        swap_plan = subset(swaps, swap)
        if swap:
            planned = self._ctx.evaluate(swap_plan, planned) or planned
        combined = dataclasses.replace(
            plan, decisions=plan.decisions + swap_plan.decisions,
            swaps=swap_plan.swaps, cache_budget=self._budget if swap else None)
        self.results[frozenset(selection)] = (combined, planned)
        return self._judged(combined, planned)

    def _judged(self, plan: Plan, planned) -> int:
        """The peak a selection's plan is judged by: its rewritten graph's,
        or lower, with weight gradients first (modes.gradient_ordered), as
        the plan taken is finished (finish.gradients_first). Judged without
        them, a selection looks higher than the plan it becomes by a share
        that differs from one selection to the next: a budget then took
        more swaps than it needed, and a lower budget could plan higher."""
        if planned is self._base:
            return planned.peak
        try:
            _, ordered = gradient_ordered(planned, self._ctx, plan)
        except Exception:  # noqa: BLE001 - optional: judged as rewritten
            return planned.peak
        return planned.peak if ordered is None else min(planned.peak, ordered.peak)

    def excess(self, selection: tuple, budget: int) -> int:
        """Bytes over `budget` summed over the planned timeline's steps (the
        selection's peak must have been computed)."""
        planned = self.results[frozenset(selection)][1]
        return sum(max(0, b - budget) for b in planned.facts.budget_timeline)


def budget_options(index, facts, recompute_plan: Plan, swap_plan: Plan) -> list:
    """The budget search's options: per buffer the backward pass keeps, its
    recomputation (every recomputed tensor living in it) and its swap.

    Args:
      index, facts: the graph and its analysis.
      recompute_plan, swap_plan: every recomputation and swap the planners
        found on that graph.

    Returns:
      A list of sntf.planner.search.Option.
    """
    def unit(tensor: str):
        node, port = names.split_tensor(tensor)
        return facts.buffer_of((index.node(node), port))

    grouped: dict = {}
    for d in acting(recompute_plan.decisions):
        grouped.setdefault(unit(d.tensor), []).append(d)
    options = [search.Option(
        unit=u, action=RECOMPUTE, tensors=tuple(d.tensor for d in ds),
        bytes_saved=sum(d.bytes_saved or 0 for d in ds),
        seconds=sum(d.seconds_added or 0.0 for d in ds))
        for u, ds in grouped.items()]
    options += [search.Option(
        unit=unit(d.tensor), action=SWAP, tensors=(d.tensor,),
        bytes_saved=d.bytes_saved or 0, seconds=d.seconds_added or 0.0)
        for d in acting(swap_plan.decisions)]
    return options


def budget_search(base, ctx: Context, sources: tuple):
    """What the budget search searches over, for one analyzed graph.

    Args:
      base: the analyzed graph.
      ctx: the planning context; ctx.budget is set.
      sources: (recompute source, swap source), each (analyzed graph,
        context) -> a plan: every recomputation, and every swap, the search
        may choose from (policies.FitBudget.sources).

    Returns:
      (options, selections, candidates): the search.Option list; a
      Selections whose peak(selection) rewrites and analyzes the graph with
      a selection (and keeps each result in selections.results); and the
      recompute and swap plans the options came from.
    """
    recompute_source, swap_source = sources
    recompute, swaps = recompute_source(base, ctx), swap_source(base, ctx)
    options = budget_options(base.index, base.facts, recompute, swaps)
    return options, Selections(base, ctx, recompute, ctx.budget), (recompute, swaps)


@dataclasses.dataclass(frozen=True)
class Fitted:
    """What fit_budget found: the plan, the rewritten graph analyzed (None
    when unchanged), the search's Choice, the plan target, and the warning
    to log once when the budget cannot be met."""

    plan: Plan
    planned: Optional[object]
    choice: Optional[search.Choice]
    candidates: tuple = ()
    warning: Optional[str] = None


def budget_target(ctx: Context) -> int:
    """The planned peak the budget search must not exceed: the room's
    target (Room.target), less the room the search holds back for order
    edges and for a device's regions (Search.reserve)."""
    return ctx.room.target - ctx.search.reserve


def fit_budget(base, ctx: Context, sources: tuple, name: str = "") -> Fitted:
    """The least predicted extra time whose planned peak fits the budget
    less its margin, by search.greedy over every buffer's options.

    A budget that no plan reaches is reported with the least planned peak
    found (and a warning to log once); then ctx.options.budget_behaviour decides:
    "best_effort" applies that plan, "unchanged" leaves the graph alone.

    Args:
      base: the analyzed graph.
      ctx: the planning context; ctx.budget is set.
      sources: where the search's options come from (budget_search).
      name: the graph's name, for the warning.

    Returns:
      A Fitted.
    """
    budget = ctx.budget
    slack = ctx.room.slack
    target = budget_target(ctx)
    with ctx.timed("plan_auto"):
        options, selections, candidates = budget_search(base, ctx, sources)
        choice = search.greedy(
            options, selections.peak, target, excess_of=selections.excess,
            small_graph=len(base.index.names) <= heuristics.SMALL_GRAPH_NODES)
    plan, planned = selections.results[frozenset(choice.options)]
    note = _budget_note(base, ctx, target, slack, choice, len(options))
    warning = None
    if not choice.fits:
        warning = unmet_warning(base, ctx, target, choice.peak, name)
        note += f"; {warning[len('sntf: '):]}"
        if ctx.options.budget_behaviour == "unchanged":
            return Fitted(identity_plan("auto", note), None, choice, candidates, warning)
    plan = dataclasses.replace(plan, policy="auto", summary=note, notes=())
    if planned is None or planned.stored is base.stored:
        return Fitted(plan, None, choice, candidates, warning)
    # As in the recompute stage: swaps and clones keep reads alive too.
    plan, planned = updates_in_place(plan, planned, base, ctx)
    if plan.swaps:
        plan = dataclasses.replace(plan, notes=plan.notes + (
            ctx.room.cache_note(planned.facts),))
    return Fitted(plan, planned, choice, candidates, warning)


def _budget_note(base, ctx: Context, target: int, slack: int, choice, options: int) -> str:
    counts = {a: sum(1 for o in choice.options if o.action == a)
              for a in (RECOMPUTE, SWAP)}
    reserve = (f", {ctx.search.order_reserve} bytes for order edges"
               if ctx.search.order_reserve else "")
    if ctx.search.region_reserve:
        reserve += (f", {ctx.search.region_reserve} bytes for the device's allocator "
                    "regions")
    return (f"auto: budget {ctx.budget} bytes (plan target {target} bytes: margin "
            f"{ctx.room.margin:g}, {ctx.room.outside} bytes held outside the "
            f"graph, {slack} bytes of allocator slack{reserve}), predicted peak "
            f"{base.facts.budget_peak_bytes} -> planned {choice.peak} bytes with "
            f"{counts[RECOMPUTE]} buffer(s) recomputed and "
            f"{counts[SWAP]} swapped of {options} option(s), "
            f"{choice.seconds * 1e3:.3f} ms predicted extra per step, "
            f"{choice.evaluations} plan(s) evaluated")


def unmet_warning(base, ctx: Context, target: int, peak: int, name: str,
                  held: Optional[int] = None) -> str:
    """The warning logged once when no plan meets ctx.budget; peak: the
    least planned peak found (with held, the least in the executor's
    order); held: where the plan applied is held to a memory-aware order
    by its edges and plans below the target only there, its planned
    peak."""
    behaviour = ctx.options.budget_behaviour
    applied = ("applying that plan (budget_behaviour='best_effort')" if held is None else
               f"applying a plan held to a memory-aware order, planned at {held} bytes "
               "(budget_behaviour='best_effort')")
    return (f"sntf: budget {ctx.budget} bytes cannot be met for graph "
            f"{name or '?'} (plan target {target} bytes, "
            f"budget_margin {ctx.room.margin:g}): the least "
            + ("planned peak is " if held is None else
               "planned peak in the executor's order is ")
            + f"{peak} bytes (lower bound of any plan "
            f"{base.facts.lower_bound_bytes} bytes); "
            + (applied if behaviour == "best_effort" else
               "graph left unchanged (budget_behaviour='unchanged')"))
