"""Liveness and the memory timeline: the predicted peak and the lower bound.

The memory model follows TensorFlow's executor and CPU allocator:
  * an op's outputs are allocated when it runs, while its inputs are alive;
  * a buffer is freed when the last consumer of every tensor sharing it has
    run (Identity/Reshape-like ops alias their input; element-wise kernels
    reuse an input buffer of the same size when they are its last reader);
  * variables and constants are persistent: allocated before the step, alive
    after it;
  * every allocation is rounded up to the allocator's 256-byte granule, and
    a model of the BFC allocator gives the bytes it reports in use.

Which buffer each tensor lives in, and when, is sntf.analysis.liveness.
Buffers are keyed by the tensor (node, port) that allocated them; a
variable's buffer by (its handle's root, VARIABLE_PORT), an op's scratch
memory by (the op, SCRATCH_PORT).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from sntf.analysis import bfc
from sntf.analysis.costs import DEFAULT_COST_MODEL, CostModel, op_seconds
from sntf.analysis.liveness import Liveness, input_shapes, itemsize, outputs_of
from sntf.analysis.phased import by_phase
from sntf.analysis.schedule import schedule
from sntf.analysis.shapes import (Properties, SymbolicSize, resolve_symbolic_dims,
                                  tensor_size)
from sntf.graph import optable
from sntf.graph.fusions import merged_kernels
from sntf.graph.index import GraphIndex

from sntf.analysis.facts import (  # noqa: F401 (the module's public names)
    ACTIVATION, GRADIENT, PERSISTENT, SCRATCH_PORT, TEMPORARY, TENSOR_CLASSES,
    VARIABLE_PORT, Analysis, Deferred, Timeline)


@dataclasses.dataclass(frozen=True)
class Sized:
    """A graph's properties with its symbolic dims resolved, the bytes of
    every output at a batch, and how many of them are not fully known:
    what an analysis derives from the nodes and data edges alone, and so
    shares with a graph that differs in control edges only."""

    properties: Properties
    sizes: dict
    unknown: int


def sized(g: GraphIndex, properties: Properties, batch: Optional[int]) -> Sized:
    """The Sized outputs of graph `g` with static `properties` at `batch`.

    Args:
      g: the graph index.
      properties: node name -> [(dtype enum, shape or None) per output].
      batch: the batch that resolves unknown batch dimensions.

    Returns:
      The Sized.
    """
    resolved = resolve_symbolic_dims(g, properties)
    sizes, unknown = _sizes(g, resolved, batch)
    return Sized(resolved, sizes, unknown)


def analyze(g: GraphIndex, properties: Properties, batch: Optional[int] = None,
            cost_model: CostModel = DEFAULT_COST_MODEL,
            threads: Optional[int] = None, onednn: bool = False,
            shapes: Optional[Sized] = None, priors: tuple = ()) -> Analysis:
    """Predicts the memory timeline of one step of a graph.

    Args:
      g: the graph index.
      properties: node name -> [(dtype enum, shape or None) per output].
      batch: the batch size that resolves unknown batch dimensions (None:
        counted as 1, and the prediction is then per unit of batch).
      cost_model: machine constants for op times.
      threads: intra-op threads of the device (the size of convolution
        scratch buffers depends on it); None: this machine's CPU count.
      onednn: whether TensorFlow's oneDNN graph pass runs (it swaps the
        CPU convolution kernels, and with them their scratch memory).
      shapes: sized(g, properties, batch), where the caller has it (from a
        graph with the same nodes and data edges).
      priors: analyses, at the same settings, of graphs with the same nodes
        and data edges (that differ in control edges); where `g` runs in
        the same order as one, its buffers and timeline are this one's.

    Returns:
      The Analysis.
    """
    if threads is None:
        threads = os.cpu_count() or 1
    order = schedule(g, merged=merged_kernels(g) if onednn else None)
    for prior in priors:
        if (prior.liveness is not None and not prior.outside_bytes
                and prior.batch == batch and prior.schedule == order):
            return _rebound(prior, g)
    given = properties
    if shapes is None:
        shapes = sized(g, given, batch)
    properties, sizes, unknown = shapes.properties, shapes.sizes, shapes.unknown
    live = Liveness(g, order, properties, sizes)
    live.add_scratch(batch, threads, onednn)
    end = len(order)
    intervals = live.intervals()
    handover = live.handover()
    device = device_series(live.buffer_bytes, live.persistent, intervals, end, handover)
    peak_step = _peak_step(device)
    peak = device[peak_step] if end else live.persistent_bytes()
    buffer_bytes, buffers = live.release()
    # The planner compares most graphs it analyzes by their peaks alone:
    # what depends on phases, and the lower bound and op costs, wait until
    # they are read.
    timeline = Timeline(steps=order, device_bytes=device,
                        classes=Deferred(lambda: by_phase(g, live, intervals)))
    return Analysis(
        device_timelines=_device_timelines(g, buffer_bytes, live.persistent,
                                           intervals, end, handover),
        batch=batch, schedule=order,
        buffer_bytes=buffer_bytes,
        buffer_intervals=intervals, buffers=buffers,
        persistent_bytes=live.persistent_bytes(), timeline=timeline,
        predicted_peak_bytes=peak, peak_step=peak_step,
        costs=Deferred(lambda: _lower_bound_and_costs(live, given, batch, cost_model)),
        unknown_sizes=unknown,
        variable_bytes=sum(buffer_bytes[b] for b in live.persistent
                           if b[1] == VARIABLE_PORT),
        persistent_buffers=frozenset(live.persistent), handover=handover, liveness=live)


def _rebound(prior: Analysis, g: GraphIndex) -> Analysis:
    """`prior` as the analysis of graph `g`, which runs the same ops in the
    same order with the same data edges: only its phases, which control
    edges can move, are g's own."""
    live, intervals = prior.liveness, prior.buffer_intervals
    return dataclasses.replace(prior, timeline=dataclasses.replace(
        prior.timeline, classes=Deferred(lambda: by_phase(g, live, intervals))))


def _sizes(g: GraphIndex, properties, batch: Optional[int]) -> tuple[dict, int]:
    """Byte size of every output at `batch`, and how many are not fully known."""
    counts = getattr(properties, "counts", {})
    sizes: dict = {}
    unknown = 0
    sized: dict = {}    # (dtype, shape) -> its size: a graph has few of them
    for i, name in enumerate(g.names):
        for port, (dtype, shape) in enumerate(properties.get(name, ())):
            key = (dtype, shape if shape is None or isinstance(shape, tuple) else tuple(shape))
            size = sized.get(key)
            if size is None:
                size = sized[key] = tensor_size(dtype, shape)
            if counts and (name, port) in counts:
                # Unsolved dims, or one that holds the batch times a number,
                # but a known element count.
                elements, power = counts[(name, port)]
                width = optable.DTYPE_BYTES.get(dtype, 0)
                size = (SymbolicSize(0, width * elements) if power == 1 else
                        SymbolicSize(width * elements, 0) if power == 0 else size)
            if not size.known:
                unknown += 1
            sizes[(i, port)] = size.at(batch)
    return sizes, unknown


def _lower_bound_and_costs(live: Liveness, given, batch: Optional[int],
                           cost_model: CostModel) -> tuple[int, int, tuple]:
    """The largest single-op working set plus persistent bytes (the lower
    bound, and its step), and every step's estimated seconds, for a
    released liveness whose shapes came from `given` properties."""
    g, owner, persistent = live.g, live.owner, live.persistent
    properties = resolve_symbolic_dims(g, given)
    sizes, _ = _sizes(g, properties, batch)
    outs_of = outputs_of(g, properties)
    persistent_bytes = live.persistent_bytes()
    lower, lower_step = persistent_bytes, 0
    seconds = []
    for s, i in enumerate(live.order):
        ins = [sizes.get(t, 0) for t in g.data_inputs[i]
               if owner.get(t) is not None and owner.get(t) not in persistent]
        outs = [sizes.get(t, 0) for t in outs_of[i]
                if owner.get(t) is not None and owner.get(t) not in persistent]
        # Distinct buffers: a view or a forwarded output shares its input's.
        touched = {owner[t] for t in list(g.data_inputs[i]) + outs_of[i]
                   if owner.get(t) is not None and owner[t] not in persistent}
        touched.add((i, SCRATCH_PORT))
        work = persistent_bytes + sum(live.buffer_bytes.get(b, 0) for b in touched)
        if work > lower:
            lower, lower_step = work, s
        seconds.append(op_seconds(g.ops[i], ins, outs, input_shapes(g, properties, i),
                                  batch, cost_model, itemsize=itemsize(g, properties, i)))
    return lower, lower_step, tuple(seconds)


def device_series(buffer_bytes: dict, persistent: set, intervals: dict, end: int,
                  handover: dict, outside: int = 0) -> tuple[int, ...]:
    """Bytes the allocator reports in use at each step, less what it holds
    outside the graph: the graph's share of the device's peak.

    What the device holds outside the graph is allocated first. It takes
    the allocator's first region, so the graph's small buffers land in the
    regions its large ones use, where they keep freed neighbours from
    coalescing into chunks a large request splits: the zoo's pre-activation
    ResNet, with its dataset's 1.8 MiB on CPU:0, measured 14.0 MiB, its
    2 MiB activations each in a chunk of 4 MiB less a few small buffers,
    where the graph alone models 9.0.
    """
    series = _simulate(buffer_bytes, persistent, intervals, end, outside=outside,
                       handover=handover)
    held = bfc.held_bytes(outside)
    return tuple(b - held for b in series)


def with_outside(facts: Analysis, outside: int) -> Analysis:
    """The analysis with its device timeline modelled on top of `outside`
    bytes the device holds outside the graph (device_series); unchanged for
    a graph on several devices."""
    if facts.device_timelines or outside == facts.outside_bytes:
        return facts
    end = len(facts.schedule)
    device = device_series(facts.buffer_bytes, facts.persistent_buffers,
                           facts.buffer_intervals, end, facts.handover, outside)
    peak_step = _peak_step(device)
    return dataclasses.replace(
        facts, timeline=dataclasses.replace(facts.timeline, device_bytes=device),
        predicted_peak_bytes=device[peak_step] if end else facts.predicted_peak_bytes,
        peak_step=peak_step, outside_bytes=outside)


def _peak_step(device: tuple) -> int:
    """The first step at which a device timeline peaks (0 for none)."""
    return max(range(len(device)), key=device.__getitem__) if device else 0


def _simulate(buffer_bytes: dict, persistent: set, intervals: dict, end: int,
              **limits) -> tuple[int, ...]:
    """Bytes TensorFlow's BFC allocator reports in use at each step
    (bfc.simulate, with this module's scratch buffers; limits: its limit,
    outside and grows)."""
    return bfc.simulate(buffer_bytes, persistent, intervals, end,
                        lambda b: b[1] == SCRATCH_PORT, **limits)


def runs_out_of_memory(analysis: Analysis, limit: int, outside: int = 0, grows: bool = True,
                       lifetimes: Optional[tuple] = None) -> Optional[int]:
    """The first schedule step at which the step would run out of memory
    under an allocator limit (bfc.OutOfMemory), or None if it fits.

    Args:
      analysis: a single-device graph's analysis.
      limit: the allocator's limit in bytes.
      outside: bytes the device holds outside the graph, allocated first.
      grows: the allocator grows by regions, else it is one of the limit.
      lifetimes: (sizes, intervals) for the analysis' own (tensor_cache).

    Returns:
      The step, -1 if what exists before the step does not fit, or None.
    """
    sizes, intervals = lifetimes or (analysis.buffer_bytes, analysis.buffer_intervals)
    try:
        _simulate(sizes, analysis.persistent_buffers, intervals, len(analysis.schedule),
                  limit=limit, outside=outside, grows=grows, handover=analysis.handover)
    except bfc.OutOfMemory as e:
        return e.step
    return None


def _device_timelines(g: GraphIndex, buffer_bytes: dict, persistent: set,
                      intervals: dict, end: int, handover: dict) -> dict:
    """Bytes in use per device and step, for a graph on several devices.

    A buffer belongs to the device of the node that owns it (a variable's to
    its handle's); each device's buffers go through their own allocator
    model, as each device has its own allocator.
    """
    devices = {d for d in g.devices if d}
    if len(devices) < 2:
        return {}
    timelines = {}
    for device in sorted(devices):
        mine = {b for b in buffer_bytes if g.devices[b[0]] == device}
        timelines[device] = _simulate(
            buffer_bytes, persistent & mine,
            {b: span for b, span in intervals.items() if b in mine}, end,
            handover={b: v for b, v in handover.items() if b in mine and v in mine})
    return timelines


