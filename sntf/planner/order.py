"""Order edges: control edges that change when ops run, never what they compute."""

from __future__ import annotations

from typing import Optional

from sntf.graph import names, optable
from sntf.graph.regions import control_flow_region
from sntf.graph.training import variable_access
from sntf.planner.plan import Order


def plan_gradient_order(g, onednn: bool = True) -> tuple:
    """Control edges that run each layer's weight gradient before the input
    gradient of the same output gradient.

    A convolution's output gradient is read by the filter gradient and by
    the input gradient. TensorFlow's executor runs one of the two ready
    expensive ops inline and defers the other to its pool, which runs the
    most recently deferred op first: the input gradient's chain goes on
    down the network while every deferred filter gradient keeps its output
    gradient (and its forward input, or that input's recomputation) alive
    until the chain ends. With the input gradient waiting for it, the filter
    gradient runs first and both tensors die as the chain passes the layer.
    Values are unchanged; only the order is.

    A bias gradient is deferred the same way, keeping its output gradient
    alive; it is ordered too where oneDNN's graph pass does not fuse it
    with the filter gradient (optable.UNFUSED_WEIGHT_GRADIENT_OPS).

    Args:
      g: the graph index.
      onednn: whether oneDNN's graph pass runs on the graph's device.

    Returns:
      Order edges (weight gradient -> input gradient of the same output
      gradient, see INPUT_GRADIENT_OPS), none that would close a cycle,
      cross devices or repeat an existing path.
    """
    weight_ops = dict(optable.WEIGHT_GRADIENT_OPS)
    if not onednn:
        weight_ops.update(optable.UNFUSED_WEIGHT_GRADIENT_OPS)
    pairs = []
    for w, op in enumerate(g.ops):
        slot = weight_ops.get(op)
        if slot is None or len(g.data_inputs[w]) <= slot:
            continue
        producer, port = g.data_inputs[w][slot]
        # A reader upstream of w (through a clone's release edge, say) must
        # not wait for it; _new_orders drops those pairs.
        pairs += [(w, c) for c, _, p in g.consumers[producer]
                  if p == port and g.ops[c] in optable.INPUT_GRADIENT_OPS
                  and g.devices[c] == g.devices[w]]
    return _new_orders(g, pairs)


def _new_orders(g, pairs: list) -> tuple:
    """Order edges for (before, after) node pairs, in the pairs' order, less
    duplicates and the pairs already ordered (before is an ancestor of
    after) or that would close a cycle (after reaches before, through the
    graph and the edges already taken)."""
    if not pairs:
        return ()
    bit = {n: k for k, n in enumerate(sorted({n for pair in pairs for n in pair}))}
    ancestors = _ancestor_bits(g, bit)
    orders = {}
    added: dict = {}   # before -> the afters of the edges taken so far
    for before, after in pairs:
        if (before, after) in orders or ancestors[after] >> bit[before] & 1:
            continue   # already ordered
        # Two edges each fine alone can close a cycle together, so the
        # edges taken so far count too.
        if _reaches(ancestors, bit, after, before, added):
            continue
        orders[(before, after)] = Order(before=g.names[before], after=g.names[after])
        added.setdefault(before, []).append(after)
    return tuple(orders.values())


def _reaches(ancestors: dict, bit: dict, start: int, goal: int, added: dict) -> bool:
    """Whether goal is reachable from start over the graph's edges and the
    order edges in `added` (before -> afters). A path is graph stretches
    joined by added edges, so only the marked nodes (the keys of `bit`)
    are visited, never the graph itself: the pass runs this per pair."""
    seen, reached = {start}, [start]
    while reached:
        node = reached.pop()
        if ancestors[goal] >> bit[node] & 1:
            return True
        for source, targets in added.items():
            if ancestors[source] >> bit[node] & 1:
                for target in targets:
                    if target not in seen:
                        seen.add(target)
                        reached.append(target)
    return False


def plan_update_order(g) -> tuple:
    """Control edges that make each variable update wait for the readers of
    the variable's earlier reads, so that TensorFlow updates it in place.

    A ReadVariableOp's output shares the variable's buffer. An update
    (AssignSubVariableOp, ResourceApplyAdam, ...) that runs while such a
    read is still alive cannot write in place: TensorFlow copies the variable
    into a buffer allocated in the middle of the step, and that buffer stays
    the variable's into the next steps, splitting the free chunks the next
    step's large buffers would take. Recomputation makes reads live longer
    (clones reuse the forward read and run late in the backward pass).
    Values are unchanged (a reader sees the value before the update either
    way); only the order is.

    Args:
      g: the graph index.

    Returns:
      Order edges (reader -> update), none that would close a cycle, cross
      devices, touch a control-flow region, or repeat an existing path.
    """
    region = control_flow_region(g)
    position = {node: k for k, node in enumerate(g.topo)}
    updates, readers = variable_access(g)
    pairs = []
    for root, ups in updates.items():
        reads = [r for r in readers.get(root, ()) if g.ops[r] == optable.READ_VARIABLE_OP]
        for u in ups:
            if u in region:
                continue
            for r in reads:
                # Reads after the update (automatic control dependencies
                # order them after it) see the new value.
                if position[r] < position[u]:
                    pairs += [(c, u) for c in _alias_readers(g, r)
                              if c != u and c not in region
                              and not optable.is_update_op(g.ops[c])
                              and g.devices[c] == g.devices[u]]
    return _new_orders(g, pairs)


def plan_sequence(g, facts, min_bytes: int, merges: Optional[dict] = None) -> tuple:
    """Control edges that make the ops that allocate or free much memory run
    in the order the plan was made for, on each device.

    The planned peak is the peak of one order: `facts.schedule`, the
    executor's with one inter-op thread (analysis.schedule), or a
    memory-aware order of the same ops (memory_orders). With TensorFlow's default pool the
    executor runs ready ops side by side and in an order left to thread
    timing: a branch's activations allocated early, two convolutions'
    scratch at once, a swap-in run before the buffer it was to follow had
    died. Two kinds of edges hold the large allocations and frees to the
    planned order, as a Checkmate schedule is held by its edges:

    - a chain, in schedule order, through every op that allocates a buffer
      of at least `min_bytes` (an output or its scratch) or is the planned
      last reader of one, so that a large allocation still waits for the
      op that frees the buffer before it; a swap's copy joins the chain but
      the chain does not wait for it, so that it still overlaps compute;
    - from every other reader of such a buffer to its planned last reader,
      so that the buffer dies where the plan says, whichever reader the
      executor happens to run last;
    - from every reader of such a buffer that the plan runs before an op
      that takes the buffer over (takeovers: a forwarding kernel, or a
      variable adopting its new value) to that op. A kernel forwards only
      an input no other op has yet to read; run early, a cheap element-wise
      op of a backward pass allocates a buffer of its own beside the one it
      was planned to reuse.

    Cheap ops still run where they fall. Values are unchanged, and so is
    what TensorFlow's oneDNN pass merges (sntf.graph.fusions): no edge goes
    into a Conv2D -> BiasAdd pair or between the two nodes of a pair, and an
    edge into one node of another pair comes from an op scheduled before
    both, so that the rewrite can give the other node the same edge.

    Args:
      g: the index of the graph as planned (generated nodes included).
      facts: its analysis (schedule, buffers and their intervals).
      min_bytes: the least bytes of a buffer whose allocation and free are
        held to the plan.
      merges: node -> the graph.fusions.MergePair it belongs to, where
        oneDNN's pass runs (None: it does not).

    Returns:
      Order edges, none in a control-flow region (a control edge carries a
      dead branch's deadness on), none across devices, none at a function's
      arguments or results or at an op that moves data between devices or
      replicas (optable.never_ordered), and none already a direct input. Every edge points forward in the schedule, a
      topological order of the graph, so none can close a cycle.
    """
    step = {node: k for k, node in enumerate(facts.schedule)}
    region = control_flow_region(g)
    pairs = _sequence_pairs(g, facts, _large_buffers(facts, min_bytes), step)
    merges = merges or {}
    orders = {}
    for before, after in pairs:
        if (before in region or after in region or g.devices[before] != g.devices[after]
                or optable.never_ordered(g.ops[before])
                or optable.never_ordered(g.ops[after])
                or before in g.control_inputs[after]
                or any(p == before for p, _ in g.data_inputs[after])
                or not _keeps_merge(merges.get(after), before, step)):
            continue
        orders.setdefault((before, after),
                          Order(before=g.names[before], after=g.names[after]))
    return tuple(orders.values())


def _sequence_pairs(g, facts, large: dict, step: dict) -> list:
    """(before, after) pairs of plan_sequence's three kinds, unfiltered:
    to each large buffer's last reader from its other readers, to each
    taker of one from the readers before it, and the chain."""
    chained = set()
    pairs = []
    for buffer, readers in _readers(g, facts, large).items():
        last = large[buffer]
        chained.add(facts.schedule[facts.buffer_intervals[buffer][0]])
        chained.add(last)
        pairs += [(r, last) for r in sorted(readers, key=step.__getitem__)
                  if step[r] < step[last]]
    for taker, readers in takeovers(g, facts, large).items():
        pairs += [(r, taker) for r in sorted(readers, key=step.__getitem__)]
    ends: dict = {}    # device -> the op chained last so far
    for node in facts.schedule:
        if node in chained and not optable.never_ordered(g.ops[node]):
            before = ends.get(g.devices[node])
            if before is not None:
                pairs.append((before, node))
            # A copy to or from the host pool starts no earlier than
            # planned, but nothing waits for it to end but its readers:
            # the copy overlaps the compute after it, as planned.
            if g.ops[node] not in _TRANSFER_OPS:
                ends[g.devices[node]] = node
    return pairs


_TRANSFER_OPS = frozenset({names.SWAP_OUT_OP, names.SWAP_IN_OP, names.CACHE_OUT_OP,
                           names.CACHE_IN_OP})


def _keeps_merge(pair, before: int, step: dict) -> bool:
    """Whether an edge from `before` into a node of `pair` (None: a node in
    no merge pair) leaves the pair mergeable (see plan_sequence)."""
    if pair is None:
        return True
    if pair.strict or before in (pair.first, pair.second):
        return False
    return step[before] < min(step[pair.first], step[pair.second])


def _large_buffers(facts, min_bytes: int) -> dict:
    """Buffer of at least min_bytes that dies within the step -> the node of
    its last planned use. A buffer that lives to the step's end (an output
    of the step) has no last reader to hold to."""
    last = len(facts.schedule) - 1
    return {buffer: facts.schedule[stop]
            for buffer, (_, stop) in facts.buffer_intervals.items()
            if facts.buffer_bytes.get(buffer, 0) >= min_bytes and stop < last}


def _readers(g, facts, buffers) -> dict:
    """Buffer (of `buffers`) -> the nodes that read it through any tensor
    living in it (an alias's readers included)."""
    readers: dict = {buffer: set() for buffer in buffers}
    for (node, port), buffer in facts.buffers.items():
        if buffer in readers:
            readers[buffer].update(c for c, _, p in g.consumers[node] if p == port)
    return readers


def takeovers(g, facts, buffers=None) -> dict:
    """Node that takes a buffer over -> the nodes that read the buffer
    before it in facts.schedule.

    The analysis places a forwarding kernel's output (optable.FORWARDING_OPS)
    in the buffer of an input the kernel reads last, and an AssignVariableOp
    adopts a value it reads last as the variable's buffer (facts.handover).
    TensorFlow does either only when no other op has yet to read the
    buffer: run before such a reader, the kernel allocates a buffer of its
    own beside the one the analysis had it reuse. A view (an alias op, a
    reduction that keeps every element) shares a buffer without taking it
    over and waits for nothing.

    Args:
      g: the graph index.
      facts: its analysis, in the order whose buffers it placed or one that
        keeps each taker after these readers (memory_order's orders do).
      buffers: only these buffers' takers (None: every buffer's).

    Returns:
      {taker: {the nodes before it that read a tensor living in its
      buffer}}, for the takers with any.
    """
    step = {node: s for s, node in enumerate(facts.schedule)}
    tensors: dict = {}
    for tensor, buffer in facts.buffers.items():
        if buffers is None or buffer in buffers:
            tensors.setdefault(buffer, []).append(tensor)
    found: dict = {}
    for buffer, held in tensors.items():
        takers = [node for node, port in held
                  if port == 0 and (node, port) != buffer and node in step
                  and g.ops[node] in optable.FORWARDING_OPS
                  and g.ops[node] not in optable.ALIAS_OPS
                  and any(facts.buffers.get(t) == buffer for t in g.data_inputs[node])]
        handed = buffer in facts.handover and buffer in facts.buffer_intervals
        if not takers and not handed:
            continue    # most buffers: no one takes them over
        readers = {c for node, port in held for c, _, p in g.consumers[node]
                   if p == port and c in step}
        if handed:
            stop = facts.buffer_intervals[buffer][1]
            takers += [r for r in readers if g.ops[r] == optable.ASSIGN_VARIABLE_OP
                       and step[r] == stop]
        for taker in takers:
            earlier = {r for r in readers if step[r] < step[taker]}
            if earlier:
                found.setdefault(taker, set()).update(earlier)
    return found


def _alias_readers(g, read: int) -> list:
    """The nodes that read a tensor's buffer: its consumers, and those of
    the Identity ops that forward it (not the Identity ops themselves)."""
    found, stack = [], [read]
    while stack:
        for c, _, _ in g.consumers[stack.pop()]:
            if g.ops[c] == optable.IDENTITY_OP:
                stack.append(c)
            else:
                found.append(c)
    return found


def _ancestor_bits(g, bit: dict) -> dict:
    """Node -> an int with bit[m] set for each marked node m (the keys of
    `bit`) that is the node itself or one of its ancestors (data and
    control), by topological order."""
    bits = {}
    for node in g.topo:
        mask = 1 << bit[node] if node in bit else 0
        for p in [p for p, _ in g.data_inputs[node]] + list(g.control_inputs[node]):
            mask |= bits.get(p, 0)
        bits[node] = mask
    return bits
