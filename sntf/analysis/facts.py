"""What an analysis says about a graph: its buffers, their classes and
intervals, the memory timeline, the predicted peak and the lower bound.

Buffers are keyed by the tensor (node, port) that allocated them; a
variable's buffer by (its handle's root, VARIABLE_PORT), an op's scratch
memory by (the op, SCRATCH_PORT). sntf.analysis.memory computes them.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Mapping, Optional

from sntf.graph.index import on_gpu

VARIABLE_PORT = -2   # buffer key (handle root, -2): a variable's own buffer
SCRATCH_PORT = -1    # buffer key (node, -1): an op's scratch memory

# Buffer classes.
PERSISTENT, ACTIVATION, GRADIENT, TEMPORARY = (
    "persistent", "activation", "gradient", "temporary")
TENSOR_CLASSES = (PERSISTENT, ACTIVATION, GRADIENT, TEMPORARY)


class Deferred:
    """A value computed when first read, its computation then dropped.

    A planner tries many rewritten graphs and compares most by their peaks
    alone; it reads the phases, buffer classes, lower bound and op costs of
    only those it builds on, and the analysis of the others never computes
    them. Equal to any other Deferred, so that analyses compare by what
    they hold."""

    def __init__(self, compute: Callable[[], object]):
        self._compute: Optional[Callable[[], object]] = compute
        self._value: object = None
        self._lock = threading.Lock()

    def get(self) -> object:
        """The value, computed on the first call."""
        with self._lock:
            if self._compute is not None:
                self._value, self._compute = self._compute(), None
            return self._value

    def __eq__(self, other) -> bool:
        return isinstance(other, Deferred)

    __hash__ = None


@dataclasses.dataclass(frozen=True)
class Classes:
    """What an analysis says by phase: each node's, each buffer's class, and
    the bytes live per class."""

    node_phases: tuple[str, ...]                                 # node -> phase
    buffer_class: Mapping[tuple[int, int], str]                  # buffer -> class
    live_bytes: tuple[int, ...]       # per step, while it runs (inputs + outputs)
    by_class: Mapping[str, tuple[int, ...]]
    backward_start: Optional[int]     # first step of the backward pass
    checkpoint_steps: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Bytes live at every schedule step, total and per buffer class (the
    latter computed when first read: see Deferred)."""

    steps: tuple[int, ...]            # node index run at each step
    device_bytes: tuple[int, ...]     # what the allocator reports in use (chunks)
    classes: Deferred                 # -> Classes

    @property
    def live_bytes(self) -> tuple[int, ...]:
        """Bytes live while each step runs (its inputs and outputs)."""
        return self.classes.get().live_bytes

    @property
    def by_class(self) -> Mapping[str, tuple[int, ...]]:
        """Bytes live at each step per buffer class."""
        return self.classes.get().by_class

    @property
    def backward_start(self) -> Optional[int]:
        """The first step of the backward pass."""
        return self.classes.get().backward_start

    @property
    def checkpoint_steps(self) -> tuple[int, ...]:
        """The steps of the forward pass's checkpoint ops."""
        return self.classes.get().checkpoint_steps


@dataclasses.dataclass(frozen=True)
class Analysis:
    """Everything the planner needs to know about one training graph.

    Each field says what it is keyed by: a node index, a schedule step, a
    tensor (node, port), or a buffer (the tensor that allocated it).
    """

    batch: Optional[int]
    schedule: tuple[int, ...]                                    # step -> node
    buffer_bytes: Mapping[tuple[int, int], int]                  # buffer -> bytes
    buffer_intervals: Mapping[tuple[int, int], tuple[int, int]]  # buffer -> (alloc, free) steps
    buffers: Mapping[tuple[int, int], tuple[int, int]]           # tensor -> its buffer
    persistent_bytes: int
    timeline: Timeline
    predicted_peak_bytes: int
    peak_step: int
    # (lower bound bytes, its step, step -> seconds), computed when read.
    costs: Deferred
    unknown_sizes: int
    # Bytes of the variables the graph reads (part of persistent_bytes):
    # allocated before the step, by whoever created the variables.
    variable_bytes: int = 0
    # The buffers that exist before the step (variables, constants).
    persistent_buffers: frozenset = frozenset()
    # Graphs placed on several devices (one replica per device under
    # tf.distribute): each device's own allocator timeline (bytes in use at
    # every step), its buffers being those of the nodes placed on it. Empty
    # for a single-device graph.
    device_timelines: Mapping[str, tuple[int, ...]] = dataclasses.field(
        default_factory=dict)
    # Buffer -> the variable buffer it becomes where it dies: the value of
    # an AssignVariableOp that is its last reader (TensorFlow's kernel then
    # adopts the value's buffer and frees the variable's old one).
    handover: Mapping[tuple[int, int], tuple[int, int]] = dataclasses.field(
        default_factory=dict)
    # Bytes the device holds outside the graph when the step starts (a
    # dataset's tensors, leftovers of other models), where the timeline is
    # modelled on them (memory.with_outside): allocated first in the
    # allocator model, the timeline is then what the graph adds to them.
    outside_bytes: int = 0
    # The liveness the analysis was made from (sntf.analysis.liveness),
    # released: what its deferred parts are computed from.
    liveness: object = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def node_phases(self) -> tuple[str, ...]:
        """Per node, its phase (sntf.graph.phases)."""
        return self.timeline.classes.get().node_phases

    @property
    def buffer_class(self) -> Mapping[tuple[int, int], str]:
        """Per buffer, its class (TENSOR_CLASSES)."""
        return self.timeline.classes.get().buffer_class

    @property
    def lower_bound_bytes(self) -> int:
        """The largest single-op working set plus the persistent bytes."""
        return self.costs.get()[0]

    @property
    def lower_bound_step(self) -> int:
        """The schedule step of that op."""
        return self.costs.get()[1]

    @property
    def step_seconds(self) -> tuple[float, ...]:
        """Estimated seconds of each schedule step."""
        return self.costs.get()[2]

    @property
    def device_peak_bytes(self) -> dict:
        """Device -> its predicted peak (multi-device graphs; else empty)."""
        return {d: max(series, default=0) for d, series in self.device_timelines.items()}

    @property
    def budget_timeline(self) -> tuple[int, ...]:
        """The bytes in use a memory budget applies to, at every step.

        One device: the graph's timeline. Several (replicas under
        tf.distribute): each GPU has its own memory, so the timeline of the
        GPU that peaks highest. Logical CPU devices share the process's one
        CPU allocator, and replicas run in lockstep, so their peaks
        coincide: n times the highest device's timeline (the single merged
        timeline would put the replicas' peaks one after the other).
        """
        if not self.device_timelines:
            return self.timeline.device_bytes
        gpus = [series for device, series in sorted(self.device_timelines.items())
                if on_gpu(device)]
        if gpus:
            return max(gpus, key=lambda series: max(series, default=0))
        top = max(self.device_timelines.values(), key=lambda series: max(series, default=0))
        return tuple(len(self.device_timelines) * b for b in top)

    @property
    def budget_peak_bytes(self) -> int:
        """The peak a memory budget applies to (see budget_timeline); the
        reports' predicted and planned peaks are this figure."""
        if not self.device_timelines:
            return self.predicted_peak_bytes
        return max(self.budget_timeline, default=self.predicted_peak_bytes)

    def buffer_of(self, tensor: tuple[int, int]) -> Optional[tuple[int, int]]:
        """The buffer a tensor (node, port) lives in, or None (no memory)."""
        return self.buffers.get(tensor)

    def summary(self) -> dict:
        """Headline figures as plain data."""
        return {
            "batch": self.batch,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
            "persistent_bytes": self.persistent_bytes,
            "peak_step": self.peak_step,
            "steps": len(self.schedule),
            "backward_start": self.timeline.backward_start,
            "unknown_sizes": self.unknown_sizes,
        }
