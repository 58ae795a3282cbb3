"""Sums TensorFlow adds in the order their terms arrive, as the verifier
sees them: which accumulators a graph has, the order it holds their
additions to, and their sum in a given order. Pure: nothing here imports
TensorFlow.

Grappler's accumulators (sntf.graph.accumulations): a TemporaryVariable
zeroed by an Assign, one AssignAdd (or AssignSub) per term, and a
DestroyTemporaryVariable whose output is the sum. TensorFlow adds the terms
in the order they arrive; sntf holds them to one order.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from sntf.graph import names
from sntf.graph.index import parse_input
from sntf.verify.core import Node, topological_order

# ---------------------------------------------------------------- order-dependent sums
# Grappler's accumulators (sntf.graph.accumulations): a TemporaryVariable
# zeroed by an Assign, one AssignAdd (or AssignSub) per term, and a
# DestroyTemporaryVariable whose output is the sum. TensorFlow adds the
# terms in the order they arrive; sntf holds them to one order.
ACCUMULATOR_VARIABLE = "TemporaryVariable"
ACCUMULATOR_SUM = "DestroyTemporaryVariable"
ACCUMULATOR_INIT = "Assign"
ACCUMULATOR_SIGNS = {"AssignAdd": 1, "AssignSub": -1}
# Ops whose output is their first input's ref.
_REF_FORWARDING = frozenset({"Assign", "AssignAdd", "AssignSub", "RefIdentity"})


@dataclasses.dataclass(frozen=True)
class Accumulator:
    """One accumulator of a graph and the order its additions are held to.

    Attributes:
      sum: the DestroyTemporaryVariable node whose output is the sum.
      tensor: that output ("sum:0").
      variable: the TemporaryVariable it adds into.
      init: the Assign that zeroes it ('' where there is none).
      init_value: the tensor that Assign writes ('' where there is none).
      updates: (update node, its op, the term it adds) for every addition,
        in the order the graph holds them to where `held`, else in
        topological order.
      held: whether edges hold every addition after the zeroing and after
        the addition before it, so the graph adds in one order only.
      why: where not held, what is left free.
    """

    sum: str
    tensor: str
    variable: str
    init: str
    init_value: str
    updates: tuple
    held: bool
    why: str = ""


def _ref_root(name: str, by_name: Mapping[str, Node]) -> str:
    """The node a ref input comes from, through the ops that pass it on."""
    for _ in range(len(by_name) + 1):
        node = by_name.get(name)
        if node is None or node.op not in _REF_FORWARDING or not node.inputs:
            return name
        source, _, control = parse_input(node.inputs[0])
        if control:
            return name
        name = source
    return name


def _waits_for(after: str, before: str, by_name: Mapping[str, Node],
               position: Mapping[str, int]) -> bool:
    """Whether a path of data or control edges leads from `before` to
    `after` (only nodes placed after `before` can be on it)."""
    floor = position.get(before, -1)
    seen, stack = {after}, [after]
    while stack:
        node = by_name.get(stack.pop())
        if node is None:
            continue
        for text in node.inputs:
            source = parse_input(text)[0]
            if source == before:
                return True
            if source not in seen and position.get(source, -1) > floor:
                seen.add(source)
                stack.append(source)
    return False


def accumulators(nodes: Sequence[Node]) -> dict:
    """The accumulators of a graph, with the order each adds its terms in.

    Args:
      nodes: the graph's nodes.

    Returns:
      sum node name -> Accumulator, for each DestroyTemporaryVariable whose
      variable two or more additions write.
    """
    by_name = {n.name: n for n in nodes}
    order = topological_order(nodes)
    position = {name: i for i, name in enumerate(order)}
    writers: dict = {}
    for n in nodes:
        if (n.op in ACCUMULATOR_SIGNS or n.op == ACCUMULATOR_INIT) and n.inputs:
            source, _, control = parse_input(n.inputs[0])
            if not control:
                writers.setdefault(_ref_root(source, by_name), []).append(n)
    out = {}
    for n in nodes:
        if n.op != ACCUMULATOR_SUM or not n.inputs:
            continue
        variable = _ref_root(parse_input(n.inputs[0])[0], by_name)
        if by_name.get(variable) is None or by_name[variable].op != ACCUMULATOR_VARIABLE:
            continue
        mine = writers.get(variable, [])
        updates = sorted((w for w in mine if w.op in ACCUMULATOR_SIGNS),
                         key=lambda w: position[w.name])
        if len(updates) < 2:
            continue
        inits = [w for w in mine if w.op == ACCUMULATOR_INIT]
        init = inits[0] if len(inits) == 1 else None
        why = ""
        if init is None:
            why = f"{len(inits)} zeroing Assign(s) of {variable}"
        else:
            loose = [u.name for u in updates
                     if not _waits_for(u.name, init.name, by_name, position)]
            if loose:
                why = f"addition {loose[0]} is not held after the zeroing {init.name}"
        if not why:
            for before, after in zip(updates, updates[1:]):
                if not _waits_for(after.name, before.name, by_name, position):
                    why = f"additions {before.name} and {after.name} may run in either order"
                    break
        out[n.name] = Accumulator(
            n.name, names.tensor_name(n.name, 0), variable, init.name if init else "",
            _data_input(init, 1) if init else "",
            tuple((u.name, u.op, _data_input(u, 1)) for u in updates), not why, why)
    return out


def _data_input(node: Node, slot: int) -> str:
    """A node's data input `slot` as "node:port" ('' where it has none)."""
    inputs = [parse_input(t) for t in node.inputs]
    data = [names.tensor_name(src, port) for src, port, control in inputs if not control]
    return data[slot] if slot < len(data) else ""


def _flushed(value: np.ndarray) -> np.ndarray:
    """TensorFlow's CPU threads run with denormals flushed to zero, on the
    way in and on the way out (port::ScopedFlushDenormal)."""
    if not np.issubdtype(value.dtype, np.floating):
        return value
    tiny = np.finfo(value.dtype).tiny
    return np.where(np.abs(value) < tiny, np.copysign(np.zeros_like(value), value), value)


def ordered_sum(init: np.ndarray, terms: Sequence[tuple]) -> np.ndarray:
    """What an accumulator holds after adding `terms` to `init` one by one,
    in the given order, elementwise in the tensors' own dtype.

    Args:
      init: the value the accumulator is zeroed with.
      terms: (sign, array) per addition: +1 for AssignAdd, -1 for AssignSub.

    Returns:
      The sum, as TensorFlow's CPU kernels compute it (IEEE addition,
      rounded to the dtype at each step, denormals flushed).
    """
    total = _flushed(np.array(init, copy=True))
    for sign, term in terms:
        term = _flushed(np.asarray(term, dtype=total.dtype))
        with np.errstate(all="ignore"):
            total = _flushed(total + term if sign > 0 else total - term)
    return total
