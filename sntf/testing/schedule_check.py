"""How closely sntf's predicted executor order follows the order TensorFlow
ran: the measure behind benchmarks/check_schedule.py."""

from __future__ import annotations

# Ops that allocate nothing and run wherever they become ready.
_READS = frozenset({"ReadVariableOp"})


def order_agreement(graph_def, executed: list) -> dict:
    """How closely sntf's predicted schedule follows an executed op order.

    Args:
      graph_def: the graph the executor ran.
      executed: node names in the order they ran (names not in the graph,
        such as the profiler's own events, are ignored).

    Returns:
      {"ops": executed ops found in the graph, "in_order": share of
      consecutive pairs the prediction also runs back to back,
      "in_order_no_reads": the same over pairs without a ReadVariableOp}.
    """
    from sntf import analysis
    from sntf import graph as graph_model

    g = graph_model.build_index(graph_def)
    ran = [n for n in executed if n in g.index]
    seen = set(ran)
    predicted = [g.names[i] for i in analysis.schedule(g) if g.names[i] in seen]
    position = {name: k for k, name in enumerate(predicted)}
    pairs = list(zip(ran, ran[1:]))
    adjacent = [position[b] == position[a] + 1 for a, b in pairs]
    plain = [ok for (a, b), ok in zip(pairs, adjacent)
             if g.ops[g.node(a)] not in _READS and g.ops[g.node(b)] not in _READS]
    return {"ops": len(ran),
            "in_order": round(sum(adjacent) / max(len(adjacent), 1), 4),
            "in_order_no_reads": round(sum(plain) / max(len(plain), 1), 4)}


def executed_ops(xspace_path: str) -> list:
    """Op names in the order the executor's threads started them."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(xspace_path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for e in line.events:
                # Op events are "node_name:OpType"; the executor's own are
                # "ExecutorState::Process" and the like.
                name = names[e.metadata_id]
                if ":" in name and " " not in name and "::" not in name:
                    events.append((line.timestamp_ns * 1000 + e.offset_ps,
                                   name.rsplit(":", 1)[0]))
    return [name for _, name in sorted(events)]
