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
from sntf.planner.room import Room

# (plan, analyzed graph) -> the rewritten graph analyzed, or None when the
# plan changes nothing. Raises when the rewrite is malformed.
Evaluate = Callable[[Plan, object], Optional[object]]


@dataclasses.dataclass(frozen=True)
class Options:
    """The user's settings a policy plans under.

    Attributes:
      recompute_mode: "speed", "memory" or "auto".
      swap_min_bytes: smaller tensors are never swapped; None: a threshold
        scaled to the graph (planner.swap.default_min_bytes).
      budget_behaviour: "best_effort" or "unchanged" when no plan fits.
      min_gain: without a budget, the least share of the planned peak a
        rewritten graph must save to be applied.
      pin_order: the user allows order edges at all (option pin_order).
    """

    recompute_mode: str = "auto"
    swap_min_bytes: Optional[int] = None
    budget_behaviour: str = "best_effort"
    min_gain: float = 0.05
    pin_order: bool = True


@dataclasses.dataclass(frozen=True)
class Device:
    """What the planner knows of the device and the runtime.

    Attributes:
      bandwidth: bytes per second between the device and the host pool.
      onednn: whether oneDNN pairs forward ops with their gradients.
      pool: ready ops may run side by side or in any order, as on
        TensorFlow's default inter-op pool; False where one inter-op thread
        runs the step in the order the analysis emulates.
    """

    bandwidth: float = heuristics.PCIE4_X16_BYTES_PER_SECOND
    onednn: bool = True
    pool: bool = True


@dataclasses.dataclass(frozen=True)
class Search:
    """What the fit loop (sntf.planner.fit) varies between the plans it tries.

    Attributes:
      pin_order: chain a rewritten graph's memory-heavy ops in the planned
        order (sntf.planner.order.plan_sequence).
      memory_order: the chain may hold a memory-aware order instead of the
        executor's (sntf.planner.memory_order.memory_orders).
      order_reserve: bytes the budget search's target holds back below
        the room's (Room.target) for order edges: what they added to a
        first plan that fitted with no room for them.
      region_reserve: bytes it holds back for a device's allocator
        regions, where the allocator model ran out of memory on a plan
        that fitted the target.
    """

    pin_order: bool = True
    memory_order: bool = True
    order_reserve: int = 0
    region_reserve: int = 0

    @property
    def reserve(self) -> int:
        """Bytes the budget search's target holds back in all."""
        return self.order_reserve + self.region_reserve


@dataclasses.dataclass(frozen=True)
class Instruments:
    """Where planning reports on itself.

    Attributes:
      stage_seconds: where the wall time of each planning stage is added
        (the report's field), or None.
    """

    stage_seconds: Optional[dict] = None

    @contextlib.contextmanager
    def timed(self, stage: str):
        """Adds the wall time of a planning stage to stage_seconds, where
        the stage is the last key while it runs (a progress display reads
        it)."""
        seconds = self.stage_seconds
        if seconds is not None:
            seconds[stage] = seconds.pop(stage, 0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            if seconds is not None:
                seconds[stage] += time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class Context:
    """What a policy plans under.

    Attributes:
      evaluate: tries a plan (see module docstring).
      options: the user's settings.
      device: the device and the runtime.
      room: the bytes the step may use (sntf.planner.room.Room).
      search: what the fit loop varies.
      instruments: where planning reports on itself.
    """

    evaluate: Evaluate
    options: Options = Options()
    device: Device = Device()
    room: Room = Room()
    search: Search = Search()
    instruments: Instruments = Instruments()

    @property
    def budget(self) -> Optional[int]:
        """The user's budget in bytes, or None."""
        return self.room.budget

    def timed(self, stage: str):
        """Adds the wall time of a planning stage to the report's
        stage_seconds (Instruments.timed)."""
        return self.instruments.timed(stage)

    def searching(self, **changes) -> "Context":
        """The context with search state changed (Search's fields)."""
        return dataclasses.replace(self, search=dataclasses.replace(self.search, **changes))


_PARTS = {Options: "options", Device: "device", Search: "search", Instruments: "instruments"}


def build(evaluate: Evaluate, room: Optional[Room] = None, **settings) -> Context:
    """A Context from flat settings, each the field of one part (Options,
    Device, Search, Instruments; pin_order sets both the user's permission
    and the search's).

    Args:
      evaluate: tries a plan.
      room: the step's room; None: no budget and no limit.
      **settings: fields of the parts, by name.

    Returns:
      The Context.

    Raises:
      ValueError: a setting no part has.
    """
    parts: dict = {name: {} for name in _PARTS.values()}
    for key, value in settings.items():
        owners = [name for cls, name in _PARTS.items()
                  if key in {f.name for f in dataclasses.fields(cls)}]
        if not owners:
            raise ValueError(f"unknown planning setting {key!r}; settings: "
                             f"{sorted(f.name for cls in _PARTS for f in dataclasses.fields(cls))}")
        for name in owners:
            parts[name][key] = value
    made = {name: cls(**parts[name]) for cls, name in _PARTS.items()}
    return Context(evaluate=evaluate, room=room or Room(), **made)


def protected(index) -> frozenset:
    """Nodes no plan may touch: the fetch nodes and the nodes to preserve."""
    return frozenset(index.fetch) | frozenset(index.preserve)
