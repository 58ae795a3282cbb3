"""Indexes of rewritten graphs, made from the index of the graph they were
rewritten from at the cost of what changed: a deep network's planner tries
many rewrites of one graph, and indexing a large graph anew costs more than
most of its analysis."""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable

from sntf.graph import names
from sntf.graph.index import GraphError, GraphIndex, frame_name, parsed_inputs


def updated_index(before: GraphIndex, graph_def, touched: Iterable[str]) -> GraphIndex:
    """The index of a graph rewritten from `before`'s by appending nodes and
    changing the inputs of the nodes named in `touched`, and nothing else
    (sntf.rewrite's rewrites): equal to build_index of it with `before`'s
    fetch and preserve nodes, at the cost of the nodes that changed and a
    new topological order.

    Args:
      before: the index of the graph it was rewritten from.
      graph_def: the rewritten GraphDef, `before`'s nodes first, in order.
      touched: names of `before`'s nodes whose inputs may have changed.

    Returns:
      The index.

    Raises:
      GraphError: a new node's name is taken, or an input names a missing node.
    """
    nodes = graph_def.node
    n, m = len(before.names), len(nodes)
    index = dict(before.index)
    for i in range(n, m):
        name = nodes[i].name
        if name in index:
            raise GraphError(f"duplicate node name {name!r}")
        index[name] = i
    data_inputs = list(before.data_inputs) + [()] * (m - n)
    control_inputs = list(before.control_inputs) + [()] * (m - n)
    consumers = list(before.consumers) + [()] * (m - n)
    control_consumers = list(before.control_consumers) + [()] * (m - n)
    changed = sorted({before.index[name] for name in touched if name in before.index}
                     | set(range(n, m)))
    # Each producer's consumers are listed by consumer, then input slot, as
    # build_index lists them: the changed nodes' edges are taken out and
    # put back in that order.
    fed, controlled = collections.defaultdict(list), collections.defaultdict(list)
    for i in changed:
        for p, port in data_inputs[i]:
            fed[p]
        for p in control_inputs[i]:
            controlled[p]
    for i in changed:
        data, control = parsed_inputs(nodes[i], index)
        data_inputs[i], control_inputs[i] = data, control
        for slot, (p, port) in enumerate(data):
            fed[p].append((i, slot, port))
        for p in control:
            controlled[p].append(i)
    moved = frozenset(changed)
    for p, edges in fed.items():
        consumers[p] = tuple(sorted([e for e in consumers[p] if e[0] not in moved] + edges))
    for p, edges in controlled.items():
        control_consumers[p] = tuple(sorted(
            [c for c in control_consumers[p] if c not in moved] + edges))
    new = nodes[n:]
    ops = before.ops + tuple(node.op for node in new)
    after = GraphIndex(
        names=before.names + tuple(node.name for node in new), ops=ops,
        devices=before.devices + tuple(node.device for node in new), index=index,
        data_inputs=tuple(data_inputs), control_inputs=tuple(control_inputs),
        consumers=tuple(consumers), control_consumers=tuple(control_consumers),
        fetch=before.fetch, preserve=before.preserve,
        sntf_nodes=before.sntf_nodes + tuple(n + k for k, node in enumerate(new)
                                             if names.role_of(node)),
        frames=before.frames + tuple(frame_name(node) for node in new))
    if m == n and all(data_inputs[i] == before.data_inputs[i] for i in changed):
        _carry_data_edges(before, after)
    return after


def with_control_inputs(before: GraphIndex, added: dict) -> GraphIndex:
    """The index of `before`'s graph with control inputs appended to some of
    its nodes, and nothing else changed: equal to updated_index of that
    GraphDef (each node's inputs followed by "^producer" for each producer
    added, in order), without the GraphDef.

    Args:
      before: the graph's index.
      added: node -> the producers of the control inputs appended to it,
        in order.

    Returns:
      The index.
    """
    control_inputs = list(before.control_inputs)
    control_consumers = list(before.control_consumers)
    gained = collections.defaultdict(list)
    for node, producers in added.items():
        if producers:
            control_inputs[node] = control_inputs[node] + tuple(producers)
            for p in producers:
                gained[p].append(node)
    for p, nodes in gained.items():
        control_consumers[p] = tuple(sorted(control_consumers[p] + tuple(nodes)))
    after = dataclasses.replace(before, control_inputs=tuple(control_inputs),
                                control_consumers=tuple(control_consumers))
    _carry_data_edges(before, after)
    return after


def _carry_data_edges(before: GraphIndex, after: GraphIndex) -> None:
    """Gives `after`, which differs from `before` in control edges alone,
    what `before` has already worked out from the nodes and data edges."""
    for kind in ("data_topo", "data_producers", "data_readers"):
        if kind in before.__dict__:
            after.__dict__[kind] = before.__dict__[kind]
    if "_of_data_edges" in before.__dict__:
        after.__dict__["_of_data_edges"] = dict(before.__dict__["_of_data_edges"])
