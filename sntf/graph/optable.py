"""Every op-type and DataType table the pass consults, in one place.

The pass recognizes ops by type only. Each set below answers one question
about an op type; where two sets overlap, the docstring of each says what it
is for. Replace or extend a table here, never inline a literal elsewhere.
"""

from __future__ import annotations

import functools

# ---------------------------------------------------------------- DataTypes
# DataType enum values (tensorflow/core/framework/types.proto).
DT_FLOAT, DT_DOUBLE, DT_INT32, DT_UINT8, DT_INT16, DT_INT8 = 1, 2, 3, 4, 5, 6
DT_STRING, DT_COMPLEX64, DT_INT64, DT_BOOL = 7, 8, 9, 10
DT_QINT8, DT_QUINT8, DT_QINT32, DT_BFLOAT16 = 11, 12, 13, 14
DT_QINT16, DT_QUINT16, DT_UINT16, DT_COMPLEX128, DT_HALF = 15, 16, 17, 18, 19
DT_RESOURCE, DT_VARIANT, DT_UINT32, DT_UINT64 = 20, 21, 22, 23
DT_FLOAT8_E5M2, DT_FLOAT8_E4M3FN = 24, 25

# Bytes per element. Types absent here (string, resource, variant) own heap
# objects rather than a flat buffer.
DTYPE_BYTES = {
    DT_FLOAT: 4, DT_DOUBLE: 8, DT_INT32: 4, DT_UINT8: 1, DT_INT16: 2, DT_INT8: 1,
    DT_COMPLEX64: 8, DT_INT64: 8, DT_BOOL: 1, DT_QINT8: 1, DT_QUINT8: 1,
    DT_QINT32: 4, DT_BFLOAT16: 2, DT_QINT16: 2, DT_QUINT16: 2, DT_UINT16: 2,
    DT_COMPLEX128: 16, DT_HALF: 2, DT_UINT32: 4, DT_UINT64: 8,
    DT_FLOAT8_E5M2: 1, DT_FLOAT8_E4M3FN: 1,
}
# Handles: no payload of their own, and a known size (nothing).
HANDLE_DTYPES = frozenset({DT_RESOURCE, DT_VARIANT})
# The types sntf's swap and cache ops are registered for (their T attr in
# tf_ops/swap_ops.cc and tf_ops/tensor_cache.cc): flat buffers only.
SWAP_DTYPES = frozenset({
    DT_FLOAT, DT_DOUBLE, DT_INT32, DT_UINT8, DT_INT16, DT_INT8, DT_COMPLEX64,
    DT_INT64, DT_BOOL, DT_QINT8, DT_QUINT8, DT_QINT32, DT_BFLOAT16, DT_QINT16,
    DT_QUINT16, DT_UINT16, DT_COMPLEX128, DT_HALF, DT_UINT32, DT_UINT64,
})

# ---------------------------------------------------------------- constants
CONST_OPS = frozenset({"Const", "HostConst"})
# Outputs allocated before the step and alive after it.
PERSISTENT_OPS = CONST_OPS

# ---------------------------------------------------------------- variables
# Ops that write a variable: these types, the prefixes below, and the
# reference-variable scatters.
UPDATE_OPS = frozenset({
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "Assign", "AssignAdd", "AssignSub",
})
UPDATE_OP_PREFIXES = ("ResourceApply", "ResourceSparseApply", "ResourceScatter",
                      "Apply", "SparseApply")
# Ref-variable scatters write a variable; ScatterNd and
# ScatterNdNonAliasingAdd build a new tensor and are not updates.
REF_SCATTER_OPS = frozenset({
    "ScatterAdd", "ScatterSub", "ScatterMul", "ScatterDiv", "ScatterMin",
    "ScatterMax", "ScatterUpdate", "ScatterNdAdd", "ScatterNdSub",
    "ScatterNdUpdate", "ScatterNdMax", "ScatterNdMin",
})
# TF1 reference variables: their output is the variable's value itself (a
# ref tensor), read by the `<name>/read` Identity or by ops taking the ref.
REF_VARIABLE_OPS = frozenset({"Variable", "VariableV2", "TemporaryVariable"})
# The read of a resource variable: its output shares the variable's buffer.
READ_VARIABLE_OP = "ReadVariableOp"
# Adopts its value's buffer when it is the value's last reader.
ASSIGN_VARIABLE_OP = "AssignVariableOp"
# Keeps the element count: a reshape to a known size proves its input's.
RESHAPE_OP = "Reshape"


@functools.lru_cache(maxsize=None)     # a graph has few op types
def is_update_op(op: str) -> bool:
    """Whether an op type writes a variable."""
    return (op in UPDATE_OPS or op in REF_SCATTER_OPS
            or op.startswith(UPDATE_OP_PREFIXES))


# ---------------------------------------------------------------- views
# Five questions about ops that pass a value on, each with its own set:
#
# Ops that forward a resource handle unchanged: Identity left by function
# inlining, and the Switch of a lowered tf.cond whose branch writes the
# variable (Keras' loss-scale optimizer applies gradients under one).
HANDLE_FORWARDING_OPS = frozenset({"Identity", "IdentityN", "Switch", "RefSwitch",
                                   "Enter", "RefEnter"})
# Single-value ops through which a variable's read stays "the variable"
# (training detection: a weight consumer reads the weight through them).
PASS_THROUGH_OPS = frozenset({"Identity", "Cast", "Reshape", "Transpose",
                              "ExpandDims", "Squeeze", "Snapshot", "IdentityN"})
# Views of a step tensor that the backward pass may read in its stead (a
# Dense layer on a 3-D input reads its input through a Reshape): swapping
# the view frees the buffer when no other tensor in it is read there.
VIEW_OPS = frozenset({"Reshape", "Squeeze", "ExpandDims", "Identity"})
# Kernels of TensorFlow's ReductionOp. One that reduces nothing hands back
# its input's buffer (ReductionOp::Compute, "Reduces nothing"): the gradient
# of an Add or Mul whose operands turn out to have the same shape is summed
# over the empty axes BroadcastGradientArgs returns, and with an unknown
# batch nothing says so before the step runs.
REDUCTION_OPS = frozenset({"Sum", "Mean", "Prod", "Max", "Min", "All", "Any",
                           "EuclideanNorm"})
# Ops whose output is a view of input 0: no allocation (the memory model).
ALIAS_OPS = frozenset({
    "Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
    "PreventGradient", "Snapshot", "EnsureShape", "CheckNumerics", "_Retval",
    READ_VARIABLE_OP, "Bitcast",
    # Control flow forwards the tensor itself into a frame or a branch and
    # out again. A Merge forwards whichever input is live, which the model
    # cannot tell: it counts a buffer of its own.
    "Enter", "RefEnter", "Exit", "RefExit", "Switch", "RefSwitch",
    "NextIteration", "RefNextIteration",
})
# Views a recompute chain never re-runs through: re-running them rebuilds
# nothing, and their input is the tensor to start from.
RECOMPUTE_VIEW_OPS = frozenset({"Reshape", "ExpandDims", "Squeeze", "Snapshot"})
# Ops whose output holds exactly the elements of input 0 (shape inference:
# a symbolic dim of the output is whatever makes the element counts agree).
SAME_COUNT_OPS = ALIAS_OPS - {"IdentityN", "_Retval", READ_VARIABLE_OP} | {"Cast"}
# The Identity that function inlining leaves between a tensor and its
# readers (its readers read the tensor's buffer).
IDENTITY_OP = "Identity"
# Readers that need only a tensor's shape: they run as soon as the tensor
# exists, so they keep reading the original.
METADATA_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})

# ---------------------------------------------------------------- memory
# Ops that produce no tensor memory the step pays for. SnSwapOut's output is
# parked in sntf's host pool, outside the device allocator; SnCacheOut's is a
# ticket (the planned peak assumes the cache copies every tensor).
FREE_OPS = frozenset({"_Arg", "NoOp", "VarHandleOp", "Placeholder", "SnSwapOut",
                      "SnCacheOut"})
# Element-wise kernels that write into an input buffer they read last
# (forward_input_or_allocate_output): TensorFlow's UnaryOp and BinaryOp
# kernels and the _UnaryOpsComposition Grappler's arithmetic optimizer fuses
# unary chains into.
# oneDNN's _MklSwish allocates its output, so it is not one of them.
FORWARDING_OPS = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "Sigmoid", "Softplus",
    "Neg", "Abs", "Exp", "Log", "Sqrt", "Rsqrt", "Square", "Reciprocal", "Erf",
    "Erfc", "Expm1", "Log1p", "Sin", "Cos", "Tan", "Atan", "Softsign",
    "_UnaryOpsComposition",
    "Cast", "AddV2", "Add", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum",
    "Minimum", "SquaredDifference", "BiasAdd", "ReluGrad", "Relu6Grad",
    "TanhGrad", "SigmoidGrad", "EluGrad", "LeakyReluGrad", "SeluGrad",
    "SoftplusGrad", "RsqrtGrad", "SqrtGrad", "SelectV2", "Select", "Pow",
    "FloorDiv", "FloorMod", "AddN", "Sign", "Floor", "Ceil", "Round", "Inv",
    "ClipByValue", "Softmax", "LogSoftmax",
})
# Element-wise ops (shape inference: an output dim equals every
# non-broadcast input's dim).
ELEMENTWISE_OPS = FORWARDING_OPS
CONCAT_OPS = frozenset({"ConcatV2", "Concat"})
TILE_OP = "Tile"

# ---------------------------------------------------------------- op classes
# Superneurons' checkpoints (expensive, kept) against its cheap layers.
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


def op_class(op: str) -> str:
    """Checkpoint (expensive, kept), cheap (recomputable) or unknown (treated safely)."""
    if op in CHECKPOINT_OPS:
        return CHECKPOINT
    if op in CHEAP_OPS:
        return CHEAP
    return UNKNOWN


# Ops never re-run, whatever their class: reading a variable again could see
# a newer value; inputs, constants and handles are free to keep.
NEVER_RECOMPUTE_OPS = frozenset({
    READ_VARIABLE_OP, "ResourceGather", "ResourceGatherNd", "_Arg", "Const",
    "HostConst", "Placeholder", "VarHandleOp", "IteratorGetNext", "Identity",
    "IdentityN", "NoOp",
    # Superneurons' CONCAT checkpoint: re-running a concatenation rebuilds
    # the whole joined tensor in the backward pass, next to its gradient.
    "ConcatV2", "Concat",
    # Paired with their gradient through a workspace: TensorFlow's oneDNN
    # graph pass (on by default on x86) links MaxPoolGrad to the MaxPool that
    # produced its input, and with a recomputed MaxPool that link closed a
    # cycle ("nodes in a cycle" in a GradientTape loop).
    "MaxPool", "MaxPoolV2", "MaxPool3D", "LRN",
})

# ---------------------------------------------------------------- executor
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

# ---------------------------------------------------------------- control flow
# Loop back edges: the executor and every topological order ignore them.
NEXT_ITERATION_OPS = frozenset({"NextIteration", "RefNextIteration"})
# Ops that open a loop frame, close one, and route a tensor by a predicate.
ENTER_OPS = frozenset({"Enter", "RefEnter"})
EXIT_OPS = frozenset({"Exit", "RefExit"})
SWITCH_OPS = frozenset({"Switch", "RefSwitch"})
MERGE_OPS = frozenset({"Merge", "RefMerge"})
# Ops of TF1-style control flow.
CONTROL_FLOW_OPS = frozenset({"Enter", "Exit", "Merge", "Switch", "NextIteration",
                              "LoopCond", "RefEnter", "RefExit", "RefMerge",
                              "RefSwitch", "RefNextIteration"})
FUNCTIONAL_CONTROL_FLOW_OPS = frozenset({"While", "StatelessWhile", "If",
                                         "StatelessIf", "Case", "StatelessCase"})
# Control-flow ops of loops: the pass models no iteration, so a graph with a
# loop is left alone; conditionals are modelled as both branches running.
LOOP_OPS = frozenset({"Enter", "RefEnter", "Exit", "RefExit", "NextIteration",
                      "RefNextIteration", "LoopCond", "While", "StatelessWhile"})
# Node attributes that mark a node for XLA compilation.
XLA_COMPILE_ATTRS = ("_XlaCompile", "_XlaMustCompile")

# ---------------------------------------------------------------- gradients
# Losses whose second output is the gradient with respect to the logits.
FUSED_LOSS_OPS = frozenset({"SoftmaxCrossEntropyWithLogits",
                            "SparseSoftmaxCrossEntropyWithLogits"})
# Op types that only gradient computations use.
GRADIENT_OP_TYPES = frozenset({"BroadcastGradientArgs", "BiasAddGrad",
                               "BiasAddGradV1", "SymbolicGradient"})


@functools.lru_cache(maxsize=None)
def is_gradient_op(op: str) -> bool:
    """Whether an op type is a gradient kernel (ReluGrad, Conv2DBackpropInput...)."""
    return (op in GRADIENT_OP_TYPES or op.endswith("Grad") or "Backprop" in op
            or op.endswith("GradV2") or op.endswith("GradGrad"))


# Weight-gradient ops and the input slot of the output gradient they read.
WEIGHT_GRADIENT_OPS = {"Conv2DBackpropFilter": 2, "Conv2DBackpropFilterV2": 2,
                       "DepthwiseConv2dNativeBackpropFilter": 2,
                       "Conv3DBackpropFilterV2": 2}
# Weight-gradient ops that oneDNN's graph pass fuses with the filter
# gradient of the same output gradient (see INPUT_GRADIENT_OPS): ordered
# like one only where that pass does not run.
UNFUSED_WEIGHT_GRADIENT_OPS = {"BiasAddGrad": 0, "BiasAddGradV1": 0}
# The readers made to wait for a weight gradient: the input gradients that
# carry the backward chain on. Not BiasAddGrad: oneDNN's graph pass (on by
# default on x86) fuses a filter gradient with the bias gradient of the
# same output gradient, and an edge between them changed the bias
# gradient's bits.
INPUT_GRADIENT_OPS = frozenset({"Conv2DBackpropInput", "Conv2DBackpropInputV2",
                                "DepthwiseConv2dNativeBackpropInput",
                                "Conv3DBackpropInputV2"})
# oneDNN's graph pass (MklLayoutRewritePass, on by default on x86) pairs a
# forward op with its gradient through a workspace tensor when the gradient
# reads the forward output directly, at this input slot. Served by a
# swap-in, the gradient loses the pairing and runs TensorFlow's own kernel,
# which breaks ties between equal maxima differently.
WORKSPACE_PAIRS = {("MaxPool", "MaxPoolGrad"): 1, ("MaxPool3D", "MaxPool3DGrad"): 1,
                   ("LRN", "LRNGrad"): 2}
# Convolution backprops whose CPU kernels take an im2col scratch buffer.
CONV_BACKPROP_INPUT_OP = "Conv2DBackpropInput"
CONV_BACKPROP_FILTER_OP = "Conv2DBackpropFilter"

# Ops an order edge never starts or ends at: a function's arguments and
# results (Grappler turns the graph back into a function without them, so
# an edge naming one would dangle), and the ops that move data between
# devices or replicas (an edge on one replica's all-reduce alone can leave
# the others waiting for it).
FUNCTION_BOUNDARY_OPS = frozenset({"_Arg", "_Retval", "_DeviceArg", "_DeviceRetval"})
COMMUNICATION_PREFIXES = ("Collective", "Nccl", "_Nccl", "_Send", "_Recv", "_HostSend",
                          "_HostRecv")


def never_ordered(op: str) -> bool:
    """Whether an order edge may not start or end at an op of this type."""
    return op in FUNCTION_BOUNDARY_OPS or op.startswith(COMMUNICATION_PREFIXES)


# The pairs TensorFlow's oneDNN graph pass merges (sntf.graph.fusions).
CONV2D_OP = "Conv2D"
BIAS_ADD_OP = "BiasAdd"
BIAS_ADD_GRAD_OP = "BiasAddGrad"
PAD_OPS = frozenset({"Pad"})
PAD_MERGED_CONVOLUTIONS = frozenset({"Conv2D", "_FusedConv2D"})
