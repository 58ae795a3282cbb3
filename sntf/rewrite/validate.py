"""Checks a rewritten graph before it goes back to TensorFlow."""

from __future__ import annotations

from typing import Optional

from sntf.graph.index import GraphError, GraphIndex, build_index
from sntf.graph.regions import new_mixed_nodes


def validate(graph_def, before: GraphIndex, index: Optional[GraphIndex] = None) -> GraphIndex:
    """Indexes a rewritten graph; a malformed or cyclic result is an error
    (the pass then hands the original graph back).

    Args:
      graph_def: the rewritten GraphDef.
      before: the index of the graph it was rewritten from.
      index: graph_def's own index (with before's fetch and preserve
        nodes), where the caller has it already.

    Returns:
      The rewritten graph's index.

    Raises:
      GraphError: a cycle the original did not have, a lost fetch node, a
        node reading from two loop frames or from two branches that do not
        nest where the original had none, or an input naming a missing node.
    """
    fetch = [before.names[i] for i in before.fetch]
    if index is None:
        index = index_as(graph_def, before)
    if index.has_cycles and not before.has_cycles:
        raise GraphError("the rewrite created a cycle")
    missing = set(fetch) - set(index.names)
    if missing:
        raise GraphError(f"the rewrite lost fetch nodes {sorted(missing)}")
    mixed = new_mixed_nodes(before, index)
    if mixed:
        raise GraphError(f"the rewrite made {len(mixed)} node(s) read from different "
                         f"loop frames or branches, first {mixed[0]!r}")
    return index


def index_as(graph_def, before: GraphIndex) -> GraphIndex:
    """graph_def's index, with the fetch and preserve nodes of the graph it
    was rewritten from."""
    return build_index(graph_def, [before.names[i] for i in before.fetch],
                       [before.names[i] for i in before.preserve])
