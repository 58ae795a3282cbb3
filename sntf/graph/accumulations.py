"""Sums whose bits depend on the order the executor runs the step.

Floating-point addition is not associative, and TensorFlow computes two
kinds of gradient sums in an order decided at run time:

- **Accumulators.** Grappler's memory optimizer (`SchedulingPass`,
  `grappler/optimizers/memory_optimizer.cc`) turns an AddN of three or more
  large inputs into a `TemporaryVariable`, an `Assign` of zeros, one
  `AssignAdd` per input and a `DestroyTemporaryVariable`. Nothing orders the
  `AssignAdd`s: they add in the order their inputs arrive.
- **AddN.** TensorFlow's CPU AddN kernel (`kernels/aggregate_ops.h`) writes
  into the first input it can forward (the executor holds the only
  reference to it: the AddN is its last reader) and moves that input to the
  front of the sum. Which input that is depends on whether the AddN runs
  before or after the other readers of each input.

With one inter-op thread the executor decides both the same way in every
run; with the thread pool, or after a rewrite that moves any of the readers,
they change, and so does the gradient. This module finds the decisions and
the control edges that make a rewritten graph take each of them as a given
order of the original graph does.

Pure functions over GraphIndex values; nothing here runs TensorFlow.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence

from sntf.graph import optable
from sntf.graph.index import GraphIndex

# Updates that add into their target: the sum depends on the order of two
# of them. (An overwrite such as Assign is ordered by its readers; these
# are not.)
ACCUMULATING_OPS = frozenset({
    "AssignAdd", "AssignSub", "AssignAddVariableOp", "AssignSubVariableOp",
    "ScatterAdd", "ScatterSub", "ScatterNdAdd", "ScatterNdSub",
    "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterNdAdd",
    "ResourceScatterNdSub",
})
# Ops whose output is their first input's variable (a ref or a handle):
# an AssignAdd into `Assign(tmp, zeros)` adds into `tmp`.
TARGET_FORWARDING_OPS = optable.HANDLE_FORWARDING_OPS | frozenset({
    "Assign", "RefIdentity", "AssignAdd", "AssignSub",
})
# Sums whose kernel moves its first forwardable input to the front.
FORWARDING_SUM_OPS = frozenset({"AddN"})
# Below three inputs the order is a + b or b + a, which IEEE addition
# computes alike.
MIN_REORDERED_INPUTS = 3
# Producers whose buffer someone else holds for the whole step: a variable's
# value, a constant, an argument of the function. Never forwarded.
HELD_BUFFER_OPS = (optable.CONST_OPS | optable.REF_VARIABLE_OPS
                   | frozenset({optable.READ_VARIABLE_OP, "_Arg", "Placeholder",
                                "VarHandleOp", "DestroyTemporaryVariable"}))
MAX_FORWARDING = 64   # a chain of views longer than this is not followed further


@dataclasses.dataclass(frozen=True)
class Pin:
    """One control edge a rewritten graph needs: `after` waits for `before`.

    Attributes:
      before, after: node names.
      sum_node: the node whose sum the edge keeps in order.
    """

    before: str
    after: str
    sum_node: str


def target_root(g: GraphIndex, node: int) -> int:
    """The variable an update's first input designates, through the ops
    that pass a ref or a handle on.

    Args:
      g: the graph index.
      node: an update op's index.

    Returns:
      The index of the node the target comes from.
    """
    root = g.data_inputs[node][0][0]
    for _ in range(MAX_FORWARDING):
        if g.ops[root] not in TARGET_FORWARDING_OPS or not g.data_inputs[root]:
            break
        root = g.data_inputs[root][0][0]
    return root


def accumulation_groups(g: GraphIndex) -> list[tuple[int, ...]]:
    """Groups of two or more accumulating updates of one variable.

    Args:
      g: the graph index.

    Returns:
      One tuple of node indices per variable that two or more accumulating
      updates write, in graph order.
    """
    groups = collections.defaultdict(list)
    for i, op in enumerate(g.ops):
        if op in ACCUMULATING_OPS and g.data_inputs[i]:
            groups[target_root(g, i)].append(i)
    return [tuple(members) for members in groups.values() if len(members) > 1]


def reordering_sums(g: GraphIndex) -> list[int]:
    """The AddN nodes whose kernel may reorder their inputs (three or more).

    Args:
      g: the graph index.

    Returns:
      Node indices in graph order.
    """
    return [i for i, op in enumerate(g.ops)
            if op in FORWARDING_SUM_OPS and len(g.data_inputs[i]) >= MIN_REORDERED_INPUTS]


def _buffer_root(g: GraphIndex, tensor: tuple[int, int]) -> tuple[int, int]:
    """The tensor whose buffer `tensor` is a view of (itself if none)."""
    for _ in range(MAX_FORWARDING):
        node, port = tensor
        if g.ops[node] not in optable.ALIAS_OPS or not g.data_inputs[node] or port != 0:
            break
        tensor = g.data_inputs[node][0]
    return tensor


def _holders(g: GraphIndex, root: tuple[int, int]) -> set[int]:
    """Every node that reads the buffer of `root`: readers of the tensor and
    of every view of it, the views themselves included."""
    holders, stack = set(), [root]
    while stack:
        node, port = stack.pop()
        for c, _, p in g.consumers[node]:
            if p != port or c in holders:
                continue
            holders.add(c)
            if g.ops[c] in optable.ALIAS_OPS:
                stack.append((c, 0))
    return holders


def _never_forwarded(g: GraphIndex, node: int, slot: int) -> bool:
    """Whether the sum at `node` can never forward its input `slot`: the
    buffer is not the step's own (a variable's value, a constant, an
    argument), or the sum reads the tensor more than once."""
    tensor = g.data_inputs[node][slot]
    if sum(1 for t in g.data_inputs[node] if t == tensor) > 1:
        return True
    root = _buffer_root(g, tensor)
    return g.ops[root[0]] in HELD_BUFFER_OPS or g.ops[root[0]] in optable.ALIAS_OPS


def _other_holders(g: GraphIndex, node: int, slot: int) -> list[int]:
    """The nodes besides the sum at `node` that hold input `slot`'s buffer."""
    root = _buffer_root(g, g.data_inputs[node][slot])
    return [h for h in _holders(g, root) if h != node]


def _forwardable(g: GraphIndex, node: int, slot: int, ran_before) -> bool:
    """Whether the sum at `node` can forward its input `slot`: it may ever,
    and every other holder of the buffer has run before it
    (`ran_before(holder)`)."""
    if _never_forwarded(g, node, slot):
        return False
    return all(ran_before(h) for h in _other_holders(g, node, slot))


def forwarded_slot(g: GraphIndex, node: int, order: Sequence[int]) -> Optional[int]:
    """The input a sum's kernel forwards when the step runs in `order`.

    Args:
      g: the graph index.
      node: an AddN node.
      order: node indices in execution order.

    Returns:
      The first forwardable input slot, or None when there is none.
    """
    return _forwarded_slot(g, node, {n: k for k, n in enumerate(order)})


def _forwarded_slot(g: GraphIndex, node: int, position: dict) -> Optional[int]:
    """forwarded_slot, with `position` (node -> step) built once by the caller."""
    mine = position.get(node, len(position))
    ran_before = lambda h: position.get(h, len(position) + 1) < mine  # noqa: E731
    for slot in range(len(g.data_inputs[node])):
        if _forwardable(g, node, slot, ran_before):
            return slot
    return None


def _reaches(g: GraphIndex, source: int, target: int) -> bool:
    """Whether a path of data or control edges runs from source to target."""
    seen, stack = {target}, [target]
    while stack:
        i = stack.pop()
        for p in [p for p, _ in g.data_inputs[i]] + list(g.control_inputs[i]):
            if p == source:
                return True
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return False


def accumulation_pins(g: GraphIndex, order: Sequence[int]) -> list[Pin]:
    """Edges that chain every accumulation in `order`.

    Args:
      g: the graph index (original and rewritten graph alike: the rewrite
        keeps the names of the updates).
      order: node indices of `g` in execution order.

    Returns:
      The pins; a pair the graph already orders by a path is left out.
    """
    position = {node: step for step, node in enumerate(order)}
    pins = []
    for group in accumulation_groups(g):
        ranked = sorted(group, key=lambda i: (position.get(i, len(position)), i))
        for before, after in zip(ranked, ranked[1:]):
            if not _reaches(g, before, after):
                pins.append(Pin(g.names[before], g.names[after],
                                g.names[target_root(g, after)]))
    return pins


def sum_pins(original: GraphIndex, order: Sequence[int],
             rewritten: GraphIndex) -> tuple[list[Pin], list[str]]:
    """Edges that make each reordering sum of a rewritten graph forward the
    input it forwards in the original graph run in `order`.

    The forwarded input's other holders must run before the sum; each
    earlier input must keep a holder that runs after it.

    Args:
      original: the original graph's index.
      order: its node indices in execution order.
      rewritten: the rewritten graph's index.

    Returns:
      (pins, sums that no edge can hold to the original's choice: an earlier
      input the rewrite made forwardable with no holder left to wait).
    """
    position = {n: k for k, n in enumerate(order)}
    pins, lost = [], []
    for node in reordering_sums(original):
        name = original.names[node]
        if name not in rewritten.index:
            continue
        chosen = _forwarded_slot(original, node, position)
        mine = position.get(node, len(position))
        later = {original.names[h] for slot in range(len(original.data_inputs[node]))
                 for h in _other_holders(original, node, slot)
                 if position.get(h, -1) > mine}
        new = rewritten.index[name]
        for slot in range(len(rewritten.data_inputs[new])):
            holders = _other_holders(rewritten, new, slot)
            if slot == chosen:
                pins += [Pin(rewritten.names[h], name, name) for h in holders]
                break
            if _never_forwarded(rewritten, new, slot):
                continue
            waiting = [h for h in holders if rewritten.names[h] in later]
            if not waiting:
                lost.append(name)
                break
            pins.append(Pin(name, rewritten.names[waiting[0]], name))
    return pins, lost
