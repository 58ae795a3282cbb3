"""Forward, backward or other: every node's phase, by structure."""

from __future__ import annotations

import collections
from typing import Iterable

from sntf.graph import optable
from sntf.graph.index import GraphIndex, ancestors, descendants, memoized
from sntf.graph.training import gradient_writes, variable_access, weight_users


FORWARD, BACKWARD, OTHER = "forward", "backward", "other"
def weight_consumers(g: GraphIndex) -> frozenset:
    """Forward ops that combine an updated variable with an activation.

    These anchor the forward pass of a training graph: every forward op that
    computes with a weight (MatMul(x, W), Conv2D(x, K), BiasAdd(h, b), a
    normalization's scale) and feeds some variable update. The backward pass
    has ops of the same shape (dx = dy W^T reads W and dy), told apart by
    structure: their activation input descends from another op that reads the
    same weight, which a forward op's input never does.

    Args:
      g: the graph index.

    Returns:
      Indices of the forward weight consumers.
    """
    return memoized(g, "weight_roles", _weight_roles)[0]


def _weight_roles(g: GraphIndex) -> tuple:
    """(forward weight consumers, the backward ops among the weight users
    that weight_consumers tells apart by structure: dx = dy W^T)."""
    updates, readers = variable_access(g)
    if not updates:
        return frozenset(), frozenset()
    all_updates = [u for us in updates.values() for u in us]
    feeding_updates = ancestors(g, all_updates, control=False, state=True)
    roles = _roles_of(g, list(updates), readers, feeding_updates)
    if roles[0]:
        return roles
    # The weights of a gradient-accumulation step are read, never written:
    # their gradients go into other variables, so the written variables
    # anchor nothing. Once the step is known to train that way
    # (gradient_writes), every variable it reads is a weight, as every
    # written one is above; the last layer's weights count too, though
    # their gradient (h^T dy) alone does not show reverse mode.
    accumulated = gradient_writes(g)
    if not accumulated.found:
        return roles
    weights = list(updates) + [h for h in accumulated.readers if h not in updates]
    return _roles_of(g, weights, {**accumulated.readers, **readers}, feeding_updates)


def _roles_of(g: GraphIndex, weights: list, readers: dict, feeding_updates: set
              ) -> tuple:
    """_weight_roles for the variables `weights` (handle roots), read by
    `readers` (root -> reader nodes)."""
    candidates = {}  # anchor -> (handles it reads, its activation inputs)
    for handle in weights:
        _, users = weight_users(g, handle, readers[handle])
        for f, acts in users:
            if f not in feeding_updates:
                continue
            handles, inputs = candidates.setdefault(f, (set(), set()))
            handles.add(handle)
            inputs.update(acts)
    if not candidates:
        return frozenset(), frozenset()
    bit = {f: 1 << k for k, f in enumerate(sorted(candidates))}
    reads_of = collections.defaultdict(int)  # handle -> mask of its consumers
    for f, (handles, _) in candidates.items():
        for h in handles:
            reads_of[h] |= bit[f]
    # mask[n]: the candidates n descends from (data edges), in one topo sweep.
    mask = [0] * len(g.names)
    producers = g.data_producers
    for n in g.topo:
        m = bit.get(n, 0)
        for p in producers[n]:
            m |= mask[p]
        mask[n] = m
    backward = set()
    for f, (handles, inputs) in candidates.items():
        same_weight = 0
        for h in handles:
            same_weight |= reads_of[h]
        same_weight &= ~bit[f]
        upstream = 0
        for x in inputs:
            upstream |= mask[x]
        if upstream & same_weight:
            backward.add(f)
    # Gradient kernels (by op type, a structural fact) and the backprop output
    # of fused losses start the backward pass too; an optimizer's ops that read
    # slot variables (Adam's m and v) sit downstream of them.
    tainted = descendants(g, backward | _gradient_sources(g, set(candidates) - backward))
    # A forward op's output flows into the gradient computation; an
    # optimizer op reading a slot (m, v) only flows into updates.
    feeds_gradients = ancestors(g, tainted, control=False)
    anchors = frozenset(f for f in candidates
                        if f not in tainted and f in feeds_gradients)
    return anchors, frozenset(backward)


def classify_phases(g: GraphIndex) -> tuple[str, ...]:
    """Labels every node forward, backward or other, by structure.

    Forward: ancestors of the weight consumers (the forward pass up to its
    last layer). Backward: nodes downstream of a weight consumer that feed a
    variable update and are not forward (the loss, the gradients and the
    optimizer's arithmetic). Other: everything else (metrics, counters,
    tf.data plumbing).

    Args:
      g: the graph index.

    Returns:
      One label per node, by node index.
    """
    anchors, backward_users = memoized(g, "weight_roles", _weight_roles)
    if not anchors:
        return tuple(OTHER for _ in g.names)
    below = descendants(g, anchors)
    # The gradient computation starts at the gradient kernels and at the
    # weight users told apart as backward (dx = dy W^T: a network of dense
    # layers whose loss gradient meets no gradient kernel has only these).
    # An op that waits on it by a control edge runs in the backward pass
    # too: TensorFlow's swish gradient recomputes sigmoid(x) from the
    # forward x once dy exists.
    tainted = descendants(g, _gradient_sources(g, anchors) | backward_users,
                          control=True)
    # The forward pass: up to the last weight consumer, then on to what the
    # step returns (the loss, through the metric that records it), short of
    # anything downstream of a gradient kernel.
    outputs = set(g.fetch) | {i for i, op in enumerate(g.ops) if op == "_Retval"}
    returned = ancestors(g, outputs, control=False, state=True)
    forward = ancestors(g, anchors, control=False) | ((returned & below) - tainted)
    all_updates = [i for i, op in enumerate(g.ops)
                   if g.data_inputs[i] and optable.is_update_op(op)]
    feeding = ancestors(g, all_updates, control=False, state=True)
    # Backward: the gradient computation (downstream of a gradient kernel, or
    # feeding one, like the loss seed) -- not statistics updates such as
    # BatchNormalization's moving averages, which only feed their variables.
    gradient_side = tainted | ancestors(g, tainted, control=False)
    # ...and what the loss seed feeds before any of that: a weight gradient
    # dW = h^T dy where dy met no gradient kernel.
    gradient_side |= descendants(g, (gradient_side & below) - forward)
    backward = ((below & feeding) - forward) & gradient_side
    return tuple(FORWARD if i in forward else BACKWARD if i in backward else OTHER
                 for i in range(len(g.names)))


def waits_for_loss(g: GraphIndex) -> frozenset:
    """Nodes downstream of the forward pass's output layers (the weight
    consumers no other one descends from): the loss and every backward op
    that waits for it.

    A backward op outside the set computes from forward values alone
    (GELU's exp(-x*x/2), the x - mean of a normalization's gradient): the
    executor runs it as soon as those exist, during the forward pass, so it
    cannot time anything in the backward pass. Control edges count, as
    they do for the executor.

    Args:
      g: the graph index.

    Returns:
      Node indices (empty when the graph updates no weight from an
      activation).
    """
    return memoized(g, "waits_for_loss", _waits_for_loss)


def _waits_for_loss(g: GraphIndex) -> frozenset:
    anchors = weight_consumers(g)
    upstream = ancestors(g, [p for a in anchors for p, _ in g.data_inputs[a]],
                         control=False)
    return frozenset(descendants(g, set(anchors) - upstream, control=True))


def _gradient_sources(g: GraphIndex, forward_users: Iterable[int]) -> set:
    """Gradient kernels and fused-loss backprop outputs (by op type).

    A gradient kernel that reads a weight no op upstream of it reads is a
    forward layer (forward_users): a transposed convolution is a
    Conv2DBackpropInput in the forward pass, and what follows it is not
    the backward pass.
    """
    forward_users = set(forward_users)
    sources = set()
    for n, op in enumerate(g.ops):
        if optable.is_gradient_op(op) and n not in forward_users:
            sources.add(n)
        elif op in optable.FUSED_LOSS_OPS:
            sources.update(c for c, _, port in g.consumers[n] if port == 1)
    return sources
