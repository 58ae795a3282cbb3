"""Structural training detection.

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
from typing import Optional, Sequence

from sntf.graph import optable
from sntf.graph.index import GraphIndex, ancestors, descendants

# Upper bound on variables examined by training detection, so that the pass
# stays fast on graphs with thousands of variables; the first few trained
# variables are found long before this.
MAX_VARIABLES_EXAMINED = 4096


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
        if g.ops[root] in optable.REF_VARIABLE_OPS:
            # A reference variable has no handle to forward: every consumer
            # that does not write it reads its value (`w/read`, or an op
            # taking the ref directly), at any input slot.
            readers[root] = sorted({c for c, _, _ in g.consumers[root]
                                    if not optable.is_update_op(g.ops[c])})
            continue
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
                    readers[root].append(c)
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
