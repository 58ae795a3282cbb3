"""Small hand-built GraphDefs for tests of the graph pass.

Nothing here runs TensorFlow: only the protobuf message modules are imported.

    g = (GraphBuilder()
         .arg("x")
         .arg("w", dtype=DT_RESOURCE)
         .op("ReadVariableOp", "r", ["w"], dtype=DT_FLOAT)
         .op("MatMul", "mm", ["x", "r"], T=DT_FLOAT)
         .build())

Inputs are written as in a NodeDef: "node", "node:1" or "^node". Attribute
values are converted by type: bool -> b, float -> f, str/bytes -> s, int -> i
except for the type attributes in TYPE_ATTRS (T, dtype, ...), where an int is
a DataType; an AttrValue is used as is.

The families mirror what TensorFlow 2 / Keras emit for a training step
(_Arg inputs, DT_RESOURCE handles, ReadVariableOp, gradient ops under
gradient_tape/, optimizer updates) so that structural detection is exercised
on realistic shapes of graphs, and each family documents the names the tests
rely on as module constants.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.framework import graph_pb2
from tensorflow.core.framework import tensor_pb2
from tensorflow.core.framework import tensor_shape_pb2
from tensorflow.core.framework import types_pb2

DT_FLOAT = types_pb2.DT_FLOAT
DT_INT32 = types_pb2.DT_INT32
DT_INT64 = types_pb2.DT_INT64
DT_BOOL = types_pb2.DT_BOOL
DT_RESOURCE = types_pb2.DT_RESOURCE

TYPE_ATTRS = frozenset({"T", "dtype", "Tidx", "Tindices", "Tparams", "Tshape",
                        "Tmultiples", "out_type", "SrcT", "DstT", "index_type"})


def _tensor(value, dtype, shape=None) -> tensor_pb2.TensorProto:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if shape is None:
        shape = [len(values)] if isinstance(value, (list, tuple)) else []
    tensor = tensor_pb2.TensorProto(dtype=dtype)
    tensor.tensor_shape.CopyFrom(tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=s) for s in shape]))
    if dtype == DT_FLOAT:
        tensor.float_val.extend(float(v) for v in values)
    elif dtype == DT_INT64:
        tensor.int64_val.extend(int(v) for v in values)
    elif dtype == DT_BOOL:
        tensor.bool_val.extend(bool(v) for v in values)
    else:
        tensor.int_val.extend(int(v) for v in values)
    return tensor


def attr_value(key: str, value) -> attr_value_pb2.AttrValue:
    """Converts a Python value to the AttrValue for attribute `key`."""
    if isinstance(value, attr_value_pb2.AttrValue):
        return value
    if isinstance(value, tensor_pb2.TensorProto):
        return attr_value_pb2.AttrValue(tensor=value)
    if isinstance(value, bool):
        return attr_value_pb2.AttrValue(b=value)
    if isinstance(value, int):
        if key in TYPE_ATTRS:
            return attr_value_pb2.AttrValue(type=value)
        return attr_value_pb2.AttrValue(i=value)
    if isinstance(value, float):
        return attr_value_pb2.AttrValue(f=value)
    if isinstance(value, str):
        return attr_value_pb2.AttrValue(s=value.encode("utf-8"))
    if isinstance(value, bytes):
        return attr_value_pb2.AttrValue(s=value)
    if isinstance(value, (list, tuple)):
        return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
            i=[int(v) for v in value]))
    raise TypeError(f"no AttrValue conversion for {key}={value!r}")


class GraphBuilder:
    """Appends NodeDefs in call order; build() returns a GraphDef copy.

    Nothing is validated (duplicate names and dangling inputs are allowed), so
    malformed graphs can be built on purpose.
    """

    def __init__(self, producer: int = 1994):
        self._graph = graph_pb2.GraphDef()
        self._graph.versions.producer = producer
        self._args = 0
        self._retvals = 0

    def op(self, op: str, name: str, inputs: Sequence[str] = (), device: str = "",
           **attrs) -> "GraphBuilder":
        node = self._graph.node.add(name=name, op=op, device=device)
        node.input.extend(inputs)
        for key, value in attrs.items():
            node.attr[key].CopyFrom(attr_value(key, value))
        return self

    def arg(self, name: str, dtype: int = DT_FLOAT, index: int | None = None,
            **attrs) -> "GraphBuilder":
        """A function argument (_Arg), indexed in call order by default."""
        if index is None:
            index = self._args
        self._args += 1
        return self.op("_Arg", name, (), T=dtype, index=index, **attrs)

    def const(self, name: str, value=0.0, dtype: int = DT_FLOAT,
              inputs: Sequence[str] = (), shape: Sequence[int] | None = None,
              ) -> "GraphBuilder":
        """A Const; `inputs` may hold control inputs ("^node")."""
        return self.op("Const", name, inputs, dtype=dtype,
                       value=_tensor(value, dtype, shape))

    def retval(self, name: str, value: str, dtype: int = DT_FLOAT,
               index: int | None = None) -> "GraphBuilder":
        """A function result (_Retval) fed by `value`."""
        if index is None:
            index = self._retvals
        self._retvals += 1
        return self.op("_Retval", name, [value], T=dtype, index=index)

    def read(self, name: str, handle: str, inputs: Iterable[str] = (),
             dtype: int = DT_FLOAT) -> "GraphBuilder":
        """ReadVariableOp of `handle`, with extra (control) inputs appended."""
        return self.op("ReadVariableOp", name, [handle, *inputs], dtype=dtype)

    def build(self) -> graph_pb2.GraphDef:
        out = graph_pb2.GraphDef()
        out.CopyFrom(self._graph)
        return out


# --------------------------------------------------------------------------
# Training steps.
# --------------------------------------------------------------------------

# Names shared by the dense families (y = relu(x @ W), loss = sum(y^2)).
X = "x"
W_HANDLE = "sequential_dense_matmul_readvariableop_resource"
W_READ = "sequential/dense/MatMul/ReadVariableOp"
FWD_MATMUL = "sequential/dense/MatMul"
RELU = "sequential/dense/Relu"
LOSS = "loss/Sum"
RELU_GRAD = "gradient_tape/sequential/dense/ReluGrad"
DW = "gradient_tape/sequential/dense/MatMul/MatMul_1"   # dW = x^T dy
SGD_UPDATE = "SGD/AssignSubVariableOp"


def _dense_forward_and_grad(b: GraphBuilder) -> GraphBuilder:
    """x, W's handle, forward y = relu(x @ W), loss = sum(y^2), dW = x^T dy."""
    (b.arg(X, DT_FLOAT)
     .arg(W_HANDLE, DT_RESOURCE)
     .read(W_READ, W_HANDLE)
     .op("MatMul", FWD_MATMUL, [X, W_READ], T=DT_FLOAT,
         transpose_a=False, transpose_b=False)
     .op("Relu", RELU, [FWD_MATMUL], T=DT_FLOAT)
     .op("Square", "loss/Square", [RELU], T=DT_FLOAT)
     .const("loss/Const", [0, 1], DT_INT32)
     .op("Sum", LOSS, ["loss/Square", "loss/Const"], T=DT_FLOAT, Tidx=DT_INT32,
         keep_dims=False)
     # d loss / d loss = 1, broadcast back over the reduced axes.
     .const("gradient_tape/loss/ones", 1.0)
     .const("gradient_tape/loss/Reshape/shape", [1, 1], DT_INT32)
     .op("Reshape", "gradient_tape/loss/Reshape",
         ["gradient_tape/loss/ones", "gradient_tape/loss/Reshape/shape"],
         T=DT_FLOAT, Tshape=DT_INT32)
     .op("Shape", "gradient_tape/loss/Shape", ["loss/Square"], T=DT_FLOAT,
         out_type=DT_INT32)
     .op("Tile", "gradient_tape/loss/Tile",
         ["gradient_tape/loss/Reshape", "gradient_tape/loss/Shape"],
         T=DT_FLOAT, Tmultiples=DT_INT32)
     # d(y^2)/dy = 2y.
     .const("gradient_tape/loss/Square/Const", 2.0)
     .op("Mul", "gradient_tape/loss/Square/Mul",
         [RELU, "gradient_tape/loss/Square/Const"], T=DT_FLOAT)
     .op("Mul", "gradient_tape/loss/Square/Mul_1",
         ["gradient_tape/loss/Tile", "gradient_tape/loss/Square/Mul"], T=DT_FLOAT)
     .op("ReluGrad", RELU_GRAD, ["gradient_tape/loss/Square/Mul_1", RELU],
         T=DT_FLOAT)
     .op("MatMul", DW, [X, RELU_GRAD], T=DT_FLOAT, transpose_a=True,
         transpose_b=False))
    return b


def train_mlp() -> graph_pb2.GraphDef:
    """One SGD step of y = relu(x @ W): W -= lr * x^T dy.

    Trained variable: W_HANDLE; weight gradient: DW; update: SGD_UPDATE.
    """
    b = _dense_forward_and_grad(GraphBuilder())
    (b.const("SGD/learning_rate", 0.01)
     .op("Mul", "SGD/Mul", ["SGD/learning_rate", DW], T=DT_FLOAT)
     .op("AssignSubVariableOp", SGD_UPDATE, [W_HANDLE, "SGD/Mul"], dtype=DT_FLOAT)
     .op("Identity", "Identity", [LOSS, "^" + SGD_UPDATE], T=DT_FLOAT)
     .retval("identity_retval", "Identity"))
    return b.build()


M_HANDLE = "adam_assignaddvariableop_resource"
ITER_HANDLE = "adam_readvariableop_resource"
LR_HANDLE = "adam_readvariableop_1_resource"
M_UPDATE = "Adam/AssignAddVariableOp"
M_READ_AFTER = "Adam/ReadVariableOp_3"
ADAM_UPDATE = "Adam/AssignSubVariableOp"
ITER_UPDATE = "Adam/AssignAddVariableOp_1"


def adam_style_train(control_edge: bool = True) -> graph_pb2.GraphDef:
    """A Keras 3 Adam-like step (first moment only).

    m.assign_add((g - m) * (1 - beta1)); W.assign_sub(read(m) * alpha) where
    the second read of m (M_READ_AFTER) is ordered after the write only by a
    control input from M_UPDATE: the weight update's value depends on the
    gradient through that control edge alone. alpha = lr / (1 - beta1^t) reads
    the learning-rate and iteration variables; the iteration counter is bumped
    after the weight update (automatic control dependencies).

    With control_edge=False the ^M_UPDATE input is left out.
    """
    b = _dense_forward_and_grad(GraphBuilder())
    (b.arg(M_HANDLE, DT_RESOURCE)
     .arg(ITER_HANDLE, DT_RESOURCE)
     .arg(LR_HANDLE, DT_RESOURCE)
     # alpha = lr / (1 - beta1 ** (iterations + 1))
     .read("Adam/ReadVariableOp", ITER_HANDLE, dtype=DT_INT64)
     .op("Cast", "Adam/Cast", ["Adam/ReadVariableOp"], SrcT=DT_INT64, DstT=DT_FLOAT)
     .const("Adam/add/y", 1.0)
     .op("AddV2", "Adam/add", ["Adam/Cast", "Adam/add/y"], T=DT_FLOAT)
     .const("Adam/Pow/x", 0.9)
     .op("Pow", "Adam/Pow", ["Adam/Pow/x", "Adam/add"], T=DT_FLOAT)
     .const("Adam/sub/x", 1.0)
     .op("Sub", "Adam/sub", ["Adam/sub/x", "Adam/Pow"], T=DT_FLOAT)
     .read("Adam/ReadVariableOp_1", LR_HANDLE)
     .op("RealDiv", "Adam/truediv", ["Adam/ReadVariableOp_1", "Adam/sub"],
         T=DT_FLOAT)
     # m.assign_add((g - m) * (1 - beta1))
     .read("Adam/ReadVariableOp_2", M_HANDLE)
     .op("Sub", "Adam/sub_1", [DW, "Adam/ReadVariableOp_2"], T=DT_FLOAT)
     .const("Adam/mul/y", 0.1)
     .op("Mul", "Adam/mul", ["Adam/sub_1", "Adam/mul/y"], T=DT_FLOAT)
     .op("AssignAddVariableOp", M_UPDATE, [M_HANDLE, "Adam/mul"], dtype=DT_FLOAT)
     # W.assign_sub(m * alpha), m read after its update.
     .read(M_READ_AFTER, M_HANDLE, ["^" + M_UPDATE] if control_edge else [])
     .op("Mul", "Adam/mul_1", [M_READ_AFTER, "Adam/truediv"], T=DT_FLOAT)
     .op("AssignSubVariableOp", ADAM_UPDATE, [W_HANDLE, "Adam/mul_1"],
         dtype=DT_FLOAT)
     # iterations.assign_add(1)
     .const("Adam/Const", 1, DT_INT64)
     .op("AssignAddVariableOp", ITER_UPDATE,
         [ITER_HANDLE, "Adam/Const", "^" + ADAM_UPDATE], dtype=DT_INT64)
     .op("Identity", "Identity", [LOSS, "^" + ADAM_UPDATE, "^" + ITER_UPDATE],
         T=DT_FLOAT)
     .retval("identity_retval", "Identity"))
    return b.build()


W1_HANDLE = "sequential_dense_matmul_readvariableop_resource"
W2_HANDLE = "sequential_dense_1_matmul_readvariableop_resource"
DW1 = "gradient_tape/sequential/dense/MatMul/MatMul_1"
DW2 = "gradient_tape/sequential/dense_1/MatMul/MatMul_1"
DA1 = "gradient_tape/sequential/dense_1/MatMul/MatMul"


def train_mlp2_weight_decay() -> graph_pb2.GraphDef:
    """Two dense layers; SGD on both, with weight decay on the second.

    h = relu(x @ W1) @ W2, loss = sum(h^2). W1 -= lr dW1 and W2 -= lr dW2
    (gradient updates); W2 is also decayed, W2.assign(W2 - wd * W2), which
    reads W2 a second time: W2 has two readers, W1 one. W1 is listed first.
    """
    b = GraphBuilder()
    (b.arg(X)
     .arg(W1_HANDLE, DT_RESOURCE)
     .arg(W2_HANDLE, DT_RESOURCE)
     .read("sequential/dense/MatMul/ReadVariableOp", W1_HANDLE)
     .op("MatMul", "sequential/dense/MatMul",
         [X, "sequential/dense/MatMul/ReadVariableOp"], T=DT_FLOAT)
     .op("Relu", "sequential/dense/Relu", ["sequential/dense/MatMul"], T=DT_FLOAT)
     .read("sequential/dense_1/MatMul/ReadVariableOp", W2_HANDLE)
     .op("MatMul", "sequential/dense_1/MatMul",
         ["sequential/dense/Relu", "sequential/dense_1/MatMul/ReadVariableOp"],
         T=DT_FLOAT)
     .op("Square", "loss/Square", ["sequential/dense_1/MatMul"], T=DT_FLOAT)
     .const("loss/Const", [0, 1], DT_INT32)
     .op("Sum", "loss/Sum", ["loss/Square", "loss/Const"], T=DT_FLOAT,
         Tidx=DT_INT32)
     .const("gradient_tape/loss/Square/Const", 2.0)
     .op("Mul", "gradient_tape/loss/Square/Mul",
         ["sequential/dense_1/MatMul", "gradient_tape/loss/Square/Const"],
         T=DT_FLOAT)
     .op("MatMul", DA1, ["gradient_tape/loss/Square/Mul",
                         "sequential/dense_1/MatMul/ReadVariableOp"],
         T=DT_FLOAT, transpose_b=True)
     .op("MatMul", DW2, ["sequential/dense/Relu", "gradient_tape/loss/Square/Mul"],
         T=DT_FLOAT, transpose_a=True)
     .op("ReluGrad", "gradient_tape/sequential/dense/ReluGrad",
         [DA1, "sequential/dense/Relu"], T=DT_FLOAT)
     .op("MatMul", DW1, [X, "gradient_tape/sequential/dense/ReluGrad"],
         T=DT_FLOAT, transpose_a=True)
     .const("SGD/learning_rate", 0.01)
     .op("Mul", "SGD/Mul", ["SGD/learning_rate", DW1], T=DT_FLOAT)
     .op("AssignSubVariableOp", "SGD/AssignSubVariableOp", [W1_HANDLE, "SGD/Mul"],
         dtype=DT_FLOAT)
     .read("SGD/ReadVariableOp", W2_HANDLE)
     .const("SGD/weight_decay", 0.0001)
     .op("Mul", "SGD/Mul_1", ["SGD/ReadVariableOp", "SGD/weight_decay"],
         T=DT_FLOAT)
     .op("Sub", "SGD/sub", ["SGD/ReadVariableOp", "SGD/Mul_1"], T=DT_FLOAT)
     .op("AssignVariableOp", "SGD/AssignVariableOp", [W2_HANDLE, "SGD/sub"],
         dtype=DT_FLOAT)
     .op("Mul", "SGD/Mul_2", ["SGD/learning_rate", DW2], T=DT_FLOAT)
     .op("AssignSubVariableOp", "SGD/AssignSubVariableOp_1",
         [W2_HANDLE, "SGD/Mul_2", "^SGD/AssignVariableOp"], dtype=DT_FLOAT)
     .retval("loss_retval", "loss/Sum"))
    return b.build()



# --------------------------------------------------------------------------
# Gradient accumulation: gradients written into other variables.
# --------------------------------------------------------------------------

# What writes a gradient into its accumulator (the weights stay unwritten):
# acc += g; acc = acc + g; acc[ids] += g; and an optimizer's apply op.
GRADIENT_WRITERS = ("assign_add", "assign", "scatter", "apply")
# What makes the step's backward pass recognizable: a gradient kernel
# (ReluGrad), an input gradient dx = dy W^T, a filter gradient
# (Conv2DBackpropFilter), or nothing ("none": one linear layer under a
# squared loss, whose gradient is ordinary arithmetic).
GRADIENT_MARKERS = ("relu", "dx", "conv", "none")
ACC_PREFIX = "accumulator"


def _linear_backward_body(b: GraphBuilder, marker: str) -> list[tuple[str, str]]:
    """A forward and backward pass of the kind `marker` names (not "relu"),
    on an x already declared.

    Returns:
      [(weight handle, its weight gradient)], first layer first.
    """
    if marker == "conv":
        (b.arg(CONV_FILTER_HANDLE, DT_RESOURCE)
         .read("conv/read", CONV_FILTER_HANDLE)
         .op("Conv2D", "conv/Conv2D", [X, "conv/read"], T=DT_FLOAT,
             strides=[1, 1, 1, 1], padding="SAME")
         .op("Square", "loss/Square", ["conv/Conv2D"], T=DT_FLOAT)
         .const("loss/axes", [0, 1, 2, 3], DT_INT32)
         .op("Sum", LOSS, ["loss/Square", "loss/axes"], T=DT_FLOAT, Tidx=DT_INT32)
         .const("grad/two", 2.0)
         .op("Mul", "grad/dy", ["conv/Conv2D", "grad/two"], T=DT_FLOAT)
         .const("grad/filter_shape", [3, 3, 3, 8], DT_INT32)
         .op("Conv2DBackpropFilter", CONV_FILTER_GRAD,
             [X, "grad/filter_shape", "grad/dy"], T=DT_FLOAT,
             strides=[1, 1, 1, 1], padding="SAME"))
        return [(CONV_FILTER_HANDLE, CONV_FILTER_GRAD)]
    layers = 2 if marker == "dx" else 1
    below = X
    for i in range(1, layers + 1):
        (b.arg(f"w{i}", DT_RESOURCE).read(f"w{i}/read", f"w{i}")
         .op("MatMul", f"layer{i}", [below, f"w{i}/read"], T=DT_FLOAT))
        below = f"layer{i}"
    (b.op("Square", "loss/Square", [below], T=DT_FLOAT)
     .const("loss/axes", [0, 1], DT_INT32)
     .op("Sum", LOSS, ["loss/Square", "loss/axes"], T=DT_FLOAT, Tidx=DT_INT32)
     .const("grad/two", 2.0)
     .op("Mul", f"grad/layer{layers}", [below, "grad/two"], T=DT_FLOAT))
    grads = []
    for i in range(layers, 0, -1):
        before = X if i == 1 else f"layer{i - 1}"
        b.op("MatMul", f"grad/w{i}", [before, f"grad/layer{i}"], T=DT_FLOAT,
             transpose_a=True)
        if i > 1:   # dx = dy W^T
            b.op("MatMul", f"grad/layer{i - 1}", [f"grad/layer{i}", f"w{i}/read"],
                 T=DT_FLOAT, transpose_b=True)
        grads.append((f"w{i}", f"grad/w{i}"))
    return grads[::-1]


def gradient_write_step(writer: str, marker: str = "relu", identity: bool = False,
                        ) -> tuple[graph_pb2.GraphDef, list[tuple[str, str]]]:
    """A gradient-accumulation micro-step: each weight gradient is written
    into an accumulator variable of its own by `writer`; no weight is written.

    Args:
      writer: one of GRADIENT_WRITERS.
      marker: one of GRADIENT_MARKERS: the shape of the backward pass.
      identity: route each gradient, and each accumulator's handle, through
        two Identity ops on their way to the write (as function inlining
        leaves them).

    Returns:
      (the step, [(weight handle, weight gradient)], first layer first).
    """
    if writer not in GRADIENT_WRITERS or marker not in GRADIENT_MARKERS:
        raise ValueError(f"unknown writer {writer!r} or marker {marker!r}")
    b = GraphBuilder()
    if marker == "relu":
        _dense_forward_and_grad(b)
        grads = [(W_HANDLE, DW)]
    else:
        b.arg(X)
        grads = _linear_backward_body(b, marker)
    writes = []
    for k, (_, grad) in enumerate(grads):
        acc, value = f"{ACC_PREFIX}{k}", grad
        b.arg(acc, DT_RESOURCE)
        if identity:
            b.op("Identity", f"{acc}/handle", [acc], T=DT_RESOURCE)
            b.op("Identity", f"{acc}/handle_1", [f"{acc}/handle"], T=DT_RESOURCE)
            b.op("Identity", f"{acc}/grad", [grad], T=DT_FLOAT)
            b.op("Identity", f"{acc}/grad_1", [f"{acc}/grad"], T=DT_FLOAT)
            acc, value = f"{acc}/handle_1", f"{acc}/grad_1"
        write = f"{ACC_PREFIX}{k}/write"
        if writer == "assign_add":
            b.op("AssignAddVariableOp", write, [acc, value], dtype=DT_FLOAT)
        elif writer == "assign":
            (b.read(f"{ACC_PREFIX}{k}/read", acc)
             .op("AddV2", f"{ACC_PREFIX}{k}/sum", [f"{ACC_PREFIX}{k}/read", value],
                 T=DT_FLOAT)
             .op("AssignVariableOp", write, [acc, f"{ACC_PREFIX}{k}/sum"],
                 dtype=DT_FLOAT))
        elif writer == "scatter":
            (b.const(f"{ACC_PREFIX}{k}/rows", [0, 1, 2], DT_INT32)
             .op("ResourceScatterAdd", write, [acc, f"{ACC_PREFIX}{k}/rows", value],
                 dtype=DT_FLOAT, Tindices=DT_INT32))
        else:
            (b.const(f"{ACC_PREFIX}{k}/lr", 1.0)
             .op("ResourceApplyGradientDescent", write,
                 [acc, f"{ACC_PREFIX}{k}/lr", value], T=DT_FLOAT))
        writes.append(write)
    (b.op("Identity", "Identity", [LOSS] + ["^" + w for w in writes], T=DT_FLOAT)
     .retval("loss_retval", "Identity"))
    return b.build(), grads


CONV_FILTER_HANDLE = "conv2d_convolution_readvariableop_resource"
CONV_FILTER_GRAD = "gradient_tape/conv2d/Conv2D/Conv2DBackpropFilter"


def conv_train() -> graph_pb2.GraphDef:
    """SGD on a Conv2D filter: dW = Conv2DBackpropFilter(x, Shape(W), dy)."""
    conv_attrs = dict(T=DT_FLOAT, strides=[1, 1, 1, 1], padding="SAME",
                      data_format="NHWC")
    b = GraphBuilder()
    (b.arg("images")
     .arg(CONV_FILTER_HANDLE, DT_RESOURCE)
     .read("conv2d/Conv2D/ReadVariableOp", CONV_FILTER_HANDLE)
     .op("Conv2D", "conv2d/Conv2D", ["images", "conv2d/Conv2D/ReadVariableOp"],
         **conv_attrs)
     .op("Square", "loss/Square", ["conv2d/Conv2D"], T=DT_FLOAT)
     .const("loss/Const", [0, 1, 2, 3], DT_INT32)
     .op("Sum", "loss/Sum", ["loss/Square", "loss/Const"], T=DT_FLOAT,
         Tidx=DT_INT32)
     .const("gradient_tape/loss/Square/Const", 2.0)
     .op("Mul", "gradient_tape/loss/Square/Mul",
         ["conv2d/Conv2D", "gradient_tape/loss/Square/Const"], T=DT_FLOAT)
     .op("Shape", "gradient_tape/conv2d/Conv2D/Shape",
         ["conv2d/Conv2D/ReadVariableOp"], T=DT_FLOAT, out_type=DT_INT32)
     .op("Conv2DBackpropFilter", CONV_FILTER_GRAD,
         ["images", "gradient_tape/conv2d/Conv2D/Shape",
          "gradient_tape/loss/Square/Mul"], **conv_attrs)
     .const("SGD/learning_rate", 0.01)
     .op("Mul", "SGD/Mul", ["SGD/learning_rate", CONV_FILTER_GRAD], T=DT_FLOAT)
     .op("AssignSubVariableOp", "SGD/AssignSubVariableOp",
         [CONV_FILTER_HANDLE, "SGD/Mul"], dtype=DT_FLOAT)
     .retval("loss_retval", "loss/Sum"))
    return b.build()


def transposed_conv_train() -> graph_pb2.GraphDef:
    """A transposed convolution (Conv2DBackpropInput in the forward pass)
    then a Conv2D, with both filters' gradients and SGD updates."""
    conv = dict(T=DT_FLOAT, strides=[1, 1, 1, 1], padding="SAME", data_format="NHWC")
    b = GraphBuilder()
    (b.arg("images")
     .arg("up_handle", DT_RESOURCE)
     .arg("conv_handle", DT_RESOURCE)
     .read("up/ReadVariableOp", "up_handle")
     .read("conv/ReadVariableOp", "conv_handle")
     .const("up/output_shape", [8, 16, 16, 4], DT_INT32)
     .op("Conv2DBackpropInput", "up/conv2d_transpose",
         ["up/output_shape", "up/ReadVariableOp", "images"], **conv)
     .op("Conv2D", "conv/Conv2D", ["up/conv2d_transpose", "conv/ReadVariableOp"], **conv)
     .op("Square", "loss/Square", ["conv/Conv2D"], T=DT_FLOAT)
     .const("loss/Const", [0, 1, 2, 3], DT_INT32)
     .op("Sum", "loss/Sum", ["loss/Square", "loss/Const"], T=DT_FLOAT, Tidx=DT_INT32)
     .const("grad/Const", 2.0)
     .op("Mul", "grad/dconv", ["conv/Conv2D", "grad/Const"], T=DT_FLOAT)
     .op("Shape", "grad/conv_shape", ["conv/ReadVariableOp"], T=DT_FLOAT,
         out_type=DT_INT32)
     .op("Conv2DBackpropFilter", "grad/dconv_filter",
         ["up/conv2d_transpose", "grad/conv_shape", "grad/dconv"], **conv)
     .op("Shape", "grad/up_out_shape", ["up/conv2d_transpose"], T=DT_FLOAT,
         out_type=DT_INT32)
     .op("Conv2DBackpropInput", "grad/dup",
         ["grad/up_out_shape", "conv/ReadVariableOp", "grad/dconv"], **conv)
     .op("Shape", "grad/up_shape", ["up/ReadVariableOp"], T=DT_FLOAT, out_type=DT_INT32)
     .op("Conv2DBackpropFilter", "grad/dup_filter",
         ["grad/dup", "grad/up_shape", "images"], **conv)
     .const("SGD/learning_rate", 0.01)
     .op("Mul", "SGD/up", ["SGD/learning_rate", "grad/dup_filter"], T=DT_FLOAT)
     .op("Mul", "SGD/conv", ["SGD/learning_rate", "grad/dconv_filter"], T=DT_FLOAT)
     .op("AssignSubVariableOp", "SGD/update_up", ["up_handle", "SGD/up"], dtype=DT_FLOAT)
     .op("AssignSubVariableOp", "SGD/update_conv", ["conv_handle", "SGD/conv"],
         dtype=DT_FLOAT)
     .retval("loss_retval", "loss/Sum"))
    return b.build()


IDS = "ids"
TABLE_HANDLE = "embedding_embedding_lookup_readvariableop_resource"
GATHER = "embedding/embedding_lookup"
SCATTER = "SGD/ResourceScatterAdd"


def embedding_train() -> graph_pb2.GraphDef:
    """SGD on an embedding table alone: pred = sum(E[ids], axis=1).

    Forward: ResourceGather(E, ids); update: ResourceScatterAdd(E, ids,
    -lr * d emb). The only activation that meets the table's value is `ids`,
    so the weight gradient is the sparse update keyed by the ids (SCATTER).
    """
    b = GraphBuilder()
    (b.arg(IDS, DT_INT32)
     .arg(TABLE_HANDLE, DT_RESOURCE)
     .arg("labels")
     .op("ResourceGather", GATHER, [TABLE_HANDLE, IDS], dtype=DT_FLOAT,
         Tindices=DT_INT32, batch_dims=0, validate_indices=True)
     .const("sum/axis", 1, DT_INT32)
     .op("Sum", "sum", [GATHER, "sum/axis"], T=DT_FLOAT, Tidx=DT_INT32)
     .op("Sub", "loss/sub", ["sum", "labels"], T=DT_FLOAT)
     .op("Square", "loss/Square", ["loss/sub"], T=DT_FLOAT)
     .const("loss/Const", 0, DT_INT32)
     .op("Sum", "loss/Sum", ["loss/Square", "loss/Const"], T=DT_FLOAT,
         Tidx=DT_INT32)
     .const("gradient_tape/loss/Square/Const", 2.0)
     .op("Mul", "gradient_tape/loss/Square/Mul",
         ["loss/sub", "gradient_tape/loss/Square/Const"], T=DT_FLOAT)
     .const("gradient_tape/sum/Reshape/shape", [-1, 1], DT_INT32)
     .op("Reshape", "gradient_tape/sum/Reshape",
         ["gradient_tape/loss/Square/Mul", "gradient_tape/sum/Reshape/shape"],
         T=DT_FLOAT, Tshape=DT_INT32)
     .op("Shape", "gradient_tape/sum/Shape", [GATHER], T=DT_FLOAT,
         out_type=DT_INT32)
     .op("Tile", "gradient_tape/sum/Tile",
         ["gradient_tape/sum/Reshape", "gradient_tape/sum/Shape"], T=DT_FLOAT,
         Tmultiples=DT_INT32)
     .const("SGD/neg_learning_rate", -0.01)
     .op("Mul", "SGD/Mul", ["SGD/neg_learning_rate", "gradient_tape/sum/Tile"],
         T=DT_FLOAT)
     .op("ResourceScatterAdd", SCATTER, [TABLE_HANDLE, IDS, "SGD/Mul"],
         dtype=DT_FLOAT, Tindices=DT_INT32)
     .retval("loss_retval", "loss/Sum"))
    return b.build()


DENSE_ON_EMB_W = "dense_matmul_readvariableop_resource"
D_EMB = "gradient_tape/dense/MatMul/MatMul"   # d emb = dh W^T


def embedding_dense_train() -> graph_pb2.GraphDef:
    """SGD on an embedding table followed by a frozen dense layer.

    h = E[ids] @ W (W not updated); the table's gradient dE = dh W^T (D_EMB)
    consumes W's read, which meets the table's value in the forward MatMul.
    """
    b = GraphBuilder()
    (b.arg(IDS, DT_INT32)
     .arg(TABLE_HANDLE, DT_RESOURCE)
     .arg(DENSE_ON_EMB_W, DT_RESOURCE)
     .op("ResourceGather", GATHER, [TABLE_HANDLE, IDS], dtype=DT_FLOAT,
         Tindices=DT_INT32)
     .read("dense/MatMul/ReadVariableOp", DENSE_ON_EMB_W)
     .op("MatMul", "dense/MatMul", [GATHER, "dense/MatMul/ReadVariableOp"],
         T=DT_FLOAT)
     .op("Square", "loss/Square", ["dense/MatMul"], T=DT_FLOAT)
     .const("loss/Const", [0, 1], DT_INT32)
     .op("Sum", "loss/Sum", ["loss/Square", "loss/Const"], T=DT_FLOAT,
         Tidx=DT_INT32)
     .const("gradient_tape/loss/Square/Const", 2.0)
     .op("Mul", "gradient_tape/loss/Square/Mul",
         ["dense/MatMul", "gradient_tape/loss/Square/Const"], T=DT_FLOAT)
     .op("MatMul", D_EMB,
         ["gradient_tape/loss/Square/Mul", "dense/MatMul/ReadVariableOp"],
         T=DT_FLOAT, transpose_a=False, transpose_b=True)
     .const("SGD/neg_learning_rate", -0.01)
     .op("Mul", "SGD/Mul", ["SGD/neg_learning_rate", D_EMB], T=DT_FLOAT)
     .op("ResourceScatterAdd", SCATTER, [TABLE_HANDLE, IDS, "SGD/Mul"],
         dtype=DT_FLOAT, Tindices=DT_INT32)
     .retval("loss_retval", "loss/Sum"))
    return b.build()


# --------------------------------------------------------------------------
# Graphs that are not training steps.
# --------------------------------------------------------------------------

def _dense_forward(b: GraphBuilder) -> GraphBuilder:
    return (b.arg(X)
            .arg(W_HANDLE, DT_RESOURCE)
            .read(W_READ, W_HANDLE)
            .op("MatMul", FWD_MATMUL, [X, W_READ], T=DT_FLOAT)
            .op("Relu", RELU, [FWD_MATMUL], T=DT_FLOAT))


def forward_only() -> graph_pb2.GraphDef:
    """predict(): y = relu(x @ W), no variable written."""
    b = _dense_forward(GraphBuilder())
    (b.op("Identity", "Identity", [RELU], T=DT_FLOAT)
     .retval("identity_retval", "Identity"))
    return b.build()


TOTAL_HANDLE = "mean_assignaddvariableop_resource"
COUNT_HANDLE = "mean_assignaddvariableop_1_resource"


def _mean_metric(b: GraphBuilder, value: str) -> GraphBuilder:
    """Keras Mean: total += sum(value); count += size(value); total / count."""
    return (b.arg(TOTAL_HANDLE, DT_RESOURCE)
            .arg(COUNT_HANDLE, DT_RESOURCE)
            .const("mean/Const", [0, 1], DT_INT32)
            .op("Sum", "mean/Sum", [value, "mean/Const"], T=DT_FLOAT,
                Tidx=DT_INT32)
            .op("AssignAddVariableOp", "mean/AssignAddVariableOp",
                [TOTAL_HANDLE, "mean/Sum"], dtype=DT_FLOAT)
            .op("Size", "mean/Size", [value], T=DT_FLOAT, out_type=DT_INT32)
            .op("Cast", "mean/Cast", ["mean/Size"], SrcT=DT_INT32, DstT=DT_FLOAT)
            .op("AssignAddVariableOp", "mean/AssignAddVariableOp_1",
                [COUNT_HANDLE, "mean/Cast", "^mean/AssignAddVariableOp"],
                dtype=DT_FLOAT)
            .read("mean/div_no_nan/ReadVariableOp", TOTAL_HANDLE,
                  ["^mean/AssignAddVariableOp", "^mean/AssignAddVariableOp_1"])
            .read("mean/div_no_nan/ReadVariableOp_1", COUNT_HANDLE,
                  ["^mean/AssignAddVariableOp_1"])
            .op("DivNoNan", "mean/div_no_nan",
                ["mean/div_no_nan/ReadVariableOp",
                 "mean/div_no_nan/ReadVariableOp_1"], T=DT_FLOAT)
            .op("Identity", "Identity", ["mean/div_no_nan"], T=DT_FLOAT)
            .retval("identity_retval", "Identity"))


def metrics_only() -> graph_pb2.GraphDef:
    """evaluate(): forward on W (never written) plus a Mean metric update."""
    return _mean_metric(_dense_forward(GraphBuilder()), RELU).build()


RESIDUAL_ADD = "block/add"


def forward_with_residual_and_metric() -> graph_pb2.GraphDef:
    """z = x + relu(x @ W) (W square, never written) feeding a Mean metric.

    The skip connection makes an op that consumes x (RESIDUAL_ADD) lie
    downstream of the op that meets W's value and x (the forward MatMul) and
    upstream of a variable update (the metric's), without any gradient.
    """
    b = _dense_forward(GraphBuilder())
    b.op("AddV2", RESIDUAL_ADD, [X, RELU], T=DT_FLOAT)
    return _mean_metric(b, RESIDUAL_ADD).build()


def scatter_nd_residual_forward() -> graph_pb2.GraphDef:
    """Inference with a stateless ScatterNd after a residual block.

    out = ScatterNd(idx, z, shape) where z = x * cast(idx) + x: no variable
    is written anywhere (ScatterNd builds a new tensor).
    """
    b = GraphBuilder()
    (b.arg("idx", DT_INT32)
     .arg(X)
     .op("Cast", "block/Cast", ["idx"], SrcT=DT_INT32, DstT=DT_FLOAT)
     .op("Mul", "block/mul", ["block/Cast", X], T=DT_FLOAT)
     .op("AddV2", "block/add", ["block/mul", X], T=DT_FLOAT)
     .const("scatter/shape", [8, 4], DT_INT32)
     .op("ScatterNd", "scatter/ScatterNd", ["idx", "block/add", "scatter/shape"],
         T=DT_FLOAT, Tindices=DT_INT32)
     .retval("out_retval", "scatter/ScatterNd"))
    return b.build()


# --------------------------------------------------------------------------
# Small shapes for index tests.
# --------------------------------------------------------------------------

def chain(n: int = 4) -> graph_pb2.GraphDef:
    """n0 -> n1 -> ... -> n{n-1} (n0 a Const, the rest Identity)."""
    b = GraphBuilder().const("n0", 1.0)
    for i in range(1, n):
        b.op("Identity", f"n{i}", [f"n{i - 1}"], T=DT_FLOAT)
    return b.build()


def diamond() -> graph_pb2.GraphDef:
    """a -> b, a -> c, (b, c) -> d, listed in the order d, b, c, a."""
    return (GraphBuilder()
            .op("AddV2", "d", ["b", "c"], T=DT_FLOAT)
            .op("Neg", "b", ["a"], T=DT_FLOAT)
            .op("Exp", "c", ["a"], T=DT_FLOAT)
            .const("a", 1.0)
            .build())


def two_sources() -> graph_pb2.GraphDef:
    """sink(p, q), q, p(r), r: two sources ready at once (q at 1, r at 3)."""
    return (GraphBuilder()
            .op("AddV2", "sink", ["p", "q"], T=DT_FLOAT)
            .const("q", 1.0)
            .op("Neg", "p", ["r"], T=DT_FLOAT)
            .const("r", 2.0)
            .build())


def skip_connection() -> graph_pb2.GraphDef:
    """x -> f1 -> f2, out = x + f2, with out listed first."""
    return (GraphBuilder()
            .op("AddV2", "out", ["x", "f2"], T=DT_FLOAT)
            .op("Relu", "f2", ["f1"], T=DT_FLOAT)
            .op("Relu", "f1", ["x"], T=DT_FLOAT)
            .arg("x")
            .build())


def duplicate_name() -> graph_pb2.GraphDef:
    return (GraphBuilder().arg("x").op("Identity", "y", ["x"], T=DT_FLOAT)
            .op("Neg", "y", ["x"], T=DT_FLOAT).build())


def missing_input() -> graph_pb2.GraphDef:
    return (GraphBuilder().arg("x")
            .op("AddV2", "y", ["x", "nowhere:1"], T=DT_FLOAT).build())


def missing_control_input() -> graph_pb2.GraphDef:
    return (GraphBuilder().arg("x")
            .op("Identity", "y", ["x", "^nowhere"], T=DT_FLOAT).build())


def while_loop() -> graph_pb2.GraphDef:
    """TF1 `while i < 10: i += 1`, NextIteration listed before the Merge.

    Back edge: while/NextIteration -> while/Merge:1.
    """
    frame = dict(frame_name="while/while_context", is_constant=False,
                 parallel_iterations=10)
    return (GraphBuilder()
            .const("i0", 0, DT_INT32)
            .op("NextIteration", "while/NextIteration", ["while/add"], T=DT_INT32)
            .op("Enter", "while/Enter", ["i0"], T=DT_INT32, **frame)
            .op("Merge", "while/Merge", ["while/Enter", "while/NextIteration"],
                T=DT_INT32, N=2)
            .const("while/Less/y", 10, DT_INT32, inputs=["^while/Merge"])
            .op("Less", "while/Less", ["while/Merge", "while/Less/y"], T=DT_INT32)
            .op("LoopCond", "while/LoopCond", ["while/Less"])
            .op("Switch", "while/Switch", ["while/Merge", "while/LoopCond"],
                T=DT_INT32)
            .op("Identity", "while/Identity", ["while/Switch:1"], T=DT_INT32)
            .const("while/add/y", 1, DT_INT32, inputs=["^while/Identity"])
            .op("AddV2", "while/add", ["while/Identity", "while/add/y"], T=DT_INT32)
            .op("Exit", "while/Exit", ["while/Switch"], T=DT_INT32)
            .op("Identity", "result", ["while/Exit"], T=DT_INT32)
            .build())


def real_cycle() -> graph_pb2.GraphDef:
    """a <-> b (no NextIteration on the cycle) plus a free node c."""
    return (GraphBuilder()
            .op("Neg", "a", ["b"], T=DT_FLOAT)
            .op("Neg", "b", ["a"], T=DT_FLOAT)
            .const("c", 1.0)
            .build())


def properties_fn(props: dict):
    """A pipeline `properties` callable serving `props` (name -> [(dtype,
    shape)]) as Grappler's serialized TensorProperties, for run_pass."""

    def properties(names):
        from tensorflow.core.framework import tensor_shape_pb2
        from tensorflow.core.grappler.costs import op_performance_data_pb2 as perf

        result = {}
        for name in names:
            outs = []
            for dtype, shape in props.get(name, []):
                p = perf.OpInfo.TensorProperties(dtype=dtype)
                p.shape.CopyFrom(tensor_shape_pb2.TensorShapeProto(
                    dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in shape]))
                outs.append(p.SerializeToString())
            result[name] = outs
        return result

    return properties


def mlp_step(widths=(256, 192, 320, 128, 256), batch=512):
    """A dense network's training step: pre_i = h_{i-1} W_i, h_i = relu(pre_i),
    loss = sum(h_L), and SGD on every W_i.

    The backward pass reads pre_i (ReluGrad on the features) and h_{i-1}
    (for dW_i), so each layer holds two buffers worth freeing: h_i can be
    recomputed (one Relu) or swapped, pre_i only swapped (the last layer's
    buffers have no earlier backward op to start a swap-in). About 10 ops
    per layer; five layers stay under 60 ops.
    """
    b = GraphBuilder()
    shapes = {}
    b.arg("x")
    shapes["x"] = (batch, widths[0])
    prev = "x"
    for i, width in enumerate(widths[1:], 1):
        b.arg(f"w{i}", DT_RESOURCE).read(f"w{i}_read", f"w{i}")
        shapes[f"w{i}_read"] = (widths[i - 1], width)
        b.op("MatMul", f"pre{i}", [prev, f"w{i}_read"], T=DT_FLOAT)
        b.op("Relu", f"h{i}", [f"pre{i}"], T=DT_FLOAT)
        shapes[f"pre{i}"] = shapes[f"h{i}"] = (batch, width)
        prev = f"h{i}"
    layers = len(widths) - 1
    b.const("axes", [0, 1], DT_INT32).op("Sum", "loss", [prev, "axes"], T=DT_FLOAT)
    b.const("grad/ones", 1.0, shape=(batch, widths[-1]))
    shapes["grad/ones"] = (batch, widths[-1])
    b.const("lr", 0.01)
    grad = "grad/ones"
    for i in range(layers, 0, -1):
        below = "x" if i == 1 else f"h{i - 1}"
        b.op("ReluGrad", f"grad/pre{i}", [grad, f"pre{i}"], T=DT_FLOAT)
        shapes[f"grad/pre{i}"] = (batch, widths[i])
        b.op("MatMul", f"grad/w{i}", [below, f"grad/pre{i}"], T=DT_FLOAT,
             transpose_a=True)
        shapes[f"grad/w{i}"] = shapes[f"sgd/mul{i}"] = (widths[i - 1], widths[i])
        b.op("Mul", f"sgd/mul{i}", ["lr", f"grad/w{i}"], T=DT_FLOAT)
        b.op("AssignSubVariableOp", f"sgd/update{i}", [f"w{i}", f"sgd/mul{i}"],
             dtype=DT_FLOAT)
        if i > 1:
            b.op("MatMul", f"grad/h{i - 1}", [f"grad/pre{i}", f"w{i}_read"],
                 T=DT_FLOAT, transpose_b=True)
            shapes[f"grad/h{i - 1}"] = (batch, widths[i - 1])
            grad = f"grad/h{i - 1}"
    b.retval("ret", "loss")
    graph_def = b.build()
    return graph_def, _step_props(graph_def, shapes)


def _step_props(graph_def, shapes: dict, default: tuple = (),
                scalar=lambda node: False) -> dict:
    """The properties of a hand-built step: none for results and updates,
    handles for the weight arguments, (2,) for "axes", a scalar where
    scalar(node) says so, else shapes' entry or `default`."""
    props = {}
    for node in graph_def.node:
        if node.op in ("_Retval", "AssignSubVariableOp"):
            props[node.name] = []
        elif node.op == "_Arg" and node.name != "x":
            props[node.name] = [(DT_RESOURCE, ())]
        elif node.name == "axes":
            props[node.name] = [(DT_INT32, (2,))]
        elif scalar(node):
            props[node.name] = [(DT_FLOAT, ())]
        else:
            props[node.name] = [(DT_FLOAT, shapes.get(node.name, default))]
    return props


def swish_step(batch: int = 512, width: int = 256, returns_weights: bool = False):
    """A dense layer with swish, its gradient as TensorFlow writes it, and a
    second dense layer: pre = x W1; h = pre * sigmoid(pre); y = h W2;
    loss = sum(y); SGD on W1 and W2.

    The swish gradient recomputes sigmoid(pre) once the incoming gradient
    dh exists (a control edge) and reads it twice, before and after three
    ops that each make a (batch, width) tensor:
        grad/sig = sigmoid(pre)            ^grad/h
        grad/sub = 1 - grad/sig
        grad/xsub = pre * grad/sub
        grad/add = 1 + grad/xsub
        grad/act = grad/sig * grad/add
        grad/pre = grad/h * grad/act
    The loss gradient meets no gradient kernel (MatMul and Mul only): only
    the weight users' structure tells the backward pass apart. With
    returns_weights, the step also returns W1 read after its update, as a
    custom training loop may.
    """
    b = GraphBuilder()
    (b.arg("x").arg("w1", DT_RESOURCE).read("w1_read", "w1")
     .arg("w2", DT_RESOURCE).read("w2_read", "w2")
     .op("MatMul", "pre", ["x", "w1_read"], T=DT_FLOAT)
     .op("Sigmoid", "gate", ["pre"], T=DT_FLOAT)
     .op("Mul", "h", ["pre", "gate"], T=DT_FLOAT)
     .op("MatMul", "y", ["h", "w2_read"], T=DT_FLOAT)
     .const("axes", [0, 1], DT_INT32).op("Sum", "loss", ["y", "axes"], T=DT_FLOAT)
     .const("grad/ones", 1.0)
     .op("Mul", "grad/y", ["grad/ones", "loss"], T=DT_FLOAT)
     .op("MatMul", "grad/w2", ["h", "grad/y"], T=DT_FLOAT, transpose_a=True)
     .op("MatMul", "grad/h", ["grad/y", "w2_read"], T=DT_FLOAT, transpose_b=True)
     .op("Sigmoid", "grad/sig", ["pre", "^grad/h"], T=DT_FLOAT)
     .const("grad/one", 1.0)
     .op("Sub", "grad/sub", ["grad/one", "grad/sig"], T=DT_FLOAT)
     .op("Mul", "grad/xsub", ["pre", "grad/sub"], T=DT_FLOAT)
     .op("AddV2", "grad/add", ["grad/one", "grad/xsub"], T=DT_FLOAT)
     .op("Mul", "grad/act", ["grad/sig", "grad/add"], T=DT_FLOAT)
     .op("Mul", "grad/pre", ["grad/h", "grad/act"], T=DT_FLOAT)
     .op("MatMul", "grad/w1", ["x", "grad/pre"], T=DT_FLOAT, transpose_a=True)
     .const("lr", 0.01)
     .op("Mul", "sgd/mul1", ["lr", "grad/w1"], T=DT_FLOAT)
     .op("Mul", "sgd/mul2", ["lr", "grad/w2"], T=DT_FLOAT)
     .op("AssignSubVariableOp", "sgd/update1", ["w1", "sgd/mul1"], dtype=DT_FLOAT)
     .op("AssignSubVariableOp", "sgd/update2", ["w2", "sgd/mul2"], dtype=DT_FLOAT)
     .retval("ret", "loss"))
    if returns_weights:
        b.read("w1_after", "w1", ["^sgd/update1"]).retval("ret_w1", "w1_after")
    graph_def = b.build()
    out = 64
    shapes = {"x": (batch, 128), "w1_read": (128, width), "w2_read": (width, out),
              "w1_after": (128, width), "y": (batch, out), "grad/y": (batch, out),
              "grad/w2": (width, out), "sgd/mul2": (width, out),
              "grad/w1": (128, width), "sgd/mul1": (128, width)}
    return graph_def, _step_props(
        graph_def, shapes, (batch, width),
        scalar=lambda node: node.op == "Const" or node.name == "loss")


LOOP_FRAME = "while/while_context"


def in_loop(graph_def, props: dict, guarded: bool = True):
    """A step wrapped as Keras' `steps_per_execution` lowers it: inside a
    while loop's frame, guarded by a conditional in the body (guarded=False:
    the step is the loop's body, as a `tf.while_loop` around it lowers).

    Every `_Arg` stays at the top level and enters the frame through an
    Enter (constant) and a Switch on the body's predicate "while/has" (on
    the loop's own "while/cond" when unguarded); the step reads the Switch's
    true output. A Const of the step waits on the branch's pivot (TensorFlow's lowering does the same, so that it lives in
    the frame). The step's `_Retval`s are dropped: its first one's value
    leaves the branch through a Merge that the loop's NextIteration waits on,
    and the loop's counter leaves through an Exit to "ret".

    Args:
      graph_def: a step built with GraphBuilder (not modified).
      props: its output properties (name -> [(dtype, shape)]).
      guarded: whether the body guards the step with a conditional.

    Returns:
      (graph_def, props) of the wrapped step.
    """
    frame = dict(frame_name=LOOP_FRAME, parallel_iterations=10)
    scalar = [(DT_INT32, ())]
    b = GraphBuilder()
    (b.const("i0", 0, DT_INT32).const("n", 4, DT_INT32)
     .op("Enter", "while/i_enter", ["i0"], T=DT_INT32, is_constant=False, **frame)
     .op("Enter", "while/n_enter", ["n"], T=DT_INT32, is_constant=True, **frame)
     .op("Merge", "while/i", ["while/i_enter", "while/i_next"], T=DT_INT32, N=2)
     .op("Less", "while/less", ["while/i", "while/n_enter"], T=DT_INT32)
     .op("LoopCond", "while/cond", ["while/less"])
     .op("Switch", "while/i_switch", ["while/i", "while/cond"], T=DT_INT32)
     .op("Identity", "while/pivot", ["while/i_switch:1"], T=DT_INT32)
     .const("while/one", 1, DT_INT32, inputs=["^while/pivot"])
     .op("AddV2", "while/i_add", ["while/pivot", "while/one"], T=DT_INT32)
     .op("Less", "while/has", ["while/pivot", "while/n_enter"], T=DT_INT32)
     .op("Switch", "step/switch", ["while/has", "while/has"], T=DT_BOOL)
     .op("Identity", "step/pivot", ["step/switch:1"], T=DT_BOOL)
     .op("Identity", "step/else_pivot", ["step/switch:0"], T=DT_BOOL))
    out_props = {name: scalar for name in (
        "i0", "n", "while/i_enter", "while/n_enter", "while/i", "while/less",
        "while/pivot", "while/one", "while/i_add", "while/has", "while/i_next",
        "while/exit")}
    out_props.update({"while/cond": [(DT_BOOL, ())], "while/i_switch": scalar * 2,
                      "step/switch": [(DT_BOOL, ())] * 2, "ret": [],
                      "step/pivot": [(DT_BOOL, ())], "step/else_pivot": [(DT_BOOL, ())]})
    renamed = {}
    for node in graph_def.node:
        if node.op == "_Arg":
            dtype = node.attr["T"].type
            b.op("_Arg", node.name, (), T=dtype, index=node.attr["index"].i)
            b.op("Enter", f"while/enter/{node.name}", [node.name], T=dtype,
                 is_constant=True, **frame)
            b.op("Switch", f"step/in/{node.name}", [f"while/enter/{node.name}",
                                                   "while/has" if guarded else "while/cond"],
                 T=dtype)
            renamed[node.name] = f"step/in/{node.name}:1"
            out_props[node.name] = out_props[f"while/enter/{node.name}"] = props[node.name]
            out_props[f"step/in/{node.name}"] = props[node.name] * 2
    loss = None
    for node in graph_def.node:
        if node.op == "_Arg":
            continue
        if node.op == "_Retval":
            loss = loss or node.input[0]
            continue
        copy = b._graph.node.add()
        copy.CopyFrom(node)
        del copy.input[:]
        for text in node.input:
            control = text.startswith("^")
            name = text.lstrip("^")
            if name in renamed:
                text = ("^" + renamed[name].split(":")[0]) if control else renamed[name]
            copy.input.append(text)
        if not node.input:
            copy.input.append("^step/pivot" if guarded else "^while/pivot")
        out_props[node.name] = props[node.name]
    if not guarded:
        return (b.op("NextIteration", "while/i_next", ["while/i_add", "^" + loss],
                     T=DT_INT32)
                .op("Exit", "while/exit", ["while/i_switch"], T=DT_INT32)
                .retval("ret", "while/exit", DT_INT32).build(), out_props)
    (b.const("step/else", 0.0, inputs=["^step/else_pivot"])
     .op("Merge", "step/out", [loss, "step/else"], T=DT_FLOAT, N=2)
     .op("NextIteration", "while/i_next", ["while/i_add", "^step/out"], T=DT_INT32)
     .op("Exit", "while/exit", ["while/i_switch"], T=DT_INT32)
     .retval("ret", "while/exit", DT_INT32))
    out_props["step/else"] = [(DT_FLOAT, ())]
    out_props["step/out"] = [props[loss.split(":")[0]][0], scalar[0]]
    return b.build(), out_props


def analyzed(graph_def, fetch, props: dict, batch=None):
    """A hand-built graph as the planner's stages take it (sntf.analysis.Analyzed)."""
    from sntf import analysis
    from sntf import graph as graph_model

    index = graph_model.build_index(graph_def, fetch)
    return analysis.analyze_graph(graph_def, index, props, batch, threads=None)


def context(**settings):
    """A planning context whose plans are tried with the real rewrite."""
    from sntf import planner, rewrite

    return planner.context.build(rewrite.evaluator(None), **settings)
