"""Runs a function body's GraphDef in a tf.compat.v1.Session of its own.

A function body's GraphDef (what Grappler hands sntf) reads its inputs from
`_Arg` nodes and returns through `_Retval` nodes, which only a function call
frame serves. To run it in a Session, each data `_Arg` becomes a
Placeholder, each DT_RESOURCE `_Arg` a VarHandleOp of its own (initialised
from the given value before every run), and each `_Retval` an Identity.
The Sessions run with Grappler and TensorFlow's classic graph optimizer off
(neither TensorFlow's optimizers nor sntf's plugin touch the graphs again;
constant folding or CSE would merge a recomputed clone back into its
source) and with one inter-op thread (one executor order per graph).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import numpy as np

from sntf.graph import names
from sntf.verify import core

# The prefix of every node and shared name the verifier adds.
PREFIX = "sntf_verify"


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """One _Arg of a function body.

    Attributes:
      index: its `index` attr (its place among the function's inputs).
      name: the node's name.
      dtype: its DataType enum (T).
      handle_dtype: for a DT_RESOURCE argument, the DataType of the value
        the handle holds (`_handle_dtypes`), else None.
    """

    index: int
    name: str
    dtype: int
    handle_dtype: Optional[int]


def arg_specs(graph_def) -> dict:
    """index -> ArgSpec of every _Arg node of a GraphDef."""
    from tensorflow.core.framework import types_pb2

    out = {}
    for node in graph_def.node:
        if node.op != "_Arg":
            continue
        dtype = node.attr["T"].type
        handle = None
        if dtype == types_pb2.DT_RESOURCE:
            listed = node.attr["_handle_dtypes"].list.type if "_handle_dtypes" in node.attr \
                else []
            handle = listed[0] if listed else None
        out[node.attr["index"].i] = ArgSpec(node.attr["index"].i, node.name, dtype, handle)
    return out


def session_graph_def(graph_def, values: Mapping[int, np.ndarray]):
    """A copy of a function body's GraphDef that a Session can run.

    Each data _Arg becomes a Placeholder of its dtype and its value's shape,
    each DT_RESOURCE _Arg a VarHandleOp of the value's dtype and shape with
    a shared_name of its own, each _Retval an Identity. Names, inputs and
    devices stay as they are, so every other node's inputs still resolve.

    Args:
      graph_def: the function body.
      values: _Arg index -> its value (a variable's value for a resource).

    Returns:
      The new GraphDef.
    """
    import tensorflow as tf
    from tensorflow.core.framework import graph_pb2, types_pb2

    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    for node in out.node:
        if node.op == "_Arg":
            index, dtype = node.attr["index"].i, node.attr["T"].type
            value = values[index]
            shape = tf.TensorShape(value.shape).as_proto()
            node.ClearField("attr")
            if dtype == types_pb2.DT_RESOURCE:
                node.op = "VarHandleOp"
                node.attr["dtype"].type = tf.as_dtype(value.dtype).as_datatype_enum
                node.attr["shape"].shape.CopyFrom(shape)
                node.attr["container"].s = b""
                node.attr["shared_name"].s = f"{PREFIX}_{index}_{node.name}".encode()
            else:
                node.op = "Placeholder"
                node.attr["dtype"].type = dtype
                node.attr["shape"].shape.CopyFrom(shape)
        elif node.op == "_Retval":
            dtype = node.attr["T"].type
            node.op = "Identity"
            node.ClearField("attr")
            node.attr["T"].type = dtype
    return out


def session_config():
    """Grappler and the classic graph optimizer off, one inter-op thread of
    the Session's own, the process' intra-op threads."""
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(
        inter_op_parallelism_threads=1, use_per_session_threads=True,
        intra_op_parallelism_threads=tf.config.threading.get_intra_op_parallelism_threads(),
        allow_soft_placement=True)
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    options = config.graph_options.optimizer_options
    options.opt_level = tf.compat.v1.OptimizerOptions.L0
    options.do_common_subexpression_elimination = False
    options.do_constant_folding = False
    return config


class GraphRun:
    """One graph in a Session of its own, run step by step from the same
    variable values: every run assigns them first."""

    def __init__(self, graph_def, values: Mapping[int, np.ndarray], specs: Mapping[int, ArgSpec]):
        import tensorflow as tf

        self.graph_def = graph_def
        self.graph = tf.Graph()
        self._feeds: dict = {}
        self._init_feeds: dict = {}
        init, reads = [], []
        with self.graph.as_default():
            tf.graph_util.import_graph_def(session_graph_def(graph_def, values), name="")
            for index in sorted(specs):
                spec, value = specs[index], values[index]
                tensor = self.graph.get_tensor_by_name(spec.name + ":0")
                if spec.handle_dtype is None and tensor.dtype != tf.resource:
                    self._feeds[tensor] = value
                    continue
                with tf.name_scope(f"{PREFIX}/init"):
                    holder = tf.compat.v1.placeholder(value.dtype, value.shape)
                    init.append(tf.raw_ops.AssignVariableOp(resource=tensor, value=holder))
                with tf.name_scope(f"{PREFIX}/read"):
                    reads.append(tf.raw_ops.ReadVariableOp(resource=tensor,
                                                           dtype=holder.dtype))
                self._init_feeds[holder] = value
        self._init, self.reads = init, reads
        returns = {n.name for n in graph_def.node if n.op == "_Retval"}
        mine = {n.name for n in graph_def.node}
        # What a function call runs (TensorFlow prunes a function body to the
        # nodes its returns need plus its stateful nodes): the whole step,
        # however few tensors a run fetches.
        self.targets = [op for op in self.graph.get_operations()
                        if op.name in mine and (op.name in returns or op.op_def.is_stateful)]
        self.returns = sorted(returns)
        self.session = tf.compat.v1.Session(graph=self.graph, config=session_config())
        self.runs = 0

    def nodes(self) -> list:
        """The graph's nodes as core.Node values (outputs as the Session sees
        them: a _Retval is an Identity with one output)."""
        out = []
        for n in self.graph_def.node:
            op = self.graph.get_operation_by_name(n.name)
            out.append(core.Node(n.name, n.op, tuple(n.input), names.role_of(n),
                                 tuple(t.dtype.name for t in op.outputs)))
        return out

    def sizes(self) -> dict:
        """"node:port" -> bytes of each output whose static shape is known."""
        out = {}
        for n in self.graph_def.node:
            for t in self.graph.get_operation_by_name(n.name).outputs:
                count = t.shape.num_elements() if t.shape.rank is not None else None
                width = t.dtype.size if t.dtype.is_numeric or t.dtype.is_bool else None
                out[t.name] = None if count is None or width is None else count * width
        return out

    def run(self, fetches: Sequence[str], variables: bool = False,
            feeds: Optional[Mapping[str, np.ndarray]] = None) -> tuple:
        """One step from the initial values, fetching `fetches`.

        Args:
          fetches: "node:port" names.
          variables: also read every variable after the step.
          feeds: "node:port" -> the value every reader of that tensor reads
            instead of it (its producer still runs).

        Returns:
          (digests of the fetches, digests of the variables or []), each a
          list of 32-byte sha256 digests in order. The values themselves are
          dropped as soon as they are digested.
        """
        values = self.values(fetches, feeds)
        fetched = [core.digest(v) for v in values]
        del values
        after = []
        if variables:
            after = [core.digest(v) for v in self.session.run(self.reads)]
        return fetched, after

    def values(self, fetches: Sequence[str],
               feeds: Optional[Mapping[str, np.ndarray]] = None) -> list:
        """One step from the initial values; the fetched values themselves
        (a ref output's value is its variable's at the end of the step).

        Args:
          fetches: "node:port" names.
          feeds: as run()'s.

        Returns:
          The values, numpy arrays in order.
        """
        self.session.run(self._init, self._init_feeds)
        tensors = [self.graph.get_tensor_by_name(f) for f in fetches]
        fed = dict(self._feeds)
        for name, value in (feeds or {}).items():
            fed[self.graph.get_tensor_by_name(name)] = value
        values = self.session.run([tensors, self.targets], fed)[0]
        self.runs += 1
        return values

    def close(self) -> None:
        self.session.close()
