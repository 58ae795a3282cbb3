"""Finishing a composition's outcome: the order its rewritten graph runs in.

Two sets of control edges, each applied where the analysis of the graph
with them stands behind it:

    gradients_first  each weight gradient before the input gradient that
                     shares its output gradient (order.plan_gradient_order)
    pinned           the ops that allocate or free large buffers held to
                     the planned order, or a memory-aware one
                     (order.plan_sequence, memory_order.memory_orders)

The parts of a LowerOf are compared finished (sntf.planner.policies).
"""

from __future__ import annotations

import dataclasses

from sntf.graph.fusions import merge_members
from sntf.planner import budget as budget_planning
from sntf.planner import heuristics
from sntf.planner.context import Context
from sntf.planner.memory_order import memory_orders
from sntf.planner.modes import gradient_ordered
from sntf.planner.order import plan_sequence
from sntf.planner.plan import Outcome, Plan, noted


def gradients_first(outcome: Outcome, ctx: Context) -> Outcome:
    """The outcome with each weight gradient ordered before the input
    gradient of the same output gradient (order.plan_gradient_order), where
    the rewritten graph then plans lower.

    A rewrite makes the executor defer weight gradients: a filter gradient
    whose input is swapped in, or recomputed, is ready only after the input
    gradient it shares an output gradient with, and the executor defers it
    behind that chain; both its tensors then stay alive down the network."""
    planned = outcome.planned
    if planned is None:
        return outcome
    try:
        with ctx.timed("plan_order"):
            orders, ordered = gradient_ordered(planned, ctx, outcome.plan)
    except Exception as e:  # noqa: BLE001 - an optional stage never fails a plan
        return noted(outcome, f"order: gradient edges not applied: "
                               f"{type(e).__name__}: {e}")
    if ordered is None or ordered.peak >= planned.peak:
        return outcome
    plan = outcome.plan
    plan = dataclasses.replace(plan, orders=plan.orders + orders, notes=plan.notes + (
        f"order: {len(orders)} weight gradient(s) run before the input gradient of "
        f"the same output gradient ({planned.peak} -> {ordered.peak} bytes)",))
    return dataclasses.replace(outcome, plan=plan, planned=ordered)


def pinned(outcome: Outcome, ctx: Context) -> Outcome:
    """The outcome with the rewritten graph's large allocations and frees
    held to an order (plan_sequence, _sequenced), where the analysis stands
    behind it: the chained graph, analyzed, plans no higher than the
    unchained one, give or take what one unchained op allocates, and a plan
    that fits its budget still fits its target (else held_in_margin)."""
    planned = outcome.planned
    if not ctx.search.pin_order or planned is None:
        return outcome
    least = max(heuristics.SEQUENCE_MIN_BYTES,
                int(heuristics.SEQUENCE_PEAK_SHARE * planned.peak))
    with ctx.timed("plan_order"):
        # The edges are optional: whatever goes wrong with them leaves the
        # plan as it was, with the reason in its notes.
        try:
            merges = merge_members(planned.index) if ctx.device.onednn else None
            orders, ordered, kind = _sequenced(outcome, planned, ctx, least, merges)
            if not orders:
                return outcome
        except Exception as e:  # noqa: BLE001 - an optional stage never fails a plan
            return noted(outcome, f"order: edges not applied: {type(e).__name__}: {e}")
        plan = dataclasses.replace(outcome.plan, orders=outcome.plan.orders + orders)
    # The ops left unchained may fall elsewhere in the one-thread order
    # once the chained ones wait for each other, moving the predicted peak.
    # The unchained plan's peak is that of one order, which the inter-op
    # pool does not keep (its measured peaks ran 10-40% above it), so a
    # chained plan is worth a small predicted rise: the order it predicts
    # is the order that runs.
    rise = max(least, int(heuristics.SEQUENCE_RISE_SHARE * planned.peak))
    if ordered is None or ordered.peak > planned.peak + rise:
        return noted(outcome, _dropped_note(orders, planned, ordered))
    headroom = outcome.cache_headroom
    if headroom is not None and plan.cache_budget is not None:
        headroom = ctx.room.headroom(ordered.facts)
    held = dataclasses.replace(
        outcome, plan=dataclasses.replace(plan, notes=plan.notes + (
            f"order: {len(orders)} edge(s) hold the ops that allocate or free "
            f"{least} bytes or more to the {kind}",)),
        planned=ordered, cache_headroom=headroom, pinned=True)
    if ctx.budget is None or outcome.fit is None or not outcome.fit.budget_fits:
        return held
    if ordered.peak <= budget_planning.budget_target(ctx):
        return held
    # A plan that fits its budget must still fit its target. Only that left
    # the edges no room: the policy fits again (sntf.planner.fit._searched),
    # or takes them into the budget's margin, under the budget itself.
    in_margin = None
    if ordered.peak <= ctx.budget - ctx.room.outside:
        in_margin = noted(held, (
            f"order: the edges take the planned peak {ordered.peak - planned.peak} "
            f"bytes into the budget's margin: no plan fits the target with them"))
    return dataclasses.replace(noted(outcome, _dropped_note(orders, planned, ordered)),
                               held_in_margin=in_margin)


def _sequenced(outcome: Outcome, planned, ctx: Context, least: int, merges) -> tuple:
    """(order edges, the graph chained by them analyzed, which order they
    hold): the executor's order as planned, or, where ctx.search.memory_order, a
    memory-aware order of the same ops (memory_orders) where the graph
    chained to it plans lower.

    Not under a budget or a device limit: there the plan's prediction
    decides what fits (and sizes the tensor cache's headroom), so it must be
    one the run reaches. The zoo's SE-ResNet at half TensorFlow's peak, held
    to the memory-aware order, planned 0.82 of what it measured and
    measured 1.11 times a budget it was said to fit."""
    tried: dict = {}     # order edges -> the graph chained by them, analyzed

    def chained(facts):
        orders = plan_sequence(planned.index, facts, least, merges)
        # A memory-aware order can chain the ops as the executor's does:
        # the same edges are analyzed once.
        if orders not in tried:
            # The edges name the planned graph's nodes (clones and swap-ins
            # included), so they are applied to it, not to the base graph.
            tried[orders] = (ctx.evaluate(Plan(policy=outcome.plan.policy, orders=orders),
                                          planned) if orders else None)
        return orders, tried[orders]

    orders, ordered = chained(planned.facts)
    if not ctx.search.memory_order:
        return orders, ordered, "planned order"
    best = (orders, ordered, "planned order")
    try:
        for reordered in memory_orders(planned.index, planned.facts, ctx.device.pool):
            other, analyzed = chained(reordered)
            if analyzed is not None and (best[1] is None or analyzed.peak < best[1].peak):
                best = (other, analyzed, "memory-aware order")
    except Exception:  # noqa: BLE001 - the orders tried so far stand
        pass
    return best


def _dropped_note(orders: tuple, planned, ordered) -> str:
    return (f"order: {len(orders)} edge(s) not applied: the predicted peak would "
            f"rise ({planned.peak} -> {ordered.peak if ordered else None} bytes)")
