"""Keeps the node pairs TensorFlow's oneDNN pass merged in the original graph
merged in the rewritten one (see sntf.graph.fusions)."""

from __future__ import annotations

from typing import Optional

from sntf.graph import names
from sntf.graph.fusions import merge_pairs
from sntf.graph.index import GraphError, GraphIndex, build_index, parse_input


def merged_pairs(before: GraphIndex) -> frozenset:
    """(first, second) names of the pairs the oneDNN pass merges in a graph:
    those whose nodes have equal control inputs."""
    return frozenset((before.names[p.first], before.names[p.second])
                     for p in merge_pairs(before)
                     if set(before.control_inputs[p.first])
                     == set(before.control_inputs[p.second]))


def keep_merges(graph_def, before: GraphIndex, merged: Optional[frozenset] = None,
                index: Optional[GraphIndex] = None):
    """Gives both nodes of every merge pair the same control inputs again
    where the original graph had the pair with equal control inputs (the
    oneDNN pass merged it there): each gets the control inputs only the
    other has.

    A recompute clone counts as the node it was cloned from, so a cloned
    pair stays merged as the original pair is.

    Args:
      graph_def: the rewritten GraphDef (left untouched).
      before: the index of the graph it was rewritten from.
      merged: merged_pairs(before), where the caller has it already.
      index: graph_def's own index, where the caller has it already.

    Returns:
      graph_def itself when nothing needed changing, else a new GraphDef.

    Raises:
      GraphError: a merged pair that cannot stay merged: one of a
        Conv2D -> BiasAdd pair gained a control input (TensorFlow aborts on
        such a merge), or a node would have to wait for itself.
    """
    return kept_merges(graph_def, before, merged, index)[0]


def kept_merges(graph_def, before: GraphIndex, merged: Optional[frozenset] = None,
                index: Optional[GraphIndex] = None) -> tuple:
    """keep_merges, with the names of the nodes it gave control inputs:
    (graph_def or a new GraphDef, names)."""
    if merged is None:
        merged = merged_pairs(before)
    if not merged:
        return graph_def, frozenset()
    index = build_index(graph_def) if index is None else index
    pairs = [(index.names[p.first], index.names[p.second], p.strict)
             for p in merge_pairs(index)
             if _sources(index.names[p.first], index.names[p.second]) in merged]
    if not pairs:
        return graph_def, frozenset()
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    changed: set = set()

    def node(name: str):
        return out.node[index.index[name]]

    for first, second, strict in pairs:
        a, b = _controls(node(first)), _controls(node(second))
        if a == b:
            continue
        if strict:
            raise GraphError(
                f"the rewrite gave control inputs to {first!r} or {second!r}, a "
                "Conv2D -> BiasAdd pair oneDNN merges (TensorFlow aborts on "
                "such a merge)")
        if first in b or second in a:
            raise GraphError(f"{first!r} and {second!r}, a pair oneDNN merges, "
                             "would have to wait for each other")
        node(first).input.extend("^" + n for n in sorted(b - a))
        node(second).input.extend("^" + n for n in sorted(a - b))
        changed.update((first, second))
    return (out, frozenset(changed)) if changed else (graph_def, frozenset())


def _controls(node) -> frozenset:
    """The names of a NodeDef's control inputs."""
    found = set()
    for text in node.input:
        name, _, control = parse_input(text)
        if control:
            found.add(name)
    return frozenset(found)


def _sources(first: str, second: str) -> tuple:
    """The original nodes behind a pair: a clone's source for a clone."""
    return tuple(names.recompute_source(n) or n for n in (first, second))
