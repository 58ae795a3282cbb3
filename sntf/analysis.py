"""Analysis: tensor sizes, op costs, schedule, liveness and the memory timeline.

Pure functions over plain data. Input: a GraphIndex, the static output
properties of its nodes as plain tuples, and a batch size. Output: an
Analysis holding the predicted peak of the graph as TensorFlow's executor
would run it, and the lower bound Superneurons aims for: the largest working
set of a single op.

The memory model follows TensorFlow's executor and CPU allocator:
  * an op's outputs are allocated when it runs, while its inputs are alive;
  * a buffer is freed when the last consumer of every tensor sharing it has
    run (Identity/Reshape-like ops alias their input; element-wise kernels
    reuse an input buffer of the same size when they are its last reader);
  * variables and constants are persistent: allocated before the step, alive
    after it;
  * every allocation is rounded up to the allocator's 256-byte granule.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Mapping, Optional, Sequence

from sntf import bfc, graph

# ---------------------------------------------------------------- tables
# Bytes per element, by DataType enum value (tensorflow/core/framework/types.proto).
DTYPE_BYTES = {
    1: 4, 2: 8, 3: 4, 4: 1, 5: 2, 6: 1, 8: 8, 9: 8, 10: 1, 11: 1, 12: 1, 13: 4,
    14: 2, 15: 2, 16: 2, 17: 2, 18: 16, 19: 2, 22: 4, 23: 8, 24: 1, 25: 1,
}
ALLOCATION_GRANULE = 256  # TensorFlow's BFC allocator rounds to 256 bytes.

# Ops whose output is a view of input 0 (no allocation).
ALIAS_OPS = frozenset({
    "Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
    "PreventGradient", "Snapshot", "EnsureShape", "CheckNumerics", "_Retval",
    "ReadVariableOp", "Bitcast",
})
# Ops that produce no tensor memory the step pays for. SnSwapOut's output is
# parked in sntf's host pool, outside the device allocator; SnCacheOut's is a
# ticket (the planned peak assumes the cache copies every tensor).
FREE_OPS = frozenset({"_Arg", "NoOp", "VarHandleOp", "Placeholder", "SnSwapOut",
                      "SnCacheOut"})
# Element-wise kernels that write into an input buffer they read last.
FORWARDING_OPS = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "Sigmoid", "Softplus",
    "Neg", "Abs", "Exp", "Log", "Sqrt", "Rsqrt", "Square", "Reciprocal", "Erf",
    "Cast", "AddV2", "Add", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum",
    "Minimum", "SquaredDifference", "BiasAdd", "ReluGrad", "Relu6Grad",
    "TanhGrad", "SigmoidGrad", "EluGrad", "LeakyReluGrad", "SeluGrad",
    "SoftplusGrad", "RsqrtGrad", "SqrtGrad", "SelectV2", "Select", "Pow",
    "FloorDiv", "FloorMod", "AddN", "Sign", "Floor", "Ceil", "Round", "Inv",
    "ClipByValue", "Softmax", "LogSoftmax",
})
PERSISTENT_OPS = frozenset({"Const", "HostConst"})

# Op classes (Superneurons' checkpoints vs. cheap layers).
CHECKPOINT_OPS = frozenset({
    "Conv2D", "Conv3D", "_FusedConv2D", "_FusedConv3D", "DepthwiseConv2dNative",
    "_FusedDepthwiseConv2dNative", "MatMul", "_FusedMatMul", "BatchMatMul",
    "BatchMatMulV2", "BatchMatMulV3", "_FusedBatchMatMul", "Einsum",
    "_MklMatMul", "_MklConv2D", "Conv2DBackpropInput",
})
CHEAP_OPS = frozenset(FORWARDING_OPS | {
    "MaxPool", "AvgPool", "MaxPoolV2", "FusedBatchNorm", "FusedBatchNormV3",
    "Mean", "Sum", "Variance", "Moments", "Pad", "PadV2", "MirrorPad",
    "ConcatV2", "Concat", "Split", "SplitV", "Slice", "StridedSlice",
    "Transpose", "Tile", "StatelessRandomUniformV2", "StatelessRandomGetKeyCounter",
    "GreaterEqual", "Greater", "Less", "LessEqual", "Equal", "NotEqual",
    "LogicalAnd", "LogicalOr", "LogicalNot", "ZerosLike", "OnesLike", "Fill",
} | ALIAS_OPS)
CHECKPOINT, CHEAP, UNKNOWN = "checkpoint", "cheap", "unknown"

# Tensor classes.
PERSISTENT, ACTIVATION, GRADIENT, TEMPORARY = (
    "persistent", "activation", "gradient", "temporary")
TENSOR_CLASSES = (PERSISTENT, ACTIVATION, GRADIENT, TEMPORARY)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Machine constants for op time estimates; replace the whole table to retarget."""

    flops_per_second: float = 50e9        # sustained GEMM/conv throughput
    bytes_per_second: float = 10e9        # sustained memory bandwidth
    op_overhead_seconds: float = 5e-6     # executor dispatch per op


DEFAULT_COST_MODEL = CostModel()


def op_class(op: str) -> str:
    """Checkpoint (expensive, kept), cheap (recomputable) or unknown (treated safely)."""
    if op in CHECKPOINT_OPS:
        return CHECKPOINT
    if op in CHEAP_OPS:
        return CHEAP
    return UNKNOWN


# ---------------------------------------------------------------- sizes
@dataclasses.dataclass(frozen=True)
class SymbolicSize:
    """Bytes as a linear form in the batch: const + per_batch * batch."""

    const: int = 0
    per_batch: int = 0
    known: bool = True

    def at(self, batch: Optional[int]) -> int:
        """Concrete bytes for a batch (an unknown batch counts as 1)."""
        return self.const + self.per_batch * (batch if batch else 1)


def tensor_size(dtype: int, shape: Optional[Sequence[int]]) -> SymbolicSize:
    """Size of a tensor from its static properties.

    Args:
      dtype: DataType enum value.
      shape: dims with -1 for unknown ones, or None for unknown rank.

    Returns:
      The size; an unknown first dimension is the batch, further unknown
      dimensions count as 1 (and mark the size as not fully known).
    """
    itemsize = DTYPE_BYTES.get(dtype, 0)
    if itemsize == 0:
        return SymbolicSize(0, 0, known=dtype in (20, 21))  # resource/variant: no payload
    if shape is None:
        return SymbolicSize(itemsize, 0, known=False)
    known_elems, unknown = 1, 0
    for d in shape:
        if d is None or d < 0:
            unknown += 1
        else:
            known_elems *= d
    if unknown == 0:
        return SymbolicSize(itemsize * known_elems, 0)
    return SymbolicSize(0, itemsize * known_elems, known=unknown == 1)


def rounded(n: int) -> int:
    """Bytes the allocator actually reserves for a request of n bytes."""
    if n <= 0:
        return 0
    return -(-n // ALLOCATION_GRANULE) * ALLOCATION_GRANULE


# ---------------------------------------------------------------- results
@dataclasses.dataclass(frozen=True)
class Timeline:
    """Bytes live at every schedule step, total and per tensor class."""

    steps: tuple[int, ...]            # node index run at each step
    live_bytes: tuple[int, ...]       # while the step runs (inputs + outputs)
    device_bytes: tuple[int, ...]     # what the allocator reports in use (chunks)
    by_class: Mapping[str, tuple[int, ...]]
    backward_start: Optional[int]     # first step of the backward pass
    checkpoint_steps: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Analysis:
    """Everything the planner needs to know about one training graph."""

    batch: Optional[int]
    schedule: tuple[int, ...]
    phases: tuple[str, ...]
    tensor_bytes: Mapping[tuple[int, int], int]
    tensor_class: Mapping[tuple[int, int], str]
    intervals: Mapping[tuple[int, int], tuple[int, int]]  # buffer owner -> (alloc, free) steps
    buffers: Mapping[tuple[int, int], tuple[int, int]]    # tensor -> the buffer it lives in
    persistent_bytes: int
    timeline: Timeline
    predicted_peak_bytes: int
    peak_step: int
    lower_bound_bytes: int
    lower_bound_step: int
    op_seconds: tuple[float, ...]
    unknown_sizes: int
    # Bytes of the variables the graph reads (part of persistent_bytes):
    # allocated before the step, by whoever created the variables.
    variable_bytes: int = 0
    # Graphs placed on several devices (one replica per device under
    # tf.distribute): each device's own allocator timeline (bytes in use at
    # every step), its buffers being those of the nodes placed on it. Empty
    # for a single-device graph.
    device_timelines: Mapping[str, tuple[int, ...]] = dataclasses.field(
        default_factory=dict)

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
        timeline would put the replicas' peaks one after the other: planned
        56 MiB where two VGG replicas measured 109 MiB).
        """
        if not self.device_timelines:
            return self.timeline.device_bytes
        gpus = [series for device, series in sorted(self.device_timelines.items())
                if "GPU" in device.upper()]
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


# ---------------------------------------------------------------- schedule
# Kernels whose OpKernel::IsExpensive() is false: TensorFlow's executor runs
# them inline, ahead of any expensive node made ready with them. Every other
# CPU kernel counts as expensive for the first steps of a graph (the
# executor's cost estimates start at 10^8 cycles and decay by a tenth per
# run), which are the steps sntf's measurements cover.
INEXPENSIVE_OPS = frozenset({
    "Identity", "IdentityN", "StopGradient", "PreventGradient", "Const",
    "HostConst", "NoOp", "_Arg", "_Retval", "Shape", "ShapeN", "Size", "Rank",
    "Reshape", "ExpandDims", "Squeeze", "ReadVariableOp", "VarHandleOp",
    "StridedSliceGrad", "Enter", "Exit", "Switch", "Merge", "NextIteration",
})


def schedule(g: graph.GraphIndex, consumers_last_first: bool = False) -> tuple[int, ...]:
    """The order TensorFlow's executor runs a step, with one inter-op thread.

    Emulates ExecutorState::ScheduleReady on a one-thread pool. A completed
    node's newly ready consumers (data edges, then control edges) are split:
    inexpensive ones join the FIFO inline queue of the running Process loop;
    of the expensive ones the last runs inline when that queue is empty, and
    the others go to the pool. The pool's thread pushes its own tasks to the
    front of its queue (Eigen's run queue), so the most recently deferred
    node runs first once the inline chain ends; the roots, scheduled from the
    calling thread, go to the back.

    Checked against TensorFlow's profiler by tools/check_schedule.py (the
    op order of one step, from the host trace): on VGG, ResNet and DenseNet,
    unchanged and recomputed, 99% of consecutive ops run back to back in
    the predicted order, ReadVariableOps aside (they allocate nothing and
    run wherever they become ready). Taking a node's consumers last-added
    first, as this function once did, matched 62-66% and put a DenseNet's
    recomputed clones beside gradients that ran elsewhere (planned 0.76x of
    the measured peak).

    Args:
      g: the graph index.
      consumers_last_first: take each node's data consumers last-added
        first instead (not the executor's order; the recompute planner
        also tries release points picked on it, see
        sntf.pipeline._lowest_recompute).

    Returns:
      Node indices in execution order (all nodes; cycles broken in index order).
    """
    n = len(g.names)
    back_edge = {i for i in range(n) if g.ops[i] in ("NextIteration", "RefNextIteration")}
    pending = [0] * n
    for i in range(n):
        preds = [p for p, _ in g.data_inputs[i]] + list(g.control_inputs[i])
        pending[i] = sum(1 for p in preds if p not in back_edge)
    pool = collections.deque(i for i in range(n) if pending[i] == 0)
    order = []
    while pool:
        inline = collections.deque([pool.popleft()])
        while inline:
            i = inline.popleft()
            order.append(i)
            if i in back_edge:
                continue
            current, deferred = None, []
            # Data consumers in graph order, then control consumers: the
            # order of the executor's out-edge lists.
            data = [c for c, _, _ in g.consumers[i]]
            if consumers_last_first:
                data.reverse()
            for c in data + list(g.control_consumers[i]):
                pending[c] -= 1
                if pending[c] != 0:
                    continue
                if g.ops[c] in INEXPENSIVE_OPS:
                    inline.append(c)
                    continue
                if current is not None:
                    deferred.append(current)
                current = c
            if current is not None:
                if inline:
                    deferred.append(current)
                else:
                    inline.append(current)
            pool.extendleft(deferred)
    if len(order) < n:
        seen = set(order)
        order.extend(i for i in range(n) if i not in seen)
    return tuple(order)


# ---------------------------------------------------------------- costs
def op_seconds(op: str, input_bytes: Sequence[int], output_bytes: Sequence[int],
               input_shapes: Sequence[Optional[tuple]], batch: Optional[int],
               model: CostModel = DEFAULT_COST_MODEL, itemsize: int = 4) -> float:
    """Estimated run time of one op: max(compute, memory traffic) + dispatch.

    FLOPs: matmul-like ops 2*M*N*K from their operands; convolutions 2 *
    output elements * filter elements / output channels; everything else one
    FLOP per output element.
    """
    moved = sum(input_bytes) + sum(output_bytes)
    out_elems = sum(output_bytes) / max(itemsize, 1)
    flops = out_elems
    if op in ("MatMul", "_FusedMatMul") and len(input_shapes) >= 2 and input_shapes[1]:
        k = input_shapes[1][0] if input_shapes[1][0] > 0 else 1
        flops = 2.0 * out_elems * k
    elif "Conv" in op and len(input_shapes) >= 2 and input_shapes[1]:
        f = input_shapes[1]
        per_out = 1
        for d in f[:-1]:
            per_out *= max(d, 1)
        flops = 2.0 * out_elems * per_out
    elif op.startswith("BatchMatMul") or op == "Einsum":
        if input_shapes and input_shapes[0]:
            flops = 2.0 * out_elems * max(input_shapes[0][-1], 1)
    return (max(flops / model.flops_per_second, moved / model.bytes_per_second)
            + model.op_overhead_seconds)


# ---------------------------------------------------------------- workspaces
# Scratch memory kernels take from the device allocator while they run
# (allocate_temp), beyond their outputs. TensorFlow's CPU convolution
# backprops use an im2col buffer sized from a 30 MiB target working set.
CONV_TARGET_WORKING_SET_BYTES = 30 << 20
CONV_MIN_THREAD_WORK_BYTES = 256 << 10


def _conv_col_buffer(batch: int, out_image: int, filter_total: int,
                     out_depth: int, itemsize: int, threads: int,
                     may_parallelize: bool) -> int:
    """Bytes of the im2col buffer of TensorFlow's CPU Conv2D backprops.

    Measured on this stack with single ops in eager mode: the input backprop
    switches to one image per shard when each thread has at least 256 KiB of
    work; the filter backprop always shards by the 30 MiB working set.
    """
    size_a = out_image * out_depth
    size_b = filter_total * out_depth
    size_c = out_image * filter_total
    work = size_a + size_b + size_c
    if work <= 0:
        return 0
    parallel = may_parallelize and (
        batch == 1 or work // max(threads, 1) >= CONV_MIN_THREAD_WORK_BYTES // itemsize)
    shard = 1 if parallel else -(-(CONV_TARGET_WORKING_SET_BYTES // itemsize) // work)
    return shard * size_c * itemsize


def workspace_bytes(op: str, input_shapes: Sequence[Optional[tuple]],
                    output_shapes: Sequence[Optional[tuple]], itemsize: int,
                    threads: int) -> int:
    """Temporary bytes an op allocates while it runs (0 where not modeled).

    Args:
      op: op type.
      input_shapes, output_shapes: concrete shapes (batch resolved) or None.
      itemsize: bytes per element of the op's main dtype.
      threads: intra-op threads of the device.

    Returns:
      Bytes of scratch memory.
    """
    if op in ("Conv2DBackpropInput", "Conv2DBackpropFilter") and len(input_shapes) >= 3:
        dy = input_shapes[2]
        if op == "Conv2DBackpropInput":
            filt = input_shapes[1]
        else:
            filt = output_shapes[0] if output_shapes else None
        if not dy or not filt or len(dy) != 4 or len(filt) != 4:
            return 0
        if min(dy) < 0 or min(filt) < 0:
            return 0
        return _conv_col_buffer(dy[0], dy[1] * dy[2], filt[0] * filt[1] * filt[2],
                                filt[3], itemsize, threads,
                                may_parallelize=op == "Conv2DBackpropInput")
    return 0


# ---------------------------------------------------------------- analysis
Properties = Mapping[str, Sequence[tuple[int, Optional[tuple[int, ...]]]]]


# Ops whose output holds exactly the elements of input 0 (a symbolic dim
# of the output is whatever makes the element counts agree).
_SAME_COUNT_OPS = ALIAS_OPS - {"IdentityN", "_Retval", "ReadVariableOp"} | {"Cast"}
# Element-wise ops: an output dim equals every non-broadcast input's dim.
_ELEMENTWISE_OPS = FORWARDING_OPS
_MAX_RESOLVE_PASSES = 8


def resolve_symbolic_dims(g: graph.GraphIndex, properties: Properties) -> Properties:
    """Static shapes with Grappler's symbolic dims resolved where the graph
    determines them.

    Shape inference marks dims it cannot compute with negative ids; equal
    ids are equal dims. Keras' UpSampling2D, for one, reshapes through a
    computed shape, so a U-Net's decoder tensors come out as (-2, 32, 32,
    -32) and would be sized as one channel; a Dense layer on a sequence
    (Tensordot) multiplies batch and length into one symbolic dim. A dim is
    solved as n * batch**p: from element counts (a reshape keeps them; a tile
    multiplies them by the ratio of its known dims), concatenations (the
    joined axis sums its inputs) and element-wise ops (an output dim equals
    an input's). The batch - the id most often first - stays symbolic.

    Args:
      g: the graph index.
      properties: node name -> [(dtype, shape or None)].

    Returns:
      The properties with every dim solved to a number replaced by it; its
      `counts` maps (name, port) to (elements per batch**power, power) for
      tensors whose shape keeps a dim that holds the batch.
    """
    # Grappler gives the batch several ids across a graph: every id that
    # comes first in a shape counts as the batch until an element count
    # proves it a multiple of it (a sequence model's batch * length).
    firsts = collections.Counter(
        shape[0] for outs in properties.values() for _, shape in outs
        if shape and shape[0] is not None and shape[0] < 0)
    batch_ids = set(firsts)
    value: dict = {}          # symbol -> (n, p): the dim is n * batch**p
    counts: dict = {}         # (node, port) -> (n, p) of its element count

    def dim(d):
        if d is None:
            return None
        if d >= 0:
            return (d, 0)
        if d in value:
            return value[d]
        return (1, 1) if d in batch_ids else None

    def product(shape):
        n, p = 1, 0
        for d in shape:
            v = dim(d)
            if v is None:
                return None
            n, p = n * v[0], p + v[1]
        return n, p

    def dims(t):
        outs = properties.get(g.names[t[0]], ())
        return outs[t[1]][1] if t[1] < len(outs) else None

    def count(t):
        shape = dims(t)
        return (product(shape) if shape is not None else None) or counts.get(t)

    def solve(symbol, v) -> bool:
        # -1 is "unknown" with no identity; a dim is never 0 or fractional.
        if symbol == -1 or symbol in value or v is None or v[0] <= 0 or v[1] < 0:
            return False
        value[symbol] = v
        return True

    for _ in range(_MAX_RESOLVE_PASSES):
        changed = False
        for i in g.topo:
            op, inputs = g.ops[i], g.data_inputs[i]
            outs = properties.get(g.names[i], ())
            if not outs or not inputs or outs[0][1] is None:
                continue
            out_t, out = (i, 0), outs[0][1]
            todo = [k for k, d in enumerate(out) if dim(d) is None]
            if op in _SAME_COUNT_OPS or op == "Tile":
                src = count(inputs[0])
                if src is None:
                    continue
                n, p = src
                if op == "Tile":
                    shape_in = dims(inputs[0])
                    if shape_in is None or len(shape_in) != len(out):
                        continue
                    for a, b in zip(shape_in, out):
                        if a == b:
                            continue
                        a, b = dim(a), dim(b)
                        if a is None or b is None or a[1] != b[1] or b[0] % a[0]:
                            break
                        n *= b[0] // a[0]
                    else:
                        counts.setdefault(out_t, (n, p))
                    if out_t not in counts:
                        continue
                else:
                    counts.setdefault(out_t, (n, p))
                if len(todo) == 1:
                    rest = product(d for k, d in enumerate(out) if k != todo[0])
                    if rest and n % rest[0] == 0:
                        changed |= solve(out[todo[0]], (n // rest[0], p - rest[1]))
                elif not todo and out and out[0] in batch_ids and out[0] not in value:
                    # A first dim taken for the batch: the counts may say
                    # it is a multiple of it.
                    rest = product(out[1:])
                    if rest and n % rest[0] == 0 and (n // rest[0], p - rest[1]) != (1, 1):
                        changed |= solve(out[0], (n // rest[0], p - rest[1]))
            elif op in ("ConcatV2", "Concat") and todo:
                data = inputs[:-1] if op == "ConcatV2" else inputs[1:]
                shapes = [dims(t) for t in data]
                if any(x is None or len(x) != len(out) for x in shapes):
                    continue
                for k in todo:
                    vals = [dim(x[k]) for x in shapes]
                    if any(v is None for v in vals) or len({v[1] for v in vals}) != 1:
                        continue
                    others_agree = all(dim(x[j]) == dim(out[j]) and dim(x[j]) is not None
                                       for x in shapes for j in range(len(out)) if j != k)
                    if others_agree:
                        changed |= solve(out[k], (sum(v[0] for v in vals), vals[0][1]))
            elif op in _ELEMENTWISE_OPS and todo:
                for t in inputs:
                    x = dims(t)
                    if x is None or len(x) != len(out):
                        continue
                    for k in todo:
                        v = dim(x[k])
                        if v is not None and v != (1, 0):
                            changed |= solve(out[k], v)
        if not changed:
            break
    if not value and not counts:
        return properties
    # The batch's main id: the one most often first, of those still the batch.
    batch_id = next((d for d, _ in firsts.most_common()
                     if value.get(d, (1, 1)) == (1, 1)), None)
    resolved, kept = {}, {}
    for name, outs in properties.items():
        new_outs = []
        for port, (dtype, shape) in enumerate(outs):
            if shape is not None:
                total = product(shape)
                shape = tuple(d if d is None or d >= 0 or d not in value else
                              value[d][0] if value[d][1] == 0 else
                              batch_id if value[d] == (1, 1) else d for d in shape)
                if total is not None and any(d is not None and d < 0 and d != batch_id
                                             for d in shape):
                    # A dim left symbolic (n * batch, or an id of the batch
                    # other than the main one): the count says the size.
                    kept[(name, port)] = total
            new_outs.append((dtype, shape))
        resolved[name] = new_outs
    for (node, port), c in counts.items():
        kept.setdefault((g.names[node], port), c)
    return _CountedProperties(resolved, kept)


class _CountedProperties(dict):
    """Resolved properties, plus element counts known for tensors whose
    shape still holds unsolved dims (name, port) -> (elements, batch power)."""

    def __init__(self, data, counts):
        super().__init__(data)
        self.counts = counts


def has_unknown_dims(properties: Properties) -> bool:
    """Whether any output has an unknown dimension (usually the batch)."""
    for outputs in properties.values():
        for _, shape in outputs:
            if shape is None or any(d < 0 for d in shape):
                return True
    return False


def analyze(g: graph.GraphIndex, properties: Properties,
            batch: Optional[int] = None,
            cost_model: CostModel = DEFAULT_COST_MODEL) -> Analysis:
    """Predicts the memory timeline of one step of a graph.

    Args:
      g: the graph index.
      properties: node name -> [(dtype enum, shape or None) per output].
      batch: the batch size that resolves unknown batch dimensions (None:
        counted as 1, and the prediction is then per unit of batch).
      cost_model: machine constants for op times.

    Returns:
      The Analysis.
    """
    order = schedule(g)
    phases = graph.classify_phases(g)
    step_of = {node: s for s, node in enumerate(order)}
    n = len(g.names)
    properties = resolve_symbolic_dims(g, properties)
    counts = getattr(properties, "counts", {})

    # Byte size of every output.
    sizes: dict = {}
    unknown = 0
    for i in range(n):
        for port, (dtype, shape) in enumerate(properties.get(g.names[i], ())):
            size = tensor_size(dtype, shape)
            if (g.names[i], port) in counts:
                # Unsolved dims, or one that holds the batch times a number,
                # but a known element count.
                elements, power = counts[(g.names[i], port)]
                itemsize = DTYPE_BYTES.get(dtype, 0)
                size = (SymbolicSize(0, itemsize * elements) if power == 1 else
                        SymbolicSize(itemsize * elements, 0) if power == 0 else size)
            if not size.known:
                unknown += 1
            sizes[(i, port)] = size.at(batch)

    # Buffers: aliases share their source's buffer; forwarding kernels take
    # over an input buffer of the same size that they read last.
    last_use = collections.defaultdict(int)  # tensor -> last consumer step
    for i in range(n):
        for p, port in g.data_inputs[i]:
            t = (p, port)
            last_use[t] = max(last_use[t], step_of[i])
    fetched = set()
    for f in g.fetch:
        for p, port in g.data_inputs[f]:
            fetched.add((p, port))
        if g.ops[f] != "_Retval":
            fetched.update((f, port) for port in range(len(properties.get(g.names[f], ()))))
    for i in range(n):
        if g.ops[i] == "_Retval":
            fetched.update(g.data_inputs[i])

    owner = _Owners()         # tensor -> buffer id (the tensor that allocated it)
    buffer_bytes: dict = {}   # buffer id -> rounded bytes
    buffer_free: dict = {}    # buffer id -> last step any alias is read
    buffer_alloc: dict = {}   # buffer id -> step allocated
    persistent = set()
    outputs_of = collections.defaultdict(list)
    for i in range(n):
        count = len(properties.get(g.names[i], ()))
        outputs_of[i] = [(i, port) for port in range(count)]

    for s, i in enumerate(order):
        op = g.ops[i]
        inputs = g.data_inputs[i]
        for t in outputs_of[i]:
            if op in FREE_OPS or sizes.get(t, 0) == 0:
                continue
            if op in ALIAS_OPS and inputs and inputs[0] in owner:
                owner[t] = owner[inputs[0]]
                continue
            if op in ALIAS_OPS and inputs and _reads_variable(g, inputs[0][0]):
                # A read of a variable is a view of the variable's buffer:
                # persistent, and counted once however often it is read.
                b = (graph.handle_root(g, inputs[0][0]), VARIABLE_PORT)
                owner[t] = b
                buffer_bytes.setdefault(b, rounded(sizes[t]))
                buffer_alloc[b] = -1
                persistent.add(b)
                continue
            if op in PERSISTENT_OPS:
                owner[t] = t
                buffer_bytes[t] = rounded(sizes[t])
                buffer_alloc[t] = -1
                persistent.add(t)
                continue
            if op in FORWARDING_OPS and t[1] == 0:
                reused = _forwardable_input(inputs, owner, buffer_free, last_use,
                                            buffer_bytes, persistent, fetched,
                                            rounded(sizes[t]), s)
                if reused is not None:
                    owner[t] = reused
                    continue
            owner[t] = t
            buffer_bytes[t] = rounded(sizes[t])
            buffer_alloc[t] = s
        # Extend the life of every buffer this op reads.
        for p, port in inputs:
            b = owner.get((p, port))
            if b is not None:
                buffer_free[b] = max(buffer_free.get(b, -1), s)
        for t in outputs_of[i]:
            b = owner.get(t)
            if b is not None:
                buffer_free[b] = max(buffer_free.get(b, -1), s)

    end = len(order)
    for t in fetched:
        b = owner.get(t)
        if b is not None:
            buffer_free[b] = end

    # Per node, once: static input shapes and the element size of its output.
    input_shapes = [[_shape_of(properties, g, t) for t in g.data_inputs[i]]
                    for i in range(n)]
    itemsizes = [DTYPE_BYTES.get(properties[g.names[i]][0][0], 4)
                 if properties.get(g.names[i]) else 4 for i in range(n)]

    # Scratch buffers: live only while their op runs.
    threads = os.cpu_count() or 1
    for s, i in enumerate(order):
        outs = properties.get(g.names[i], ())
        ws = workspace_bytes(g.ops[i], [_concrete(x, batch) for x in input_shapes[i]],
                             [_concrete(o[1], batch) for o in outs], itemsizes[i],
                             threads)
        if ws:
            b = (i, SCRATCH_PORT)
            buffer_bytes[b] = rounded(ws)
            buffer_alloc[b] = s
            buffer_free[b] = s

    # Tensor classes: a buffer holding a forward tensor that the backward
    # pass reads is an activation (whichever tensor allocated it).
    klass = {}
    for b in buffer_bytes:
        if b in persistent:
            klass[b] = PERSISTENT
        elif b[1] == SCRATCH_PORT:
            klass[b] = TEMPORARY
        else:
            klass[b] = _buffer_class(g, phases, owner.tensors[b] or [b])

    persistent_bytes = sum(buffer_bytes[b] for b in persistent)
    intervals = {b: (buffer_alloc[b], buffer_free.get(b, buffer_alloc[b]))
                 for b in buffer_bytes if b not in persistent}

    # Timeline: a buffer counts from its allocating step through its last use.
    delta = {c: [0] * (end + 2) for c in TENSOR_CLASSES}
    for b, (start, stop) in intervals.items():
        c = klass[b]
        delta[c][start] += buffer_bytes[b]
        delta[c][min(stop, end) + 1] -= buffer_bytes[b]
    by_class = {}
    for c in TENSOR_CLASSES:
        running, series = 0, []
        for s in range(end):
            running += delta[c][s]
            series.append(running + (persistent_bytes if c == PERSISTENT else 0))
        by_class[c] = tuple(series)
    live = tuple(sum(by_class[c][s] for c in TENSOR_CLASSES) for s in range(end))
    device = _simulate_allocator(buffer_bytes, persistent, intervals, end)
    peak_step = max(range(end), key=lambda s: device[s]) if end else 0
    peak = device[peak_step] if end else persistent_bytes

    # Lower bound: the largest single-op working set plus persistent bytes.
    lower, lower_step = persistent_bytes, 0
    seconds = []
    for s, i in enumerate(order):
        ins = [sizes.get(t, 0) for t in g.data_inputs[i]
               if owner.get(t) is not None and owner.get(t) not in persistent]
        outs = [sizes.get(t, 0) for t in outputs_of[i]
                if owner.get(t) is not None and owner.get(t) not in persistent]
        # Distinct buffers: a view or a forwarded output shares its input's.
        touched = {owner[t] for t in list(g.data_inputs[i]) + outputs_of[i]
                   if owner.get(t) is not None and owner[t] not in persistent}
        touched.add((i, SCRATCH_PORT))
        work = persistent_bytes + sum(buffer_bytes.get(b, 0) for b in touched)
        if work > lower:
            lower, lower_step = work, s
        seconds.append(op_seconds(g.ops[i], ins, outs, input_shapes[i], batch,
                                  cost_model, itemsize=itemsizes[i]))

    backward_steps = [s for s, i in enumerate(order) if phases[i] == graph.BACKWARD]
    timeline = Timeline(
        steps=order, live_bytes=live, device_bytes=device, by_class=by_class,
        backward_start=backward_steps[0] if backward_steps else None,
        checkpoint_steps=tuple(s for s, i in enumerate(order)
                               if op_class(g.ops[i]) == CHECKPOINT
                               and phases[i] == graph.FORWARD))
    return Analysis(
        device_timelines=_device_timelines(g, buffer_bytes, persistent, intervals,
                                           end),
        batch=batch, schedule=order, phases=phases,
        tensor_bytes=dict(buffer_bytes),
        tensor_class=klass, intervals=intervals, buffers=dict(owner),
        persistent_bytes=persistent_bytes, timeline=timeline,
        predicted_peak_bytes=peak, peak_step=peak_step,
        lower_bound_bytes=lower, lower_bound_step=lower_step,
        op_seconds=tuple(seconds), unknown_sizes=unknown,
        variable_bytes=sum(buffer_bytes[b] for b in persistent
                           if b[1] == VARIABLE_PORT))


VARIABLE_PORT = -2   # buffer key (handle root, -2): a variable's own buffer
SCRATCH_PORT = -1    # buffer key (node, -1): an op's scratch memory


def _reads_variable(g: graph.GraphIndex, producer: int) -> bool:
    """Whether a tensor comes from a resource handle (through Identity ops)."""
    return g.ops[graph.handle_root(g, producer)] in FREE_OPS


def _simulate_allocator(buffer_bytes: dict, persistent: set, intervals: dict,
                        end: int) -> tuple[int, ...]:
    """Bytes TensorFlow's BFC allocator reports in use at each step.

    Persistent buffers are allocated first (they exist before the step);
    within a step, outputs are allocated, then scratch, then scratch and
    dead inputs are freed.
    """
    sim = bfc.BfcModel()
    for b in sorted(persistent):
        sim.allocate(buffer_bytes[b])
    allocs = collections.defaultdict(list)
    frees = collections.defaultdict(list)
    for b, (start, stop) in intervals.items():
        # Scratch last in, first out; outputs by node and port.
        allocs[start].append((b[1] == SCRATCH_PORT, b))
        if stop < end:
            frees[stop].append((b[1] != SCRATCH_PORT, b))
    where = {}
    series = []
    for s in range(end):
        for _, b in sorted(allocs.get(s, ())):
            where[b] = sim.allocate(buffer_bytes[b])
        series.append(sim.in_use)
        for _, b in sorted(frees.get(s, ())):
            sim.free(where.pop(b))
    return tuple(series)


def _device_timelines(g: graph.GraphIndex, buffer_bytes: dict, persistent: set,
                      intervals: dict, end: int) -> dict:
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
        timelines[device] = _simulate_allocator(
            buffer_bytes, persistent & mine,
            {b: span for b, span in intervals.items() if b in mine}, end)
    return timelines


def _concrete(shape: Optional[tuple], batch: Optional[int]) -> Optional[tuple]:
    """A static shape with unknown dims set to the batch (None stays None)."""
    if shape is None:
        return None
    return tuple(d if d >= 0 else (batch or 1) for d in shape)


def _shape_of(properties: Properties, g: graph.GraphIndex, t) -> Optional[tuple]:
    outputs = properties.get(g.names[t[0]], ())
    if t[1] < len(outputs):
        return outputs[t[1]][1]
    return None


def _buffer_class(g: graph.GraphIndex, phases, tensors) -> str:
    """Activation, gradient or temporary, from the tensors sharing a buffer."""
    producers = {phases[t[0]] for t in tensors}
    for t in tensors:
        if phases[t[0]] == graph.FORWARD and any(
                phases[c] == graph.BACKWARD
                for c, _, port in g.consumers[t[0]] if port == t[1]):
            return ACTIVATION
    return GRADIENT if graph.BACKWARD in producers else TEMPORARY


class _Owners(dict):
    """tensor -> buffer, with the inverse (buffer -> its tensors) kept current."""

    def __init__(self):
        super().__init__()
        self.tensors = collections.defaultdict(list)

    def __setitem__(self, tensor, buffer):
        super().__setitem__(tensor, buffer)
        self.tensors[buffer].append(tensor)


def _forwardable_input(inputs, owner, buffer_free, last_use, buffer_bytes,
                       persistent, fetched, need, step):
    """The buffer of an input this op reads last and can overwrite, if any."""
    for t in inputs:
        b = owner.get(t)
        if b is None or b in persistent or t in fetched or b not in buffer_bytes:
            continue
        if buffer_bytes[b] != need:
            continue
        # Every tensor living in the buffer must be done by this step.
        if buffer_free.get(b, -1) > step:
            continue
        if any(last_use.get(other, -1) > step or other in fetched
               for other in owner.tensors[b]):
            continue
        return b
    return None
