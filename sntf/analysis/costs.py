"""Op costs: estimated run times and the scratch memory kernels take."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from sntf.graph import optable


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Machine constants for op time estimates; replace the whole table to retarget."""

    flops_per_second: float = 50e9        # sustained GEMM/conv throughput
    bytes_per_second: float = 10e9        # sustained memory bandwidth
    op_overhead_seconds: float = 5e-6     # executor dispatch per op


DEFAULT_COST_MODEL = CostModel()


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


def has_workspace(op: str, onednn: bool = False) -> bool:
    """Whether workspace_bytes can be more than 0 for an op of this type."""
    return not onednn and op in (optable.CONV_BACKPROP_INPUT_OP,
                                 optable.CONV_BACKPROP_FILTER_OP)


def workspace_bytes(op: str, input_shapes: Sequence[Optional[tuple]],
                    output_shapes: Sequence[Optional[tuple]], itemsize: int,
                    threads: int, onednn: bool = False) -> int:
    """Temporary bytes an op allocates while it runs (0 where not modeled).

    Args:
      op: op type.
      input_shapes, output_shapes: concrete shapes (batch resolved) or None.
      itemsize: bytes per element of the op's main dtype.
      threads: intra-op threads of the device.
      onednn: whether TensorFlow's oneDNN graph pass runs: it replaces the
        CPU convolutions by its own kernels (_MklNativeConv2DBackpropFilter
        and the like), which take no im2col buffer from TensorFlow's
        allocator.

    Returns:
      Bytes of scratch memory.
    """
    if has_workspace(op, onednn) and len(input_shapes) >= 3:
        dy = input_shapes[2]
        if op == optable.CONV_BACKPROP_INPUT_OP:
            filt = input_shapes[1]
        else:
            filt = output_shapes[0] if output_shapes else None
        if not dy or not filt or len(dy) != 4 or len(filt) != 4:
            return 0
        if min(dy) < 0 or min(filt) < 0:
            return 0
        return _conv_col_buffer(dy[0], dy[1] * dy[2], filt[0] * filt[1] * filt[2],
                                filt[3], itemsize, threads,
                                may_parallelize=op == optable.CONV_BACKPROP_INPUT_OP)
    return 0
