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

Buffers are keyed by the tensor (node, port) that allocated them; a
variable's buffer by (its handle's root, VARIABLE_PORT), an op's scratch
memory by (the op, SCRATCH_PORT).
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Optional

from sntf.analysis import bfc
from sntf.analysis.costs import (DEFAULT_COST_MODEL, CostModel, has_workspace, op_seconds,
                                 workspace_bytes)
from sntf.analysis.phased import by_phase
from sntf.analysis.schedule import schedule
from sntf.analysis.shapes import (Properties, SymbolicSize, concrete,
                                  resolve_symbolic_dims, rounded, shape_of, tensor_size)
from sntf.graph import optable
from sntf.graph.fusions import merged_kernels
from sntf.graph.index import GraphIndex
from sntf.graph.training import handle_root

from sntf.analysis.facts import (  # noqa: F401 (the module's public names)
    ACTIVATION, GRADIENT, PERSISTENT, SCRATCH_PORT, TEMPORARY, TENSOR_CLASSES,
    VARIABLE_PORT, Analysis, Deferred, Timeline)


def analyze(g: GraphIndex, properties: Properties, batch: Optional[int] = None,
            cost_model: CostModel = DEFAULT_COST_MODEL,
            threads: Optional[int] = None, onednn: bool = False) -> Analysis:
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

    Returns:
      The Analysis.
    """
    if threads is None:
        threads = os.cpu_count() or 1
    order = schedule(g, merged=merged_kernels(g) if onednn else None)
    given = properties
    properties = resolve_symbolic_dims(g, given)
    sizes, unknown = _sizes(g, properties, batch)
    live = _Liveness(g, order, properties, sizes)
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
        persistent_buffers=frozenset(live.persistent), handover=handover)


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
                itemsize = optable.DTYPE_BYTES.get(dtype, 0)
                size = (SymbolicSize(0, itemsize * elements) if power == 1 else
                        SymbolicSize(itemsize * elements, 0) if power == 0 else size)
            if not size.known:
                unknown += 1
            sizes[(i, port)] = size.at(batch)
    return sizes, unknown


class _Owners(dict):
    """tensor -> buffer, with the inverse (buffer -> its tensors) kept current."""

    def __init__(self):
        super().__init__()
        self.tensors = collections.defaultdict(list)

    def __setitem__(self, tensor, buffer):
        super().__setitem__(tensor, buffer)
        self.tensors[buffer].append(tensor)


class _Liveness:
    """Which buffer every tensor lives in, and the steps each buffer lives.

    Aliases share their source's buffer; forwarding kernels take over an
    input buffer of the same size that they read last; a variable's reads
    share the variable's persistent buffer.
    """

    def __init__(self, g: GraphIndex, order, properties, sizes: dict):
        self.g, self.order, self.properties, self.sizes = g, order, properties, sizes
        self.step_of = {node: s for s, node in enumerate(order)}
        self.owner = _Owners()         # tensor -> buffer id
        self.buffer_bytes: dict = {}   # buffer id -> rounded bytes
        self.buffer_free: dict = {}    # buffer id -> last step any alias is read
        self.buffer_alloc: dict = {}   # buffer id -> step allocated
        self.persistent: set = set()
        # Per node, its output tensors; most nodes have one output.
        self.outputs_of = _outputs_of(g, properties)
        self.last_use = self._last_uses()
        self.fetched = self._fetched()
        self._run_all()
        for t in self.fetched:
            b = self.owner.get(t)
            if b is not None:
                self.buffer_free[b] = len(order)

    def _last_uses(self) -> dict:
        """tensor -> the step of its last consumer."""
        last_use = {}
        data_inputs = self.g.data_inputs
        for s, i in enumerate(self.order):     # steps ascending: the last wins
            for t in data_inputs[i]:
                last_use[t] = s
        return last_use

    def _fetched(self) -> set:
        """Tensors the step hands back: alive to its end."""
        g, fetched = self.g, set()
        for f in g.fetch:
            for p, port in g.data_inputs[f]:
                fetched.add((p, port))
            if g.ops[f] != "_Retval":
                fetched.update((f, port) for port in
                               range(len(self.properties.get(g.names[f], ()))))
        fetched.update(t for i, op in enumerate(g.ops) if op == "_Retval"
                       for t in g.data_inputs[i])
        return fetched

    def _allocate(self, t, s: int, persistent: bool = False, buffer=None) -> None:
        b = t if buffer is None else buffer
        self.owner[t] = b
        if persistent:
            self.buffer_bytes.setdefault(b, rounded(self.sizes[t]))
            self.buffer_alloc[b] = -1
            self.persistent.add(b)
        else:
            self.buffer_bytes[b] = rounded(self.sizes[t])
            self.buffer_alloc[b] = s

    def _place(self, s: int, i: int, t) -> None:
        """Decides the buffer of output t of node i, run at step s."""
        op, inputs, owner = self.g.ops[i], self.g.data_inputs[i], self.owner
        if op in optable.REDUCTION_OPS and t[1] == 0 and self._reduces_nothing(i):
            owner[t] = owner[inputs[0]]
            return
        if op in optable.FREE_OPS or self.sizes.get(t, 0) == 0:
            return
        if op in optable.ALIAS_OPS:
            if inputs and inputs[0] in owner:
                owner[t] = owner[inputs[0]]
                return
            if op in optable.CONTROL_FLOW_OPS:
                return      # a handle or an input carried into a frame or branch
            if inputs and self._reads_variable(inputs[0][0]):
                # A read of a variable is a view of the variable's buffer:
                # persistent, and counted once however often it is read.
                root = handle_root(self.g, inputs[0][0])
                self._allocate(t, s, persistent=True, buffer=(root, VARIABLE_PORT))
                return
        if op in optable.PERSISTENT_OPS:
            self._allocate(t, s, persistent=True)
            return
        reused = None
        if op in optable.FORWARDING_OPS and t[1] == 0:
            reused = self._forwardable_input(inputs, rounded(self.sizes[t]), s)
        if reused is not None:
            owner[t] = reused
        else:
            self._allocate(t, s)

    def _run_all(self) -> None:
        """Places every op's outputs, step by step, and extends the life of
        every buffer an op reads and writes to its step (steps run in order:
        each is the latest yet)."""
        owner, free, place = self.owner, self.buffer_free, self._place
        data_inputs, outputs_of = self.g.data_inputs, self.outputs_of
        for s, i in enumerate(self.order):
            outputs = outputs_of[i]
            for t in outputs:
                place(s, i, t)
            for t in data_inputs[i]:
                b = owner.get(t)
                if b is not None:
                    free[b] = s
            for t in outputs:
                b = owner.get(t)
                if b is not None:
                    free[b] = s

    def _reduces_nothing(self, i: int) -> bool:
        """Whether reduction i keeps every element of its input: its output
        is as large, or, its size unknown, every reader reshapes it to a
        known size that is (a Reshape keeps the element count)."""
        g, inputs = self.g, self.g.data_inputs[i]
        need = self.sizes.get(inputs[0], 0) if inputs and inputs[0] in self.owner else 0
        if not need:
            return False
        if self.sizes.get((i, 0), 0) == need:
            return True
        readers = [c for c, _, port in g.consumers[i] if port == 0]
        return bool(readers) and all(g.ops[c] == optable.RESHAPE_OP and self.sizes.get((c, 0)) == need
                                     for c in readers)

    def _reads_variable(self, producer: int) -> bool:
        """Whether a tensor comes from a resource handle (through Identity ops)."""
        return self.g.ops[handle_root(self.g, producer)] in optable.FREE_OPS

    def _forwardable_input(self, inputs, need: int, step: int):
        """The buffer of an input this op reads last and can overwrite, if any."""
        owner = self.owner
        for t in inputs:
            b = owner.get(t)
            if (b is None or b in self.persistent or t in self.fetched
                    or b not in self.buffer_bytes):
                continue
            if self.buffer_bytes[b] != need:
                continue
            # Every tensor living in the buffer must be done by this step.
            if self.buffer_free.get(b, -1) > step:
                continue
            if any(self.last_use.get(other, -1) > step or other in self.fetched
                   for other in owner.tensors[b]):
                continue
            return b
        return None

    def input_shapes(self, i: int) -> list:
        return _input_shapes(self.g, self.properties, i)

    def itemsize(self, i: int) -> int:
        return _itemsize(self.g, self.properties, i)

    def add_scratch(self, batch: Optional[int], threads: int, onednn: bool) -> None:
        """Scratch buffers: live only while their op runs."""
        ops = self.g.ops
        for s, i in enumerate(self.order):
            if not has_workspace(ops[i], onednn):
                continue
            outs = self.properties.get(self.g.names[i], ())
            ws = workspace_bytes(self.g.ops[i],
                                 [concrete(x, batch) for x in self.input_shapes(i)],
                                 [concrete(o[1], batch) for o in outs],
                                 self.itemsize(i), threads, onednn)
            if ws:
                b = (i, SCRATCH_PORT)
                self.buffer_bytes[b] = rounded(ws)
                self.buffer_alloc[b] = s
                self.buffer_free[b] = s

    def handover(self) -> dict:
        """Buffer -> the variable buffer it becomes: the value of an
        AssignVariableOp that reads it last, which the kernel adopts
        (forward_input) instead of copying it into the variable."""
        found = {}
        for i, op in enumerate(self.g.ops):
            inputs = self.g.data_inputs[i]
            if op != optable.ASSIGN_VARIABLE_OP or len(inputs) < 2 or i not in self.step_of:
                continue
            b = self.owner.get(inputs[1])
            target = (handle_root(self.g, inputs[0][0]), VARIABLE_PORT)
            if (b is not None and b not in self.persistent and target in self.persistent
                    and self.buffer_free.get(b) == self.step_of[i]
                    and self.buffer_bytes[b] == self.buffer_bytes[target]
                    and not any(t in self.fetched for t in self.owner.tensors[b])):
                found[b] = target
        return found

    def release(self) -> tuple[dict, dict]:
        """Drops what only the timeline needs, and the shapes and sizes
        (the lower bound and the op costs, computed when first read, find
        them again): what an analysis keeps for them is its buffers.
        Returns (buffer -> bytes, tensor -> buffer) as plain dicts, which
        it keeps in their place, so that an analysis and this share them."""
        del self.step_of, self.last_use, self.buffer_free, self.buffer_alloc, self.fetched
        del self.properties, self.sizes, self.outputs_of
        self.tensors = self.owner.tensors        # buffer -> its tensors
        self.buffer_bytes, self.owner = dict(self.buffer_bytes), dict(self.owner)
        return self.buffer_bytes, self.owner

    def persistent_bytes(self) -> int:
        return sum(self.buffer_bytes[b] for b in self.persistent)

    def intervals(self) -> dict:
        """Buffer -> (allocating step, last step), persistent buffers aside."""
        return {b: (self.buffer_alloc[b], self.buffer_free.get(b, self.buffer_alloc[b]))
                for b in self.buffer_bytes if b not in self.persistent}


def _outputs_of(g: GraphIndex, properties) -> list:
    """Per node, its output tensors (most nodes have one)."""
    outputs = properties.get
    return [[(i, 0)] if k == 1 else [(i, port) for port in range(k)]
            for i, k in enumerate(len(outputs(name, ())) for name in g.names)]


def _input_shapes(g: GraphIndex, properties, i: int) -> list:
    return [shape_of(properties, g, t) for t in g.data_inputs[i]]


def _itemsize(g: GraphIndex, properties, i: int) -> int:
    outs = properties.get(g.names[i])
    return optable.DTYPE_BYTES.get(outs[0][0], 4) if outs else 4


def _lower_bound_and_costs(live: _Liveness, given, batch: Optional[int],
                           cost_model: CostModel) -> tuple[int, int, tuple]:
    """The largest single-op working set plus persistent bytes (the lower
    bound, and its step), and every step's estimated seconds, for a
    released liveness whose shapes came from `given` properties."""
    g, owner, persistent = live.g, live.owner, live.persistent
    properties = resolve_symbolic_dims(g, given)
    sizes, _ = _sizes(g, properties, batch)
    outputs_of = _outputs_of(g, properties)
    persistent_bytes = live.persistent_bytes()
    lower, lower_step = persistent_bytes, 0
    seconds = []
    for s, i in enumerate(live.order):
        ins = [sizes.get(t, 0) for t in g.data_inputs[i]
               if owner.get(t) is not None and owner.get(t) not in persistent]
        outs = [sizes.get(t, 0) for t in outputs_of[i]
                if owner.get(t) is not None and owner.get(t) not in persistent]
        # Distinct buffers: a view or a forwarded output shares its input's.
        touched = {owner[t] for t in list(g.data_inputs[i]) + outputs_of[i]
                   if owner.get(t) is not None and owner[t] not in persistent}
        touched.add((i, SCRATCH_PORT))
        work = persistent_bytes + sum(live.buffer_bytes.get(b, 0) for b in touched)
        if work > lower:
            lower, lower_step = work, s
        seconds.append(op_seconds(g.ops[i], ins, outs, _input_shapes(g, properties, i),
                                  batch, cost_model, itemsize=_itemsize(g, properties, i)))
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


