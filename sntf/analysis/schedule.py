"""The order TensorFlow's executor runs a step, emulated."""

from __future__ import annotations

import collections
import operator
from typing import Mapping, Optional

from sntf.graph import optable
from sntf.graph.index import (GraphIndex, back_edge_flags, back_edges, int_objects,
                              inputs_waited_for)

try:  # the native walks (tf_ops/graph_walks.cc), where sntf is built
    from sntf import _graph_walks as _walks
except ImportError:  # pragma: no cover - a source checkout not yet built
    _walks = None


def schedule(g: GraphIndex, consumers_last_first: bool = False,
             merged: Optional[Mapping[int, int]] = None) -> tuple[int, ...]:
    """The order TensorFlow's executor runs a step, with one inter-op thread.

    Emulates ExecutorState::ScheduleReady on a one-thread pool. A completed
    node's newly ready consumers (data edges, then control edges) are split:
    inexpensive ones join the FIFO inline queue of the running Process loop;
    of the expensive ones the last runs inline when that queue is empty, and
    the others go to the pool. The pool's thread pushes its own tasks to the
    front of its queue (Eigen's run queue), so the most recently deferred
    node runs first once the inline chain ends; the roots, scheduled from the
    calling thread, go to the back.

    benchmarks/check_schedule.py compares it with the op order of a step in
    TensorFlow's profiler trace (BENCHMARKS.md gives the agreement).

    Args:
      g: the graph index.
      consumers_last_first: take each node's data consumers last-added
        first instead (not the executor's order; the recompute planner
        also tries release points picked on it).
      merged: node -> the node oneDNN's graph pass merges into its kernel
        (sntf.graph.fusions; None: the pass does not run). The merged node
        runs with the kernel when it is ready by then: a bias gradient
        merged into its filter gradient runs there, not where the executor
        would have deferred it alone.

    Returns:
      Node indices in execution order (all nodes; cycles broken in index order).
    """
    if _walks is not None:
        # The same walk in C++ (tf_ops/graph_walks.cc).
        return tuple(_walks.schedule(
            g.data_inputs, g.control_inputs, g.consumers, g.control_consumers,
            back_edge_flags(g.ops), bytes(op in optable.INEXPENSIVE_OPS for op in g.ops),
            consumers_last_first, dict(merged or {}), int_objects(len(g.ops))))
    return _python_schedule(g, consumers_last_first, merged)


def _python_schedule(g: GraphIndex, consumers_last_first: bool = False,
                     merged: Optional[Mapping[int, int]] = None) -> tuple[int, ...]:
    """schedule in Python: the reference for the native walk."""
    n = len(g.names)
    back_edge = back_edges(g.ops)
    pending = inputs_waited_for(g.data_inputs, g.control_inputs, back_edge)
    pool = collections.deque(i for i in range(n) if pending[i] == 0)
    merged = merged or {}
    absorber = {second: first for first, second in merged.items()}
    cheap = [op in optable.INEXPENSIVE_OPS for op in g.ops]
    out_edges = _out_edges(g, consumers_last_first)
    order, ran = [], [False] * n
    while pool:
        inline = collections.deque([pool.popleft()])
        while inline:
            i = inline.popleft()
            if ran[i]:
                continue   # a root that ran in its partner's kernel
            group = [i]
            partner = merged.get(i) if merged else None
            if partner is not None and not ran[partner] and pending[partner] == 0:
                group.append(partner)   # one kernel computes both
            for node in group:
                ran[node] = True
            order.extend(group)
            current, deferred = None, []
            for node in group:
                if node in back_edge:
                    continue
                for c in out_edges[node]:
                    pending[c] -= 1
                    if pending[c]:
                        continue
                    # c is ready: what it waited for has run.
                    if ran[c] or (c in absorber and not ran[absorber[c]]):
                        continue   # runs (or ran) in its partner's kernel
                    if cheap[c]:
                        inline.append(c)
                        continue
                    if current is not None:
                        deferred.append(current)
                    current = c
            if current is not None:
                if inline:
                    deferred.append(current)
                else:
                    inline.append(current)
            pool.extendleft(deferred)
    if len(order) < n:
        seen = set(order)
        order.extend(i for i in range(n) if i not in seen)
    return tuple(order)


def _out_edges(g: GraphIndex, last_first: bool) -> list:
    """Each node's out-edges in the order of the executor's out-edge lists:
    data consumers in graph order (or last-added first), then control
    consumers."""
    # Made for each call, not kept on the index: most graphs the planner
    # tries are scheduled once.
    step, first = -1 if last_first else 1, operator.itemgetter(0)
    return [tuple(map(first, d[::step])) + cc if d else cc
            for d, cc in zip(g.consumers, g.control_consumers)]
