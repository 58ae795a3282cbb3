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
of a buffer), ties going to the executor's own order; then moves blocks of
ops across the peak of that order while the peak falls (_refined), which
the greedy choice cannot see. The caller keeps it where the graph, chained
to it and analyzed, plans lower.

Where ready ops run side by side (TensorFlow's default inter-op pool),
both keep every op that the analysis has take over a buffer (a forwarding
kernel, a variable adopting its value: order.takeovers) after the buffer's
other readers, as in the order the analysis placed the buffers in, so that
the order edges hold it there: run before one of them, the kernel makes a
buffer of its own that the plan never counted. One inter-op thread runs the
ops the edges leave free where the analysis' emulation of the executor
puts them, and the chained graph is analyzed in that order.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Optional

from sntf.analysis.memory import SCRATCH_PORT
from sntf.graph import optable
from sntf.planner.order import takeovers


def memory_orders(g, facts, hold_takeovers: bool = True) -> tuple:
    """The analysis `facts` of graph `g` with its schedule replaced by each
    memory-aware order, and its buffers' intervals moved with it: the list
    schedule refined at its peak (_refined), then the list schedule itself
    where the refinement moved it. The refinement lowers the peak of live
    bytes; the allocator's chunks need not follow, so the caller chains the
    graph to each and keeps the lowest.

    Args:
      g: the graph index (generated nodes included).
      facts: its analysis.
      hold_takeovers: keep each op that takes a buffer over after the
        buffer's other readers (order.takeovers).

    Returns:
      Analyses whose schedule and buffer_intervals follow each order (their
      other fields are those of `facts`, for order.plan_sequence); none for
      a graph with cycles or one where some op never becomes ready, and
      none that is the executor's order.
    """
    if g.has_cycles:
        return ()
    last = len(facts.schedule) - 1
    readers = _readers(g, facts)
    dying = _dying(facts, readers, last)
    links = _Links(g, facts, hold_takeovers)
    greedy = _greedy(g, facts, dying, links)
    if greedy is None:
        return ()
    orders = []
    for order in (_refined(g, facts, greedy, last, readers, links), greedy):
        if order != list(facts.schedule) and order not in orders:
            orders.append(order)
    return tuple(_reordered(facts, order, dying, last) for order in orders)


def _reordered(facts, order: list, dying: dict, last: int):
    """`facts` with `order` as its schedule and each buffer's interval from
    its allocating op to its last reader in that order."""
    step = {node: s for s, node in enumerate(order)}
    intervals = {}
    for buffer, (start, stop) in facts.buffer_intervals.items():
        alloc = step[facts.schedule[start]]
        ends = [step[r] for r in dying.get(buffer, ()) if r in step]
        intervals[buffer] = (alloc, last if stop >= last else max([alloc] + ends))
    return dataclasses.replace(facts, schedule=tuple(order), buffer_intervals=intervals)


class _Links:
    """Which ops must run before and after each: the graph's data and
    control edges, and, where held, from each reader of a buffer that an op
    takes over to that op (order.takeovers)."""

    def __init__(self, g, facts, hold_takeovers: bool = True):
        # The index's own lists: data edges first, then control edges.
        self.before, self.after = list(g.producers), list(g.readers)
        for taker, readers in (takeovers(g, facts) if hold_takeovers else {}).items():
            for r in sorted(readers):
                self.before[taker] += (r,)
                self.after[r] += (taker,)


def _greedy(g, facts, dying: dict, links: _Links) -> Optional[list]:
    """The list schedule: ready ops by least bytes left allocated, then the
    executor's order; None if some op never becomes ready.

    Args:
      dying: buffer -> its readers, for the buffers that die within the step
        (a buffer live at its end has no last reader).
      links: what runs before and after each op.
    """
    rank = {node: s for s, node in enumerate(facts.schedule)}
    reads = {}
    for buffer, nodes in dying.items():
        for node in nodes:
            reads.setdefault(node, []).append(buffer)
    kept = {}
    for buffer in dying:
        if buffer[1] != SCRATCH_PORT:
            kept[buffer[0]] = kept.get(buffer[0], 0) + facts.buffer_bytes.get(buffer, 0)
    return _list_schedule(g, facts, rank, dying, reads, kept, links)


def _dying(facts, readers: dict, last: int) -> dict:
    """`readers` for the buffers that die within the step (a buffer live at
    its end has no last reader)."""
    return {b: nodes for b, nodes in readers.items()
            if b in facts.buffer_intervals and facts.buffer_intervals[b][1] < last}


def _readers(g, facts) -> dict:
    """Buffer -> the nodes that read a tensor living in it (the node that
    allocated it excepted)."""
    readers = {}
    for (node, port), buffer in facts.buffers.items():
        readers.setdefault(buffer, set()).update(
            c for c, _, p in g.consumers[node] if p == port)
    for buffer, nodes in readers.items():
        nodes.discard(buffer[0])
    return readers


def _list_schedule(g, facts, rank: dict, readers: dict, reads: dict,
                   kept: dict, links: _Links) -> Optional[list]:
    """Ready ops by least bytes left allocated, then executor order; None
    if some op never becomes ready."""
    # A loop's back edges (NextIteration -> Merge) are not waited for, as
    # in the executor's order (analysis.schedule).
    back = {n for n in rank if g.ops[n] in optable.NEXT_ITERATION_OPS}
    pending = {node: sum(1 for p in links.before[node] if p not in back)
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
        for c in links.after[node]:
            if c in pending and pending[c] > 0:
                pending[c] -= 1
                if pending[c] == 0:
                    heapq.heappush(heap, (score(c), rank[c], c, version[c]))
    return order if len(order) == len(rank) else None


# The refinement's limits: moves made, and buffers live at the peak tried
# per move (the largest first), each tried both ways. A try costs one pass
# over the buffers.
MOVES = 64
TRIES = 8
# The most ops a move takes along. A block is the closure of one op within
# the span it crosses; on a deep network that span can hold most of the
# backward pass, which depends on the op at the peak, so the walk would
# cover thousands of ops to find a move it cannot make.
MAX_BLOCK = 512


def _refined(g, facts, order: list, last: int, readers: dict, links: _Links) -> list:
    """The order with its peak lowered by moving blocks of ops across it.

    The list schedule is greedy: it runs the op that leaves the fewest bytes
    allocated now, blind to what the ops after it will need. Where a
    normalization's backward pass sums three activation-sized terms, it
    makes the cheap term first (a broadcast of a per-channel gradient) and
    only then the one that must also bring back the layer's input, so the
    input comes back beside two finished terms rather than one. So, while
    the peak falls: at the step of the peak, take a large buffer live there
    and either sink the op that allocates it, with what depends on it up to
    the peak, past the peak (as late as their readers allow), or hoist its
    last reader, with what that depends on after the peak, to just before
    the peak. The move that lowers the peak most is kept. Every move keeps
    the order topological.

    Args:
      g: the graph index.
      facts: its analysis (buffers, sizes, who allocates them).
      order: a topological order of the nodes in facts.schedule.
      last: the last step.
      readers: buffer -> the nodes that read it (_readers).
      links: what runs before and after each op; the moves keep both.

    Returns:
      An order whose peak of live bytes is at most that of `order`.
    """
    profile = _Profile(g, facts, last, readers)
    peak, at, live = profile.peak(order)
    pos = _positions(order, profile.nodes)
    for _ in range(MOVES):
        best = None
        for moved, span in _moves(links, profile, order, pos, at, live):
            got = profile.peak(moved)
            if got[0] < peak and (best is None or got[0] < best[0][0]):
                best = (got, moved, span)
        if best is None:
            break
        (peak, at, live), order, (first, end) = best
        # A move reorders one span of steps; the others keep their ops.
        for s in range(first, end):
            pos[order[s]] = s
    return order


class _Profile:
    """The bytes live at each step of an order, as the analysis counts them:
    a buffer from the step of the op that allocates it to the step of its
    last reader (to the end where it outlives the step)."""

    def __init__(self, g, facts, last: int, readers: dict):
        # numpy here, not at module level: the planner's stages import
        # nothing heavy when loaded.
        import numpy as np

        allocs, sizes, to_end, owners, reader_nodes = [], [], [], [], []
        for k, (buffer, (start, stop)) in enumerate(facts.buffer_intervals.items()):
            alloc = facts.schedule[start]
            allocs.append(alloc)
            sizes.append(facts.buffer_bytes.get(buffer, 0))
            to_end.append(stop >= last)
            for r in readers.get(buffer, ()):
                if r != alloc:
                    owners.append(k)
                    reader_nodes.append(r)
        self.nodes = len(g.ops)
        self.alloc = np.asarray(allocs, dtype=np.int64)
        self.size = np.asarray(sizes, dtype=np.int64)
        self.to_end = np.asarray(to_end, dtype=bool)
        self.owner = np.asarray(owners, dtype=np.int64)
        self.reader = np.asarray(reader_nodes, dtype=np.int64)

    def intervals(self, order: list) -> tuple:
        """(allocation step, last step live) per buffer."""
        import numpy as np

        n = len(order)
        step = np.full(self.nodes, -1, dtype=np.int64)
        step[np.asarray(order, dtype=np.int64)] = np.arange(n)
        start = step[self.alloc]
        read = step[self.reader]
        stop = start.copy()
        np.maximum.at(stop, self.owner, read)
        stop[self.to_end] = n - 1
        return start, stop

    def peak(self, order: list) -> tuple:
        """(peak live bytes, its step, (start, stop) per buffer)."""
        import numpy as np

        start, stop = self.intervals(order)
        delta = np.zeros(len(order) + 1, dtype=np.int64)
        np.add.at(delta, start, self.size)
        np.add.at(delta, stop + 1, -self.size)
        live = np.cumsum(delta[:-1])
        at = int(np.argmax(live))
        return int(live[at]), at, (start, stop)


def _positions(order: list, nodes: int) -> list:
    """Node -> its step in `order` (-1 for a node it leaves out)."""
    pos = [-1] * nodes
    for s, node in enumerate(order):
        pos[node] = s
    return pos


def _moves(links: _Links, profile: _Profile, order: list, pos: list, at: int,
           live: tuple):
    """(order, (first, end)): orders with one block of ops moved across
    step `at` (the peak), each with the steps first..end-1 it reorders;
    pos: node -> its step in `order` (_positions)."""
    import numpy as np

    start, stop = live
    around = np.nonzero((start <= at) & (stop >= at) & (profile.size > 0))[0]
    largest = around[np.argsort(-profile.size[around], kind="stable")][:TRIES]
    for k in largest:
        if start[k] < at:
            moved = _sunk(links, order, pos, int(start[k]), at)
            if moved is not None:
                yield moved
        if at < stop[k] and not profile.to_end[k]:
            moved = _hoisted(links, order, pos, at, int(stop[k]))
            if moved is not None:
                yield moved


def _sunk(links: _Links, order: list, pos: list, begin: int, at: int) -> Optional[tuple]:
    """(`order` with the op at `begin`, and every op up to step `at` that
    depends on it, moved past `at`, as late as their readers allow (just
    before the first of them), the steps it reorders); None if that takes
    the op at `at` along."""
    after = links.after.__getitem__
    block = _closure(order[begin], pos, begin, at, after, order[at])
    if block is None:
        return None
    until = min((pos[c] for n in block for c in after(n) if pos[c] > at),
                default=len(order))
    segment = order[begin:at + 1]
    return (order[:begin] + [n for n in segment if n not in block] + order[at + 1:until]
            + [n for n in segment if n in block] + order[until:]), (begin, until)


def _hoisted(links: _Links, order: list, pos: list, at: int, end: int) -> Optional[tuple]:
    """(`order` with the op at `end`, and every op from step `at` on that
    it depends on, moved to just before `at`, the steps it reorders); None
    if that takes the op at `at` along."""
    block = _closure(order[end], pos, at, end, links.before.__getitem__, order[at])
    if block is None:
        return None
    segment = order[at:end + 1]
    return (order[:at] + [n for n in segment if n in block]
            + [n for n in segment if n not in block] + order[end + 1:]), (at, end + 1)


def _closure(node: int, pos: list, first: int, last: int, neighbours,
             stop: int) -> Optional[set]:
    """`node` and the nodes at steps first..last (pos: node -> step)
    reachable from it through `neighbours`; None as soon as `stop` is among
    them, or they number more than MAX_BLOCK."""
    if node == stop:
        return None
    block, todo = {node}, [node]
    while todo:
        for other in neighbours(todo.pop()):
            if first <= pos[other] <= last and other not in block:
                if other == stop or len(block) >= MAX_BLOCK:
                    return None
                block.add(other)
                todo.append(other)
    return block
