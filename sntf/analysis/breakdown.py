"""What holds a peak up: the bytes live at one step of the timeline, by kind,
with the largest buffers named."""

from __future__ import annotations

from typing import Optional

from sntf.analysis.memory import (ACTIVATION, GRADIENT, PERSISTENT, SCRATCH_PORT,
                                  VARIABLE_PORT, Analysis)
from sntf.graph import names
from sntf.graph.index import GraphIndex

# The kinds, in the order a report lists them.
KEPT, SWAPPED_IN, RECOMPUTED, GRADIENTS, WEIGHTS, SCRATCH, INPUT, OTHER = (
    "kept activations", "swapped-in tensors", "recomputed tensors", "gradients",
    "weights, optimizer slots and constants", "scratch", "input batch",
    "other temporaries")
KINDS = (KEPT, SWAPPED_IN, RECOMPUTED, GRADIENTS, WEIGHTS, SCRATCH, INPUT, OTHER)
# Ops whose outputs are the step's input data.
INPUT_OPS = frozenset({"IteratorGetNext", "IteratorGetNextSync", "_Arg", "Placeholder",
                       "OptionalGetValue"})
# How many of the largest buffers a breakdown names.
LARGEST = 5


def kind_of(g: GraphIndex, facts: Analysis, buffer: tuple) -> str:
    """The kind of one buffer (see KINDS).

    Args:
      g: the graph index.
      facts: its analysis.
      buffer: a buffer key (the tensor that allocated it, or a variable's or
        scratch key).

    Returns:
      One of KINDS.
    """
    node, port = buffer
    if port == SCRATCH_PORT:
        return SCRATCH
    if port == VARIABLE_PORT or facts.buffer_class.get(buffer) == PERSISTENT:
        return WEIGHTS
    name, op = g.names[node], g.ops[node]
    if op in (names.SWAP_IN_OP, names.CACHE_IN_OP):
        return SWAPPED_IN
    if names.recompute_source(name):
        return RECOMPUTED
    if op in INPUT_OPS:
        return INPUT
    klass = facts.buffer_class.get(buffer)
    if klass == ACTIVATION:
        return KEPT
    if klass == GRADIENT:
        return GRADIENTS
    return OTHER


def breakdown(g: GraphIndex, facts: Analysis, step: Optional[int] = None) -> dict:
    """The bytes live at a step of the timeline, by kind.

    Args:
      g: the graph index.
      facts: its analysis.
      step: a schedule step (default: the predicted peak's).

    Returns:
      {"step", "node" (the op running then), "device_bytes" (what the
      allocator model holds then), "by_kind" {kind: bytes}, "allocator_overhead"
      (device bytes beyond the live buffers: rounding and unsplit chunks),
      "largest" [{"tensor", "kind", "bytes"}] (the largest live buffers)}.
    """
    step = facts.peak_step if step is None else step
    live = [b for b, (start, stop) in facts.buffer_intervals.items()
            if start <= step <= stop]
    live += [b for b in facts.buffer_bytes if b not in facts.buffer_intervals]
    by_kind = dict.fromkeys(KINDS, 0)
    kinds = {}
    for b in live:
        kinds[b] = kind_of(g, facts, b)
        by_kind[kinds[b]] += facts.buffer_bytes[b]
    series = facts.timeline.device_bytes
    device = series[step] if 0 <= step < len(series) else facts.predicted_peak_bytes
    largest = sorted(live, key=lambda b: (-facts.buffer_bytes[b], b))[:LARGEST]
    return {
        "step": step,
        "node": g.names[facts.schedule[step]] if 0 <= step < len(facts.schedule) else None,
        "device_bytes": device,
        "by_kind": {k: v for k, v in by_kind.items() if v},
        "allocator_overhead": max(0, device - sum(by_kind.values())),
        "largest": [{"tensor": _label(g, b), "kind": kinds[b],
                     "bytes": facts.buffer_bytes[b]} for b in largest],
    }


def _label(g: GraphIndex, buffer: tuple) -> str:
    node, port = buffer
    if port == SCRATCH_PORT:
        return f"{g.names[node]} (scratch)"
    if port == VARIABLE_PORT:
        return f"{g.names[node]} (variable)"
    return names.tensor_name(g.names[node], port)


def describe(found: dict, limit: int = 3) -> str:
    """A breakdown on one line: the kinds in MiB, largest first, and the
    largest buffers."""
    mib = float(1 << 20)
    kinds = sorted(found["by_kind"].items(), key=lambda kv: -kv[1])
    parts = [f"{k} {v / mib:.1f} MiB" for k, v in kinds]
    if found["allocator_overhead"]:
        parts.append(f"allocator overhead {found['allocator_overhead'] / mib:.1f} MiB")
    largest = ", ".join(f"{t['tensor']} ({t['kind']}, {t['bytes'] / mib:.1f} MiB)"
                        for t in found["largest"][:limit])
    return (f"peak {found['device_bytes'] / mib:.1f} MiB at {found['node']}: "
            + ", ".join(parts) + (f"; largest: {largest}" if largest else ""))
