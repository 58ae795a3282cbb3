"""Checks a rewritten graph before it goes back to TensorFlow."""

from __future__ import annotations

from sntf.graph.index import GraphError, GraphIndex, build_index


def validate(graph_def, before: GraphIndex) -> GraphIndex:
    """Indexes a rewritten graph; a malformed or cyclic result is an error
    (the pass then hands the original graph back).

    Args:
      graph_def: the rewritten GraphDef.
      before: the index of the graph it was rewritten from.

    Returns:
      The rewritten graph's index.

    Raises:
      GraphError: a cycle the original did not have, a lost fetch node, or
        an input naming a missing node.
    """
    fetch = [before.names[i] for i in before.fetch]
    preserve = [before.names[i] for i in before.preserve]
    index = build_index(graph_def, fetch, preserve)
    if index.has_cycles and not before.has_cycles:
        raise GraphError("the rewrite created a cycle")
    missing = set(fetch) - set(index.names)
    if missing:
        raise GraphError(f"the rewrite lost fetch nodes {sorted(missing)}")
    return index
