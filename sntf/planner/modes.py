"""Recompute modes: speed-centric, memory-centric (with segments) and the
cost-aware auto mode, each chosen on planned timelines.

Every function here plans on an analyzed graph (sntf.analysis.Analyzed),
tries its candidate plans with Context.evaluate, and returns (plan, the
rewritten graph analyzed, or None when the plan changes nothing).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from sntf.analysis import schedule
from sntf.graph import names
from sntf.planner import heuristics, order
from sntf.planner.context import Context, protected
from sntf.planner.plan import Plan
from sntf.planner.rebuild import plan_rebuilds
from sntf.planner.recompute import plan_recompute

MODES = ("speed", "memory", "auto")


def recompute(base, ctx: Context, mode: Optional[str] = None):
    """The recompute plan of a mode (ctx.options.recompute_mode by default), with
    variable updates ordered after their reads' readers.

    Args:
      base: the analyzed graph.
      ctx: the planning context.
      mode: "speed", "memory" or "auto".

    Returns:
      (plan, the rewritten graph analyzed or None).
    """
    mode = mode or ctx.options.recompute_mode
    if mode == "auto":
        chosen = auto_recompute(base, ctx)
    elif mode == "memory":
        chosen = memory_recompute(base, ctx)
    else:
        chosen = lowest_recompute(base, ctx, "speed")
    return updates_in_place(*chosen, base, ctx)


def rebuild(base, ctx: Context, judged_here: bool = True):
    """Cheap backward tensors re-run for their readers after the first
    (sntf.planner.rebuild), released on the predicted executor order: one
    clone for all of them, or one per reader under recompute_mode "memory".

    Args:
      base, ctx: the analyzed graph and the planning context.
      judged_here: the rebuilds stand only if they lower this graph's
        planned peak by heuristics.REBUILD_PEAK_SHARE of it; False: the
        caller judges them after the stages that follow.

    Returns:
      (plan, the rewritten graph analyzed or None when nothing qualified).
    """
    mode = "memory" if ctx.options.recompute_mode == "memory" else "speed"
    plan = plan_rebuilds(base.index, base.facts, mode, protected(base.index))
    if not plan.recomputes:
        return dataclasses.replace(plan, notes=()), None   # nothing to say
    planned = ctx.evaluate(plan, base)
    least = int(heuristics.REBUILD_PEAK_SHARE * base.peak)
    if judged_here and planned is not None and planned.peak > base.peak - least:
        # Each clone costs time; a few hundred bytes are not worth it.
        why = (f"rebuild: {len(plan.recomputes)} backward tensor(s) not re-run: the "
               f"planned peak would fall by less than {least} bytes "
               f"({base.peak} -> {planned.peak})")
        return dataclasses.replace(plan, decisions=(), recomputes=(), notes=(why,)), None
    return plan, planned


def updates_in_place(plan: Plan, planned, base, ctx: Context):
    """A plan with its variable updates ordered after the readers of their
    reads (sntf.planner.order.plan_update_order), unless that plans higher.

    The allocator model starts each step from the same state, so it cannot
    see what the edges prevent (variables copied to new buffers mid-step,
    fragmenting the steps after the first); it can see an update held back
    past the planned peak (see heuristics.UPDATE_ORDER_SLACK_BYTES).

    Returns:
      (plan, the rewritten graph analyzed or None).
    """
    if planned is None:
        return plan, planned
    orders = order.plan_update_order(planned.index)
    if not orders:
        return plan, planned
    ordered = dataclasses.replace(
        plan, orders=tuple(plan.orders) + orders,
        summary=(f"{plan.summary}, {len(orders)} edge(s) ordering variable updates after "
                 "their reads' readers"))
    ordered_planned = ctx.evaluate(ordered, base)
    if ordered_planned.peak > planned.peak + heuristics.UPDATE_ORDER_SLACK_BYTES:
        return plan, planned
    return ordered, ordered_planned


def auto_recompute(base, ctx: Context):
    """Superneurons' cost-aware rule on the planned timeline.

    Every segment starts speed-centric (one recomputation, kept through its
    backward readers). The speed plan is analyzed; the segments whose clones
    are live at its planned peak are switched to memory-centric (one
    recomputation per reader, freed right after), which is kept only if the
    planned peak falls.

    Returns:
      (plan, the rewritten graph analyzed or None).
    """
    speed, planned = lowest_recompute(base, ctx, "speed")
    if planned is None:
        # Keep the planner's own reasons ("control flow present: not
        # recomputed"), not its count ("recompute (speed): 0 tensor(s)").
        why = "; ".join(speed.notes) or "nothing to recompute"
        return dataclasses.replace(speed, summary="",
                                   notes=(f"recompute (auto): {why}",)), None
    peak = planned.facts.peak_step
    at_peak = set()
    for b, (start, end) in planned.facts.buffer_intervals.items():
        source = names.recompute_source(planned.index.names[b[0]])
        if source and start <= peak <= end:
            at_peak.add(source)
    memory_tensors = frozenset(r.tensor for r in speed.recomputes
                               if any(node in at_peak for node in r.chain))
    note = f"recompute (auto): {len(speed.recomputes)} tensor(s), speed-centric"
    if memory_tensors:
        mixed, mixed_planned = lowest_recompute(base, ctx, "speed", memory_tensors)
        if mixed_planned is not None and mixed_planned.peak < planned.peak:
            note += (f", {len(memory_tensors)} live at the planned peak made "
                     "memory-centric")
            return dataclasses.replace(mixed, summary=note), mixed_planned
    # The planner's notes (control flow left alone) stay.
    return dataclasses.replace(speed, summary=note), planned


def lowest_recompute(base, ctx: Context, mode: str,
                     memory_tensors: frozenset = frozenset(),
                     segment_checkpoints: int = 0):
    """The recompute plan of `mode` whose planned peak is lower, of two.

    Where a clone is released decides how long it and the gradients its
    readers wait on stay alive, and the executor's pool (which runs the
    most recently deferred op first) makes the best release point hard to
    pick locally. The planner picks them on the predicted executor order,
    and again on the order that takes each node's consumers last first;
    both plans are analyzed and the lower planned peak is kept.

    Returns:
      (plan, the rewritten graph analyzed or None when it changes nothing).
    """
    candidates = []
    for order_ in (None, schedule(base.index, consumers_last_first=True)):
        plan = plan_recompute(base.index, base.facts, mode, protected(base.index),
                              memory_tensors, order=order_,
                              segment_checkpoints=segment_checkpoints)
        candidates.append((plan, ctx.evaluate(plan, base)))
    return lowest_planned(candidates)


def lowest_planned(candidates: list):
    """Of (plan, analyzed graph or None) pairs, the plan that changes the
    graph with the lowest planned peak (the first if none changes it)."""
    changed = [c for c in candidates if c[1] is not None]
    if not changed:
        return candidates[0]
    return min(changed, key=lambda c: c[1].peak)


def memory_recompute(base, ctx: Context):
    """Memory-centric recomputation, never planned above speed-centric.

    One recomputation per backward reader frees each clone right after its
    reader. Plans are made under the paper's rule (checkpoint ops' outputs
    kept) and with checkpoint ops re-run in segments
    (heuristics.MEMORY_SEGMENTS, with the weight gradients ordered first, see
    segmented_recompute); the one planned lowest is kept. Its planned peak
    can still come out above the speed-centric plan's (fewer live bytes at
    its peak, but a higher peak in the allocator model's terms, where a large
    scratch buffer lands); then the speed-centric plan is the one applied,
    with a note.

    Returns:
      (plan, the rewritten graph analyzed or None).
    """
    candidates = [lowest_recompute(base, ctx, "memory")]
    candidates += [segmented_recompute(base, ctx, k) for k in heuristics.MEMORY_SEGMENTS]
    memory, planned = lowest_planned(candidates)
    if planned is None:
        return memory, None
    speed, speed_planned = lowest_recompute(base, ctx, "speed")
    if speed_planned is not None and speed_planned.peak < planned.peak:
        note = (f"recompute (memory): {len(speed.recomputes)} tensor(s), "
                f"speed-centric: its planned peak "
                f"({speed_planned.peak} bytes) is below the "
                f"memory-centric one ({planned.peak} bytes)")
        return dataclasses.replace(speed, summary=note), speed_planned
    return memory, planned


def segmented_recompute(base, ctx: Context, per_segment: int):
    """Memory-centric recomputation that re-runs checkpoint ops too.

    Only each segment's input is kept (plan_recompute's
    segment_checkpoints). The recomputed graph then also gets the weight
    gradients ordered before the input gradients of the same output
    gradients (sntf.planner.order.plan_gradient_order), where that plans
    lower: deferred by the executor, they kept both their gradients and
    their recomputed inputs alive to the end of the backward pass.

    Returns:
      (plan, the rewritten graph analyzed or None).
    """
    plan, planned = lowest_recompute(base, ctx, "memory",
                                     segment_checkpoints=per_segment)
    if planned is None:
        return plan, None
    note = (f"recompute (memory): {len(plan.recomputes)} tensor(s), checkpoint ops "
            f"re-run in segments of up to {per_segment}")
    plan = dataclasses.replace(plan, summary=note)
    orders = order.plan_gradient_order(planned.index, ctx.device.onednn)
    if orders:
        ordered = dataclasses.replace(plan, orders=orders, summary=(
            f"{note}, {len(orders)} weight gradient edge(s) ordered first"))
        ordered_planned = ctx.evaluate(ordered, base)
        if ordered_planned.peak < planned.peak:
            return ordered, ordered_planned
    return plan, planned


def gradient_ordered(planned, ctx: Context, plan: Plan) -> tuple:
    """(order edges, planned analyzed with them or None): each weight
    gradient of an analyzed rewritten graph before the input gradient of the
    same output gradient (order.plan_gradient_order), less the edges `plan`
    already holds. Raises where the rewrite or its analysis fails.

    The outcome of a composition is finished with them where they plan
    lower (sntf.planner.finish.gradients_first), and the budget search
    judges each selection with them (sntf.planner.budget.Selections). Its
    time counts to the caller's stage."""
    taken = {(o.before, o.after) for o in plan.orders}
    orders = tuple(o for o in order.plan_gradient_order(planned.index, ctx.device.onednn)
                   if (o.before, o.after) not in taken)
    return orders, (ctx.evaluate(Plan(policy=plan.policy, orders=orders), planned)
                    if orders else None)
