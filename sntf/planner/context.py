"""What planning needs besides the graph: the user's settings, the device,
and a way to try a plan.

The planner never rewrites a graph itself: `Context.evaluate` (supplied by
the pass, which owns the rewrite) applies a plan to an analyzed graph and
analyzes the result, so that the planner can compare plans by their planned
peaks while dependencies keep pointing one way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Optional

from sntf.planner import heuristics
from sntf.planner.plan import Plan

# (plan, analyzed graph) -> the rewritten graph analyzed, or None when the
# plan changes nothing. Raises when the rewrite is malformed.
Evaluate = Callable[[Plan, object], Optional[object]]


@dataclasses.dataclass(frozen=True)
class Context:
    """The settings a policy plans under.

    Attributes:
      evaluate: tries a plan (see module docstring).
      recompute_mode: "speed", "memory" or "auto".
      swap_min_bytes: smaller tensors are never swapped; None: a threshold
        scaled to the graph (planner.swap.default_min_bytes).
      bandwidth: bytes per second between the device and the host pool.
      onednn: whether oneDNN pairs forward ops with their gradients.
      budget: the device budget in bytes, or None.
      outside_bytes: device bytes held outside the graph (budgets only).
      budget_margin: share of the budget held back for the analysis' error.
      budget_behaviour: "best_effort" or "unchanged" when no plan fits.
      min_gain: without a budget, the least share of the planned peak a
        rewritten graph must save to be applied.
      order_reserve: bytes the budget target holds back besides the margin:
        what a plan's order edges added to its planned peak, where a first
        fit left them no room (policies._fitted_in_order).
      region_reserve: bytes the budget target holds back for a device's
        allocator regions, where the first plan ran out of memory in the
        allocator model under the device's limit (device_limit.refitted).
      stage_seconds: where the wall time of each planning stage is added
        (the report's field), or None.
      pin_order: chain a rewritten graph's memory-heavy ops in the planned
        order (sntf.planner.order.plan_sequence).
      memory_order: the chain may hold a memory-aware order instead of the
        executor's (sntf.planner.memory_order.memory_orders). Off under a
        budget or a
        device's allocator limit, where the plan's prediction decides what
        fits and must be one the run reaches.
      pin_allowed: the user allows order edges at all (option pin_order);
        pin_order may still be off where one inter-op thread runs the step
        in the executor's order and a budget or device limit binds the plan.
      pool: ready ops may run side by side or in any order, as on
        TensorFlow's default inter-op pool; False where one inter-op thread
        runs the step in the order the analysis emulates.
    """

    evaluate: Evaluate
    recompute_mode: str = "auto"
    swap_min_bytes: Optional[int] = None
    bandwidth: float = heuristics.PCIE4_X16_BYTES_PER_SECOND
    onednn: bool = True
    budget: Optional[int] = None
    outside_bytes: int = 0
    budget_margin: float = 0.10
    budget_behaviour: str = "best_effort"
    min_gain: float = 0.05
    order_reserve: int = 0
    region_reserve: int = 0
    stage_seconds: Optional[dict] = None
    pin_order: bool = True
    memory_order: bool = True
    pin_allowed: bool = True
    pool: bool = True

    @contextlib.contextmanager
    def timed(self, stage: str):
        """Adds the wall time of a planning stage to stage_seconds."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.stage_seconds is not None:
                self.stage_seconds[stage] = (self.stage_seconds.get(stage, 0.0)
                                             + time.perf_counter() - start)


def protected(index) -> frozenset:
    """Nodes no plan may touch: the fetch nodes and the nodes to preserve."""
    return frozenset(index.fetch) | frozenset(index.preserve)
