"""Plans on a device whose allocator has a hard limit.

A GPU's memory is a hard limit, and so is the CPU's under
TF_CPU_BFC_MEM_LIMIT_IN_MB: a step that needs more raises
ResourceExhaustedError. A planned peak under the limit is not enough
there. A growing allocator's regions are capped by what the limit leaves,
and a chunk never spans two of them, so a large request can find no chunk
(analysis.bfc). The plan's claim that it fits is therefore judged by the
allocator model, and so is what the tensor cache may keep.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from sntf.analysis import memory, tensor_cache
from sntf.planner import budget as budget_planning
from sntf.planner import heuristics
from sntf.planner.context import Context
from sntf.planner.plan import identity_plan
from sntf.planner.policies import Outcome, noted, plan


@dataclasses.dataclass(frozen=True)
class DeviceRoom:
    """What a graph may use of its device under the allocator's limit."""

    device: str
    limit: int      # the allocator's bytes_limit
    usable: int     # less the analysis' margin
    outside: int    # held outside the graph (allocated first)
    grows: bool     # the allocator grows by regions (else one region)

    def runs_out(self, facts, lifetimes: Optional[tuple] = None) -> bool:
        """Whether the allocator model runs out of memory on this step (a
        multi-device graph is judged by its peak alone); lifetimes: the
        buffers' in place of the analysis' (memory.runs_out_of_memory).

        The model replays one order, and the executor's threads run
        another: near the limit, whether a request finds its chunk turns on
        it (the same plan of the swish all-conv net trained in one run and
        ran out of memory in the next under 33 MiB). So the model's limit
        also holds back the step's largest request, the slack a budget's
        target leaves (budget.allocator_slack)."""
        if facts.device_timelines:
            return False
        largest = budget_planning.allocator_slack(facts)
        return memory.runs_out_of_memory(facts, self.usable - largest, self.outside,
                                         self.grows, lifetimes) is not None


def unchanged_note(base, room: DeviceRoom, margin: float) -> Optional[str]:
    """A graph predicted to fit its device's limit, less the analysis'
    margin and what the device holds outside the graph, is left as it is
    (no overhead where nothing is needed); one that does not is planned as
    low as the policy goes. A peak under the limit is not enough: the
    allocator's regions may leave no chunk for a large request
    (analysis.bfc). Returns the note of an unchanged graph, or None."""
    peak = base.facts.budget_peak_bytes
    if peak > room.usable - room.outside or room.runs_out(base.facts):
        return None
    return (f"auto without a budget: the predicted peak {peak} bytes fits "
            f"{room.device}'s allocator limit of {room.limit} bytes (less the margin "
            f"{margin:g} and {room.outside} bytes held outside the "
            "graph), so the graph is left as it is")


def refitted(outcome: Outcome, base, room: DeviceRoom, ctx: Context, policy: str,
             name: str) -> Outcome:
    """Under a budget, on a device whose allocator has a limit: the plan
    fitted to the budget, or, where the allocator model runs out of memory
    on it, the first plan fitted under a lower target that does not; where
    none does, the lowest of them.

    A plan under its budget's target can still find no chunk for a large
    request: a growing allocator's regions are capped by what the limit
    leaves, and a chunk never spans two of them (analysis.bfc). A lower
    planned peak leaves the regions more free chunks. The target comes down
    in steps of heuristics.DEVICE_REFIT_SHARE of the budget, at most
    heuristics.DEVICE_REFITS times, and stops where no plan fits it. Where
    the model runs out on every plan, the lowest gives the step the most
    room: near the limit, whether a step finds its chunks turns on the
    order the executor's threads allocate in, which no plan fixes."""
    first = outcome.planned or base
    # A budget no plan meets has its lowest plan already.
    if not outcome.fields.get("budget_fits") or not room.runs_out(first.facts):
        return outcome
    target = budget_planning.budget_target(base, ctx)
    step = int(heuristics.DEVICE_REFIT_SHARE * ctx.budget)
    lowest, lowered = outcome, 0
    for k in range(1, heuristics.DEVICE_REFITS + 1):
        lower = dataclasses.replace(ctx, region_reserve=ctx.region_reserve + k * step)
        again = plan(policy, base, lower, name)
        planned = again.planned or base
        if planned.peak <= target and not room.runs_out(planned.facts):
            # It fits the budget's own target: not the lowered one's unmet
            # warning, and no achievable peak to report.
            fields = {key: value for key, value in again.fields.items()
                      if key != "achievable_peak_bytes"}
            return noted(dataclasses.replace(
                again, fields={**fields, "budget_fits": True}, warnings=outcome.warnings), (
                f"device: the plan for the budget's target ran out of memory in a model "
                f"of {room.device}'s allocator under its limit of {room.limit} bytes "
                f"(regions fragment), so it is fitted {k * step} bytes lower"))
        if planned.peak < (lowest.planned or base).peak:
            lowest, lowered = again, k * step
        if planned.peak > target - k * step:
            break                                   # the lowest plan there is
    fields = {**lowest.fields, "budget_fits": (lowest.planned or base).peak <= target}
    if ctx.budget_behaviour == "unchanged":
        return Outcome(identity_plan(policy, (
            f"device: a model of {room.device}'s allocator runs out of memory under its "
            f"limit of {room.limit} bytes on every plan tried: graph left unchanged "
            "(budget_behaviour='unchanged')")), fields={**fields, "budget_fits": False},
            warnings=outcome.warnings)
    if lowest is outcome:
        return outcome
    return noted(dataclasses.replace(lowest, fields=fields), (
        f"device: a model of {room.device}'s allocator runs out of memory under its "
        f"limit of {room.limit} bytes on every plan tried, so the lowest is taken "
        f"(fitted {lowered} bytes lower)"))


def reordered(outcome: Outcome, base, room: DeviceRoom, ctx: Context, policy: str,
              name: str) -> Outcome:
    """Without a budget, on a device whose allocator has a limit: the plan
    in the executor's order where the allocator model fits it; else the
    same policy planned with a memory-aware order held by order edges
    (ctx.memory_order, ctx.pin_order), where that plans lower.

    The executor's order is the one a run reaches unchained, so a plan
    that fits in it is kept. But it defers every op the input gradients'
    chain does not wait for, and what those ops read stays alive
    (BENCHMARKS.md, "The device limit in every training loop"). A plan
    that runs out of memory anyway gains from the lower order: held by its
    edges, the run follows it."""
    first = outcome.planned or base
    if (not room.runs_out(first.facts) or not ctx.pin_allowed
            or (ctx.memory_order and ctx.pin_order)):
        return outcome
    again = plan(policy, base, dataclasses.replace(ctx, memory_order=True, pin_order=True),
                 name)
    held = again.planned
    if held is None or not again.pinned or held.peak >= first.peak:
        return outcome
    return noted(again, (
        f"device: in the executor's order the plan ({first.peak} bytes) runs out of "
        f"memory in a model of {room.device}'s allocator under its limit of "
        f"{room.limit} bytes; held to a memory-aware order it plans {held.peak} bytes"))


def cache_fitted(outcome: Outcome, room: DeviceRoom) -> Outcome:
    """The outcome with the tensor cache's headroom cut to what the
    allocator model leaves under the device's limit.

    The headroom is bytes under the budget; the cache fills it with the
    chunks of tensors the plan counted as gone, and under a hard limit
    those chunks can be the ones a later request needed (the swish
    all-conv net's plan trained under a 32 MiB limit with no headroom, and
    ran out of memory with it; BENCHMARKS.md). The headroom is halved
    until the model, with the cache keeping what it allows
    (analysis.tensor_cache), does not run out of memory, down to none."""
    planned, headroom = outcome.planned, outcome.cache_headroom
    if planned is None or headroom is None or headroom <= 0:
        return outcome
    if room.runs_out(planned.facts):
        # The model runs out without the cache: whatever it keeps adds to
        # the pressure, so it keeps nothing.
        return noted(dataclasses.replace(outcome, cache_headroom=0), (
            f"tensor cache: 0 bytes, not {headroom}: a model of {room.device}'s "
            f"allocator runs out of memory under its limit of {room.limit} bytes "
            "on the plan alone"))
    fitted = headroom
    while fitted and room.runs_out(
            planned.facts, tensor_cache.cached_lifetimes(planned.index, planned.facts, fitted)):
        fitted = fitted // 2 if fitted // 2 >= heuristics.DEVICE_CACHE_MIN_BYTES else 0
    if fitted == headroom:
        return outcome
    note = (f"tensor cache: {fitted} bytes, not {headroom}: with more, a model of "
            f"{room.device}'s allocator under its limit of {room.limit} bytes runs out "
            "of memory")
    return noted(dataclasses.replace(outcome, cache_headroom=fitted), note)


def checked(outcome: Outcome, base, room: DeviceRoom, name: str) -> tuple[Outcome, bool]:
    """The outcome, and whether the graph as planned fits the device's
    limit by the allocator model. Where it does not, a warning says so
    once, and a budget the plan was fitted to is not met."""
    facts = (outcome.planned or base).facts
    if not room.runs_out(facts):
        return outcome, True
    if outcome.fields.get("budget_fits"):
        outcome = dataclasses.replace(outcome, fields={**outcome.fields, "budget_fits": False})
    warning = (f"{name}: predicted to run out of memory under {room.device}'s "
               f"allocator limit of {room.limit / 2**20:.0f} MiB even as planned "
               f"(planned peak {facts.budget_peak_bytes / 2**20:.1f} MiB); try a smaller "
               "batch")
    return dataclasses.replace(outcome, warnings=outcome.warnings + (warning,)), False
