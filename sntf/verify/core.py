"""The verifier's pure parts: which tensors correspond, in which order and
in which chunks (the result and its text: sntf.verify.result).

Nothing here imports TensorFlow. The graphs come in as `Node` values (a
NodeDef's name, op, inputs, sntf role, and the dtype name of each output
port, which only TensorFlow's op registry knows: the caller reads them
from the imported graph), so the tests build them by hand.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from sntf.graph import names
from sntf.graph.index import parse_input

# Kinds of compared pairs, in the order they sort at one original node.
TENSOR, CLONE, SWAP_OUT, SWAP_IN = "tensor", "clone", "swap_out", "swap_in"
KINDS = (TENSOR, CLONE, SWAP_OUT, SWAP_IN)

IDENTICAL, DIFFERENT, NONDETERMINISTIC = "identical", "different", "nondeterministic"
# Every tensor the same from identical inputs, but for sums TensorFlow adds
# in the order their terms arrive, which the rewritten graph adds, from the
# same terms, in one order it holds.
IDENTICAL_UP_TO_SUM_ORDER = "identical_up_to_sum_order"
VERDICTS = (IDENTICAL, IDENTICAL_UP_TO_SUM_ORDER, DIFFERENT, NONDETERMINISTIC)
# The verdicts under which the rewrite computes what TensorFlow's step does.
SAME_RESULTS = (IDENTICAL, IDENTICAL_UP_TO_SUM_ORDER)

# Why an output is not compared (the counts the result reports).
SKIP_REF, SKIP_RESOURCE, SKIP_VARIANT = "ref", "resource", "variant"
SKIP_CONTROL_FLOW = "in a loop or a conditional branch"

# Ops whose value lives on after them in a ref they write: the first
# differing op's ref inputs are shown through these writers' values.
REF_WRITERS = frozenset({"Assign", "AssignAdd", "AssignSub", "ScatterAdd", "ScatterSub",
                         "ScatterUpdate", "ScatterMul", "ScatterDiv"})
# Ops that start a region whose tensors may be dead or live in a loop
# frame, and the ops that end it: a Session cannot fetch such tensors.
REGION_STARTS = frozenset({"Switch", "RefSwitch", "Enter", "RefEnter"})
REGION_ENDS = frozenset({"Merge", "RefMerge", "Exit", "RefExit"})

DIGEST_CHARS = 16


@dataclasses.dataclass(frozen=True)
class Node:
    """What the correspondence needs of one NodeDef.

    Attributes:
      name: the node's name.
      op: its op type.
      inputs: its NodeDef inputs ("x", "x:1", "^x").
      role: its sntf role (sntf.graph.names.role_of), '' for nodes sntf did
        not create.
      outputs: the dtype name of each output port as TensorFlow names it
        ("float32", "resource", "variant", "float32_ref").
    """

    name: str
    op: str
    inputs: tuple = ()
    role: str = ""
    outputs: tuple = ()


@dataclasses.dataclass(frozen=True)
class Pair:
    """One tensor of the original graph and the rewritten tensor that must
    hold the same bits.

    Attributes:
      kind: TENSOR (same node name and port in both graphs), CLONE (a
        recomputed clone against its source), SWAP_OUT (a swap-out's parked
        copy against the tensor it parks), SWAP_IN (a swapped-in tensor
        against the tensor that was swapped out).
      original: "node:port" in the original graph.
      rewritten: "node:port" in the rewritten graph.
      op: the rewritten node's op type (the op a difference is reported on).
      position: the original node's place in the original graph's
        topological order.
    """

    kind: str
    original: str
    rewritten: str
    op: str
    position: int

    @property
    def node(self) -> str:
        """The rewritten node whose output this pair compares."""
        return names.split_tensor(self.rewritten)[0]


@dataclasses.dataclass(frozen=True)
class Correspondence:
    """The pairs to compare, in the original graph's order, and what was left
    out.

    Attributes:
      pairs: the pairs, sorted by (position, kind, rewritten name).
      skipped: reason -> number of original outputs not compared for it.
      original_only: outputs of original nodes that the rewritten graph
        lacks (comparable ones only).
      rewritten_only: comparable outputs of rewritten nodes that match no
        original tensor (the rewrite's own: a cache ticket, for example).
    """

    pairs: tuple
    skipped: dict
    original_only: int
    rewritten_only: int


def comparable(dtype: str) -> Optional[str]:
    """Why an output of this dtype is not fetched and compared, or None when
    it is: ref outputs (a TemporaryVariable's, an AssignAdd's), resource
    handles and variants have no bytes a Session hands back."""
    if dtype.endswith("_ref"):
        return SKIP_REF
    if dtype == "resource":
        return SKIP_RESOURCE
    if dtype == "variant":
        return SKIP_VARIANT
    return None


def topological_order(nodes: Sequence[Node]) -> list:
    """The node names in a topological order of their data and control
    edges, ties broken by the order the nodes are given in (the GraphDef's).

    A loop's NextIteration -> Merge edge is a back edge and not counted, as
    TensorFlow's executor does not wait on it; nodes left on any other
    cycle, and inputs from nodes the graph does not have, do not stop the
    order: such nodes follow in their given order.

    Args:
      nodes: the graph's nodes.

    Returns:
      Every node name once.
    """
    import heapq

    rank = {n.name: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    waiting = [0] * len(nodes)
    readers: list = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        for text in n.inputs:
            src = parse_input(text)[0]
            j = rank.get(src)
            if j is None or by_name[src].op in ("NextIteration", "RefNextIteration"):
                continue
            waiting[i] += 1
            readers[j].append(i)
    ready = [i for i in range(len(nodes)) if waiting[i] == 0]
    heapq.heapify(ready)
    order, placed = [], [False] * len(nodes)
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i].name)
        placed[i] = True
        for k in readers[i]:
            waiting[k] -= 1
            if waiting[k] == 0:
                heapq.heappush(ready, k)
    order.extend(n.name for i, n in enumerate(nodes) if not placed[i])
    return order


def control_flow_nodes(nodes: Sequence[Node]) -> set:
    """Nodes whose outputs may be dead or live in a loop frame: those
    reached from a Switch or an Enter (through data or control edges) before
    a Merge or an Exit. A Session cannot fetch their tensors as a whole
    step's value.

    Args:
      nodes: the graph's nodes.

    Returns:
      Their names (the Merge and Exit nodes themselves are not among them).
    """
    readers: dict = {}
    for n in nodes:
        for text in n.inputs:
            readers.setdefault(parse_input(text)[0], []).append(n)
    inside: set = set()
    stack = [n for n in nodes if n.op in REGION_STARTS]
    for n in stack:
        inside.add(n.name)
    while stack:
        n = stack.pop()
        for reader in readers.get(n.name, ()):
            if reader.op in REGION_ENDS or reader.name in inside:
                continue
            inside.add(reader.name)
            stack.append(reader)
    return inside


def origin(tensor: str, rewritten: Mapping[str, Node],
           original: Mapping[str, Node]) -> Optional[tuple]:
    """The original tensor a rewritten tensor must equal, with the kind of
    the match; None for the rewrite's own tensors.

    A recomputed clone equals its source's output; a swap-in (or a
    swap-out's parked copy) equals the tensor it serves, which may itself
    be a clone's output in a graph both recomputed and swapped.

    Args:
      tensor: "node:port" in the rewritten graph.
      rewritten, original: name -> Node of each graph.

    Returns:
      ("node:port" in the original graph, kind), or None.
    """
    node, port = names.split_tensor(tensor)
    kind = None
    for _ in range(len(rewritten) + 1):      # a chain of clones and swaps ends
        n = rewritten.get(node)
        if n is not None and n.role == names.ROLE_RECOMPUTE:
            node, kind = names.recompute_source(node), kind or CLONE
        elif n is not None and n.op in (names.SWAP_IN_OP, names.CACHE_IN_OP,
                                        names.SWAP_OUT_OP):
            served = names.swap_source(node)
            if served is None:
                return None
            node, port = served
            kind = kind or (SWAP_OUT if n.op == names.SWAP_OUT_OP else SWAP_IN)
        elif n is not None and (n.role or n.op == names.CACHE_OUT_OP):
            return None                       # a ticket, a marker: the rewrite's own
        else:
            if node not in original:
                return None
            return names.tensor_name(node, port), kind or TENSOR
    return None


def correspond(original: Sequence[Node], rewritten: Sequence[Node]) -> Correspondence:
    """Every pair of tensors that must hold the same bits, in the original
    graph's topological order.

    Each output both graphs compute (same node name and port) is paired;
    so is each recomputed clone's output with its source's, and each
    swap-in's output (and each SnSwapOut's parked copy) with the tensor it
    serves. Outputs that are refs, resources or variants, or that lie in a
    loop or a conditional branch, are counted in `skipped` instead.

    Args:
      original: the original graph's nodes (Node.outputs filled in).
      rewritten: the rewritten graph's nodes.

    Returns:
      A Correspondence.
    """
    orig = {n.name: n for n in original}
    rew = {n.name: n for n in rewritten}
    position = {name: i for i, name in enumerate(topological_order(original))}
    flow = control_flow_nodes(original) | control_flow_nodes(rewritten)
    skipped: dict = {}
    seen_original: set = set()
    pairs = []
    rewritten_only = 0
    for n in rewritten:
        for port, dtype in enumerate(n.outputs):
            if comparable(dtype) is not None:
                continue
            tensor = names.tensor_name(n.name, port)
            found = origin(tensor, rew, orig)
            if found is None:
                rewritten_only += 1
                continue
            source, kind = found
            node, source_port = names.split_tensor(source)
            outputs = orig[node].outputs
            if source_port >= len(outputs) or comparable(outputs[source_port]) is not None:
                rewritten_only += 1
                continue
            if n.name in flow or node in flow:
                continue
            if kind == TENSOR:
                seen_original.add(source)
            pairs.append(Pair(kind, source, tensor, n.op, position[node]))
    original_only = 0
    for n in original:
        for port, dtype in enumerate(n.outputs):
            why = comparable(dtype)
            if why is None and n.name in flow:
                why = SKIP_CONTROL_FLOW
            if why is not None:
                skipped[why] = skipped.get(why, 0) + 1
            elif names.tensor_name(n.name, port) not in seen_original:
                original_only += 1
    pairs.sort(key=lambda p: (p.position, KINDS.index(p.kind), p.rewritten))
    return Correspondence(tuple(pairs), skipped, original_only, rewritten_only)


def chunk_pairs(pairs: Sequence[Pair], sizes: Mapping[str, Optional[int]],
                max_bytes: int, unknown_bytes: Optional[int] = None) -> list:
    """Splits the pairs, in order, into chunks whose fetched bytes stay
    within `max_bytes` on each side.

    A chunk's cost on a side is the sum of the sizes of the distinct tensors
    it fetches there (a source compared with its clone and with itself is
    fetched once). A tensor larger than `max_bytes` gets a chunk of its own.

    Args:
      pairs: the pairs, in order.
      sizes: "node:port" (of either graph) -> bytes, or None where unknown.
      max_bytes: the most bytes a chunk may fetch from one graph, > 0.
      unknown_bytes: the size assumed for a tensor of unknown size (default:
        the largest known size, else max_bytes).

    Returns:
      A list of lists of pairs; their concatenation is `pairs`.

    Raises:
      ValueError: max_bytes is not a positive int.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)) \
            or max_bytes <= 0:
        raise ValueError(f"sntf.verify: max_chunk_bytes must be a positive number of "
                         f"bytes, got {max_bytes!r}")
    if unknown_bytes is None:
        known = [s for s in sizes.values() if s is not None]
        unknown_bytes = max(known) if known else max_bytes

    def size(tensor: str) -> int:
        value = sizes.get(tensor)
        return unknown_bytes if value is None else int(value)

    chunks: list = []
    current: list = []
    fetched: tuple = (set(), set())
    used = [0, 0]
    for pair in pairs:
        extra = [0 if pair.original in fetched[0] else size(pair.original),
                 0 if pair.rewritten in fetched[1] else size(pair.rewritten)]
        if current and (used[0] + extra[0] > max_bytes or used[1] + extra[1] > max_bytes):
            chunks.append(current)
            current, fetched, used = [], (set(), set()), [0, 0]
            extra = [size(pair.original), size(pair.rewritten)]
        current.append(pair)
        fetched[0].add(pair.original)
        fetched[1].add(pair.rewritten)
        used = [used[0] + extra[0], used[1] + extra[1]]
    if current:
        chunks.append(current)
    return chunks


def digest(value) -> bytes:
    """sha256 of a fetched value's dtype, shape and bytes (32 bytes).

    The dtype and shape are hashed too, so that a tensor of other shape or
    type with the same bytes differs. Strings are hashed element by element
    with their lengths.

    Args:
      value: a numpy array or scalar, as Session.run returns it.

    Returns:
      The digest.
    """
    array = np.asarray(value)
    h = hashlib.sha256()
    h.update(f"{array.dtype.str}{array.shape}".encode())
    if array.dtype == object:
        for item in array.reshape(-1):
            data = item if isinstance(item, bytes) else str(item).encode()
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
    else:
        h.update(memoryview(np.ascontiguousarray(array)).cast("B"))
    return h.digest()


def first_difference(pairs: Iterable[Pair], original: Mapping[str, bytes],
                     rewritten: Mapping[str, bytes]) -> Optional[Pair]:
    """The first pair whose digests differ, or None.

    Args:
      pairs: the pairs, in order.
      original, rewritten: tensor name -> digest of each graph's run.

    Returns:
      The pair, or None when all are equal.
    """
    for pair in pairs:
        if original[pair.original] != rewritten[pair.rewritten]:
            return pair
    return None
