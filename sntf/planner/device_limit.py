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

from sntf.analysis import tensor_cache
from sntf.planner import heuristics
from sntf.planner.plan import Outcome, noted, refit
from sntf.planner.room import Room


def unchanged_note(base, room: Room) -> Optional[str]:
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
            f"{room.margin:g} and {room.outside} bytes held outside the "
            "graph), so the graph is left as it is")


def cache_fitted(outcome: Outcome, room: Room) -> Outcome:
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


def checked(outcome: Outcome, base, room: Room, name: str) -> Outcome:
    """The outcome, its Fit saying whether the graph as planned fits the
    device's limit by the allocator model (device_fits). Where it does not,
    a warning says so once, and a budget the plan was fitted to is not
    met."""
    facts = (outcome.planned or base).facts
    if not room.runs_out(facts):
        return refit(outcome, device_fits=True)
    outcome = refit(outcome, device_fits=False)
    if outcome.fit.budget_fits:
        outcome = refit(outcome, budget_fits=False)
    warning = (f"{name}: predicted to run out of memory under {room.device}'s "
               f"allocator limit of {room.limit / 2**20:.0f} MiB even as planned "
               f"(planned peak {facts.budget_peak_bytes / 2**20:.1f} MiB); try a smaller "
               "batch")
    return dataclasses.replace(outcome, warnings=outcome.warnings + (warning,))
