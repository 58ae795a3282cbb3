"""What the backward pass reads, and when: helpers the recompute and swap
planners share."""

from __future__ import annotations

import heapq
from typing import Optional

from sntf.analysis.memory import PERSISTENT
from sntf.graph import names, optable
from sntf.graph.index import descendants
from sntf.graph.phases import BACKWARD, FORWARD, waits_for_loss
from sntf.planner.plan import RecomputeGroup


def backward_read_by_buffer(g, facts, shape_readers: bool = False) -> dict:
    """Buffer -> the forward tensors living in it that the backward pass reads.

    Args:
      g, facts: the graph index and its analysis.
      shape_readers: whether a backward op that reads only the tensor's
        shape (optable.METADATA_OPS) counts. Such an op runs as soon as the
        tensor exists and holds it no longer than a forward reader, so a
        plan that serves the other readers frees the buffer regardless (a
        residual join's output, which a Shape op of the next join's
        gradient reads when the batch is unknown, shares its buffer with
        the ReLU after it).

    Returns:
      {buffer: {(node, port)}}.
    """
    phases = facts.node_phases
    result = {}
    for t, buffer in facts.buffers.items():
        if phases[t[0]] == FORWARD and any(
                phases[c] == BACKWARD and (shape_readers or g.ops[c] not in optable.METADATA_OPS)
                for c, _, p in g.consumers[t[0]] if p == t[1]):
            result.setdefault(buffer, set()).add(t)
    return result


def gradient_ancestor(g, facts, step_of: dict, reader: int, seconds: float,
                      device: Optional[str] = None,
                      follow_early: bool = False) -> Optional[int]:
    """The backward op that releases a swap-in needed by `reader`.

    Walks back from `reader` along the backward pass's critical path: at each
    op, to its backward-phase data input scheduled last (the gradient that
    arrives last). It stops at the first op whose estimated compute up to the
    reader covers `seconds`. Being an ancestor of the reader, the trigger
    runs shortly before it in any executor order; an op merely scheduled
    nearby in the predicted order (a shape computation, another branch) can
    run much earlier, bringing the tensor back long before it is needed.

    Only ops that wait for the loss (graph.waits_for_loss) are followed. A
    reader that does not (a gradient op computed from forward values alone,
    such as GELU's exp(-x*x/2)) would otherwise run in the forward pass.
    With follow_early, it is followed down to the first backward op after
    it that waits for the loss, and the walk starts there, outside the
    reader's descendants (a trigger among them would wait for the tensor it
    brings back). Such a trigger is no ancestor of the reader, so its edge
    runs against the schedule: the caller checks the plan's edges together
    (edges_acyclic).

    Args:
      g, facts: the graph index and its analysis.
      step_of: node index -> schedule step.
      reader: the node that needs the tensor.
      seconds: compute to leave between the trigger and the reader.
      device: only ops placed on this device are followed (the trigger's
        control edge must not cross devices); None: any.
      follow_early: serve a reader that does not wait for the loss.

    Returns:
      The node index, or None when no op that waits for the loss leads to
      the reader.
    """
    waits = waits_for_loss(g)
    node, below = reader, frozenset()
    if follow_early and reader not in waits:
        node = _first_waiting(g, facts, step_of, reader, waits)
        below = descendants(g, [reader], control=True)
    covered, found = 0.0, None
    while node is not None:
        # Control inputs count: a recomputed clone waits on its trigger.
        preds = [p for p, _ in g.data_inputs[node]] + list(g.control_inputs[node])
        inputs = [p for p in preds if facts.node_phases[p] == BACKWARD
                  and p in waits and p not in below
                  and (device is None or g.devices[p] == device)]
        if not inputs:
            return found
        node = max(inputs, key=step_of.get)
        found = node
        covered += facts.step_seconds[step_of[node]]
        if covered >= seconds:
            return node
    return None


def _first_waiting(g, facts, step_of: dict, reader: int, waits: frozenset):
    """The earliest scheduled backward op downstream of `reader` that waits
    for the loss, through backward ops that do not; None if there is none."""
    seen, ready = {reader}, [(step_of[reader], reader)]
    while ready:
        _, node = heapq.heappop(ready)
        if node != reader and node in waits:
            return node
        for c, _, _ in g.consumers[node]:
            if c not in seen and c in step_of and facts.node_phases[c] == BACKWARD:
                seen.add(c)
                heapq.heappush(ready, (step_of[c], c))
    return None


def edges_acyclic(g, edges) -> bool:
    """Whether the graph stays acyclic with the control edges `edges`
    ((from, to) node pairs) added: Kahn's algorithm over data and control
    edges."""
    extra = {}
    indegree = [len(g.data_inputs[n]) + len(g.control_inputs[n])
                for n in range(len(g.names))]
    for a, b in edges:
        extra.setdefault(a, []).append(b)
        indegree[b] += 1
    ready = [n for n, d in enumerate(indegree) if d == 0]
    seen = 0
    while ready:
        n = ready.pop()
        seen += 1
        for c in ([c for c, _, _ in g.consumers[n]] + list(g.control_consumers[n])
                  + extra.get(n, [])):
            indegree[c] -= 1
            if indegree[c] == 0:
                ready.append(c)
    return seen == len(g.names)


def read_under_control_flow(g, tensor: tuple, region: frozenset) -> bool:
    """Whether a node under control flow reads the tensor (see
    graph.control_flow_region): such a tensor is left as it is."""
    return bool(region) and any(c in region for c, _, p in g.consumers[tensor[0]]
                                if p == tensor[1])


def control_flow_note(regions) -> tuple:
    """The plan notes that say where the step lies and how much control flow
    was left alone (regions: a graph.regions.StepRegions)."""
    outside = len(regions.region)
    if not regions.step:
        return ((f"control flow present: {outside} op(s) in or after a "
                 "conditional left alone",) if outside else ())
    return (f"training step inside {_describe(regions.step)}: planned within it; "
            f"{outside} op(s) around it or in or after a conditional in it left alone",)


def _describe(step: tuple) -> str:
    loops = sum(1 for kind, *_ in step if kind == "frame")
    branches = sum(1 for kind, *_ in step if kind == "branch")
    parts = [f"{loops} loop(s)"] if loops else []
    parts += [f"{branches} conditional branch(es)"] if branches else []
    return " and ".join(parts)


def backward_read_tensors(g, facts) -> list:
    """The forward tensors the backward pass reads that hold step memory
    (not a constant's or a variable's), in schedule order: the tensors a
    plan decides (keep, swap or recompute).

    Returns:
      [(node, port)] in the order of their producers in facts.schedule.
    """
    phases = facts.node_phases
    found = []
    for producer in facts.schedule:
        if phases[producer] != FORWARD:
            continue
        for port in sorted({p for c, _, p in g.consumers[producer]
                            if phases[c] == BACKWARD}):
            buffer = facts.buffer_of((producer, port))
            if buffer is not None and facts.buffer_class.get(buffer) != PERSISTENT:
                found.append((producer, port))
    return found


def tensor_name(g, tensor: tuple) -> str:
    """The "node:port" name of a (node index, port) tensor."""
    return names.tensor_name(g.names[tensor[0]], tensor[1])


def reader_groups(g, readers: list, mode: str, step_of: dict, facts) -> list:
    """Groups of backward readers, each with the node that releases its clone.

    Args:
      g, facts: the graph index and its analysis.
      readers: (node, data input slot) pairs reading the rebuilt tensor.
      mode: "speed" (one group for them all) or "memory" (one per reader).
      step_of: node index -> position in the order readers are sorted by.

    Returns:
      [RecomputeGroup], or [] where a reader has no backward op to wait on.
    """
    readers = sorted(readers, key=lambda r: step_of[r[0]])
    batches = [readers] if mode == "speed" else [[r] for r in readers]
    groups = []
    for batch in batches:
        # The gradient that reaches the group's first reader last, on the
        # tensor's device, releases the clone: an ancestor of that reader, it
        # runs shortly before it in any executor order. An op merely
        # scheduled nearby may run far earlier (and the clone with it), may
        # be another device's (a control edge across devices deadlocked a
        # step on two logical CPUs), or may be a variable update that
        # oneDNN later fuses with the reader ("nodes in a cycle"). Scheduled
        # before every reader of the group, the ancestor never depends on
        # one of them. A reader without such an input is not served.
        c, slot = batch[0]
        device = g.devices[g.data_inputs[c][slot][0]]
        # No compute to cover (0.0), so step_of may be another order than
        # facts.schedule (plan_recompute's `order`).
        trigger = gradient_ancestor(g, facts, step_of, c, 0.0, device)
        if trigger is None:
            return []
        groups.append(RecomputeGroup(
            consumers=tuple((g.names[c], slot) for c, slot in batch),
            trigger=g.names[trigger]))
    return groups
