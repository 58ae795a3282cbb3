"""Policies: per-tensor questions, and the combinators that compose them.

A leaf policy (`Stage`) asks one question of every forward tensor the
backward pass reads: can it be recomputed, or can it be swapped? Its
planner answers per tensor with a recipe or the reason the tensor is kept.
One more leaf asks it of the backward pass's own tensors read twice: can
one be re-run for its later readers (sntf.planner.rebuild)?
Combinators decide how the answers become one plan:

    Then(a, b)       a, then b over the graph a left; a stage that would not
                     lower the planned peak, even with weight gradients run
                     first, is not applied (a deferred one, whose gain
                     shows only after the stages after it, is judged by
                     the LowerOf around it)
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
    "auto"            FitBudget(recompute, swap, fallback="swap+recompute");
                      under a budget no plan meets, the lowest of its
                      search, swap+recompute and recompute

Whatever a composition rewrote is then held to an order by order
edges (sntf.planner.finish; option pin_order), where the analysis of the
chained graph stands behind them: the executor's order, or without a
budget or device limit a memory-aware one where that plans lower. Without
a budget, a rewritten graph that plans less than option min_gain (5%)
below the original is not applied.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from sntf.graph.names import split_tensor
from sntf.planner import budget as budget_planning
from sntf.planner import heuristics, modes
from sntf.planner.backward import backward_read_tensors, tensor_name
from sntf.planner.context import Context
from sntf.planner.finish import gradient_ordered, gradients_first, pinned
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
    orders: tuple = ()       # order edges a stage needed to lower the peak
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

    def run(self, base, ctx: Context, proposals: Optional[dict] = None,
            rival=None) -> _Run:
        """proposals: (stage, graph) -> the stage's proposal, shared by the
        parts of a LowerOf, which start from the same stages on one graph.
        rival: the analyzed graph this composition must plan below, or None;
        a deferred stage none of whose tensors is live at its peak cannot
        lower that peak, and the run is void without the stages after it."""
        run = _Run(current=base, decisions=[], notes=[])
        proposals = {} if proposals is None else proposals
        for stage in self.parts:
            key = (stage, id(run.current))
            if key not in proposals:   # the graph is kept, so its id stays its own
                proposals[key] = (run.current, *stage.propose(run.current, ctx))
            _, plan, planned = proposals[key]
            run.keep_reasons(plan)
            if stage.deferred and planned is not None and rival is not None \
                    and not _any_live_at_peak(plan, rival):
                planned = None
            if planned is None:
                run.notes.extend(plan.notes)
                run.void |= stage.deferred
                if run.void:
                    return run
                continue
            if planned.peak >= run.current.peak and not stage.deferred:
                planned = _ordered_to_fall(run, stage, planned, ctx)
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


def _ordered_to_fall(run: _Run, stage: Stage, planned, ctx: Context):
    """A stage's analyzed graph, or where its peak would not fall, that
    graph with weight gradients first (finish.gradient_ordered) where that
    takes it below the current one's.

    The executor defers a weight gradient behind the input gradients'
    chain, and with it the output gradient it reads: once a stage frees the
    forward tensors, those deferred gradients can hold the step's peak to
    the end of the backward pass (BENCHMARKS.md, "The swap stage with
    oneDNN off"). The stage's gain then shows only in that order."""
    try:
        orders, ordered = gradient_ordered(planned, ctx, Plan(policy=stage.kind))
    except Exception:  # noqa: BLE001 - optional: the stage is judged as it is
        return planned
    if ordered is None or ordered.peak >= run.current.peak:
        return planned
    run.orders += orders
    run.notes.append(f"order: {len(orders)} weight gradient(s) run before the input "
                     f"gradient of the same output gradient, so that {stage.kind} "
                     f"lowers the peak ({planned.peak} -> {ordered.peak} bytes)")
    return ordered


def _any_live_at_peak(plan: Plan, planned) -> bool:
    """Whether a tensor a plan acts on is live at the planned peak of
    another analyzed graph (where it is not in that graph: it may be)."""
    g, facts = planned.index, planned.facts
    for d in acting(plan.decisions):
        node, port = split_tensor(d.tensor)
        if node not in g.index:
            return True
        buffer = facts.buffer_of((g.node(node), port))
        if buffer is None:
            continue   # no memory of its own there
        # A buffer without an interval lives through the step.
        start, stop = facts.buffer_intervals.get(buffer, (0, facts.peak_step))
        if start <= facts.peak_step <= stop:
            return True
    return False


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
            fitted = _fitted_in_order(base, ctx, name)
            if fitted.fields.get("budget_fits") or ctx.budget_behaviour != "best_effort":
                return fitted
            return _least_unmet(fitted, base, ctx, name, composition.fallback)
        composition = composition.fallback
    return _standing(_finished(policy, composition, base, ctx, {}), base, ctx, policy)


def _finished(policy: str, composition, base, ctx: Context, proposals: dict,
              rival=None) -> Optional[Outcome]:
    """A composition's outcome with weight gradients first and held to its
    order (sntf.planner.finish).

    The parts of a LowerOf are compared finished: the order edges lower
    some plans far more than others (the zoo's GPT planned 50.4 MiB with
    recompute then swap and 52.6 with swap alone; held to a memory-aware
    order, 48.4 and 38.8). A part whose deferred stage found nothing to do,
    or nothing live at the peak of the same part without that stage
    (rival), is another part again: its outcome is None, and it is
    skipped."""
    if isinstance(composition, LowerOf):
        return _lowest(policy, composition, base, ctx, proposals)
    composed = _composed(policy, composition, base, ctx, proposals, rival)
    if composed is None:
        return None
    return pinned(gradients_first(composed, ctx), base, ctx)


def _lowest(policy: str, composition: LowerOf, base, ctx: Context,
            proposals: dict) -> Outcome:
    """The LowerOf's part planned lowest, finished: the parts without a
    margin by their peaks (the earliest on a tie); one with a margin where
    it plans that far below every other."""
    def peak(o):
        return o.planned.peak if o.planned is not None else base.peak

    # (position, part, margin in bytes, outcome, planned peak)
    finished = []
    for k, part in enumerate(composition.parts):
        if not getattr(part, "margin", 0.0):
            o = _finished(policy, part, base, ctx, proposals)
            finished.append((k, part, 0.0, o, peak(o)))
    plain = min(finished, key=lambda f: (f[4], f[0]))
    best = plain
    for k, part in enumerate(composition.parts):
        margin = getattr(part, "margin", 0.0) * base.peak
        if margin:
            # A part with a deferred stage is held to the same part without
            # it, whose graph names the tensors the stage acts on.
            without = tuple(s for s in part.parts if not getattr(s, "deferred", False))
            rival = next((f[3].planned or base for f in finished
                          if getattr(f[1], "parts", None) == without), None)
            o = _finished(policy, part, base, ctx, proposals, rival)
            if o is not None:
                finished.append((k, part, margin, o, peak(o)))
                if peak(o) < plain[4] - margin and peak(o) < best[4]:
                    best = finished[-1]
    first = min(finished, key=lambda f: f[0])
    _, part, _, outcome, planned_peak = best
    if part is not first[1]:
        label = part.label + (" alone" if len(part.parts) == 1 else "")
        outcome = noted(outcome, f"{first[1].label} planned {first[4]} "
                                 f"bytes, {label} {planned_peak}: {label} applied")
    return outcome


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
    outcome = pinned(gradients_first(_fitted(base, ctx, name), ctx), base, ctx)
    held = outcome.held_in_margin
    if held is None:
        return outcome
    rise = held.planned.peak - outcome.planned.peak
    roomy = dataclasses.replace(ctx, order_reserve=ctx.order_reserve + rise)
    # The edges are then judged against the budget's own target (ctx).
    again = pinned(gradients_first(_fitted(base, roomy, name), roomy), base, ctx)
    if again.pinned and again.fields.get("budget_fits"):
        return again
    # No plan fits the target with its edges: the first plan keeps them,
    # its planned peak a little into the budget's margin. The margin is
    # there for the analysis' error, and an order the executor does not
    # keep errs far more than the edges' rise (the swish all-conv net's
    # plan, unchained, measured up to 1.23 times its budget).
    return held


def _least_unmet(fitted: Outcome, base, ctx: Context, name: str, fallback) -> Outcome:
    """Policy "auto" under a budget no plan of its search meets: the lowest
    of the search's plan and the plans of its fallback composition and of
    policy "recompute", each planned in the executor's order and, where
    order edges are allowed, held to a memory-aware order.

    The search decides per buffer, in the executor's order; the
    compositions' stages and orders reach plans it does not (BENCHMARKS.md,
    "A budget no plan meets"). A budget that cannot be met asks
    for the lowest plan sntf has, so it is never above one the policies
    find. Such a plan is never said to fit: a budget's fit is judged in
    the executor's order, which the run reaches unchained."""
    def peak(o):
        return (o.planned or base).peak

    best, how = fitted, None
    orders = [(ctx, "in the executor's order")]
    if ctx.pin_allowed:
        orders.append((dataclasses.replace(ctx, memory_order=True, pin_order=True),
                       "held to a memory-aware order"))
    for composition in (fallback, POLICIES["recompute"]):
        for tried, label in orders:
            outcome = _finished("auto", composition, base, tried, {})
            if outcome is not None and outcome.planned is not None \
                    and peak(outcome) < peak(best):
                best, how = outcome, f"{composition.label} {label}"
    if how is None:
        return fitted
    target = budget_planning.budget_target(base, ctx)
    warning = budget_planning.unmet_warning(base, ctx, target, peak(best), name)
    fields = {**fitted.fields, "budget_fits": False, "achievable_peak_bytes": peak(best),
              "predicted_seconds_added": sum(d.seconds_added or 0.0 for d in acting(
                  best.plan.decisions))}
    best = noted(best, (f"auto: the budget search's least plan ({peak(fitted)} bytes) "
                        f"is above {how} ({peak(best)} bytes), which is applied; "
                        f"{warning[len('sntf: '):]}"))
    return dataclasses.replace(best, fields=fields, warnings=(warning,))


def _composed(policy: str, composition, base, ctx: Context, proposals: dict,
              rival=None) -> Optional[Outcome]:
    run = composition.run(base, ctx, proposals, rival)
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
                  recomputes=run.recomputes, swaps=run.swaps, orders=run.orders,
                  cache_budget=cache_budget)
    return Outcome(_with_keeps(result, base, run.kept, f"policy {policy!r}"),
                   run.current if modified else None, headroom)


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
