"""What the allocator held at a run's measured peak, from TensorFlow's
profiler: the measure behind benchmarks/measured_peak.py.

The BFC allocator records a MemoryAllocation or MemoryDeallocation event for
every request while the profiler traces the host (host_tracer_level 2 or
more), with the bytes in use after it, the chunk it handed out
(allocation_bytes, which exceeds the request where a free chunk under twice
the request was not split), the op that asked and the shape. Replaying the
events gives the chunks live at the moment the bytes in use peaked: the
measured counterpart of a plan's peak breakdown.
"""

from __future__ import annotations

from typing import Optional

ALLOCATION, DEALLOCATION = "MemoryAllocation", "MemoryDeallocation"


def allocator_events(space, allocator: Optional[str] = None) -> list:
    """The allocator's events in time order.

    Args:
      space: a tensorflow.tsl.profiler.protobuf.xplane_pb2.XSpace.
      allocator: keep only this allocator's events (None: every one).

    Returns:
      [(picoseconds, event name, {stat name: value})].
    """
    events = []
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        stats = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            for e in line.events:
                name = names.get(e.metadata_id)
                if name not in (ALLOCATION, DEALLOCATION):
                    continue
                values = {stats.get(s.metadata_id): _stat_value(s, stats) for s in e.stats}
                if allocator is None or values.get("allocator_name") == allocator:
                    events.append((line.timestamp_ns * 1000 + e.offset_ps, name, values))
    events.sort(key=lambda event: event[0])
    return events


def _stat_value(stat, stats: dict):
    """An XStat's value, whichever of its fields holds it."""
    kind = stat.WhichOneof("value")
    if kind == "ref_value":
        return stats.get(stat.ref_value)
    return getattr(stat, kind) if kind else None


def live_at_peak(events: list) -> dict:
    """The chunks live when the bytes in use peaked.

    Args:
      events: allocator_events' list.

    Returns:
      {"peak_bytes": the highest bytes in use an event reported,
       "op": the op whose request reached it,
       "chunks": [{"bytes": chunk bytes, "requested": requested bytes,
                   "op": op, "shape": shape}], largest first}.
    """
    live, peak, at, held = {}, -1, None, {}
    for _, name, values in events:
        addr = values.get("addr")
        if name == ALLOCATION:
            live[addr] = {"bytes": int(values.get("allocation_bytes") or 0),
                          "requested": int(values.get("requested_bytes") or 0),
                          "op": values.get("tf_op"), "shape": values.get("shape")}
        else:
            live.pop(addr, None)
        in_use = int(values.get("bytes_allocated") or 0)
        if in_use > peak:
            peak, at, held = in_use, values.get("tf_op"), dict(live)
    chunks = sorted(held.values(), key=lambda c: -c["bytes"])
    return {"peak_bytes": max(peak, 0), "op": at, "chunks": chunks}
