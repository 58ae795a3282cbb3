"""The verifier's check of sums TensorFlow adds in the order their terms
arrive (Grappler's accumulators: sntf.verify.sums), from identical inputs.

Both graphs are run again "settled" (settle()): once an accumulator's
additions are done, it copies its own sum aside and is set to the
original's sum, in its own buffer, before its DestroyTemporaryVariable
hands it on. Every tensor after it then comes from identical inputs, and
the accumulator's own sum can be checked against its terms.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import numpy as np

from sntf.verify import core, sums
from sntf.verify.session import PREFIX

# The nodes settle() adds per sum, under PREFIX.
SETTLED_VALUE, SETTLED_OWN, SETTLED_SET = "value", "own", "set"


def settled_value(sum_node: str) -> str:
    """The tensor settle() feeds a sum's value through."""
    return f"{PREFIX}/{SETTLED_VALUE}/{sum_node}:0"


def settled_own(sum_node: str) -> str:
    """The tensor that holds a settled sum's own value, before it is set."""
    return f"{PREFIX}/{SETTLED_OWN}/{sum_node}:0"


def settle(graph_def, accumulated: Sequence[sums.Accumulator]):
    """A copy of a graph in which each accumulator, once its additions are
    done, copies its own sum aside (`settled_own`) and is then set to a
    value fed through `settled_value`, before its DestroyTemporaryVariable
    hands the sum on.

    The sum's readers then read that value in the variable's own buffer,
    as they read the sum: a fed tensor itself is never handed over for
    in-place reuse, and an AddN among its readers would forward, and so
    add in, another order (sntf.graph.accumulations).

    Args:
      graph_def: the graph (a function body).
      accumulated: its accumulators.

    Returns:
      The new GraphDef.
    """
    from tensorflow.core.framework import graph_pb2

    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    nodes = {n.name: n for n in out.node}
    for acc in accumulated:
        destroy = nodes[acc.sum]
        ref = next(t for t in destroy.input if not t.startswith("^"))
        dtype = destroy.attr["T"].type
        value = out.node.add(name=f"{PREFIX}/{SETTLED_VALUE}/{acc.sum}", op="Placeholder",
                             device=destroy.device)
        value.attr["dtype"].type = dtype
        own = out.node.add(name=f"{PREFIX}/{SETTLED_OWN}/{acc.sum}", op="DeepCopy",
                           device=destroy.device,
                           input=[ref] + [f"^{u}" for u, _, _ in acc.updates])
        own.attr["T"].type = dtype
        assign = out.node.add(name=f"{PREFIX}/{SETTLED_SET}/{acc.sum}", op="Assign",
                              device=destroy.device,
                              input=[ref, value.name, f"^{own.name}"])
        assign.attr["T"].type = dtype
        assign.attr["use_locking"].b = True
        assign.attr["validate_shape"].b = True
        destroy.input.append(f"^{assign.name}")
    return out


def paired_accumulators(o_nodes: list, r_nodes: list, match: core.Correspondence) -> list:
    """(original, rewritten) Accumulator of every sum both graphs compute
    as a comparable tensor outside loops and branches, in the original
    graph's order."""
    original, rewritten = sums.accumulators(o_nodes), sums.accumulators(r_nodes)
    paired = {p.original for p in match.pairs if p.kind == core.TENSOR}
    position = {p.original: p.position for p in match.pairs}
    out = [(original[name], acc) for name, acc in rewritten.items()
           if name in original and acc.tensor in paired]
    return sorted(out, key=lambda pair: position[pair[0].tensor])


@dataclasses.dataclass(frozen=True)
class SumCheck:
    """What the check of one sum found.

    Attributes:
      sum: the sum node.
      same_terms: whether the rewritten graph adds the original's terms,
        bit for bit, in one order it holds, and adding them in that order
        gives its bits.
      reordered: whether its bits differ from the original's all the same.
      why: where not same_terms, why not.
      digests: (original, rewritten) digests of the sum.
    """

    sum: str
    same_terms: bool
    reordered: bool
    why: str
    digests: tuple


def check_sums(runs: tuple, accumulated: list, feeds: Mapping[str, np.ndarray],
               sizes: Mapping[str, Optional[int]], chunk_bytes: int) -> list:
    """Checks each accumulator from identical inputs: its terms are the
    original's, bit for bit; and added in the order the rewritten graph
    holds, from its zeroed value, they give the rewritten graph's sum
    exactly. An addition that runs before the zeroing, or out of the held
    order, fails the second.

    Args:
      runs: the settled graphs' GraphRuns (original, rewritten).
      accumulated: (original, rewritten) Accumulator pairs, in order.
      feeds: settled_value(sum) -> the original's sum, for every sum.
      sizes: "node:port" -> bytes (None where unknown).
      chunk_bytes: the most bytes of values one run fetches from a graph.

    Returns:
      A SumCheck per accumulator, in order.
    """
    first, second = runs
    out = []
    for group in _sum_groups(accumulated, sizes, chunk_bytes):
        fetch = ([], [])
        for o_acc, r_acc in group:
            for side, acc in ((0, o_acc), (1, r_acc)):
                fetch[side].extend([t for t in (acc.init_value,) if t]
                                   + [term for _, _, term in acc.updates]
                                   + [settled_own(acc.sum)])
        o_fetch, r_fetch = (list(dict.fromkeys(f)) for f in fetch)
        o_digests = dict(zip(o_fetch, first.run(o_fetch, feeds=feeds)[0]))
        r_values = dict(zip(r_fetch, second.values(r_fetch, feeds)))
        for o_acc, r_acc in group:
            out.append(_check_sum(o_acc, r_acc, o_digests, r_values))
        del r_values
    return out


def _check_sum(o_acc: sums.Accumulator, r_acc: sums.Accumulator, o_digests: dict,
               r_values: dict) -> SumCheck:
    """check_sums for one accumulator, from the fetched values."""
    o_final = o_digests[settled_own(o_acc.sum)]
    r_final = r_values[settled_own(r_acc.sum)]
    digests = (o_final.hex(), core.digest(r_final).hex())

    def failed(why: str) -> SumCheck:
        return SumCheck(r_acc.sum, False, o_final != core.digest(r_final), why, digests)

    if not r_acc.held:
        return failed(f"its additions are not held to one order: {r_acc.why}")
    o_terms = {name: (op, term) for name, op, term in o_acc.updates}
    r_terms = {name: (op, term) for name, op, term in r_acc.updates}
    if set(o_terms) != set(r_terms):
        extra = sorted(set(o_terms) ^ set(r_terms))
        return failed(f"the graphs add other terms ({', '.join(extra[:4])})")
    if not o_acc.init_value or o_digests[o_acc.init_value] != core.digest(
            r_values[r_acc.init_value]):
        return failed(f"its zeroing {r_acc.init} writes another value")
    for name, (op, term) in r_terms.items():
        if op != o_terms[name][0]:
            return failed(f"{name} is {op} here, {o_terms[name][0]} in the original")
        if o_digests[o_terms[name][1]] != core.digest(r_values[term]):
            return failed(f"{name} adds other bits ({o_terms[name][1]} | {term})")
    expected = sums.ordered_sum(r_values[r_acc.init_value], [
        (sums.ACCUMULATOR_SIGNS[op], r_values[term]) for _, op, term in r_acc.updates])
    if core.digest(expected) != core.digest(r_final):
        return failed("its terms, added in the order the rewritten graph holds them, "
                      "give other bits than it computed (an addition ran outside that "
                      "order, or before the zeroing)")
    return SumCheck(r_acc.sum, True, o_final != core.digest(r_final), "", digests)


def _sum_groups(accumulated: list, sizes: Mapping[str, Optional[int]],
                chunk_bytes: int) -> list:
    """The accumulators in groups whose fetched values (terms, zeroed value
    and sum) stay within chunk_bytes, one accumulator at least per group."""
    groups, current, used = [], [], 0
    for o_acc, r_acc in accumulated:
        cost = (len(r_acc.updates) + 2) * (sizes.get(r_acc.tensor) or 0)
        if current and used + cost > chunk_bytes:
            groups.append(current)
            current, used = [], 0
        current.append((o_acc, r_acc))
        used += cost
    if current:
        groups.append(current)
    return groups
