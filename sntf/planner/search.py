"""The budget-driven planner behind policy "auto": per buffer, keep,
recompute or swap, so that the planned peak fits a budget at the least
predicted extra time.

This module is pure: it ranks and selects options and never touches a graph.
The planned peak of a selection comes from a callable (sntf.planner.budget
rewrites the graph with the selection and analyzes the result), so the same
search runs on hand-made peak functions in tests.

Two searches over the same options:
  - `greedy`: options in order of bytes saved per second of added time (a
    swap whose transfer hides behind compute costs nothing and comes first).
    On large graphs the shortest prefix of that order that fits (found by
    bisection); on small ones, one option at a time, the one that lowers
    the current planned peak most per second. Then a local search drops
    options, and exchanges one or two for a cheaper one, while the plan
    still fits.
  - `exact`: every combination (keep, or one of a buffer's options), cheapest
    first, until one fits: the least-overhead plan, for small graphs in tests.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterable, Optional, Sequence

from sntf.planner.heuristics import SMALL_GRAPH_SEARCH, UNMET_PREFIXES

# Ranks a free option (fully hidden transfer) ahead of every costed one
# without dividing by zero; among free options more bytes come first.
_FREE_SECONDS = 1e-12


@dataclasses.dataclass(frozen=True)
class Option:
    """One way to stop keeping one buffer from the forward to the backward pass."""

    unit: object                 # the buffer it frees (options of one unit exclude each other)
    action: str                  # planner.RECOMPUTE or planner.SWAP
    tensors: tuple[str, ...]     # "node:port" names decided together
    bytes_saved: int
    seconds: float               # predicted extra time

    @property
    def score(self) -> float:
        """Bytes saved per second of added time."""
        return self.bytes_saved / max(self.seconds, _FREE_SECONDS)


@dataclasses.dataclass(frozen=True)
class Choice:
    """A selection of options and what the planner learned about it."""

    options: tuple[Option, ...]
    peak: int                    # planned peak with the selection applied
    fits: bool                   # peak <= budget
    evaluations: int             # planned peaks computed to find it

    @property
    def seconds(self) -> float:
        return sum(o.seconds for o in self.options)


PeakFn = Callable[[tuple], int]
ExcessFn = Callable[[tuple, int], int]


def ranked(options: Iterable[Option], gains: Optional[dict] = None) -> list[Option]:
    """The best option of each unit, best bytes per second first.

    Args:
      options: every option of every unit.
      gains: option -> how much it alone lowers the planned peak, where
        measured. Measured options rank by that gain per second, ahead of
        options whose gain is nil; unmeasured ones by bytes saved per second.

    Returns:
      One option per unit, best first; ties keep the input order, so the
      ranking is deterministic.
    """
    def key(o: Option):
        if gains is None:
            return (1, o.score, o.bytes_saved)
        gain = gains.get(o, 0)
        return (1 if gain > 0 else 0,
                gain / max(o.seconds, _FREE_SECONDS) if gain > 0 else o.score,
                o.bytes_saved)

    best: dict = {}
    for o in options:
        if o.bytes_saved <= 0:
            continue
        current = best.get(o.unit)
        if current is None or key(o) > key(current):
            best[o.unit] = o
    return sorted(best.values(), key=lambda o: tuple(-k for k in key(o)))


class _Counted:
    """A peak function that counts its distinct evaluations and memoizes them."""

    def __init__(self, peak_of: PeakFn):
        self._peak_of = peak_of
        self._memo: dict = {}

    def __call__(self, selection: Sequence[Option]) -> int:
        key = frozenset(selection)
        if key not in self._memo:
            self._memo[key] = self._peak_of(tuple(selection))
        return self._memo[key]

    @property
    def count(self) -> int:
        return len(self._memo)


def greedy(options: Iterable[Option], peak_of: PeakFn, budget: int,
           refine_evaluations: int = 24, measure_limit: int = 48,
           excess_of: Optional[ExcessFn] = None, small_graph: bool = True) -> Choice:
    """Fits `budget` with the options of best bytes per second.

    Args:
      options: candidate options (several per unit allowed; the best of each
        unit is used).
      peak_of: planned peak of a selection (a tuple of options).
      budget: the byte budget.
      refine_evaluations: planned peaks spent on a local search from the
        first fitting selection (see _improve): dropping options, and
        exchanging one or two for a cheaper one, while the plan fits. Small
        graphs get SMALL_GRAPH_SEARCH times as many.
      measure_limit: with at most this many options, options are added one
        at a time, each step measuring every remaining option's effect on
        the current planned peak: bytes saved are only a proxy, since a
        buffer lowers the peak only if it is live there, and a swap and a
        recomputation of one buffer free it over different steps. Larger
        graphs take the shortest fitting prefix of the bytes-per-second
        order, found by bisection (a few planned peaks in all).
      excess_of: (selection, budget) -> the planned timeline's excess over
        the budget (bytes over it, summed over steps) of a selection whose
        peak was computed; with
        it, small graphs measure progress by the excess removed, which also
        moves when several steps tie at the peak.
      small_graph: whether the graph is small enough (SMALL_GRAPH_NODES)
        for the small-graph search, whose thousands of planned peaks assume
        each takes milliseconds.

    Returns:
      The Choice. Where every option together does not fit, the search
      goes on from the lowest of a few prefixes of the ranked options if
      one fits; else that prefix comes back with fits=False: the least
      planned peak found.
    """
    options = [o for o in options if o.bytes_saved > 0]
    peak = _Counted(peak_of)
    if peak(()) <= budget:
        return Choice((), peak(()), True, peak.count)
    order = ranked(options)
    if peak(order) > budget:
        lowest = _lowest_prefix(order, peak)
        if peak(lowest) > budget:
            return Choice(tuple(lowest), peak(lowest), False, peak.count)
        order = lowest      # a prefix fits where the whole does not
    if len(options) > measure_limit or not small_graph:
        chosen = _shortest_prefix(order, peak, budget)
        chosen = _improve(chosen, options, peak, budget, peak.count + refine_evaluations)
        return Choice(tuple(chosen), peak(chosen), True, peak.count)
    # Small graphs: several starts, each improved by local search; the
    # cheapest result wins (a local search from one start can stall where
    # only exchanging three options for two would help).
    best = None
    starts = [_shortest_prefix(order, peak, budget)]
    for subset, per_second in _starts(options, peak, budget):
        start = _marginal(subset, peak, budget, per_second, excess_of)
        if start is not None:
            starts.append(start)
    for start in starts:
        limit = peak.count + refine_evaluations * SMALL_GRAPH_SEARCH
        chosen = _improve(start, options, peak, budget, limit)
        if best is None or _cost(chosen) < _cost(best):
            best = chosen
    return Choice(tuple(best), peak(best), True, peak.count)


def _starts(options: list, peak: _Counted, budget: int):
    """Where the small-graph search starts, besides the bytes-per-second
    prefix: the greedy by gain per second and by gain over every option, and by gain per second over each
    action's options alone when those alone fit (a plan of swaps only or
    recomputations only, which mixing may never reach)."""
    yield options, True
    yield options, False
    for action in sorted({o.action for o in options}):
        alone = [o for o in options if o.action == action]
        if len(alone) < len(options) and peak(ranked(alone)) <= budget:
            yield alone, True


def _cost(selection) -> float:
    return sum(o.seconds for o in selection)


def _lowest_prefix(order: list, peak: _Counted) -> list:
    """Of UNMET_PREFIXES prefixes of `order` at evenly spaced lengths (the
    whole included), the one planned lowest; the shortest of those tied."""
    n = len(order)
    lengths = sorted({max(1, -(-n * k // UNMET_PREFIXES))
                      for k in range(1, UNMET_PREFIXES + 1)})
    return min((list(order[:k]) for k in lengths), key=lambda s: (peak(s), len(s)))


def _shortest_prefix(order: list, peak: _Counted, budget: int) -> list:
    """The shortest prefix of `order` that fits, by bisection (the full
    order fits). The planned peak falls with every option in all but
    contrived graphs; where it does not, bisection still returns a fitting
    prefix."""
    lo, hi = 0, len(order)       # the prefix of length hi fits, lo does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak(order[:mid]) <= budget:
            hi = mid
        else:
            lo = mid
    return list(order[:hi])


def _marginal(options: list, peak: _Counted, budget: int,
              per_second: bool = True, excess_of: Optional[ExcessFn] = None) -> list:
    """Adds, one at a time, the option that lowers the current planned peak
    (or its excess over the budget, given excess_of) most per second (or
    most, with per_second False), every remaining option measured at each
    step, until the plan fits. Where no single option helps, the best bytes
    per second goes in.

    Returns:
      The selection, or None when every unit is taken and it still does
      not fit.
    """

    def measure(selection) -> float:
        value = peak(selection)
        return excess_of(tuple(selection), budget) if excess_of is not None else value

    chosen: list = []
    while peak(chosen) > budget:
        current = measure(chosen)
        taken = {o.unit for o in chosen}
        remaining = [o for o in options if o.unit not in taken]
        if not remaining:
            return None
        gains = {o: current - measure(chosen + [o]) for o in remaining}
        if not per_second:
            # Equal seconds for all: the ranking is by gain alone.
            remaining = [dataclasses.replace(o, seconds=1.0) for o in remaining]
            gains = {dataclasses.replace(o, seconds=1.0): g for o, g in gains.items()}
        pick = ranked(remaining, gains)[0]
        chosen.append(next(o for o in options if o.unit == pick.unit
                           and o.action == pick.action))
    return chosen


def _improve(chosen: list, options: list, peak: _Counted, budget: int,
             limit: int) -> list:
    """Local search for a cheaper fitting selection, until no move helps or
    `limit` planned peaks have been computed. Moves, cheapest result first:
    drop one option; exchange one option for a cheaper one (of another
    unit, or the other action of its own); exchange two for one; replace
    everything by a single option. A move is taken only if the plan fits.
    Both actions of a unit are tried: a swap and a recomputation free the
    same bytes but not at the same steps, so their peaks differ."""

    cost = _cost

    def moves(current: list):
        for i, o in enumerate(current):
            yield current[:i] + current[i + 1:]
        for i, o in enumerate(current):
            rest = current[:i] + current[i + 1:]
            taken = {r.unit for r in rest}
            for other in options:
                if other.unit not in taken and other is not o:
                    yield rest + [other]
        for i, j in itertools.combinations(range(len(current)), 2):
            rest = [o for k, o in enumerate(current) if k not in (i, j)]
            taken = {r.unit for r in rest}
            for other in options:
                if other.unit not in taken:
                    yield rest + [other]
        for single in options:
            yield [single]

    improved = True
    while improved and peak.count < limit:
        improved = False
        best = cost(chosen)
        for trial in sorted(moves(chosen), key=cost):
            if cost(trial) >= best or peak.count >= limit:
                break
            if peak(trial) <= budget:
                chosen, improved = trial, True
                break
    return chosen


def exact(options: Iterable[Option], peak_of: PeakFn, budget: int,
          max_combinations: int = 200_000) -> Optional[Choice]:
    """The least-overhead selection that fits, by enumeration.

    Every unit is kept or gets one of its options; combinations are tried in
    order of predicted extra time and the first that fits is optimal.

    Args:
      options: candidate options (several per unit allowed).
      peak_of: planned peak of a selection.
      budget: the byte budget.
      max_combinations: refuse (ValueError) beyond this many combinations.

    Returns:
      The optimal Choice, or None when no combination fits.
    """
    units: dict = {}
    for o in options:
        if o.bytes_saved > 0:
            units.setdefault(o.unit, [None]).append(o)
    total = 1
    for alternatives in units.values():
        total *= len(alternatives)
    if total > max_combinations:
        raise ValueError(f"{total} combinations exceed max_combinations="
                         f"{max_combinations}")
    combos = [tuple(o for o in combo if o is not None)
              for combo in itertools.product(*units.values())]
    combos.sort(key=lambda c: (sum(o.seconds for o in c), len(c)))
    peak = _Counted(peak_of)
    for combo in combos:
        if peak(combo) <= budget:
            return Choice(combo, peak(combo), True, peak.count)
    return None
