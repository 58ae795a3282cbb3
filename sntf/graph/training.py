"""Structural training detection.

Training graphs are recognized by the structure of reverse-mode
differentiation, never by node names (Grappler's CSE shares nodes between
`gradient_tape/` and forward scopes): a variable V is *trained* when some op F
consumes a value derived from V together with another activation x, and an op
G that also consumes x lies downstream of F and upstream of an update of V.
That G is the weight gradient (dW = x^T dy, Conv2DBackpropFilter(x, dy), a
sparse update keyed by the ids): a forward-only graph has no update of V
downstream of F, and a metrics update never depends on V's own read.

A step that writes its gradients into other variables (gradient
accumulation: `acc.assign_add(g)`, or any other write: AssignVariableOp, a
ResourceScatter*, an optimizer's apply op, through Identity ops or not)
trains V too, though V itself is not written there. The write alone does not
say so: an evaluation step's residual block (z = x + relu(x W)) meets the
same pattern on its way to a metric update. What a metric update never has is
reverse-mode differentiation upstream of G, so for such a write G must lie
downstream of a backward marker: a gradient kernel (ReluGrad,
Conv2DBackpropFilter, ...; a transposed convolution's forward
Conv2DBackpropInput is a weight user, not a marker), the gradient output of a
fused loss, or an input gradient dx = dy W^T (an op that reads a weight
together with a value derived from another op reading that same weight).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence

from sntf.graph import optable
from sntf.graph.index import GraphIndex, ancestors, descendants, memoized

# Ops that read a resource variable's value at input 0: where the variables
# that no op writes (the weights of a gradient-accumulation step) are found.
_VALUE_READ_OPS = frozenset({optable.READ_VARIABLE_OP, "ResourceGather",
                             "ResourceGatherNd"})


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
    while g.ops[node] in optable.HANDLE_FORWARDING_OPS and g.data_inputs[node] and seen < 64:
        node = g.data_inputs[node][0][0]
        seen += 1
    return node


def _readers_of(g: GraphIndex, root: int) -> list[int]:
    """The nodes that read the variable behind handle root `root`: every
    consumer that does not write it, through handle forwarding ops."""
    if g.ops[root] in optable.REF_VARIABLE_OPS:
        # A reference variable has no handle to forward: every consumer
        # that does not write it reads its value (`w/read`, or an op
        # taking the ref directly), at any input slot.
        return sorted({c for c, _, _ in g.consumers[root]
                       if not optable.is_update_op(g.ops[c])})
    readers = []
    stack, seen = [root], {root}
    while stack:
        h = stack.pop()
        for c, slot, _ in g.consumers[h]:
            if optable.is_update_op(g.ops[c]) or c in seen:
                continue
            if slot == 0 and g.ops[c] in optable.HANDLE_FORWARDING_OPS:
                seen.add(c)
                stack.append(c)
            elif slot == 0:
                seen.add(c)
                readers.append(c)
    return readers


def variable_access(g: GraphIndex) -> tuple[dict, dict]:
    """Updates and readers of every updated variable, keyed by handle root.

    Returns:
      (updates, readers): root -> update node indices, and root -> nodes that
      read the variable (ReadVariableOp, ResourceGather, ...), following the
      Identity ops that function inlining leaves on resource inputs.
    """
    updates = collections.defaultdict(list)
    for i, op in enumerate(g.ops):
        if g.data_inputs[i] and optable.is_update_op(op):
            updates[handle_root(g, g.data_inputs[i][0][0])].append(i)
    readers = collections.defaultdict(list)
    for root in updates:
        readers[root] = _readers_of(g, root)
    return updates, readers


def _variable_derived(g: GraphIndex, reads: Sequence[int]) -> set:
    """Nodes whose value is the variable itself: reads and pass-through ops."""
    derived = set(reads)
    stack = list(reads)
    while stack:
        i = stack.pop()
        for c, _, _ in g.consumers[i]:
            if c in derived or g.ops[c] not in optable.PASS_THROUGH_OPS:
                continue
            others = [p for p, _ in g.data_inputs[c]
                      if p not in derived and g.ops[p] not in optable.CONST_OPS]
            if not others:
                derived.add(c)
                stack.append(c)
    return derived


def weight_users(g: GraphIndex, handle: int, readers: Sequence[int]
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
                       if p not in derived and g.ops[p] not in optable.CONST_OPS
                       and handle_root(g, p) != handle}
        if activations and not optable.is_update_op(g.ops[f]):
            result.append((f, activations))
    return derived, result


def _gradient_of(g: GraphIndex, handle: int, readers: Sequence[int],
                 update_ancestors: set) -> Optional[int]:
    """Finds a weight-gradient op for the variable behind `handle`, or None."""
    _, users = weight_users(g, handle, readers)
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


@dataclasses.dataclass(frozen=True)
class GradientWrites:
    """Variables trained through a write of another variable (gradient
    accumulation), found by `gradient_writes`.

    Attributes:
      found: handle root -> (weight user F, weight gradient G, the root of a
        variable G's value is written into), for variables that no op of the
        graph writes, in the order detect_training examines them.
      readers: handle root -> reader nodes, for every variable read.
    """

    found: dict
    readers: dict


def gradient_writes(g: GraphIndex) -> GradientWrites:
    """Variables no op writes whose weight gradient is written elsewhere.

    A variable V qualifies when an op F combines V's value with an
    activation x, an op G that also consumes x lies downstream of F and
    upstream of some variable write, and G is in the backward pass:
    downstream of a backward marker (see the module docstring). Costs two
    sweeps of the graph however many variables it has; memoized per graph.

    Args:
      g: the graph index.

    Returns:
      A GradientWrites.
    """
    return memoized(g, "gradient_writes", _gradient_writes)


def _all_readers(g: GraphIndex) -> dict:
    """Handle root -> readers, for every variable that is read."""
    roots = set()
    for i, op in enumerate(g.ops):
        if op in _VALUE_READ_OPS and g.data_inputs[i]:
            roots.add(handle_root(g, g.data_inputs[i][0][0]))
        elif op in optable.REF_VARIABLE_OPS:
            roots.add(i)
    readers = {}
    for root in sorted(roots):
        found = _readers_of(g, root)
        if found:
            readers[root] = found
    return readers


def _gradient_writes(g: GraphIndex) -> GradientWrites:
    readers = _all_readers(g)
    update_nodes = [i for i, op in enumerate(g.ops)
                    if g.data_inputs[i] and optable.is_update_op(op)]
    if not update_nodes or not readers:
        return GradientWrites({}, readers)
    written = {handle_root(g, g.data_inputs[u][0][0]) for u in update_nodes}
    feeding = ancestors(g, update_nodes, control=False, state=True)
    # Every weight user that feeds a write, of any variable: the candidate
    # F's, and the evidence for input gradients dx = dy W^T.
    users_of = {}
    for root, nodes in readers.items():
        _, users = weight_users(g, root, nodes)
        users_of[root] = [(f, acts) for f, acts in users if f in feeding]
    bit, handles_of = {}, collections.defaultdict(set)
    for root, users in users_of.items():
        for f, _ in users:
            bit.setdefault(f, 1 << len(bit))
            handles_of[f].add(root)
    if not bit:
        return GradientWrites({}, readers)
    # mask[n]: the weight users n descends from (data edges), one topo sweep
    # over the nodes that feed a write (no other node can be a G).
    mask = {}
    for n in g.topo:
        if n not in feeding:
            continue
        m = bit.get(n, 0)
        for p, _ in g.data_inputs[n]:
            m |= mask.get(p, 0)
        mask[n] = m
    same_weight = {}
    for root, users in users_of.items():
        m = 0
        for f, _ in users:
            m |= bit[f]
        same_weight[root] = m
    markers = set()
    for root, users in users_of.items():
        for f, acts in users:
            # dx = dy W^T: reads W with a value derived from another op that
            # reads W (the forward F); a forward op's input never is.
            others = same_weight[root] & ~bit[f]
            if any(mask.get(x, 0) & others for x in acts):
                markers.add(f)
    forward_users = set(bit) - markers
    for n, op in enumerate(g.ops):
        if optable.is_gradient_op(op) and n not in forward_users:
            markers.add(n)
        elif op in optable.FUSED_LOSS_OPS:
            markers.update(c for c, _, port in g.consumers[n] if port == 1)
    if not markers:
        # No reverse-mode differentiation anywhere: an evaluation or
        # metrics step, whatever its residual blocks look like.
        return GradientWrites({}, readers)
    backward = descendants(g, markers, within=feeding)
    found = {}
    candidates = sorted((h for h in users_of if h not in written and users_of[h]),
                        key=lambda h: (-len(readers[h]), h))
    for root in candidates:
        for f, acts in users_of[root]:
            gop = next((c for x in sorted(acts) for c, _, _ in g.consumers[x]
                        if c != f and c in backward and mask[c] & bit[f]), None)
            if gop is not None:
                found[root] = (f, gop, _written_by(g, gop, feeding))
                break
    return GradientWrites(found, readers)


def _written_by(g: GraphIndex, node: int, feeding: set) -> int:
    """The handle root of the first variable write downstream of `node`."""
    for n in sorted(descendants(g, [node], within=feeding)):
        if optable.is_update_op(g.ops[n]) and g.data_inputs[n]:
            return handle_root(g, g.data_inputs[n][0][0])
    return node


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
    # Every one is examined where need be (each costs the ops near it): in a
    # deep network the optimizer's slots and the normalizations' statistics
    # can outnumber and out-read the weights.
    candidates = sorted((h for h in updates if readers[h]),
                        key=lambda h: (-len(readers[h]), h))
    for handle in candidates:
        gop = _gradient_of(g, handle, readers[handle], feeding)
        if gop is not None:
            return TrainingInfo(
                True, f"variable {g.names[handle]!r} is updated from a weight "
                f"gradient ({g.names[gop]!r})", (g.names[handle],),
                (g.names[gop],), len(updates))
    # Gradient accumulation: the weights are read, their gradients written
    # into other variables.
    accumulated = gradient_writes(g).found
    for handle, (_, gop, target) in accumulated.items():
        return TrainingInfo(
            True, f"variable {g.names[handle]!r} has a weight gradient "
            f"({g.names[gop]!r}) written into variable {g.names[target]!r}",
            (g.names[handle],), (g.names[gop],), len(updates))
    return TrainingInfo(False, f"{len(updates)} variable(s) updated, none from a "
                        "gradient (metrics or state updates only)",
                        updated_variables=len(updates))
