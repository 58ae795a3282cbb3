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
    FitBudget(s, f)  per buffer keep, or one of its sources' answers, the
                     least predicted time that fits the room; without a
                     budget, its fallback composition f (run by the fit
                     loop, sntf.planner.fit)
    Keep()           nothing moves (policy "off")

A leaf holds the callable that asks its question, and a FitBudget the
callables its search's options come from: what a composition holds is what
runs. The user's policies are compositions (POLICIES):

    "recompute"       Then(recompute, rebuild)
    "swap"            Then(swap)
    "swap+recompute"  LowerOf(Then(recompute, swap), Then(recompute, rebuild*, swap),
                              Then(swap)); rebuild* deferred
    "auto"            FitBudget((every recomputation, every swap),
                                fallback="swap+recompute", others=("recompute",));
                      where its search fits nothing, the fit loop tries
                      its compositions

Whatever a composition rewrote is then held to an order by order
edges (sntf.planner.finish; option pin_order), where the analysis of the
chained graph stands behind them: the executor's order, or without a
budget or device limit a memory-aware one where that plans lower. Without
a budget, a rewritten graph that plans less than option min_gain (5%)
below the original is not applied.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from sntf.graph.names import split_tensor
from sntf.planner import budget as budget_planning
from sntf.planner import heuristics, modes
from sntf.planner.backward import backward_read_tensors, tensor_name
from sntf.planner.context import Context
from sntf.planner.finish import gradients_first, pinned
from sntf.planner import reasons as R
from sntf.planner.plan import KEEP, Outcome, Plan, acting, identity_plan, keep, noted
from sntf.planner.reasons import reason

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
    kept: dict = dataclasses.field(default_factory=dict)   # tensor -> [Reason]
    void: bool = False       # a deferred stage found nothing to do

    def keep_reasons(self, plan: Plan) -> None:
        for d in plan.decisions:
            if d.action == KEEP:
                self.kept.setdefault(d.tensor, []).extend(d.why)


@dataclasses.dataclass(frozen=True)
class Stage:
    """A leaf: one question per tensor, asked by `propose`.

    A deferred stage is applied whenever it changes the graph: the stages
    after it decide whether it pays (a rebuilt sigmoid(x) frees nothing at
    the peak until the forward tensors around it are swapped out).

    Attributes:
      kind: what it asks ("recompute", "rebuild" or "swap"), for notes.
      ask: (analyzed graph, context, judged_here) -> (plan, the rewritten
        graph analyzed or None); judged_here is False for a deferred stage.
      deferred: see above.
    """

    kind: str
    ask: Callable
    deferred: bool = False

    @property
    def label(self) -> str:
        return self.kind

    def propose(self, base, ctx: Context):
        """The stage's plan on `base`, tried: (plan, analyzed or None)."""
        with ctx.timed(f"plan_{self.kind}"):
            return self.ask(base, ctx, not self.deferred)

    def held_back(self) -> "Stage":
        """The same stage, deferred."""
        return dataclasses.replace(self, deferred=True)


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
                run.notes.extend(plan.lines)
                run.void |= stage.deferred
                if run.void:
                    return run
                continue
            if planned.peak >= run.current.peak and not stage.deferred:
                planned = _ordered_to_fall(run, stage, planned, ctx)
            if planned.peak >= run.current.peak and not stage.deferred:
                count = len(plan.recomputes) + len(plan.swaps)
                why = reason(R.NOT_LOWERED, stage.kind, count=count,
                             before=run.current.peak, after=planned.peak)
                run.notes.append(why.text)
                for d in acting(plan.decisions):
                    run.kept.setdefault(d.tensor, []).append(why)
                continue
            run.current = planned
            run.decisions.extend(acting(plan.decisions))
            run.notes.extend(plan.lines)
            run.recomputes += plan.recomputes
            run.swaps += plan.swaps
        return run


def _ordered_to_fall(run: _Run, stage: Stage, planned, ctx: Context):
    """A stage's analyzed graph, or where its peak would not fall, that
    graph with weight gradients first (modes.gradient_ordered) where that
    takes it below the current one's.

    The executor defers a weight gradient behind the input gradients'
    chain, and with it the output gradient it reads: once a stage frees the
    forward tensors, those deferred gradients can hold the step's peak to
    the end of the backward pass (BENCHMARKS.md, "The swap stage with
    oneDNN off"). The stage's gain then shows only in that order."""
    try:
        orders, ordered = modes.gradient_ordered(planned, ctx, Plan(policy=stage.kind))
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
    """Per buffer keep, or one of its sources' answers: the least predicted
    extra time whose planned peak fits the room (sntf.planner.fit, which
    runs it); without a budget, the fallback composition.

    Attributes:
      sources: (analyzed graph, context) -> a plan whose decisions are the
        budget search's options (sntf.planner.budget.budget_search).
      fallback: the composition planned without a budget, and first among
        those the fit loop tries where its search fits nothing.
      others: the other compositions it tries then.
    """

    sources: tuple
    fallback: object
    others: tuple = ()

    @property
    def label(self) -> str:
        return "auto"

    @property
    def compositions(self) -> tuple:
        """The compositions the fit loop tries where its search fits nothing."""
        return (self.fallback,) + self.others


def _recompute(base, ctx: Context, judged_here: bool):
    return modes.recompute(base, ctx)


def _rebuild(base, ctx: Context, judged_here: bool):
    return modes.rebuild(base, ctx, judged_here=judged_here)


def _swap(base, ctx: Context, judged_here: bool):
    return budget_planning.lowest_swap(base, ctx)


def _search_recompute(base, ctx: Context) -> Plan:
    """Every recomputation of the recompute planner's lower mode."""
    mode = "memory" if ctx.options.recompute_mode == "memory" else "speed"
    return modes.lowest_recompute(base, ctx, mode)[0]


def _search_swap(base, ctx: Context) -> Plan:
    """Every swap of the swap planner, conditional under the budget."""
    return budget_planning.swap_stage(base, ctx, ctx.budget)


RECOMPUTE_STAGE, REBUILD_STAGE = Stage("recompute", _recompute), Stage("rebuild", _rebuild)
SWAP_STAGE = Stage("swap", _swap)
SWAP_AND_RECOMPUTE = LowerOf((
    Then((RECOMPUTE_STAGE, SWAP_STAGE)),
    Then((RECOMPUTE_STAGE, REBUILD_STAGE.held_back(), SWAP_STAGE),
         margin=heuristics.REBUILD_PEAK_SHARE),
    Then((SWAP_STAGE,))))
RECOMPUTE = Then((RECOMPUTE_STAGE, REBUILD_STAGE))
POLICIES = {
    "off": Keep(),
    "recompute": RECOMPUTE,
    "swap": Then((SWAP_STAGE,)),
    "swap+recompute": SWAP_AND_RECOMPUTE,
    "auto": FitBudget((_search_recompute, _search_swap), fallback=SWAP_AND_RECOMPUTE,
                      others=(RECOMPUTE,)),
}


def composed(policy: str, composition, base, ctx: Context) -> Outcome:
    """A user policy's composition planned on an analyzed training graph,
    finished (weight gradients first, held to its order) and standing only
    where it gains enough (_standing). Policy "auto" runs here as its
    fallback; under a budget or a device limit the fit loop runs it
    (sntf.planner.fit).

    Args:
      policy: a key of POLICIES, for notes.
      composition: what runs: a Then, LowerOf or Keep.
      base: the analyzed graph (sntf.analysis.Analyzed).
      ctx: the planning context.

    Returns:
      The Outcome.
    """
    if isinstance(composition, Keep):
        return Outcome(with_keeps(identity_plan(policy, OFF_NOTE), base, {},
                                   "policy 'off'"))
    return _standing(finished(policy, composition, base, ctx, {}), base, ctx, policy)


def finished(policy: str, composition, base, ctx: Context, proposals: dict,
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
    return pinned(gradients_first(composed, ctx), ctx)


def _lowest(policy: str, composition: LowerOf, base, ctx: Context,
            proposals: dict) -> Outcome:
    """The LowerOf's part planned lowest, finished: the parts without a
    margin by their peaks (the earliest on a tie); one with a margin where
    it plans that far below every other."""
    def peak(o):
        return o.planned.peak if o.planned is not None else base.peak

    # (position, part, margin in bytes, outcome, planned peak)
    done = []
    for k, part in enumerate(composition.parts):
        if not getattr(part, "margin", 0.0):
            o = finished(policy, part, base, ctx, proposals)
            done.append((k, part, 0.0, o, peak(o)))
    plain = min(done, key=lambda f: (f[4], f[0]))
    best = plain
    for k, part in enumerate(composition.parts):
        margin = getattr(part, "margin", 0.0) * base.peak
        if margin:
            # A part with a deferred stage is held to the same part without
            # it, whose graph names the tensors the stage acts on.
            without = tuple(s for s in part.parts if not getattr(s, "deferred", False))
            rival = next((f[3].planned or base for f in done
                          if getattr(f[1], "parts", None) == without), None)
            o = finished(policy, part, base, ctx, proposals, rival)
            if o is not None:
                done.append((k, part, margin, o, peak(o)))
                if peak(o) < plain[4] - margin and peak(o) < best[4]:
                    best = done[-1]
    first = min(done, key=lambda f: f[0])
    _, part, _, outcome, planned_peak = best
    if part is not first[1]:
        label = part.label + (" alone" if len(part.parts) == 1 else "")
        outcome = noted(outcome, f"{first[1].label} planned {first[4]} "
                                 f"bytes, {label} {planned_peak}: {label} applied")
    return outcome


def _standing(outcome: Outcome, base, ctx: Context, policy: str) -> Outcome:
    """The outcome, or, without a budget, the graph unchanged where the
    rewritten graph plans less than ctx.options.min_gain below the original: a gain
    the analysis cannot stand behind is not worth the rewrite's time, nor
    the risk of a measured peak above TensorFlow's own. Under a budget every
    byte the plan saves counts toward it."""
    planned = outcome.planned
    if planned is None or ctx.budget is not None:
        return outcome
    floor = int(base.peak * (1.0 - ctx.options.min_gain))
    if planned.peak <= floor:
        return outcome
    why = reason(R.BELOW_MIN_GAIN, policy=policy, percent=ctx.options.min_gain * 100,
                 before=base.peak, after=planned.peak)
    kept = {d.tensor: [why] for d in acting(outcome.plan.decisions)}
    unchanged = Plan(policy=outcome.plan.policy, notes=outcome.plan.lines + (why.text,))
    return Outcome(with_keeps(unchanged, base, kept, f"policy {policy!r}"),
                   fit=outcome.fit, warnings=outcome.warnings)


def _composed(policy: str, composition, base, ctx: Context, proposals: dict,
              rival=None) -> Optional[Outcome]:
    run = composition.run(base, ctx, proposals, rival)
    if run.void:
        return None
    modified = run.current.stored is not base.stored
    notes, headroom = list(run.notes), None
    cache_budget = ctx.budget if run.swaps else None
    if cache_budget is not None:
        headroom = ctx.room.headroom(run.current.facts)
        notes.append(ctx.room.cache_note(run.current.facts))
    result = Plan(policy=policy, decisions=tuple(run.decisions), notes=tuple(notes),
                  recomputes=run.recomputes, swaps=run.swaps, orders=run.orders,
                  cache_budget=cache_budget)
    return Outcome(with_keeps(result, base, run.kept, f"policy {policy!r}"),
                   run.current if modified else None, headroom)


def with_keeps(result: Plan, base, kept: dict, default: str) -> Plan:
    """The plan with a KEEP decision for every forward tensor the backward
    pass reads that it does not move, each with the reasons gathered."""
    acted = {d.tensor for d in result.decisions}
    keeps = []
    for t in backward_read_tensors(base.index, base.facts):
        name = tensor_name(base.index, t)
        if name not in acted:
            why = list(dict.fromkeys(kept.get(name, ()))) or [reason(R.UNTOUCHED, by=default)]
            keeps.append(keep(name, *why))
    return dataclasses.replace(result, decisions=result.decisions + tuple(keeps))
