"""The graph model's index: a read-only adjacency over a GraphDef.

Pure functions over plain data: a GraphDef (protobuf message, never mutated)
in, plain Python structures out. Nothing here runs TensorFlow.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import threading
import weakref
from typing import Callable, Iterable, Optional

from sntf.graph import names, optable


class GraphError(ValueError):
    """The GraphDef is malformed in a way the pass cannot model."""


def parse_input(text: str) -> tuple[str, int, bool]:
    """Parses a NodeDef input string.

    Args:
      text: "node", "node:2" or "^node".

    Returns:
      (producer name, output port, is_control); the port of a control input is -1.
    """
    if text.startswith("^"):
        return text[1:], -1, True
    name, sep, port = text.rpartition(":")
    if sep and port.isdigit():
        return name, int(port), False
    return text, 0, False


def on_gpu(device: str) -> bool:
    """Whether a node's device string names a GPU.

    Args:
      device: "/device:GPU:0", "GPU:1", a full "/job:.../device:GPU:0", or "".

    Returns:
      Whether its last component's device type is GPU (a job's name that
      happens to say "gpu" does not count).
    """
    last = device.rsplit("/", 1)[-1].upper()
    if last.startswith("DEVICE:"):
        last = last[len("DEVICE:"):]
    return last.startswith("GPU")


@dataclasses.dataclass(frozen=True)
class GraphIndex:
    """Read-only adjacency over a GraphDef's nodes, addressed by position.

    Attributes:
      names, ops, devices: per node.
      data_inputs: per node, (producer index, port) of each data input in order.
      control_inputs: per node, producer indices of control inputs.
      consumers: per node, (consumer index, input slot, port) of data edges.
      control_consumers: per node, indices of nodes with a control edge from it.
      topo: a topological order (NextIteration back edges ignored).
      fetch, preserve: indices of fetch and nodes-to-preserve that exist.
      has_cycles: whether a cycle remained besides NextIteration back edges.
      sntf_nodes: indices of the nodes an earlier rewrite generated.
      frames: per node, the frame an Enter op opens ("" for every other op).
    """

    names: tuple[str, ...]
    ops: tuple[str, ...]
    devices: tuple[str, ...]
    index: dict
    data_inputs: tuple[tuple[tuple[int, int], ...], ...]
    control_inputs: tuple[tuple[int, ...], ...]
    consumers: tuple[tuple[tuple[int, int, int], ...], ...]
    control_consumers: tuple[tuple[int, ...], ...]
    topo: tuple[int, ...]
    fetch: frozenset
    preserve: frozenset
    has_cycles: bool
    sntf_nodes: tuple[int, ...]
    frames: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.names)

    def node(self, name: str) -> int:
        """Index of the node called `name`."""
        return self.index[name]


def build_index(graph_def, fetch: Iterable[str] = (),
                preserve: Iterable[str] = ()) -> GraphIndex:
    """Builds a GraphIndex.

    Args:
      graph_def: a tensorflow GraphDef message (not modified).
      fetch: names of fetch nodes ("node" or "node:port").
      preserve: names of nodes that must be preserved.

    Returns:
      The index.

    Raises:
      GraphError: duplicate node names or inputs naming missing nodes.
    """
    nodes = graph_def.node
    index: dict = {}
    for i, node in enumerate(nodes):
        if node.name in index:
            raise GraphError(f"duplicate node name {node.name!r}")
        index[node.name] = i
    n = len(nodes)
    data_inputs, control_inputs = [], []
    consumers = [[] for _ in range(n)]
    control_consumers = [[] for _ in range(n)]
    for i, node in enumerate(nodes):
        data, control = [], []
        for text in node.input:
            name, port, is_control = parse_input(text)
            producer = index.get(name)
            if producer is None:
                raise GraphError(f"node {node.name!r} reads missing node {name!r}")
            if is_control:
                control.append(producer)
                control_consumers[producer].append(i)
            else:
                consumers[producer].append((i, len(data), port))
                data.append((producer, port))
        data_inputs.append(tuple(data))
        control_inputs.append(tuple(control))
    ops = tuple(node.op for node in nodes)
    topo, has_cycles = _topological_order(ops, data_inputs, control_inputs,
                                          consumers, control_consumers)

    def existing(names_: Iterable[str]) -> frozenset:
        return frozenset(index[parse_input(x)[0]] for x in names_
                         if parse_input(x)[0] in index)

    return GraphIndex(
        names=tuple(node.name for node in nodes), ops=ops,
        devices=tuple(node.device for node in nodes), index=index,
        data_inputs=tuple(data_inputs), control_inputs=tuple(control_inputs),
        consumers=tuple(tuple(c) for c in consumers),
        control_consumers=tuple(tuple(c) for c in control_consumers),
        topo=tuple(topo), fetch=existing(fetch), preserve=existing(preserve),
        has_cycles=has_cycles,
        sntf_nodes=tuple(i for i, node in enumerate(nodes) if names.role_of(node)),
        frames=tuple(_frame_name(node) for node in nodes))


def _frame_name(node) -> str:
    if node.op not in optable.ENTER_OPS:
        return ""
    return node.attr["frame_name"].s.decode("utf-8", "replace")


def _topological_order(ops, data_inputs, control_inputs, consumers,
                       control_consumers) -> tuple[list[int], bool]:
    """Kahn's algorithm, lowest index first among ready nodes (stable)."""
    n = len(ops)
    back_edge_sources = {i for i in range(n) if ops[i] in optable.NEXT_ITERATION_OPS}
    indegree = [0] * n
    for i in range(n):
        preds = [p for p, _ in data_inputs[i]] + list(control_inputs[i])
        indegree[i] = sum(1 for p in preds if p not in back_edge_sources)
    ready = [i for i in range(n) if indegree[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        if i in back_edge_sources:
            successors = []
        else:
            successors = [c for c, _, _ in consumers[i]] + list(control_consumers[i])
        for c in successors:
            indegree[c] -= 1
            if indegree[c] == 0:
                heapq.heappush(ready, c)
    has_cycles = len(order) != n
    if has_cycles:
        seen = set(order)
        order.extend(i for i in range(n) if i not in seen)
    return order, has_cycles


def ancestors(g: GraphIndex, starts: Iterable[int], control: bool = True,
              state: bool = False) -> set:
    """All nodes with a path to any of `starts` (the starts included).

    Args:
      g: the graph index.
      starts: node indices.
      control: follow every control edge.
      state: follow control edges from variable updates only: a read ordered
        after a write of the same state depends on the written value (Adam's
        slots are written, then read to update the weight).

    Returns:
      The set of ancestor indices.
    """
    seen = set(starts)
    stack = list(seen)
    while stack:
        i = stack.pop()
        preds = [p for p, _ in g.data_inputs[i]]
        if control:
            preds += g.control_inputs[i]
        elif state:
            preds += [p for p in g.control_inputs[i] if optable.is_update_op(g.ops[p])]
        for p in preds:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def descendants(g: GraphIndex, starts: Iterable[int], within: Optional[set] = None,
                control: bool = False) -> set:
    """All nodes reachable from `starts` (included), optionally inside `within`."""
    seen = set(starts)
    stack = list(seen)
    while stack:
        i = stack.pop()
        succs = [c for c, _, _ in g.consumers[i]]
        if control:
            succs += g.control_consumers[i]
        for c in succs:
            if c not in seen and (within is None or c in within):
                seen.add(c)
                stack.append(c)
    return seen


def name_hint(g: GraphIndex, limit: int = 3) -> str:
    """A short human hint of what a graph is: its most common top-level scopes."""
    counts = collections.Counter()
    for name in g.names:
        if "/" in name:
            counts[name.split("/", 1)[0]] += 1
    top = [scope for scope, _ in counts.most_common(limit)]
    return ",".join(top) if top else (g.names[0] if g.names else "empty")


# The planners ask for a graph's regions (and which ops wait for the loss)
# once per plan they try, and a budget search tries dozens on one base graph:
# each answer is kept for the last few graphs asked about (held weakly, so no
# graph outlives its pass).
_MEMO_SIZE = 8
_memo: list = []
_memo_lock = threading.Lock()


def memoized(g: GraphIndex, kind: str, compute: Callable):
    """compute(g), kept for the last few graphs asked about under `kind`."""
    with _memo_lock:
        for ref, k, value in _memo:
            if k == kind and ref() is g:
                return value
    value = compute(g)
    with _memo_lock:
        _memo.append((weakref.ref(g), kind, value))
        del _memo[:-_MEMO_SIZE]
    return value
