"""The room a training step has on its device: the bytes a plan may use.

One value per graph, made once by the pass from the user's budget, the
device's allocator limit, the analysis' margin and what the device holds
outside the graph. Everything that asks whether a plan fits reads it:

    target      the planned peak a budget's plan must not exceed
    runs_out    whether a model of the device's allocator runs out of
                memory on a plan, under the limit
    headroom    what the tensor cache may keep on the device under the
                budget
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from sntf.analysis import memory


def allocator_slack(facts) -> int:
    """Headroom a plan leaves for the allocator's rounding: the step's
    largest single request, in bytes.

    TensorFlow's BFC allocator serves a request from the best-fitting free
    chunk and splits it only when it is at least twice the request, so a
    request may take up to twice its bytes; which chunk it gets depends on
    the allocator's history, which the pass cannot see (its model replays
    one step from an empty allocator). With TensorFlow's own convolution
    kernels the largest request is often an im2col scratch buffer; under
    oneDNN, whose kernels keep their scratch outside the allocator, it is
    an activation or a gradient (BENCHMARKS.md, "Budgets leave the step's
    largest request as allocator slack").
    """
    return max((n for b, n in facts.buffer_bytes.items()
                if b not in facts.persistent_buffers), default=0)


@dataclasses.dataclass(frozen=True)
class Room:
    """What one graph's step may use of its device.

    Attributes:
      budget: the user's budget in bytes, or None.
      margin: the share of the budget, and of the limit, held back for the
        analysis' error.
      outside: bytes the device holds outside the graph (the allocator's
        bytes in use before the step, less the graph's variables).
      slack: the allocator's slack for the unplanned graph's largest
        request (allocator_slack).
      device: the device whose memory it is ("CPU:0", "GPU:0").
      limit: the device allocator's bytes_limit, or None where it has none.
      grows: the allocator grows by regions (else one region of the limit).
    """

    budget: Optional[int] = None
    margin: float = 0.10
    outside: int = 0
    slack: int = 0
    device: str = "CPU:0"
    limit: Optional[int] = None
    grows: bool = False

    @classmethod
    def of(cls, facts, budget: Optional[int] = None, margin: float = 0.10,
           outside: int = 0, device: str = "CPU:0", limit: Optional[int] = None,
           grows: bool = False) -> "Room":
        """The room of an analyzed graph (facts: its analysis).

        Args:
          facts: the unplanned graph's analysis, whose largest request sets
            the allocator's slack.
          budget, margin, outside, device, limit, grows: as the attributes.

        Returns:
          The Room.
        """
        return cls(budget, margin, outside, allocator_slack(facts), device, limit, grows)

    @property
    def binds(self) -> bool:
        """Whether a budget or a device limit binds the plan."""
        return self.budget is not None or self.limit is not None

    @property
    def target(self) -> Optional[int]:
        """The planned peak a plan must not exceed to fit the budget: the
        budget less the margin, what the device holds outside the graph
        and the allocator's slack. None without a budget."""
        if self.budget is None:
            return None
        return int(self.budget * (1.0 - self.margin)) - self.outside - self.slack

    @property
    def usable(self) -> Optional[int]:
        """The device's limit less the margin, or None without a limit."""
        return None if self.limit is None else int(self.limit * (1.0 - self.margin))

    def runs_out(self, facts, lifetimes: Optional[tuple] = None) -> bool:
        """Whether the allocator model runs out of memory on a step under the
        device's limit (never without one; a multi-device graph is judged by
        its peak alone); lifetimes: the buffers' in place of the analysis'
        (memory.runs_out_of_memory).

        The model replays one order, and the executor's threads run
        another: near the limit, whether a request finds its chunk turns on
        it. So the model's limit also holds back the step's largest request,
        the slack a budget's target leaves (allocator_slack)."""
        if self.limit is None or facts.device_timelines:
            return False
        return memory.runs_out_of_memory(facts, self.usable - allocator_slack(facts),
                                         self.outside, self.grows, lifetimes) is not None

    def headroom(self, facts) -> Optional[int]:
        """Bytes of swapped tensors the tensor cache may keep on the device
        under the budget (negative: none; None without a budget), for a
        planned graph's analysis.

        The planned peak assumes every swap copies, so cached tensors may use
        only the headroom budget * (1 - margin) - planned peak: kept within
        it, they raise no step of the plan above the budget less its margin,
        wherever that step lies. The margin is held back for the analysis'
        error, as the target holds it: a cache that filled it would leave a
        plan that measures above its prediction over the budget. The
        headroom also leaves what the device holds outside the graph and the
        allocator's slack, as the target does."""
        if self.budget is None:
            return None
        return (int(self.budget * (1.0 - self.margin)) - self.outside
                - allocator_slack(facts) - facts.budget_peak_bytes)

    def cache_note(self, facts) -> str:
        """The plan note that says how much the tensor cache may keep."""
        peak, budget, margin = facts.budget_peak_bytes, self.budget, self.margin
        headroom = self.headroom(facts)
        kept_back = f" x (1 - margin {margin:g})" if margin else ""
        held = f" - {self.outside} held outside the graph" if self.outside else ""
        slack = allocator_slack(facts)
        slack_text = f" - {slack} allocator slack" if slack else ""
        if headroom < 0:
            return (f"budget {budget} bytes{kept_back}{held}{slack_text} is below the "
                    f"planned peak {peak} bytes: every swap copies")
        return (f"tensor cache: up to {headroom} bytes of swapped tensors stay on the "
                f"device (budget {budget}{kept_back}{held}{slack_text} - planned peak "
                f"{peak})")
