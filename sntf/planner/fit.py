"""The fit loop: the planner's entry point, and policy "auto" wherever a
budget or a device's allocator limit binds the plan.

Policy "auto" is a FitBudget (sntf.planner.policies). Where nothing binds,
its fallback composition runs as any policy's does. Where the room
(sntf.planner.room) binds, this loop gathers the plans sntf can make of
the graph and takes the one the room holds:

  under a budget
    1. the budget search (sntf.planner.budget) over the FitBudget's
       sources, at the room's target, finished in the executor's order;
       where its order edges leave it no room, again under a target lower
       by what they added (_searched);
    2. where the allocator model runs out of memory on that plan under
       the device's limit, again under targets lower by steps
       (heuristics.DEVICE_REFIT_SHARE of the budget, at most
       heuristics.DEVICE_REFITS);
    3. where no search plan fits: the FitBudget's compositions, each in
       the executor's order and, where the user allows order edges, held
       to a memory-aware order.
  under a device limit alone
    the graph as it is where the allocator model fits it; else the
    fallback composition in the executor's order, and where the model
    runs out of memory on that, held to a memory-aware order; where the
    model runs out on both, the search plan of steps 1 and 2 above with
    the limit for the budget, if the model fits it.

Which plan is taken:
  - a search plan that fits: the search minimizes predicted time over
    options that hold the compositions' own recomputations and swaps;
  - else the composition, in the executor's order, of least predicted
    time among those that fit;
  - else the lowest planned peak of every plan tried, never said to fit.
A plan held to a memory-aware order never fits a budget: a budget's fit is
judged in the executor's order, the one a run reaches unchained
(finish._sequenced).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from sntf.planner import budget as budget_planning
from sntf.planner import device_limit, heuristics, policies
from sntf.planner import reasons as R
from sntf.planner.context import Context
from sntf.planner.finish import gradients_first, pinned
from sntf.planner.plan import (COMPOSITION_FITS, DEVICE_RUNS_OUT, EDGES_IN_MARGIN, FITS_AS_IS,
                               HELD_ORDER_ONLY, KEEP, LIMIT_HELD, LIMIT_PLANNED,
                               LIMIT_SEARCHED, REFIT_FITS,
                               SEARCH_FITS, UNMET, Fit, Outcome, acting, identity_plan,
                               noted, refit)
from sntf.planner.reasons import reason


def plan(policy: str, base, ctx: Context, name: str = "") -> Outcome:
    """Plans an analyzed training graph under a user policy.

    Args:
      policy: a key of policies.POLICIES.
      base: the analyzed graph (sntf.analysis.Analyzed).
      ctx: the planning context; ctx.room says what binds the plan.
      name: the graph's name, for messages.

    Returns:
      The Outcome; where a budget or a device limit binds the plan, its
      Fit says how the plan stands against them.
    """
    composition = policies.POLICIES[policy]
    if not isinstance(composition, policies.FitBudget):
        return policies.composed(policy, composition, base, ctx)
    room = ctx.room
    if room.budget is None and room.limit is None:
        return policies.composed(policy, composition.fallback, base, ctx)
    if room.budget is None:
        unchanged = device_limit.unchanged_note(base, room)
        if unchanged is not None:
            return Outcome(identity_plan(policy, unchanged),
                           fit=Fit(FITS_AS_IS, device_fits=True))
        outcome = _under_limit(policy, composition, base, ctx, name)
    else:
        outcome = _under_budget(composition, base, ctx, name)
        if room.limit is not None:
            outcome = device_limit.cache_fitted(outcome, room)
    if room.limit is None:
        return outcome
    return device_limit.checked(outcome, base, room, name)


def _under_limit(policy: str, composition, base, ctx: Context, name: str) -> Outcome:
    """Without a budget, under a device limit: the fallback composition in
    the executor's order where the allocator model fits it; else held to a
    memory-aware order by order edges, where that plans lower; where the
    model runs out of memory on that too, the plan fitted to the limit's
    room (_limit_fitted), if the model fits it.

    The executor's order is the one a run reaches unchained, so a plan
    that fits in it is kept. But it defers every op the input gradients'
    chain does not wait for, and what those ops read stays alive
    (BENCHMARKS.md, "The device limit in every training loop"). A plan
    that runs out of memory anyway gains from the lower order: held by its
    edges, the run follows it."""
    room = ctx.room
    first = policies.composed(policy, composition.fallback, base, ctx)
    planned = first.planned or base
    taken = dataclasses.replace(first, fit=Fit(LIMIT_PLANNED))
    if not room.runs_out(planned.facts):
        return taken
    if ctx.options.pin_order and not (ctx.search.memory_order and ctx.search.pin_order):
        again = policies.composed(policy, composition.fallback, base,
                                  ctx.searching(memory_order=True, pin_order=True))
        held = again.planned
        if held is not None and again.pinned and held.peak < planned.peak:
            taken = noted(dataclasses.replace(again, fit=Fit(LIMIT_HELD)), (
                f"device: in the executor's order the plan ({planned.peak} bytes) runs "
                f"out of memory in a model of {room.device}'s allocator under its limit "
                f"of {room.limit} bytes; held to a memory-aware order it plans "
                f"{held.peak} bytes"))
            if not room.runs_out(held.facts):
                return taken
    return _limit_fitted(composition, base, ctx, name, _peak(taken, base)) or taken


def _limit_fitted(auto: policies.FitBudget, base, ctx: Context, name: str,
                  policy_peak: int) -> Optional[Outcome]:
    """Where the allocator model runs out of memory on the policy's plan in
    either order: the budget search's plan with the device's limit for the
    budget (_searched), or where the model runs out on that one, the first
    fitted under a lower target that it does not run out on (_refitted);
    None where there is none.

    The fallback composition plans as low as its stages go, but not as
    low as sntf goes: the budget search picks swaps and recomputations
    buffer by buffer to a target, and lowers the target where the model's
    regions fragment. A step that would run out of memory is worth the
    search's time. The compositions a budget falls back on are not tried
    again: the policy's is the plan that ran out."""
    room = ctx.room
    as_budget = dataclasses.replace(ctx, room=dataclasses.replace(room, budget=room.limit))
    outcome = _searched(auto, base, as_budget, name)
    planned = outcome.planned or base
    if room.runs_out(planned.facts):
        if not outcome.fit.budget_fits:
            return None         # lower targets fit less
        outcome, _ = _refitted(auto, base, as_budget, outcome, name)
        if outcome is None:
            return None
        planned = outcome.planned or base
    outcome = device_limit.cache_fitted(outcome, as_budget.room)
    fit = Fit(LIMIT_SEARCHED, seconds=outcome.fit.seconds)
    return noted(dataclasses.replace(outcome, fit=fit, warnings=()), (
        f"device: the policy's plan ({policy_peak} bytes) runs out of memory in a model "
        f"of {room.device}'s allocator under its limit of {room.limit} bytes; fitted "
        f"with the limit for the budget, it plans {planned.peak} bytes, which the "
        "model fits"))


def _peak(outcome: Outcome, base) -> int:
    return (outcome.planned or base).peak


def _under_budget(auto: policies.FitBudget, base, ctx: Context, name: str) -> Outcome:
    """Under a budget: the plan the module docstring's order takes."""
    room = ctx.room
    first = _searched(auto, base, ctx, name)
    tried = [(first, 0)]
    if first.fit.budget_fits:
        if not room.runs_out((first.planned or base).facts):
            return first
        refit, tried = _refitted(auto, base, ctx, first, name)
        if refit is not None:
            return refit
        if ctx.options.budget_behaviour == "unchanged":
            return Outcome(identity_plan("auto", (
                f"device: a model of {room.device}'s allocator runs out of memory under "
                f"its limit of {room.limit} bytes on every plan tried: graph left "
                "unchanged (budget_behaviour='unchanged')")),
                fit=dataclasses.replace(first.fit, why=DEVICE_RUNS_OUT, budget_fits=False),
                warnings=first.warnings)
    elif ctx.options.budget_behaviour == "unchanged":
        return first        # the search's unmet plan: the graph unchanged
    return _composed(auto, base, ctx, tried, name)


def _searched(auto: policies.FitBudget, base, ctx: Context, name: str) -> Outcome:
    """The budget search's plan, held to its planned order.

    A plan fitted close to its target can leave its order edges no room
    (they may raise the one-order prediction a little), and without them
    the inter-op pool runs some other order: the measured peak is left to
    chance. Such a plan is fitted once more under a target lower by what
    the edges added, and that plan is taken where it fits with its edges.
    Where none does, the first plan keeps them, its planned peak a little
    into the budget's margin: the margin is there for the analysis' error,
    and an order the executor does not keep errs far more than the edges'
    rise."""
    outcome = pinned(gradients_first(_search(auto, base, ctx, name), ctx), ctx)
    held = outcome.held_in_margin
    if held is None:
        return outcome
    rise = held.planned.peak - outcome.planned.peak
    roomy = ctx.searching(order_reserve=ctx.search.order_reserve + rise)
    # The edges are then judged against the budget's own target (ctx).
    again = pinned(gradients_first(_search(auto, base, roomy, name), roomy), ctx)
    if again.pinned and again.fit.budget_fits:
        return again
    return refit(held, why=EDGES_IN_MARGIN)


def _search(auto: policies.FitBudget, base, ctx: Context, name: str) -> Outcome:
    """The budget search's outcome (budget.fit_budget), with the reasons
    each tensor was kept."""
    fitted = budget_planning.fit_budget(base, ctx, auto.sources, name)
    choice = fitted.choice
    fit = Fit(SEARCH_FITS if choice.fits else UNMET, budget_fits=choice.fits,
              target=ctx.room.target,
              achievable=None if choice.fits else choice.peak, seconds=choice.seconds)
    kept: dict = {}
    unused = reason(R.MET_WITHOUT if choice.fits else R.NOT_APPLIED, "budget")
    for candidate in fitted.candidates:
        for d in candidate.decisions:
            kept.setdefault(d.tensor, []).extend(d.why if d.action == KEEP else (unused,))
    headroom = None
    if fitted.planned is not None and fitted.plan.swaps:
        headroom = ctx.room.headroom(fitted.planned.facts)
    warnings = (fitted.warning,) if fitted.warning else ()
    return Outcome(policies.with_keeps(fitted.plan, base, kept, "policy 'auto'"),
                   fitted.planned, headroom, fit, warnings)


def _refitted(auto: policies.FitBudget, base, ctx: Context, first: Outcome,
              name: str) -> tuple:
    """Where the allocator model runs out of memory on a plan that fits the
    budget's target: the first search plan under a lower target that it
    does not run out on.

    A growing allocator's regions are capped by what the limit leaves, and
    a chunk never spans two of them (analysis.bfc); a lower planned peak
    leaves the regions more free chunks. The target comes down in steps of
    heuristics.DEVICE_REFIT_SHARE of the budget, at most
    heuristics.DEVICE_REFITS times, and stops where the search fits no
    plan under it.

    Returns:
      (the refitted outcome or None, [(outcome, bytes it was fitted
      lower)] for every search plan tried, first first).
    """
    room, target = ctx.room, budget_planning.budget_target(ctx)
    step = int(heuristics.DEVICE_REFIT_SHARE * room.budget)
    tried = [(first, 0)]
    for k in range(1, heuristics.DEVICE_REFITS + 1):
        lower = ctx.searching(region_reserve=ctx.search.region_reserve + k * step)
        again = _searched(auto, base, lower, name)
        planned = again.planned or base
        if planned.peak <= target and not room.runs_out(planned.facts):
            # It fits the budget's own target: not the lowered one's unmet
            # warning, and no achievable peak to report.
            fit = dataclasses.replace(again.fit, why=REFIT_FITS, budget_fits=True,
                                      target=target, achievable=None)
            return noted(dataclasses.replace(again, fit=fit, warnings=first.warnings), (
                f"device: the plan for the budget's target ran out of memory in a model "
                f"of {room.device}'s allocator under its limit of {room.limit} bytes "
                f"(regions fragment), so it is fitted {k * step} bytes lower")), tried
        tried.append((again, k * step))
        if planned.peak > target - k * step:
            break                                   # the lowest search plan there is
    return None, tried


@dataclasses.dataclass(frozen=True)
class _Tried:
    """A plan the fit loop tried: its outcome, how it was made (None for a
    search plan), the bytes it was fitted lower, and whether its order is
    the executor's (only such a plan can be said to fit a budget)."""

    outcome: Outcome
    how: Optional[str] = None
    lowered: int = 0
    trusted: bool = True


def _compositions(auto: policies.FitBudget, base, ctx: Context) -> list:
    """The FitBudget's compositions, each in the executor's order and, where
    the user allows order edges, held to a memory-aware order: _Tried."""
    orders = [(ctx, "in the executor's order", True)]
    if ctx.options.pin_order:
        orders.append((ctx.searching(memory_order=True, pin_order=True),
                       "held to a memory-aware order", False))
    made = []
    for composition in auto.compositions:
        for tried_ctx, label, trusted in orders:
            outcome = policies.finished("auto", composition, base, tried_ctx, {})
            if outcome is not None and outcome.planned is not None:
                made.append(_Tried(outcome, f"{composition.label} {label}", 0, trusted))
    return made


def _composed(auto: policies.FitBudget, base, ctx: Context, tried: list,
              name: str) -> Outcome:
    """Where no search plan fits: the composition of least predicted time
    that fits, in the executor's order; else the lowest plan tried (the
    search's first on a tie), never said to fit.

    The search decides per buffer, in the executor's order; the
    compositions' stages and orders reach plans it does not (BENCHMARKS.md,
    "A budget no plan meets"), so a budget it cannot meet is never planned
    above one a policy finds.

    Args:
      auto, base, ctx, name: as _under_budget's.
      tried: [(outcome, bytes it was fitted lower)] of the search plans
        tried, the first (at the room's own target) first.
    """
    room, target = ctx.room, budget_planning.budget_target(ctx)
    searched = [_Tried(o, None, lowered) for o, lowered in tried]
    made = _compositions(auto, base, ctx)
    fitting = [t for t in made if t.trusted and t.outcome.planned.peak <= target
               and not room.runs_out(t.outcome.planned.facts)]
    first = searched[0].outcome
    if fitting:
        chosen = min(fitting, key=lambda t: _seconds(t.outcome))   # the first on a tie
        fit = Fit(COMPOSITION_FITS, budget_fits=True, target=target,
                  seconds=_seconds(chosen.outcome))
        return noted(dataclasses.replace(chosen.outcome, fit=fit), (
            f"auto: the budget search fits no plan under the target (its least "
            f"{_peak(first, base)} bytes); {chosen.how} fits it "
            f"({_peak(chosen.outcome, base)} bytes) at the least predicted time of the "
            "compositions that do, and is applied"))
    lowest = min(searched + made, key=lambda t: _peak(t.outcome, base))
    if lowest.outcome is first:
        return first
    least = min(_peak(t.outcome, base) for t in searched + made if t.trusted)
    return _lowest(lowest, first, least, base, ctx, name)


def _lowest(lowest: _Tried, first: Outcome, least: int, base, ctx: Context,
            name: str) -> Outcome:
    """The lowest plan tried, where it is not the search's first; least:
    the least planned peak in the executor's order."""
    room, target = ctx.room, budget_planning.budget_target(ctx)
    best, peak = lowest.outcome, _peak(lowest.outcome, base)
    taken = lowest.how or f"fitted {lowest.lowered} bytes lower"
    if peak <= target and room.limit is not None:
        # The allocator model runs out of memory on every plan in the
        # executor's order (checked says so of this one): the lowest leaves
        # the step the most room.
        fit = Fit(DEVICE_RUNS_OUT, budget_fits=lowest.trusted, target=target,
                  seconds=_seconds(best))
        return noted(dataclasses.replace(best, fit=fit), (
            f"device: a model of {room.device}'s allocator runs out of memory under its "
            f"limit of {room.limit} bytes on every plan tried, so the lowest is taken "
            f"({taken})"))
    fit = Fit(UNMET, budget_fits=False, target=target, achievable=peak,
              seconds=_seconds(best))
    if peak <= target:
        # Below the target only in an order its edges hold: applied, but a
        # budget's fit is judged in the executor's order.
        fit = dataclasses.replace(fit, why=HELD_ORDER_ONLY)
        warning = budget_planning.unmet_warning(base, ctx, target, least, name, peak)
        note = (f"auto: in the executor's order no plan fits the target; {taken} "
                f"plans {peak} bytes and is applied, not said to fit; "
                f"{warning[len('sntf: '):]}")
    else:
        warning = budget_planning.unmet_warning(base, ctx, target, peak, name)
        note = (f"auto: the budget search's least plan ({_peak(first, base)} bytes) is "
                f"above {taken} ({peak} bytes), which is applied; "
                f"{warning[len('sntf: '):]}")
    return dataclasses.replace(noted(best, note), fit=fit, warnings=(warning,))


def _seconds(outcome: Outcome) -> float:
    return sum(d.seconds_added or 0.0 for d in acting(outcome.plan.decisions))
