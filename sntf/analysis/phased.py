"""What an analysis says by phase: each node's phase (forward, backward,
other), each buffer's class, and the bytes live per class at every step.

Computed from the liveness sntf.analysis.memory found, when first read:
the planner compares most graphs it analyzes by their peaks alone.
"""

from __future__ import annotations

import itertools

from sntf.analysis.facts import (ACTIVATION, GRADIENT, PERSISTENT, SCRATCH_PORT, TEMPORARY,
                                 TENSOR_CLASSES, Classes)
from sntf.graph import optable
from sntf.graph.index import GraphIndex
from sntf.graph.phases import BACKWARD, FORWARD, classify_phases


def by_phase(g: GraphIndex, live, intervals: dict) -> Classes:
    """The analysis' Classes: phases, buffer classes, bytes live per class.

    Args:
      g: the graph index.
      live: the liveness sntf.analysis.memory found (its order, buffers,
        their bytes and tensors, the persistent ones).
      intervals: buffer -> (allocating step, last step).

    Returns:
      The Classes.
    """
    order, end = live.order, len(live.order)
    phases = classify_phases(g)
    klass = _classes(g, phases, live)
    by_class, total = _class_series(live, klass, intervals, end)
    backward_steps = [s for s, i in enumerate(order) if phases[i] == BACKWARD]
    return Classes(
        node_phases=phases, buffer_class=klass, live_bytes=total, by_class=by_class,
        backward_start=backward_steps[0] if backward_steps else None,
        checkpoint_steps=tuple(s for s, i in enumerate(order)
                               if optable.op_class(g.ops[i]) == optable.CHECKPOINT
                               and phases[i] == FORWARD))


def _classes(g: GraphIndex, phases, live) -> dict:
    """Buffer -> class. A buffer holding a forward tensor that the backward
    pass reads is an activation (whichever tensor allocated it)."""
    klass = {}
    for b in live.buffer_bytes:
        if b in live.persistent:
            klass[b] = PERSISTENT
        elif b[1] == SCRATCH_PORT:
            klass[b] = TEMPORARY
        else:
            klass[b] = _buffer_class(g, phases, live.tensors.get(b) or [b])
    return klass


def _class_series(live, klass: dict, intervals: dict, end: int):
    """Bytes live per class and in all at each step (a buffer counts from its
    allocating step through its last use)."""
    persistent_bytes = live.persistent_bytes()
    delta = {c: [0] * (end + 2) for c in TENSOR_CLASSES}
    for b, (start, stop) in intervals.items():
        c = klass[b]
        delta[c][start] += live.buffer_bytes[b]
        delta[c][min(stop, end) + 1] -= live.buffer_bytes[b]
    by_class = {}
    for c in TENSOR_CLASSES:
        start = persistent_bytes if c == PERSISTENT else 0
        by_class[c] = tuple(itertools.accumulate(delta[c][:end], initial=start))[1:]
    total = tuple(map(sum, zip(*(by_class[c] for c in TENSOR_CLASSES))))
    return by_class, total


def _buffer_class(g: GraphIndex, phases, tensors) -> str:
    """Activation, gradient or temporary, from the tensors sharing a buffer."""
    producers = {phases[t[0]] for t in tensors}
    for t in tensors:
        if phases[t[0]] == FORWARD and any(
                phases[c] == BACKWARD
                for c, _, port in g.consumers[t[0]] if port == t[1]):
            return ACTIVATION
    return GRADIENT if BACKWARD in producers else TEMPORARY
