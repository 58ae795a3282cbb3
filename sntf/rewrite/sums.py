"""Holds a rewritten graph's order-dependent sums to the original's order.

TensorFlow decides the order of some gradient sums at run time
(sntf.graph.accumulations). A rewrite moves the ops around them, and with
them the order, and so the bits of the gradient. This step adds the control
edges that make every such sum of the rewritten graph add in the order the
original graph does when the executor runs it as the analysis emulates.
"""

from __future__ import annotations

import dataclasses

from sntf.graph import accumulations
from sntf.graph.index import GraphIndex
from sntf.rewrite.validate import index_as, validate


@dataclasses.dataclass(frozen=True)
class PinnedSums:
    """A rewritten graph with its sums held in order.

    Attributes:
      graph_def: the new GraphDef (the input's when `pins` is empty).
      index: its index.
      pins: the control edges added.
      accumulations: the accumulations (groups of unordered accumulating
        updates of one variable) the graph has.
      lost: reordering sums no edge can hold to the original's choice.
    """

    graph_def: object
    index: GraphIndex
    pins: tuple
    accumulations: int
    lost: tuple


def pin_sums(graph_def, index: GraphIndex, original: GraphIndex, order) -> PinnedSums:
    """Adds the edges that hold a rewritten graph's sums in the original's order.

    Args:
      graph_def: the rewritten GraphDef (left untouched).
      index: its index.
      original: the original graph's index.
      order: the original graph's node indices in the order the executor
        runs them (the analysis' emulation).

    Returns:
      A PinnedSums; its graph is validated (a cycle raises GraphError).
    """
    groups = accumulations.accumulation_groups(original)
    names = [original.names[i] for i in order]
    mine = [index.index[n] for n in names if n in index.index]
    pins = accumulations.accumulation_pins(index, mine)
    held, lost = accumulations.sum_pins(original, order, index)
    pins += held
    if not pins:
        return PinnedSums(graph_def, index, (), len(groups), tuple(lost))
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    nodes = {node.name: node for node in out.node}
    added = []
    for pin in pins:
        after = nodes[pin.after]
        control = "^" + pin.before
        producers = {text.split(":")[0] for text in after.input}
        if control in after.input or pin.before in producers:
            continue
        after.input.append(control)
        added.append(pin)
    pinned = validate(out, original, index_as(out, original))
    return PinnedSums(out, pinned, tuple(added), len(groups), tuple(lost))
