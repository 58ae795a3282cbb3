"""A memory-aware order of a step, for the order edges to hold.

The planned peak is that of one order: the one TensorFlow's executor runs
with one inter-op thread (analysis.schedule). That order knows nothing of
memory. Where several ops are ready it takes them as its queues come, and
the backward pass of a normalization can hold three or four
activation-sized gradient terms, and a swapped-in input, at once, where
another order of the same ops would have summed and dropped some of them
first. The order edges (order.plan_sequence) can hold any topological
order, so the planner may offer them a better one: this module's list
schedule runs, among the ready ops, the one that leaves the fewest bytes
allocated after it (what it allocates less what it frees as the last reader
of a buffer), ties going to the executor's own order. The caller keeps it
where the graph, chained to it and analyzed, plans lower.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Optional

from sntf.analysis.memory import SCRATCH_PORT
from sntf.graph import optable


def memory_order(g, facts) -> Optional[object]:
    """The analysis `facts` of graph `g` with its schedule replaced by a
    memory-aware one, and its buffers' intervals moved with it.

    Args:
      g: the graph index (generated nodes included).
      facts: its analysis.

    Returns:
      An Analysis whose schedule and buffer_intervals follow the new order
      (its other fields are those of `facts`, for order.plan_sequence), or
      None for a graph with cycles, one where some op never becomes ready,
      or one the new order would not change.
    """
    if g.has_cycles:
        return None
    rank = {node: s for s, node in enumerate(facts.schedule)}
    last = len(facts.schedule) - 1
    readers = _buffer_readers(g, facts, last)
    reads = {}
    for buffer, nodes in readers.items():
        for node in nodes:
            reads.setdefault(node, []).append(buffer)
    kept = {}
    for buffer in readers:
        if buffer[1] != SCRATCH_PORT:
            kept[buffer[0]] = kept.get(buffer[0], 0) + facts.buffer_bytes.get(buffer, 0)
    order = _list_schedule(g, facts, rank, readers, reads, kept)
    if order is None or order == list(facts.schedule):
        return None
    step = {node: s for s, node in enumerate(order)}
    intervals = {}
    for buffer, (start, stop) in facts.buffer_intervals.items():
        alloc = step[facts.schedule[start]]
        ends = [step[r] for r in readers.get(buffer, ()) if r in step]
        intervals[buffer] = (alloc, last if stop >= last else max([alloc] + ends))
    return dataclasses.replace(facts, schedule=tuple(order), buffer_intervals=intervals)


def _buffer_readers(g, facts, last: int) -> dict:
    """Buffer -> the nodes that read a tensor living in it, for the buffers
    that die within the step (a buffer live at its end has no last reader)."""
    readers = {buffer: set() for buffer, (_, stop) in facts.buffer_intervals.items()
               if stop < last}
    for (node, port), buffer in facts.buffers.items():
        if buffer in readers:
            readers[buffer].update(c for c, _, p in g.consumers[node] if p == port)
    for buffer, nodes in readers.items():
        nodes.discard(buffer[0])
    return readers


def _list_schedule(g, facts, rank: dict, readers: dict, reads: dict,
                   kept: dict) -> Optional[list]:
    """Ready ops by least bytes left allocated, then executor order; None
    if some op never becomes ready."""
    # A loop's back edges (NextIteration -> Merge) are not waited for, as
    # in the executor's order (analysis.schedule).
    back = {n for n in rank if g.ops[n] in optable.NEXT_ITERATION_OPS}
    pending = {node: sum(1 for p in [p for p, _ in g.data_inputs[node]]
                         + list(g.control_inputs[node]) if p not in back)
               for node in rank}
    remaining = {buffer: set(nodes) for buffer, nodes in readers.items()}
    version = dict.fromkeys(rank, 0)

    def score(node: int) -> int:
        freed = sum(facts.buffer_bytes.get(b, 0) for b in reads.get(node, ())
                    if remaining[b] == {node})
        return kept.get(node, 0) - freed

    heap = [(score(n), rank[n], n, 0) for n, count in pending.items() if count == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, _, node, seen = heapq.heappop(heap)
        if seen != version[node] or pending[node] < 0:
            continue
        pending[node] = -1       # ran
        order.append(node)
        for buffer in reads.get(node, ()):
            left = remaining[buffer]
            left.discard(node)
            if len(left) == 1:
                (other,) = left
                if pending.get(other) == 0:
                    version[other] += 1
                    heapq.heappush(heap, (score(other), rank[other], other,
                                          version[other]))
        if node in back:
            continue
        for c in [c for c, _, _ in g.consumers[node]] + list(g.control_consumers[node]):
            if c in pending and pending[c] > 0:
                pending[c] -= 1
                if pending[c] == 0:
                    heapq.heappush(heap, (score(c), rank[c], c, version[c]))
    return order if len(order) == len(rank) else None
