"""Order edges: control edges that change when ops run, never what they compute."""

from __future__ import annotations

from sntf.graph import optable
from sntf.graph.regions import control_flow_region
from sntf.graph.training import variable_access
from sntf.planner.plan import Order


def plan_gradient_order(g) -> tuple:
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

    Args:
      g: the graph index.

    Returns:
      Order edges (filter gradient -> input gradient of the same output
      gradient, see INPUT_GRADIENT_OPS), none that would close a cycle,
      cross devices or repeat an existing path.
    """
    pairs = []
    for w, op in enumerate(g.ops):
        slot = optable.WEIGHT_GRADIENT_OPS.get(op)
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
