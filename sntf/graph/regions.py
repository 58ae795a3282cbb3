"""Regions of a graph the pass leaves alone: loops, conditionals, XLA clusters."""

from __future__ import annotations

from sntf.graph import optable
from sntf.graph.index import GraphIndex, descendants


def loop_ops(g: GraphIndex) -> tuple[str, ...]:
    """Types of loop ops present (TF1 frames and functional While)."""
    return tuple(sorted({op for op in g.ops if op in optable.LOOP_OPS}))


def control_flow_region(g: GraphIndex) -> frozenset:
    """Control-flow ops and every node downstream of one (data or control).

    A node downstream of a Switch may receive a dead tensor (the branch not
    taken) and pass its deadness on; one downstream of a functional If runs
    after a whole branch. The pass leaves all of them alone: it neither
    recomputes nor swaps their outputs, nor rewires a tensor one of them
    reads. Because the region is closed downstream, the ancestors of a node
    outside it (recompute chains, swap-in and clone triggers) are outside it
    too, so nothing the pass adds ever depends on a dead tensor.

    Args:
      g: the graph index.

    Returns:
      The indices of the region's nodes (empty without control flow).
    """
    seeds = [i for i, op in enumerate(g.ops)
             if op in optable.CONTROL_FLOW_OPS or op in optable.FUNCTIONAL_CONTROL_FLOW_OPS]
    return frozenset(descendants(g, seeds, control=True)) if seeds else frozenset()


def xla_compiled(graph_def) -> bool:
    """Whether the graph is marked for XLA compilation."""
    for node in graph_def.node:
        for key in optable.XLA_COMPILE_ATTRS:
            if key in node.attr and node.attr[key].b:
                return True
    return False
