"""The graph model's index: a read-only adjacency over a GraphDef.

Pure functions over plain data: a GraphDef (protobuf message, never mutated)
in, plain Python structures out. Nothing here runs TensorFlow.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import threading
import weakref
from typing import Callable, Iterable, Optional

from sntf.graph import names, optable

try:  # the native walks (tf_ops/graph_walks.cc), where sntf is built
    from sntf import _graph_walks as _walks
except ImportError:  # pragma: no cover - a source checkout not yet built
    _walks = None


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
    fetch: frozenset
    preserve: frozenset
    sntf_nodes: tuple[int, ...]
    frames: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.names)

    def node(self, name: str) -> int:
        """Index of the node called `name`."""
        return self.index[name]

    # Neighbour lists by kind of edge, made the first time a walk over the
    # graph asks (ancestors, descendants): the analysis walks each graph
    # it is given many times.
    @functools.cached_property
    def data_producers(self) -> tuple:
        """Per node, the producers of its data inputs, in input order."""
        return tuple(tuple(p for p, _ in d) for d in self.data_inputs)

    @functools.cached_property
    def producers(self) -> tuple:
        """Per node, the producers of its data inputs, then of its control ones."""
        return tuple(d + c for d, c in zip(self.data_producers, self.control_inputs))

    @functools.cached_property
    def state_producers(self) -> tuple:
        """Per node, its data producers, then the variable updates it waits
        for by a control edge."""
        ops = self.ops
        return tuple(d + tuple(p for p in c if optable.is_update_op(ops[p])) if c else d
                     for d, c in zip(self.data_producers, self.control_inputs))

    @functools.cached_property
    def data_readers(self) -> tuple:
        """Per node, the consumers of its outputs, edge by edge, in the
        order of `consumers`."""
        return tuple(tuple(c for c, _, _ in cs) for cs in self.consumers)

    # The topological order, made the first time it or has_cycles is read:
    # of the graphs the planner tries, most are compared by their peaks and
    # dropped, and a try that keeps oneDNN's merges is indexed twice.
    @functools.cached_property
    def _ordered(self) -> tuple:
        order, has_cycles = _topological_order(
            self.ops, self.data_inputs, self.control_inputs, self.consumers,
            self.control_consumers)
        return tuple(order), has_cycles

    @property
    def topo(self) -> tuple:
        """A topological order (NextIteration back edges ignored; lowest
        index first among ready nodes)."""
        return self._ordered[0]

    @property
    def has_cycles(self) -> bool:
        """Whether a cycle remains besides NextIteration back edges."""
        return self._ordered[1]

    @functools.cached_property
    def data_topo(self) -> tuple:
        """A topological order of the data edges alone (lowest index first
        among ready nodes, NextIteration back edges ignored): the same for
        graphs that differ in control edges only."""
        n = len(self.ops)
        order, _ = _topological_order(self.ops, self.data_inputs, ((),) * n,
                                      self.consumers, ((),) * n)
        return tuple(order)

    def of_data_edges(self, kind: str, compute: Callable):
        """compute(self), kept with the index under `kind`, for what depends
        on the nodes and their data edges alone: an index updated from this
        one by control edges alone (updated_index, an order tried) keeps it.

        Args:
          kind: the name it is kept under.
          compute: index -> value.

        Returns:
          The value.
        """
        kept = self.__dict__.setdefault("_of_data_edges", {})
        if kind not in kept:
            kept[kind] = compute(self)
        return kept[kind]

    @functools.cached_property
    def readers(self) -> tuple:
        """Per node, data_readers, then its control consumers."""
        return tuple(d + c for d, c in zip(self.data_readers, self.control_consumers))


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
        data, control = parsed_inputs(node, index)
        for slot, (producer, port) in enumerate(data):
            consumers[producer].append((i, slot, port))
        for producer in control:
            control_consumers[producer].append(i)
        data_inputs.append(data)
        control_inputs.append(control)
    ops = tuple(node.op for node in nodes)

    def existing(names_: Iterable[str]) -> frozenset:
        return frozenset(index[parse_input(x)[0]] for x in names_
                         if parse_input(x)[0] in index)

    return GraphIndex(
        names=tuple(node.name for node in nodes), ops=ops,
        devices=tuple(node.device for node in nodes), index=index,
        data_inputs=tuple(data_inputs), control_inputs=tuple(control_inputs),
        consumers=tuple(tuple(c) for c in consumers),
        control_consumers=tuple(tuple(c) for c in control_consumers),
        fetch=existing(fetch), preserve=existing(preserve),
        sntf_nodes=tuple(i for i, node in enumerate(nodes) if names.role_of(node)),
        frames=tuple(frame_name(node) for node in nodes))


def parsed_inputs(node, index: dict) -> tuple:
    """(data inputs, control inputs) of a NodeDef, by producer index."""
    data, control = [], []
    for text in node.input:
        name, port, is_control = parse_input(text)
        producer = index.get(name)
        if producer is None:
            raise GraphError(f"node {node.name!r} reads missing node {name!r}")
        if is_control:
            control.append(producer)
        else:
            data.append((producer, port))
    return tuple(data), tuple(control)


def frame_name(node) -> str:
    if node.op not in optable.ENTER_OPS:
        return ""
    return node.attr["frame_name"].s.decode("utf-8", "replace")


def back_edges(ops) -> set:
    """The nodes whose out-edges are a loop's back edges (NextIteration)."""
    return {i for i, op in enumerate(ops) if op in optable.NEXT_ITERATION_OPS}


def inputs_waited_for(data_inputs, control_inputs, back_edge: set) -> list:
    """Per node, how many of its input edges it waits for: all but those
    from `back_edge` nodes (back_edges)."""
    if back_edge:
        return [sum(1 for p, _ in d if p not in back_edge)
                + sum(1 for p in c if p not in back_edge)
                for d, c in zip(data_inputs, control_inputs)]
    return [len(d) + len(c) for d, c in zip(data_inputs, control_inputs)]


def _topological_order(ops, data_inputs, control_inputs, consumers,
                       control_consumers) -> tuple[list[int], bool]:
    """Kahn's algorithm, lowest index first among ready nodes (stable);
    natively where sntf is built (tf_ops/graph_walks.cc)."""
    if _walks is not None:
        return _walks.topological_order(
            data_inputs, control_inputs, consumers, control_consumers,
            back_edge_flags(ops), int_objects(len(ops)))
    return _python_topological_order(ops, data_inputs, control_inputs, consumers,
                                     control_consumers)


_INTS: list = []    # 0, 1, 2 ...: the int objects native walks return
_ints_lock = threading.Lock()


def int_objects(n: int) -> list:
    """A list holding the ints 0 to at least n - 1, one object each, shared
    by every order a native walk returns: an analysis keeps its schedule,
    and its node numbers then cost no more than Python's own. Its item k
    is k, whichever threads grow it."""
    if len(_INTS) < n:
        with _ints_lock:
            if len(_INTS) < n:
                _INTS.extend(range(len(_INTS), n))
    return _INTS


def back_edge_flags(ops) -> bytes:
    """Per node, 1 where its out-edges are a loop's back edges (back_edges)."""
    return bytes(op in optable.NEXT_ITERATION_OPS for op in ops)


def _python_topological_order(ops, data_inputs, control_inputs, consumers,
                              control_consumers) -> tuple[list[int], bool]:
    """_topological_order in Python: the reference for the native walk."""
    n = len(ops)
    back_edge_sources = back_edges(ops)
    indegree = inputs_waited_for(data_inputs, control_inputs, back_edge_sources)
    ready = [i for i in range(n) if indegree[i] == 0]
    heapq.heapify(ready)
    order = []
    pop, push = heapq.heappop, heapq.heappush
    while ready:
        i = pop(ready)
        order.append(i)
        if i in back_edge_sources:
            continue
        for c, _, _ in consumers[i]:
            indegree[c] -= 1
            if indegree[c] == 0:
                push(ready, c)
        for c in control_consumers[i]:
            indegree[c] -= 1
            if indegree[c] == 0:
                push(ready, c)
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
    preds = g.producers if control else g.state_producers if state else g.data_producers
    return _reached(preds, starts, None)


def descendants(g: GraphIndex, starts: Iterable[int], within: Optional[set] = None,
                control: bool = False) -> set:
    """All nodes reachable from `starts` (included), optionally inside `within`."""
    return _reached(g.readers if control else g.data_readers, starts, within)


def _reached(neighbours: tuple, starts: Iterable[int], within: Optional[set]) -> set:
    """`starts` and every node reached from them along `neighbours`, only
    through nodes in `within` where given."""
    seen = set(starts)
    stack = list(seen)
    pop, push, add = stack.pop, stack.append, seen.add
    while stack:
        for p in neighbours[pop()]:
            if p not in seen and (within is None or p in within):
                add(p)
                push(p)
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
