"""The measured side of a peak breakdown: replaying the allocator's profiler
events (sntf.testing.allocator_trace) on a hand-built trace."""

from sntf.testing import allocator_trace


def _space(events):
    """An XSpace with one line of allocator events:
    (name, addr, chunk bytes, requested bytes, bytes in use after, op)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    plane = space.planes.add(name="/host:CPU")
    plane.event_metadata[1].name = allocator_trace.ALLOCATION
    plane.event_metadata[2].name = allocator_trace.DEALLOCATION
    keys = ("allocator_name", "addr", "allocation_bytes", "requested_bytes",
            "bytes_allocated", "tf_op")
    for k, key in enumerate(keys, start=1):
        plane.stat_metadata[k].name = key
    line = plane.lines.add(name="allocator", timestamp_ns=0)
    for t, (name, addr, chunk, requested, in_use, op) in enumerate(events):
        e = line.events.add(metadata_id=1 if name == "alloc" else 2, offset_ps=1000 * t)
        e.stats.add(metadata_id=1, str_value="bfc_cpu_allocator_for_gpu")
        e.stats.add(metadata_id=2, uint64_value=addr)
        e.stats.add(metadata_id=3, int64_value=chunk)
        e.stats.add(metadata_id=4, int64_value=requested)
        e.stats.add(metadata_id=5, int64_value=in_use)
        e.stats.add(metadata_id=6, str_value=op)
    return space


def test_the_chunks_live_at_the_peak_with_their_requests():
    mib = 1 << 20
    space = _space([
        ("alloc", 1, 2 * mib, 2 * mib, 2 * mib, "a"),
        ("alloc", 2, 14 * mib, 8 * mib, 16 * mib, "dy"),   # an unsplit chunk
        ("free", 1, 2 * mib, 2 * mib, 14 * mib, ""),
        ("alloc", 3, 8 * mib, 8 * mib, 22 * mib, "swap_in"),
        ("free", 3, 8 * mib, 8 * mib, 14 * mib, ""),
        ("alloc", 4, 4 * mib, 4 * mib, 18 * mib, "b"),
    ])
    events = allocator_trace.allocator_events(space)
    assert [name for _, name, _ in events][:3] == [
        allocator_trace.ALLOCATION, allocator_trace.ALLOCATION, allocator_trace.DEALLOCATION]
    found = allocator_trace.live_at_peak(events)
    assert found["peak_bytes"] == 22 * mib and found["op"] == "swap_in"
    assert [(c["op"], c["bytes"], c["requested"]) for c in found["chunks"]] == [
        ("dy", 14 * mib, 8 * mib), ("swap_in", 8 * mib, 8 * mib)]
    assert allocator_trace.allocator_events(space, allocator="other") == []
