"""Analysis: tensor sizes, op costs, schedule, liveness and the memory timeline.

Pure functions over plain data. Input: a GraphIndex, the static output
properties of its nodes as plain tuples, and a batch size. Output: an
Analysis holding the predicted peak of the graph as TensorFlow's executor
would run it, and the lower bound Superneurons aims for: the largest working
set of a single op.

    shapes    sizes with a symbolic batch dimension
    schedule  the executor's order
    costs     op times and scratch memory
    liveness  which buffer each tensor lives in, and from when to when
    memory    the timeline, the predicted peak and the lower bound
    facts     the Analysis it returns
    bfc       a model of TensorFlow's BFC allocator
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

from sntf.analysis.costs import (DEFAULT_COST_MODEL, CostModel, op_seconds,
                                 workspace_bytes)
from sntf.analysis.memory import (ACTIVATION, GRADIENT, PERSISTENT, SCRATCH_PORT,
                                  TEMPORARY, TENSOR_CLASSES, VARIABLE_PORT, Analysis,
                                  Sized, Timeline, analyze, sized, with_outside)
from sntf.analysis.schedule import schedule
from sntf.analysis.shapes import (Properties, SymbolicSize, decode_properties,
                                  has_unknown_dims, resolve_symbolic_dims, rounded,
                                  tensor_size, with_generated)
from sntf.graph.index import GraphIndex

__all__ = [
    "ACTIVATION", "Analysis", "Analyzed", "CostModel", "DEFAULT_COST_MODEL",
    "GRADIENT", "PERSISTENT", "Packed", "Pending", "Properties", "SCRATCH_PORT", "Sized",
    "SymbolicSize", "TEMPORARY", "TENSOR_CLASSES", "Timeline", "VARIABLE_PORT", "analyze",
    "analyze_graph", "decode_properties", "has_unknown_dims", "op_seconds",
    "resolve_symbolic_dims", "rounded", "schedule", "sized", "tensor_size",
    "with_generated", "with_outside", "workspace_bytes",
]


class Packed(NamedTuple):
    """A GraphDef held serialized: its message class and its bytes."""

    kind: type
    data: bytes


class Pending(NamedTuple):
    """A GraphDef not yet made: `make()` makes it. The planner analyzes a
    graph that differs from one it holds in control edges alone (an order
    tried) from its index, and makes the GraphDef of the one it keeps."""

    make: Callable[[], object]


@dataclasses.dataclass(frozen=True)
class Analyzed:
    """One graph as the stages hand it on: its GraphDef, its index, the
    static properties of its nodes (decoded, sntf's own nodes included) and
    its analysis.

    `stored` is the GraphDef, or for a graph the planner tries, the GraphDef
    serialized (`packed`) or yet to be made (`Pending`): a deep network's
    stages hold several tried graphs at once, and a parsed GraphDef takes
    several times its serialized bytes. Whether two Analyzed hold the same
    graph is `stored is`."""

    stored: object
    index: GraphIndex
    props: dict
    facts: Analysis

    @property
    def graph_def(self):
        """The GraphDef; one held packed is parsed, and one pending made,
        anew on each read, so a caller that reads it often keeps what it
        read."""
        if isinstance(self.stored, Packed):
            return self.stored.kind.FromString(self.stored.data)
        if isinstance(self.stored, Pending):
            return self.stored.make()
        return self.stored

    def packed(self) -> "Analyzed":
        """This graph with its GraphDef held serialized (or pending).

        Returns:
          An Analyzed with the same index, properties and analysis.
        """
        if isinstance(self.stored, (Packed, Pending)):
            return self
        graph_def = self.stored
        return dataclasses.replace(
            self, stored=Packed(type(graph_def), graph_def.SerializeToString()))

    @property
    def peak(self) -> int:
        """The planned peak a budget applies to (Analysis.budget_peak_bytes)."""
        return self.facts.budget_peak_bytes


def analyze_graph(graph_def, index: GraphIndex, props: Properties,
                  batch: Optional[int], threads: Optional[int],
                  onednn: bool = False, shapes: Optional[Sized] = None,
                  priors: tuple = ()) -> Analyzed:
    """Analyzes a graph whose properties may lack sntf's generated nodes.

    Args:
      graph_def: the GraphDef.
      index: its index.
      props: decoded static properties of the graph the nodes came from.
      batch: the batch that resolves unknown batch dimensions.
      threads: intra-op threads of the device.
      onednn: whether TensorFlow's oneDNN graph pass runs.
      shapes: the graph's sized outputs (analysis.sized), where the caller
        has them; computed here otherwise.
      priors: analyses of graphs with the same nodes and data edges
        (memory.analyze).

    Returns:
      The Analyzed graph.
    """
    extended = with_generated(props, index)
    return Analyzed(graph_def, index, extended,
                    analyze(index, extended, batch=batch, threads=threads,
                            onednn=onednn, shapes=shapes, priors=priors))
