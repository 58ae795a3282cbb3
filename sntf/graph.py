"""Graph model: an index over a GraphDef and structural training detection.

Pure functions over plain data: a GraphDef (protobuf message, never mutated)
in, plain Python structures out. Nothing here runs TensorFlow.

Training graphs are recognized by the structure of reverse-mode
differentiation, never by node names (Grappler's CSE shares nodes between
`gradient_tape/` and forward scopes): a variable V is *trained* when some op F
consumes a value derived from V together with another activation x, and an op
G that also consumes x lies downstream of F and upstream of an update of V.
That G is the weight gradient (dW = x^T dy, Conv2DBackpropFilter(x, dy), a
sparse update keyed by the ids): a forward-only graph has no update of V
downstream of F, and a metrics update never depends on V's own read.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Optional, Sequence

from sntf import names

CONST_OPS = frozenset({"Const", "HostConst"})
# Ops that write a variable. Matched by type, plus the prefixes below.
UPDATE_OPS = frozenset({
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "Assign", "AssignAdd", "AssignSub",
})
UPDATE_OP_PREFIXES = ("ResourceApply", "ResourceSparseApply", "ResourceScatter",
                      "Apply", "SparseApply")
# Ref-variable scatters write a variable; ScatterNd and
# ScatterNdNonAliasingAdd build a new tensor and are not updates.
REF_SCATTER_OPS = frozenset({
    "ScatterAdd", "ScatterSub", "ScatterMul", "ScatterDiv", "ScatterMin",
    "ScatterMax", "ScatterUpdate", "ScatterNdAdd", "ScatterNdSub",
    "ScatterNdUpdate", "ScatterNdMax", "ScatterNdMin",
})
# Ops that forward a resource handle unchanged: Identity left by function
# inlining, and the Switch of a lowered tf.cond whose branch writes the
# variable (Keras' loss-scale optimizer applies gradients under one).
HANDLE_FORWARDING_OPS = frozenset({"Identity", "IdentityN", "Switch", "RefSwitch"})
# TF1 reference variables: their output is the variable's value itself (a
# ref tensor), read by the `<name>/read` Identity or by ops taking the ref.
REF_VARIABLE_OPS = frozenset({"Variable", "VariableV2", "TemporaryVariable"})
# Single-value ops through which a variable's read stays "the variable".
PASS_THROUGH_OPS = frozenset({"Identity", "Cast", "Reshape", "Transpose",
                              "ExpandDims", "Squeeze", "Snapshot", "IdentityN"})
# Ops of TF1-style control flow: frames the pass does not model.
CONTROL_FLOW_OPS = frozenset({"Enter", "Exit", "Merge", "Switch", "NextIteration",
                              "LoopCond", "RefEnter", "RefExit", "RefMerge",
                              "RefSwitch", "RefNextIteration"})
FUNCTIONAL_CONTROL_FLOW_OPS = frozenset({"While", "StatelessWhile", "If",
                                         "StatelessIf", "Case", "StatelessCase"})
# Control-flow ops of loops: the pass models no iteration, so a graph with a
# loop is left alone; conditionals are modelled as both branches running.
LOOP_OPS = frozenset({"Enter", "RefEnter", "Exit", "RefExit", "NextIteration",
                      "RefNextIteration", "LoopCond", "While", "StatelessWhile"})
# Upper bound on variables examined by training detection, so that the pass
# stays fast on graphs with thousands of variables; the first few trained
# variables are found long before this.
MAX_VARIABLES_EXAMINED = 4096


class GraphError(ValueError):
    """The GraphDef is malformed in a way the pass cannot model."""


def is_update_op(op: str) -> bool:
    """Whether an op type writes a variable."""
    return (op in UPDATE_OPS or op in REF_SCATTER_OPS
            or op.startswith(UPDATE_OP_PREFIXES))


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
        sntf_nodes=tuple(i for i, node in enumerate(nodes) if names.role_of(node)))


def _topological_order(ops, data_inputs, control_inputs, consumers,
                       control_consumers) -> tuple[list[int], bool]:
    """Kahn's algorithm, lowest index first among ready nodes (stable)."""
    import heapq

    n = len(ops)
    back_edge_sources = {i for i in range(n) if ops[i] in ("NextIteration",
                                                           "RefNextIteration")}
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
            preds += [p for p in g.control_inputs[i] if is_update_op(g.ops[p])]
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


@dataclasses.dataclass(frozen=True)
class TrainingInfo:
    """Result of training detection.

    Attributes:
      training: whether the graph computes gradients that update variables.
      reason: one line saying why.
      trained_variables: names of handle nodes whose updates consume a weight
        gradient (those found before detection stopped).
      gradient_ops: names of the weight-gradient ops found (the G's).
      updated_variables: number of distinct variable handles written.
    """

    training: bool
    reason: str
    trained_variables: tuple[str, ...] = ()
    gradient_ops: tuple[str, ...] = ()
    updated_variables: int = 0


def handle_root(g: GraphIndex, node: int) -> int:
    """The node a resource handle comes from, through Identity forwarding."""
    seen = 0
    while g.ops[node] in HANDLE_FORWARDING_OPS and g.data_inputs[node] and seen < 64:
        node = g.data_inputs[node][0][0]
        seen += 1
    return node


def variable_access(g: GraphIndex) -> tuple[dict, dict]:
    """Updates and readers of every updated variable, keyed by handle root.

    Returns:
      (updates, readers): root -> update node indices, and root -> nodes that
      read the variable (ReadVariableOp, ResourceGather, ...), following the
      Identity ops that function inlining leaves on resource inputs.
    """
    updates = collections.defaultdict(list)
    for i, op in enumerate(g.ops):
        if g.data_inputs[i] and is_update_op(op):
            updates[handle_root(g, g.data_inputs[i][0][0])].append(i)
    readers = collections.defaultdict(list)
    for root in updates:
        if g.ops[root] in REF_VARIABLE_OPS:
            # A reference variable has no handle to forward: every consumer
            # that does not write it reads its value (`w/read`, or an op
            # taking the ref directly), at any input slot.
            readers[root] = sorted({c for c, _, _ in g.consumers[root]
                                    if not is_update_op(g.ops[c])})
            continue
        stack, seen = [root], {root}
        while stack:
            h = stack.pop()
            for c, slot, _ in g.consumers[h]:
                if is_update_op(g.ops[c]) or c in seen:
                    continue
                if slot == 0 and g.ops[c] in HANDLE_FORWARDING_OPS:
                    seen.add(c)
                    stack.append(c)
                elif slot == 0:
                    seen.add(c)
                    readers[root].append(c)
    return updates, readers


def _variable_derived(g: GraphIndex, reads: Sequence[int]) -> set:
    """Nodes whose value is the variable itself: reads and pass-through ops."""
    derived = set(reads)
    stack = list(reads)
    while stack:
        i = stack.pop()
        for c, _, _ in g.consumers[i]:
            if c in derived or g.ops[c] not in PASS_THROUGH_OPS:
                continue
            others = [p for p, _ in g.data_inputs[c]
                      if p not in derived and g.ops[p] not in CONST_OPS]
            if not others:
                derived.add(c)
                stack.append(c)
    return derived


def _weight_users(g: GraphIndex, handle: int, readers: Sequence[int]
                  ) -> tuple[set, list[tuple[int, set]]]:
    """Ops that compute with a variable, each with its activation inputs.

    Consumers of the variable's value, and readers that take other inputs
    themselves (an embedding lookup reads E together with the ids).

    Returns:
      (derived, users): the nodes whose value is the variable, and
      [(user, activation input nodes)] for users with at least one activation.
    """
    derived = _variable_derived(g, readers)
    users = {f for d in derived for f, _, _ in g.consumers[d] if f not in derived}
    users.update(r for r in readers if len(g.data_inputs[r]) > 1)
    result = []
    for f in sorted(users):
        activations = {p for p, _ in g.data_inputs[f]
                       if p not in derived and g.ops[p] not in CONST_OPS
                       and handle_root(g, p) != handle}
        if activations and not is_update_op(g.ops[f]):
            result.append((f, activations))
    return derived, result


def _gradient_of(g: GraphIndex, handle: int, readers: Sequence[int],
                 update_ancestors: set) -> Optional[int]:
    """Finds a weight-gradient op for the variable behind `handle`, or None."""
    _, users = _weight_users(g, handle, readers)
    for f, activations in users:
        if f not in update_ancestors:
            continue
        downstream = None
        for x in activations:
            for gop, _, _ in g.consumers[x]:
                if gop == f or gop not in update_ancestors:
                    continue
                if downstream is None:
                    downstream = descendants(g, [f], within=update_ancestors)
                if gop in downstream:
                    return gop
    return None


def detect_training(g: GraphIndex) -> TrainingInfo:
    """Decides structurally whether a graph is a training step.

    Args:
      g: the graph index.

    Returns:
      A TrainingInfo.
    """
    updates, readers = variable_access(g)
    if not updates:
        return TrainingInfo(False, "no variable is updated")
    # One sweep for all updates: a weight gradient feeds *some* update. (Per
    # variable sweeps cost O(variables x nodes): minutes on a 1000-layer net.)
    feeding = ancestors(g, [u for us in updates.values() for u in us],
                        control=False, state=True)
    # Variables with the most readers first: model weights, not counters.
    candidates = sorted((h for h in updates if readers[h]),
                        key=lambda h: (-len(readers[h]), h))
    for handle in candidates[:MAX_VARIABLES_EXAMINED]:
        gop = _gradient_of(g, handle, readers[handle], feeding)
        if gop is not None:
            return TrainingInfo(
                True, f"variable {g.names[handle]!r} is updated from a weight "
                f"gradient ({g.names[gop]!r})", (g.names[handle],),
                (g.names[gop],), len(updates))
    return TrainingInfo(False, f"{len(updates)} variable(s) updated, none from a "
                        "gradient (metrics or state updates only)",
                        updated_variables=len(updates))


def loop_ops(g: GraphIndex) -> tuple[str, ...]:
    """Types of loop ops present (TF1 frames and functional While)."""
    return tuple(sorted({op for op in g.ops if op in LOOP_OPS}))


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
             if op in CONTROL_FLOW_OPS or op in FUNCTIONAL_CONTROL_FLOW_OPS]
    return frozenset(descendants(g, seeds, control=True)) if seeds else frozenset()


def xla_compiled(graph_def) -> bool:
    """Whether the graph is marked for XLA compilation."""
    for node in graph_def.node:
        for key in ("_XlaCompile", "_XlaMustCompile"):
            if key in node.attr and node.attr[key].b:
                return True
    return False


def name_hint(g: GraphIndex, limit: int = 3) -> str:
    """A short human hint of what a graph is: its most common top-level scopes."""
    counts = collections.Counter()
    for name in g.names:
        if "/" in name:
            counts[name.split("/", 1)[0]] += 1
    top = [scope for scope, _ in counts.most_common(limit)]
    return ",".join(top) if top else (g.names[0] if g.names else "empty")


FORWARD, BACKWARD, OTHER = "forward", "backward", "other"
# Losses whose second output is the gradient with respect to the logits.
FUSED_LOSS_OPS = frozenset({"SoftmaxCrossEntropyWithLogits",
                            "SparseSoftmaxCrossEntropyWithLogits"})
# Op types that only gradient computations use.
GRADIENT_OP_TYPES = frozenset({"BroadcastGradientArgs", "BiasAddGrad",
                               "BiasAddGradV1", "SymbolicGradient"})


def is_gradient_op(op: str) -> bool:
    """Whether an op type is a gradient kernel (ReluGrad, Conv2DBackpropInput...)."""
    return (op in GRADIENT_OP_TYPES or op.endswith("Grad") or "Backprop" in op
            or op.endswith("GradV2") or op.endswith("GradGrad"))


def weight_consumers(g: GraphIndex) -> frozenset:
    """Forward ops that combine an updated variable with an activation.

    These anchor the forward pass of a training graph: every forward op that
    computes with a weight (MatMul(x, W), Conv2D(x, K), BiasAdd(h, b), a
    normalization's scale) and feeds some variable update. The backward pass
    has ops of the same shape (dx = dy W^T reads W and dy), told apart by
    structure: their activation input descends from another op that reads the
    same weight, which a forward op's input never does.

    Args:
      g: the graph index.

    Returns:
      Indices of the forward weight consumers.
    """
    updates, readers = variable_access(g)
    if not updates:
        return frozenset()
    all_updates = [u for us in updates.values() for u in us]
    feeding_updates = ancestors(g, all_updates, control=False, state=True)
    candidates = {}  # anchor -> (handles it reads, its activation inputs)
    for handle in updates:
        _, users = _weight_users(g, handle, readers[handle])
        for f, acts in users:
            if f not in feeding_updates:
                continue
            handles, inputs = candidates.setdefault(f, (set(), set()))
            handles.add(handle)
            inputs.update(acts)
    if not candidates:
        return frozenset()
    bit = {f: 1 << k for k, f in enumerate(sorted(candidates))}
    reads_of = collections.defaultdict(int)  # handle -> mask of its consumers
    for f, (handles, _) in candidates.items():
        for h in handles:
            reads_of[h] |= bit[f]
    # mask[n]: the candidates n descends from (data edges), in one topo sweep.
    mask = [0] * len(g.names)
    for n in g.topo:
        m = 0
        for p, _ in g.data_inputs[n]:
            m |= mask[p]
        mask[n] = m | bit.get(n, 0)
    backward = set()
    for f, (handles, inputs) in candidates.items():
        same_weight = 0
        for h in handles:
            same_weight |= reads_of[h]
        same_weight &= ~bit[f]
        upstream = 0
        for x in inputs:
            upstream |= mask[x]
        if upstream & same_weight:
            backward.add(f)
    # Gradient kernels (by op type, a structural fact) and the backprop output
    # of fused losses start the backward pass too; an optimizer's ops that read
    # slot variables (Adam's m and v) sit downstream of them.
    tainted = descendants(g, backward | _gradient_sources(g, candidates))
    # A forward op's output flows into the gradient computation; an
    # optimizer op reading a slot (m, v) only flows into updates.
    feeds_gradients = ancestors(g, tainted, control=False)
    return frozenset(f for f in candidates
                     if f not in tainted and f in feeds_gradients)


def classify_phases(g: GraphIndex) -> tuple[str, ...]:
    """Labels every node forward, backward or other, by structure.

    Forward: ancestors of the weight consumers (the forward pass up to its
    last layer). Backward: nodes downstream of a weight consumer that feed a
    variable update and are not forward (the loss, the gradients and the
    optimizer's arithmetic). Other: everything else (metrics, counters,
    tf.data plumbing).

    Args:
      g: the graph index.

    Returns:
      One label per node, by node index.
    """
    anchors = weight_consumers(g)
    if not anchors:
        return tuple(OTHER for _ in g.names)
    below = descendants(g, anchors)
    tainted = descendants(g, _gradient_sources(g, anchors))
    # The forward pass: up to the last weight consumer, then on to what the
    # step returns (the loss, through the metric that records it), short of
    # anything downstream of a gradient kernel.
    outputs = set(g.fetch) | {i for i, op in enumerate(g.ops) if op == "_Retval"}
    returned = ancestors(g, outputs, control=False, state=True)
    forward = ancestors(g, anchors, control=False) | ((returned & below) - tainted)
    all_updates = [i for i, op in enumerate(g.ops)
                   if g.data_inputs[i] and is_update_op(op)]
    feeding = ancestors(g, all_updates, control=False, state=True)
    # Backward: the gradient computation (downstream of a gradient kernel, or
    # feeding one, like the loss seed) -- not statistics updates such as
    # BatchNormalization's moving averages, which only feed their variables.
    gradient_side = tainted | ancestors(g, tainted, control=False)
    backward = ((below & feeding) - forward) & gradient_side
    return tuple(FORWARD if i in forward else BACKWARD if i in backward else OTHER
                 for i in range(len(g.names)))


def _gradient_sources(g: GraphIndex, anchors: Iterable[int]) -> set:
    """Gradient kernels and fused-loss backprop outputs (by op type)."""
    sources = set()
    for n, op in enumerate(g.ops):
        if is_gradient_op(op):
            sources.add(n)
        elif op in FUSED_LOSS_OPS:
            sources.update(c for c, _, port in g.consumers[n] if port == 1)
    return sources
