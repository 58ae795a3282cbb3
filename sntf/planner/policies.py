"""Policies: per-tensor questions, and the combinators that compose them.

A leaf policy (`Stage`) asks one question of every forward tensor the
backward pass reads: can it be recomputed, or can it be swapped? Its
planner answers per tensor with a recipe or the reason the tensor is kept.
One more leaf asks it of the backward pass's own tensors read twice: can
one be re-run for its later readers (sntf.planner.rebuild)?
Combinators decide how the answers become one plan:

    Then(a, b)       a, then b over the graph a left; a stage that would not
                     lower the planned peak is not applied (a deferred one,
                     whose gain shows only after the stages after it, is
                     judged by the LowerOf around it)
    LowerOf(a, ...)  the lowest planned peak of its parts, each held to its
                     order (the earliest on a tie; a part that asks for a
                     margin must plan that much below every other)
    FitBudget(a, b)  per buffer keep, or one of a's or b's answers, the least
                     predicted time that fits the budget; without a budget,
                     its fallback policy
    Keep()           nothing moves (policy "off")

The user's policies are compositions (POLICIES):

    "recompute"       Then(recompute, rebuild)
    "swap"            Then(swap)
    "swap+recompute"  LowerOf(Then(recompute, swap), Then(recompute, rebuild*, swap),
                              Then(swap)); rebuild* deferred
    "auto"            FitBudget(recompute, swap, fallback="swap+recompute")

Whatever a composition rewrote is then held to an order by order
edges (order.plan_sequence; option pin_order), where the analysis of the
chained graph stands behind them: the executor's order, or without a
budget or device limit a memory-aware one where that plans lower
(memory_orders). Without a budget, a rewritten graph that
plans less than option min_gain (5%) below the original is not applied.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from sntf.graph.fusions import merge_members
from sntf.planner import budget as budget_planning
from sntf.planner import heuristics, modes
from sntf.planner.backward import backward_read_tensors, tensor_name
from sntf.planner.context import Context
from sntf.planner.memory_order import memory_orders
from sntf.planner.order import plan_gradient_order, plan_sequence
from sntf.planner.plan import KEEP, Outcome, Plan, acting, identity_plan, keep, noted

OFF_NOTE = "policy 'off': graph left as TensorFlow built it"


@dataclasses.dataclass
class _Run:
    """Stages run so far: the graph they left, what they decided, and the
    reasons each tensor was kept."""

    current: object
    decisions: list
    notes: list
    recomputes: tuple = ()
    swaps: tuple = ()
    kept: dict = dataclasses.field(default_factory=dict)   # tensor -> [reasons]
    void: bool = False       # a deferred stage found nothing to do

    def keep_reasons(self, plan: Plan, prefix: str = "") -> None:
        for d in plan.decisions:
            if d.action == KEEP:
                self.kept.setdefault(d.tensor, []).append(prefix + d.reason)


@dataclasses.dataclass(frozen=True)
class Stage:
    """A leaf: one question per tensor ("recompute", "rebuild" or "swap").

    A deferred stage is applied whenever it changes the graph: the stages
    after it decide whether it pays (a rebuilt sigmoid(x) frees nothing at
    the peak until the forward tensors around it are swapped out).
    """

    kind: str
    deferred: bool = False

    @property
    def label(self) -> str:
        return self.kind

    def propose(self, base, ctx: Context):
        """The stage's plan on `base`, tried: (plan, analyzed or None)."""
        with ctx.timed(f"plan_{self.kind}"):
            if self.kind == "recompute":
                return modes.recompute(base, ctx)
            if self.kind == "rebuild":
                return modes.rebuild(base, ctx, judged_here=not self.deferred)
            return budget_planning.lowest_swap(base, ctx)


@dataclasses.dataclass(frozen=True)
class Then:
    """Stages in order, each over the graph the previous one left; a stage
    is applied only if it lowers the planned peak (a deferred one whenever
    it changes the graph). In a LowerOf, it must plan `margin` (a share of
    the original planned peak) below every other part."""

    parts: tuple
    margin: float = 0.0

    @property
    def label(self) -> str:
        return " then ".join(p.label for p in self.parts)

    def run(self, base, ctx: Context, proposals: Optional[dict] = None) -> _Run:
        """proposals: (stage, graph) -> the stage's proposal, shared by the
        parts of a LowerOf, which start from the same stages on one graph."""
        run = _Run(current=base, decisions=[], notes=[])
        proposals = {} if proposals is None else proposals
        for stage in self.parts:
            key = (stage, id(run.current))
            if key not in proposals:   # the graph is kept, so its id stays its own
                proposals[key] = (run.current, *stage.propose(run.current, ctx))
            _, plan, planned = proposals[key]
            run.keep_reasons(plan)
            if planned is None:
                run.notes.extend(plan.notes)
                run.void |= stage.deferred
                continue
            if planned.peak >= run.current.peak and not stage.deferred:
                count = len(plan.recomputes) + len(plan.swaps)
                why = (f"{stage.kind}: {count} tensor(s) planned but not applied: the "
                       f"predicted peak would not fall ({run.current.peak} -> "
                       f"{planned.peak} bytes)")
                run.notes.append(why)
                for d in acting(plan.decisions):
                    run.kept.setdefault(d.tensor, []).append(why)
                continue
            run.current = planned
            run.decisions.extend(acting(plan.decisions))
            run.notes.extend(plan.notes)
            run.recomputes += plan.recomputes
            run.swaps += plan.swaps
        return run


@dataclasses.dataclass(frozen=True)
class LowerOf:
    """The composition planned lowest of its parts, each with its order
    edges (the earliest on a tie); see _finished."""

    parts: tuple

    @property
    def label(self) -> str:
        return self.parts[0].label


@dataclasses.dataclass(frozen=True)
class Keep:
    """Nothing moves."""

    label = "off"


@dataclasses.dataclass(frozen=True)
class FitBudget:
    """Per buffer keep, or one of its stages' answers: the least predicted
    extra time whose planned peak fits ctx.budget (sntf.planner.budget);
    without a budget, the fallback composition."""

    parts: tuple
    fallback: object

    @property
    def label(self) -> str:
        return "auto"


RECOMPUTE_STAGE, REBUILD_STAGE, SWAP_STAGE = Stage("recompute"), Stage("rebuild"), Stage("swap")
SWAP_AND_RECOMPUTE = LowerOf((
    Then((RECOMPUTE_STAGE, SWAP_STAGE)),
    Then((RECOMPUTE_STAGE, Stage("rebuild", deferred=True), SWAP_STAGE),
         margin=heuristics.REBUILD_PEAK_SHARE),
    Then((SWAP_STAGE,))))
POLICIES = {
    "off": Keep(),
    "recompute": Then((RECOMPUTE_STAGE, REBUILD_STAGE)),
    "swap": Then((SWAP_STAGE,)),
    "swap+recompute": SWAP_AND_RECOMPUTE,
    "auto": FitBudget((RECOMPUTE_STAGE, SWAP_STAGE), fallback=SWAP_AND_RECOMPUTE),
}


def plan(policy: str, base, ctx: Context, name: str = "") -> Outcome:
    """Plans an analyzed training graph under a user policy.

    Args:
      policy: a key of POLICIES.
      base: the analyzed graph (sntf.analysis.Analyzed).
      ctx: the planning context.
      name: the graph's name, for messages.

    Returns:
      The Outcome.
    """
    composition = POLICIES[policy]
    if isinstance(composition, Keep):
        return Outcome(_with_keeps(identity_plan(policy, OFF_NOTE), base, {},
                                   "policy 'off'"))
    if isinstance(composition, FitBudget):
        if ctx.budget is not None:
            return _fitted_in_order(base, ctx, name)
        composition = composition.fallback
    return _standing(_finished(policy, composition, base, ctx, {}), base, ctx, policy)


def _finished(policy: str, composition, base, ctx: Context, proposals: dict) -> Outcome:
    """A composition's outcome with weight gradients first and held to its
    order (_gradients_first, _pinned).

    The parts of a LowerOf are compared finished: the order edges lower
    some plans far more than others (the zoo's GPT planned 50.4 MiB with
    recompute then swap and 52.6 with swap alone; held to a memory-aware
    order, 48.4 and 38.8). A part whose deferred stage found nothing to do
    is another part again: its outcome is None, and it is skipped."""
    if isinstance(composition, LowerOf):
        finished = [(part, getattr(part, "margin", 0.0) * base.peak, o,
                     o.planned.peak if o.planned is not None else base.peak)
                    for part in composition.parts
                    for o in [_finished(policy, part, base, ctx, proposals)]
                    if o is not None]
        # The parts without a margin by their peaks (the earliest on a tie);
        # one with a margin must plan that far below every other.
        plain = [f for f in finished if not f[1]]
        best = min(plain, key=lambda f: f[3])
        for f in finished:
            if f[1] and all(f[3] < other[3] - f[1] for other in plain):
                best = f
        part, _, outcome, peak = best
        if part is not finished[0][0]:
            label = part.label + (" alone" if len(part.parts) == 1 else "")
            outcome = noted(outcome, f"{finished[0][0].label} planned {finished[0][3]} "
                                     f"bytes, {label} {peak}: {label} applied")
        return outcome
    composed = _composed(policy, composition, base, ctx, proposals)
    if composed is None:
        return None
    return _pinned(_gradients_first(composed, ctx), base, ctx)


def _standing(outcome: Outcome, base, ctx: Context, policy: str) -> Outcome:
    """The outcome, or, without a budget, the graph unchanged where the
    rewritten graph plans less than ctx.min_gain below the original: a gain
    the analysis cannot stand behind is not worth the rewrite's time, nor
    the risk of a measured peak above TensorFlow's own. Under a budget every
    byte the plan saves counts toward it."""
    planned = outcome.planned
    if planned is None or ctx.budget is not None:
        return outcome
    floor = int(base.peak * (1.0 - ctx.min_gain))
    if planned.peak <= floor:
        return outcome
    note = (f"policy {policy!r}: not applied: the planned peak would not fall by "
            f"{ctx.min_gain * 100:g}% ({base.peak} -> {planned.peak} bytes), within "
            f"the analysis' error (option min_gain)")
    kept = {d.tensor: [note] for d in acting(outcome.plan.decisions)}
    unchanged = Plan(policy=outcome.plan.policy, notes=outcome.plan.notes + (note,))
    return Outcome(_with_keeps(unchanged, base, kept, f"policy {policy!r}"),
                   fields=outcome.fields, warnings=outcome.warnings)


def _fitted_in_order(base, ctx: Context, name: str) -> Outcome:
    """Policy "auto" under a budget: the plan that fits it, held to its
    planned order.

    A plan fitted close to its target can leave its order edges no room
    (they may raise the one-order prediction a little), and without them
    the inter-op pool runs some other order: the measured peak is left to
    chance. Such a plan is fitted once more under a target lower by what
    the edges added, and that plan is taken where it fits with its edges."""
    outcome = _pinned(_gradients_first(_fitted(base, ctx, name), ctx), base, ctx)
    held = outcome.held_in_margin
    if held is None:
        return outcome
    rise = held.planned.peak - outcome.planned.peak
    roomy = dataclasses.replace(ctx, order_reserve=ctx.order_reserve + rise)
    # The edges are then judged against the budget's own target (ctx).
    again = _pinned(_gradients_first(_fitted(base, roomy, name), roomy), base, ctx)
    if again.pinned and again.fields.get("budget_fits"):
        return again
    # No plan fits the target with its edges: the first plan keeps them,
    # its planned peak a little into the budget's margin. The margin is
    # there for the analysis' error, and an order the executor does not
    # keep errs far more than the edges' rise (the swish all-conv net's
    # plan, unchained, measured up to 1.23 times its budget).
    return held


def _gradients_first(outcome: Outcome, ctx: Context) -> Outcome:
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
    with ctx.timed("plan_order"):
        try:
            taken = {(o.before, o.after) for o in outcome.plan.orders}
            orders = tuple(o for o in plan_gradient_order(planned.index)
                           if (o.before, o.after) not in taken)
            ordered = (ctx.evaluate(Plan(policy=outcome.plan.policy, orders=orders),
                                    planned) if orders else None)
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


def _composed(policy: str, composition, base, ctx: Context,
              proposals: dict) -> Optional[Outcome]:
    run = composition.run(base, ctx, proposals)
    if run.void:
        return None
    modified = run.current.graph_def is not base.graph_def
    notes, headroom = list(run.notes), None
    cache_budget = ctx.budget if run.swaps else None
    if cache_budget is not None:
        headroom = budget_planning.cache_headroom(run.current.facts, cache_budget,
                                                  ctx.outside_bytes, ctx.budget_margin)
        notes.append(budget_planning.cache_note(run.current.facts, cache_budget,
                                                ctx.outside_bytes, ctx.budget_margin))
    result = Plan(policy=policy, decisions=tuple(run.decisions), notes=tuple(notes),
                  recomputes=run.recomputes, swaps=run.swaps, cache_budget=cache_budget)
    return Outcome(_with_keeps(result, base, run.kept, f"policy {policy!r}"),
                   run.current if modified else None, headroom)


def _pinned(outcome: Outcome, base, ctx: Context) -> Outcome:
    """The outcome with the rewritten graph's large allocations and frees
    held to an order (plan_sequence, _sequenced), where the analysis stands
    behind it: the chained graph, analyzed, plans no higher than the
    unchained one, give or take what one unchained op allocates, and a plan
    that fits its budget still fits its target (else held_in_margin)."""
    planned = outcome.planned
    if not ctx.pin_order or planned is None:
        return outcome
    least = max(heuristics.SEQUENCE_MIN_BYTES,
                int(heuristics.SEQUENCE_PEAK_SHARE * planned.peak))
    with ctx.timed("plan_order"):
        # The edges are optional: whatever goes wrong with them leaves the
        # plan as it was, with the reason in its notes.
        try:
            merges = merge_members(planned.index) if ctx.onednn else None
            orders, pinned, kind = _sequenced(outcome, planned, ctx, least, merges)
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
    if pinned is None or pinned.peak > planned.peak + rise:
        return noted(outcome, _dropped_note(orders, planned, pinned))
    headroom = outcome.cache_headroom
    if headroom is not None and plan.cache_budget is not None:
        headroom = budget_planning.cache_headroom(pinned.facts, plan.cache_budget,
                                                  ctx.outside_bytes, ctx.budget_margin)
    held = dataclasses.replace(
        outcome, plan=dataclasses.replace(plan, notes=plan.notes + (
            f"order: {len(orders)} edge(s) hold the ops that allocate or free "
            f"{least} bytes or more to the {kind}",)),
        planned=pinned, cache_headroom=headroom, pinned=True)
    if ctx.budget is None or not outcome.fields.get("budget_fits"):
        return held
    if pinned.peak <= budget_planning.budget_target(base, ctx):
        return held
    # A plan that fits its budget must still fit its target. Only that left
    # the edges no room: _fitted_in_order fits again, or takes them into the
    # budget's margin where they stay under the budget itself.
    in_margin = None
    if pinned.peak <= ctx.budget - ctx.outside_bytes:
        in_margin = noted(held, (
            f"order: the edges take the planned peak {pinned.peak - planned.peak} "
            f"bytes into the budget's margin: no plan fits the target with them"))
    return dataclasses.replace(noted(outcome, _dropped_note(orders, planned, pinned)),
                               held_in_margin=in_margin)


def _sequenced(outcome: Outcome, planned, ctx: Context, least: int, merges) -> tuple:
    """(order edges, the graph chained by them analyzed, which order they
    hold): the executor's order as planned, or, where ctx.memory_order, a
    memory-aware order of the same ops (memory_orders) where the graph
    chained to it plans lower.

    Not under a budget or a device limit: there the plan's prediction
    decides what fits (and sizes the tensor cache's headroom), so it must be
    one the run reaches. The zoo's SE-ResNet at half TensorFlow's peak, held
    to the memory-aware order, planned 0.82 of what it measured and
    measured 1.11 times a budget it was said to fit."""
    def chained(facts):
        orders = plan_sequence(planned.index, facts, least, merges)
        # The edges name the planned graph's nodes (clones and swap-ins
        # included), so they are applied to it, not to the base graph.
        return orders, (ctx.evaluate(Plan(policy=outcome.plan.policy, orders=orders),
                                     planned) if orders else None)

    orders, pinned = chained(planned.facts)
    if not ctx.memory_order:
        return orders, pinned, "planned order"
    best = (orders, pinned, "planned order")
    try:
        for reordered in memory_orders(planned.index, planned.facts, ctx.pool):
            other, tried = chained(reordered)
            if tried is not None and (best[1] is None or tried.peak < best[1].peak):
                best = (other, tried, "memory-aware order")
    except Exception:  # noqa: BLE001 - the orders tried so far stand
        pass
    return best


def _dropped_note(orders: tuple, planned, pinned) -> str:
    return (f"order: {len(orders)} edge(s) not applied: the predicted peak would "
            f"rise ({planned.peak} -> {pinned.peak if pinned else None} bytes)")


def _fitted(base, ctx: Context, name: str) -> Outcome:
    fitted = budget_planning.fit_budget(base, ctx, name)
    choice = fitted.choice
    fields = {"budget_fits": choice.fits, "predicted_seconds_added": choice.seconds}
    if not choice.fits:
        fields["achievable_peak_bytes"] = choice.peak
    kept: dict = {}
    for candidate in fitted.candidates:
        for d in candidate.decisions:
            why = (d.reason if d.action == KEEP else
                   "budget: " + ("met without it" if choice.fits else "not applied"))
            kept.setdefault(d.tensor, []).append(why)
    headroom = None
    if fitted.planned is not None and fitted.plan.swaps:
        headroom = budget_planning.cache_headroom(fitted.planned.facts, ctx.budget,
                                                  ctx.outside_bytes, ctx.budget_margin)
    warnings = (fitted.warning,) if fitted.warning else ()
    return Outcome(_with_keeps(fitted.plan, base, kept, "policy 'auto'"),
                   fitted.planned, headroom, fields, warnings)


def _with_keeps(result: Plan, base, kept: dict, default: str) -> Plan:
    """The plan with a KEEP decision for every forward tensor the backward
    pass reads that it does not move, each with the reasons gathered."""
    acted = {d.tensor for d in result.decisions}
    keeps = []
    for t in backward_read_tensors(base.index, base.facts):
        name = tensor_name(base.index, t)
        if name not in acted:
            reasons = list(dict.fromkeys(kept.get(name, ()))) or [f"kept: {default}"]
            keeps.append(keep(name, "; ".join(reasons)))
    return dataclasses.replace(result, decisions=result.decisions + tuple(keeps))
