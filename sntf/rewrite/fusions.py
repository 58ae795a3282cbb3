"""Keeps the node pairs TensorFlow's oneDNN pass merged in the original graph
merged in the rewritten one (see sntf.graph.fusions)."""

from __future__ import annotations

from typing import Optional

from sntf.graph import names
from sntf.graph.fusions import merge_pairs
from sntf.graph.index import GraphError, GraphIndex, build_index


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
    gave = merge_controls(index, merged)
    if not gave:
        return graph_def, frozenset()
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for name, controls in gave.items():
        out.node[index.index[name]].input.extend("^" + n for n in controls)
    return out, frozenset(gave)


def merge_controls(index: GraphIndex, merged: frozenset) -> dict:
    """The control inputs keep_merges gives: for every pair of a rewritten
    graph (`index`) whose original pair is in `merged`, pair by pair, each
    node gets, sorted by name, the control inputs only the other has.

    Returns:
      Node name -> the names of the control inputs appended to it, in
      order, for each node of a pair whose control inputs differed.

    Raises:
      GraphError: as keep_merges.
    """
    pairs = [(p.first, p.second, p.strict) for p in merge_pairs(index)
             if _sources(index.names[p.first], index.names[p.second]) in merged]
    names = index.names
    controls: dict = {}    # node -> the names of its control inputs so far
    gave: dict = {}

    def of(node: int) -> set:
        if node not in controls:
            controls[node] = {names[p] for p in index.control_inputs[node]}
        return controls[node]

    for first, second, strict in pairs:
        a, b = of(first), of(second)
        if a == b:
            continue
        x, y = names[first], names[second]
        if strict:
            raise GraphError(
                f"the rewrite gave control inputs to {x!r} or {y!r}, a "
                "Conv2D -> BiasAdd pair oneDNN merges (TensorFlow aborts on "
                "such a merge)")
        if x in b or y in a:
            raise GraphError(f"{x!r} and {y!r}, a pair oneDNN merges, "
                             "would have to wait for each other")
        to_first, to_second = sorted(b - a), sorted(a - b)
        gave.setdefault(x, []).extend(to_first)
        gave.setdefault(y, []).extend(to_second)
        a.update(to_first)
        b.update(to_second)
    return gave


def _sources(first: str, second: str) -> tuple:
    """The original nodes behind a pair: a clone's source for a clone."""
    return tuple(names.recompute_source(n) or n for n in (first, second))
