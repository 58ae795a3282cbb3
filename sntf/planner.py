"""Planner: turns a graph (and its analysis) plus a policy into a Plan.

A Plan is plain data: one Decision per tensor sntf acts on (keep, swap or
recompute), each with the reason and its predicted effect, so a user can ask
why a tensor was swapped. Policies answer one question per tensor and know
nothing about how the rewrite is done.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Optional

KEEP, SWAP, RECOMPUTE = "keep", "swap", "recompute"
ACTIONS = (KEEP, SWAP, RECOMPUTE)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do with one tensor ("node:port"), and why."""

    tensor: str
    action: str
    reason: str
    bytes_saved: Optional[int] = None
    seconds_added: Optional[float] = None

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; actions: {ACTIONS}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's output: decisions plus the predicted memory picture."""

    policy: str
    decisions: tuple[Decision, ...] = ()
    predicted_peak_bytes: Optional[int] = None
    planned_peak_bytes: Optional[int] = None
    lower_bound_bytes: Optional[int] = None
    notes: tuple[str, ...] = ()
    recomputes: tuple = ()           # Recompute recipes, one per recomputed tensor
    swaps: tuple = ()                # Swap recipes, one per swapped tensor
    # Device budget for the run-time tensor cache: swaps then go through
    # SnCacheOut/SnCacheIn and copy only under memory pressure. None: every
    # swap copies (SnSwapOut/SnSwapIn).
    cache_budget: Optional[int] = None
    orders: tuple = ()               # Order edges (plan_gradient_order)

    def tensors(self, action: str) -> list[str]:
        """Tensors given `action`, in decision order."""
        return [d.tensor for d in self.decisions if d.action == action]

    @property
    def changes_graph(self) -> bool:
        return any(d.action != KEEP for d in self.decisions)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def identity_plan(policy: str, note: str = "") -> Plan:
    """The no-change plan: every tensor stays where TensorFlow puts it."""
    return Plan(policy=policy, notes=(note,) if note else ())


def make_plan(policy: str) -> Plan:
    """Plans a training graph under `policy`.

    Args:
      policy: a validated policy name. Only "off" is planned here; the
        others need the analysis and go through the pipeline's stages, so
        reaching them here is a bug.

    Returns:
      The Plan.
    """
    if policy == "off":
        return identity_plan(policy, "policy 'off': graph left as TensorFlow built it")
    raise ValueError(f"policy {policy!r} is planned by the pipeline's stages, "
                     "not by make_plan")


# ---------------------------------------------------------------- recompute
# Modes the planner itself plans; "auto" (sntf.enable's default) chooses
# between them per segment on the planned timeline, in the pipeline
# (sntf.pipeline._auto_recompute), since it needs rewrite and analysis.
RECOMPUTE_MODES = ("speed", "memory")
# Longest chain of cheap ops re-run to rebuild one tensor: recompute chains
# stop at checkpoints and never run back through a long residual chain.
MAX_RECOMPUTE_CHAIN = 8
# The same, when checkpoint ops are re-run too (segment_checkpoints): a
# segment of a few convolutions, each with Keras' unfused BatchNormalization
# (about a dozen ops) and an activation.
MAX_SEGMENT_CHAIN = 48
# Ops never re-run, whatever their class: reading a variable again could see
# a newer value; inputs, constants and handles are free to keep.
NEVER_RECOMPUTE_OPS = frozenset({
    "ReadVariableOp", "ResourceGather", "ResourceGatherNd", "_Arg", "Const",
    "HostConst", "Placeholder", "VarHandleOp", "IteratorGetNext", "Identity",
    "IdentityN", "NoOp",
    # Superneurons' CONCAT checkpoint: re-running a concatenation rebuilds
    # the whole joined tensor in the backward pass (measured: DenseNet's
    # peak rose to 1.03x baseline with concatenations recomputed).
    "ConcatV2", "Concat",
    # Paired with their gradient through a workspace: TensorFlow's oneDNN
    # graph pass (on by default on x86) links MaxPoolGrad to the MaxPool that
    # produced its input, and with a recomputed MaxPool that link closed a
    # cycle ("nodes in a cycle" in a GradientTape loop).
    "MaxPool", "MaxPoolV2", "MaxPool3D", "LRN",
})


@dataclasses.dataclass(frozen=True)
class RecomputeGroup:
    """Backward readers served by one clone of a chain, and what releases it."""

    consumers: tuple[tuple[str, int], ...]   # (node name, data input slot)
    trigger: str                             # clones wait for this node


@dataclasses.dataclass(frozen=True)
class Recompute:
    """How to rebuild one tensor in the backward pass."""

    tensor: str                      # "node:port" of the forward tensor
    chain: tuple[str, ...]           # nodes to clone, inputs before users
    groups: tuple[RecomputeGroup, ...]


def plan_recompute(g, facts, mode: str, protected: frozenset = frozenset(),
                   memory_tensors: frozenset = frozenset(),
                   order: Optional[tuple] = None,
                   segment_checkpoints: int = 0) -> Plan:
    """Superneurons' cost-aware recomputation of cheap forward tensors.

    A cheap forward tensor (activation, normalization, pooling, dropout...)
    that the backward pass reads is not kept from forward to backward: its
    chain of cheap ops is cloned from the nearest checkpoints and re-run just
    before its first backward reader, released by a control edge from the
    backward op scheduled right before that reader.

    Args:
      g: the graph index (sntf.graph.GraphIndex).
      facts: the analysis of g (sntf.analysis.Analysis).
      mode: "speed" (one clone serves every backward reader) or "memory"
        (one clone per reader, freed right after it).
      protected: node indices that must not be recomputed (fetch, preserve).
      memory_tensors: "node:port" names planned memory-centric whatever the
        mode (the pipeline's auto mode chooses them from a planned timeline).
      order: the node order readers are sorted by and release points picked
        on; None: facts.schedule, the predicted executor order.
      segment_checkpoints: 0 keeps every checkpoint op's output (the
        paper's rule). N > 0 also re-runs checkpoint ops (convolutions,
        matmuls) in chains of up to N of them, keeping only the inputs of
        each chain (see _segment_inputs).

    Returns:
      A Plan with one RECOMPUTE decision and one Recompute recipe per tensor.
    """
    from sntf import analysis
    from sntf import graph as graph_model

    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute mode {mode!r}; modes: {RECOMPUTE_MODES}")
    if graph_model.loop_ops(g):
        return identity_plan("recompute", "control flow present (a loop): "
                             "not recomputed")
    cost_step = {node: s for s, node in enumerate(facts.schedule)}   # op_seconds
    step_of = {node: s for s, node in enumerate(order)} if order else cost_step
    phases = facts.phases
    region = graph_model.control_flow_region(g)

    classes = (analysis.CHEAP, analysis.CHECKPOINT) if segment_checkpoints else (
        analysis.CHEAP,)

    def recomputable(i: int) -> bool:
        return (phases[i] == graph_model.FORWARD and i not in protected
                and i not in region
                and g.ops[i] not in NEVER_RECOMPUTE_OPS
                and analysis.op_class(g.ops[i]) in classes
                and not graph_model.is_update_op(g.ops[i]))

    if segment_checkpoints:
        # Chains start from the kept segment inputs and rebuild everything
        # between them, the tensors the backward pass reads included.
        kept = _segment_inputs(g, facts, recomputable, segment_checkpoints)
        max_chain = MAX_SEGMENT_CHAIN
    else:
        # Tensors the backward pass reads stay alive until then anyway: a
        # chain starts from them rather than re-running what produced them.
        kept = {i for i in range(len(g.names))
                if any(phases[c] == graph_model.BACKWARD for c, _, _ in g.consumers[i])}
        max_chain = MAX_RECOMPUTE_CHAIN
    candidates = []       # (buffer, tensor name, Recompute, Decision)
    for producer in facts.schedule:
        if (not recomputable(producer) or g.ops[producer] in analysis.ALIAS_OPS
                or (segment_checkpoints and producer in kept)):
            continue
        for port in sorted({p for _, _, p in g.consumers[producer]}):
            t = (producer, port)
            buffer = facts.buffer_of(t)
            if buffer is None:
                continue
            # With segments, readers of the shape alone keep the original
            # (as in plan_swap): they run as soon as it exists, and a clone's
            # release point cannot be found for them, so a conv output that
            # a Shape op reads (graphs with a dynamic batch) would never be
            # recomputed. Under the paper's rule such tensors stay kept:
            # recomputing them too planned higher (ResNet-14 auto: 58.1 ->
            # 59.5 MiB, DenseNet speed: 87.9 -> 102.3).
            readers = [(c, slot) for c, slot, p in g.consumers[producer]
                       if p == port and phases[c] == graph_model.BACKWARD
                       and not (segment_checkpoints and g.ops[c] in METADATA_OPS)]
            if not readers or _read_under_control_flow(g, t, region):
                continue
            chain = _chain(g, producer, recomputable, kept, max_chain)
            if chain is None:
                continue
            chain = sorted(chain, key=step_of.get)
            saved = facts.tensor_bytes.get(buffer, 0)
            name = f"{g.names[producer]}:{port}"
            groups = _groups(g, readers, "memory" if name in memory_tensors else mode,
                             step_of, facts)
            if not groups:
                continue
            recipe = Recompute(tensor=name, chain=tuple(g.names[i] for i in chain),
                               groups=tuple(groups))
            seconds = sum(facts.op_seconds[cost_step[i]] for i in chain) * len(groups)
            decision = Decision(
                tensor=name, action=RECOMPUTE,
                reason=(f"{'' if segment_checkpoints else 'cheap '}{g.ops[producer]} "
                        f"output read by {len(readers)} "
                        f"backward op(s); {len(chain)} op(s) re-run "
                        f"{'per reader' if len(groups) > 1 else 'once'}"),
                bytes_saved=saved, seconds_added=seconds)
            candidates.append((buffer, t, recipe, decision))
    recipes, decisions = _whole_buffers(g, facts, candidates, phases)
    notes = (f"recompute ({mode}): {len(recipes)} tensor(s)",
             *_control_flow_note(region))
    return Plan(policy="recompute", decisions=tuple(decisions), notes=notes,
                recomputes=tuple(recipes))


@dataclasses.dataclass(frozen=True)
class Order:
    """A control edge: node `after` waits for node `before` (names)."""

    before: str
    after: str


# Weight-gradient ops and the input slot of the output gradient they read.
WEIGHT_GRADIENT_OPS = {"Conv2DBackpropFilter": 2, "Conv2DBackpropFilterV2": 2,
                       "DepthwiseConv2dNativeBackpropFilter": 2,
                       "Conv3DBackpropFilterV2": 2}
# The readers made to wait for a weight gradient: the input gradients that
# carry the backward chain on. Not BiasAddGrad: oneDNN's graph pass (on by
# default on x86) fuses a filter gradient with the bias gradient of the
# same output gradient, and an edge between them changed the bias
# gradient's bits (found by tools/fuzz_pass.py).
INPUT_GRADIENT_OPS = frozenset({"Conv2DBackpropInput", "Conv2DBackpropInputV2",
                                "DepthwiseConv2dNativeBackpropInput",
                                "Conv3DBackpropInputV2"})


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
        if op not in WEIGHT_GRADIENT_OPS or len(g.data_inputs[w]) <= WEIGHT_GRADIENT_OPS[op]:
            continue
        producer, port = g.data_inputs[w][WEIGHT_GRADIENT_OPS[op]]
        # A reader upstream of w (through a clone's release edge, say) must
        # not wait for it; _new_orders drops those pairs.
        pairs += [(w, c) for c, _, p in g.consumers[producer]
                  if p == port and g.ops[c] in INPUT_GRADIENT_OPS
                  and g.devices[c] == g.devices[w]]
    return _new_orders(g, pairs)


def _new_orders(g, pairs: list) -> tuple:
    """Order edges for (before, after) node pairs, in the pairs' order, less
    duplicates and the pairs already ordered (before is an ancestor of
    after) or that would close a cycle (after is an ancestor of before)."""
    if not pairs:
        return ()
    bit = {n: k for k, n in enumerate(sorted({n for pair in pairs for n in pair}))}
    ancestors = _ancestor_bits(g, bit)
    orders = {}
    for before, after in pairs:
        if not (ancestors[after] >> bit[before] & 1 or ancestors[before] >> bit[after] & 1):
            orders[(before, after)] = Order(before=g.names[before], after=g.names[after])
    return tuple(orders.values())


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
    Measured: DenseNet's memory-centric plan peaked at 75.2 MiB in the
    first step and 95.6-101.2 MiB in every later one; with these edges,
    76.0 MiB in every step. Values are unchanged (a reader sees the value
    before the update either way); only the order is.

    Args:
      g: the graph index.

    Returns:
      Order edges (reader -> update), none that would close a cycle, cross
      devices, touch a control-flow region, or repeat an existing path.
    """
    from sntf import graph as graph_model

    region = graph_model.control_flow_region(g)
    position = {node: k for k, node in enumerate(g.topo)}
    updates, readers = graph_model.variable_access(g)
    pairs = []
    for root, ups in updates.items():
        reads = [r for r in readers.get(root, ()) if g.ops[r] == "ReadVariableOp"]
        for u in ups:
            if u in region:
                continue
            for r in reads:
                # Reads after the update (automatic control dependencies
                # order them after it) see the new value.
                if position[r] < position[u]:
                    pairs += [(c, u) for c in _alias_readers(g, r)
                              if c != u and c not in region
                              and not graph_model.is_update_op(g.ops[c])
                              and g.devices[c] == g.devices[u]]
    return _new_orders(g, pairs)


def _alias_readers(g, read: int) -> list:
    """The nodes that read a tensor's buffer: its consumers, and those of
    the Identity ops that forward it (not the Identity ops themselves)."""
    found, stack = [], [read]
    while stack:
        for c, _, _ in g.consumers[stack.pop()]:
            if g.ops[c] == "Identity":
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


def _read_under_control_flow(g, tensor: tuple, region: frozenset) -> bool:
    """Whether a node under control flow reads the tensor (see
    graph.control_flow_region): such a tensor is left as it is."""
    return bool(region) and any(c in region for c, _, p in g.consumers[tensor[0]]
                                if p == tensor[1])


def _control_flow_note(region: frozenset) -> tuple:
    """The plan note that says how much control flow was left alone."""
    if not region:
        return ()
    return (f"control flow present: {len(region)} op(s) in or after a "
            "conditional left alone",)


def _whole_buffers(g, facts, candidates, phases):
    """Keeps the candidates whose buffer is freed by the plan.

    An op that runs in place (a ReLU after a BatchNorm's add) leaves its
    output in its input's buffer, so that buffer is what the backward pass
    keeps alive. It dies early only if every tensor living in it that the
    backward pass reads is recomputed; recomputing some of them saves
    nothing, so those are dropped. Each buffer's bytes count once.
    """
    backward_read = _backward_read_by_buffer(g, facts)
    # A clone may still read the original of another recomputed tensor (a
    # ResNet block's output feeds the next block's join); that only moves the
    # original's death to the clone, earlier in the backward pass, which the
    # planned analysis accounts for.
    covered = {}
    for buffer, t, _, _ in candidates:
        covered.setdefault(buffer, set()).add(t)
    candidates = [c for c in candidates
                  if not backward_read.get(c[0], set()) - covered[c[0]]
                  and c[0] not in _chain_input_buffers(g, facts, c[2])]
    recipes, decisions, counted = [], [], set()
    for buffer, t, recipe, decision in candidates:
        if buffer in counted:
            decision = dataclasses.replace(
                decision, bytes_saved=0,
                reason=decision.reason + "; shares its buffer with another "
                "recomputed tensor")
        counted.add(buffer)
        recipes.append(recipe)
        decisions.append(decision)
    return recipes, decisions


def _chain_input_buffers(g, facts, recipe) -> set:
    """Buffers a recipe's clones read: a chain rooted in its own tensor's
    buffer (a ReLU computed in place over a kept MatMul output) frees nothing."""
    members = {g.node(name) for name in recipe.chain}
    return {facts.buffer_of((p, port)) for i in members
            for p, port in g.data_inputs[i] if p not in members}


def _chain(g, producer: int, recomputable, kept: set,
           max_chain: int = MAX_RECOMPUTE_CHAIN) -> Optional[list]:
    """The nodes to re-run for `producer` (on its device: clones run where
    their originals did), or None if the chain is too long."""
    chain, stack = {producer}, [producer]
    while stack:
        node = stack.pop()
        for p, _ in g.data_inputs[node]:
            if p in chain or p in kept or not _walkable(g, p, producer, recomputable):
                continue
            chain.add(p)
            if len(chain) > max_chain:
                return None
            stack.append(p)
    return list(chain)


def _walkable(g, p: int, node: int, recomputable) -> bool:
    """Whether a chain that re-runs `node` may re-run its input `p` too."""
    return (recomputable(p) and g.ops[p] not in _VIEW_OPS
            and g.devices[p] == g.devices[node])


def _segment_inputs(g, facts, recomputable, per_segment: int) -> set:
    """The nodes whose outputs are kept when checkpoint ops are recomputed.

    Walking the forward pass in schedule order, each recomputable node
    gets the chain that would rebuild it from kept tensors. A node whose
    chain would hold more than `per_segment` checkpoint ops (convolutions,
    matmuls) or more than MAX_SEGMENT_CHAIN nodes keeps its own inputs
    instead, which starts a new segment there: a ResNet block's input (the
    chain of a block's first convolution would otherwise run back along the
    shortcut into the blocks before), every few layers of a VGG chain. What
    no chain may re-run (variables, concatenations, pools, other devices)
    is kept anyway.
    """
    from sntf import analysis

    chains, kept = {}, set()
    for node in facts.schedule:
        if not recomputable(node):
            continue
        inputs = [p for p, _ in g.data_inputs[node]
                  if p in chains and p not in kept and _walkable(g, p, node, recomputable)]
        chain = frozenset({node}).union(*(chains[p] for p in inputs))
        checkpoints = sum(analysis.op_class(g.ops[i]) == analysis.CHECKPOINT
                          for i in chain)
        if checkpoints > per_segment or len(chain) > MAX_SEGMENT_CHAIN:
            kept.update(inputs)
            chain = frozenset({node})
        chains[node] = chain
    return kept


_VIEW_OPS = frozenset({"Reshape", "ExpandDims", "Squeeze", "Snapshot"})


def _groups(g, readers, mode, step_of, facts) -> list:
    """Groups of backward readers, each with the node that releases its clone."""
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
        # No compute to cover (0.0): the ancestor's op_seconds, looked up by
        # step_of, are never read, so step_of may be another order than
        # facts.schedule (plan_recompute's `order`).
        trigger = gradient_ancestor(g, facts, step_of, c, 0.0, device)
        if trigger is None:
            return []
        groups.append(RecomputeGroup(
            consumers=tuple((g.names[c], slot) for c, slot in batch),
            trigger=g.names[trigger]))
    return groups


# ---------------------------------------------------------------- swap
# Dtypes SnSwapOut/SnSwapIn are registered for (DataType enum values): plain
# bytes only; strings, resources and variants own heap objects.
SWAP_DTYPES = frozenset({1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                         17, 18, 19, 22, 23})
# A swap-in serves the backward readers that run within this many transfer
# times of the group's first reader; a later reader gets its own swap-in, so
# the tensor does not sit on the device between distant readers.
SWAP_WINDOW_TRANSFERS = 4.0
# oneDNN's graph pass (MklLayoutRewritePass, on by default on x86) pairs a
# forward op with its gradient through a workspace tensor when the gradient
# reads the forward output directly, at this input slot. Served by a
# swap-in, the gradient loses the pairing and runs TensorFlow's own kernel,
# which breaks ties between equal maxima differently (found by
# tools/fuzz_pass.py: a max pool after dropout, one gradient 1 ulp off).
WORKSPACE_PAIRS = {("MaxPool", "MaxPoolGrad"): 1, ("MaxPool3D", "MaxPool3DGrad"): 1,
                   ("LRN", "LRNGrad"): 2}
# Readers that need only a tensor's shape: they keep reading the original
# (they are ready, and run, as soon as the tensor exists).
METADATA_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


@dataclasses.dataclass(frozen=True)
class SwapGroup:
    """Backward readers served by one SnSwapIn, and the node that starts it."""

    consumers: tuple[tuple[str, int], ...]   # (node name, data input slot)
    trigger: str                             # the swap-in waits for this node


@dataclasses.dataclass(frozen=True)
class Swap:
    """How to park one forward tensor in the host pool until the backward pass."""

    tensor: str                      # "node:port"
    dtype: int                       # DataType enum (the ops' T attr)
    groups: tuple[SwapGroup, ...]
    shape: Optional[tuple] = None    # static shape (-1: unknown dim; None: unknown rank)
    # Forward readers of the tensor: they wait for the swap-out, so the copy
    # is made while they hold the tensor anyway and the device buffer dies
    # with its last forward reader (left alone, the executor may run the
    # swap-out late and keep the buffer alive meanwhile).
    forward_readers: tuple[str, ...] = ()


def plan_swap(g, facts, dtypes: dict, min_bytes: int, bandwidth: float,
              protected: frozenset = frozenset(), shapes: Optional[dict] = None,
              workspace_pairs: bool = True) -> Plan:
    """Superneurons' unified tensor pool: offload, then prefetch.

    A forward tensor of at least `min_bytes` that the backward pass reads is
    copied to the host pool by SnSwapOut (the device copy then dies after its
    last forward reader) and brought back by SnSwapIn before its first
    backward reader. The swap-in is released by a control edge from the
    backward op a prefetch distance earlier: far enough back that the
    estimated compute of the ops in between covers the transfer at
    `bandwidth`.

    Args:
      g: the graph index (sntf.graph.GraphIndex).
      facts: the analysis of g (sntf.analysis.Analysis).
      dtypes: (node, port) -> DataType enum of each tensor.
      min_bytes: smaller tensors are never swapped.
      bandwidth: host link bandwidth in bytes per second.
      protected: node indices that must stay as they are (fetch, preserve).
      shapes: (node, port) -> static shape, recorded for the cache ops'
        shape inference.
      workspace_pairs: whether oneDNN pairs ops with their gradients (see
        WORKSPACE_PAIRS); such a pair's tensor is then not swapped.

    Returns:
      A Plan with one SWAP decision and one Swap recipe per tensor.
    """
    from sntf import analysis
    from sntf import graph as graph_model

    if graph_model.loop_ops(g):
        return identity_plan("swap", "control flow present (a loop): nothing swapped")
    region = graph_model.control_flow_region(g)
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth!r}")
    phases = facts.phases
    step_of = {node: s for s, node in enumerate(facts.schedule)}
    # elapsed[s]: estimated compute before step s, so any span costs O(1).
    elapsed = list(itertools.accumulate(facts.op_seconds, initial=0.0))
    backward_read = _backward_read_by_buffer(g, facts)
    decisions, recipes = [], []
    for producer in facts.schedule:
        if (phases[producer] != graph_model.FORWARD or producer in protected
                or producer in region or g.ops[producer] in analysis.ALIAS_OPS
                or g.ops[producer] in analysis.FREE_OPS
                or g.ops[producer] in analysis.PERSISTENT_OPS
                or graph_model.is_update_op(g.ops[producer])):
            continue
        for port in sorted({p for _, _, p in g.consumers[producer]}):
            t = (producer, port)
            # An op that ran in place leaves t in its input's buffer; that
            # buffer is freed by swapping t when t is the only tensor in it
            # the backward pass reads.
            buffer = facts.buffer_of(t)
            size = facts.tensor_bytes.get(buffer, 0) if buffer else 0
            if (buffer is None or size < max(min_bytes, 1)
                    or dtypes.get(t) not in SWAP_DTYPES
                    or backward_read.get(buffer, set()) != {t}
                    or _read_under_control_flow(g, t, region)
                    or (workspace_pairs and _workspace_paired(g, t))):
                continue
            readers = sorted(((c, slot) for c, slot, p in g.consumers[producer]
                              if p == port and phases[c] == graph_model.BACKWARD
                              and g.ops[c] not in METADATA_OPS),
                             key=lambda r: step_of[r[0]])
            transfer = size / bandwidth
            groups = _swap_groups(g, facts, readers, transfer, step_of, elapsed)
            if not groups:
                continue
            name = f"{g.names[producer]}:{port}"
            forward = sorted({g.names[c] for c, _, p in g.consumers[producer]
                              if p == port and (phases[c] != graph_model.BACKWARD
                                                or g.ops[c] in METADATA_OPS)})
            recipes.append(Swap(tensor=name, dtype=dtypes[t], groups=tuple(groups),
                                shape=(shapes or {}).get(t),
                                forward_readers=tuple(forward)))
            decisions.append(Decision(
                tensor=name, action=SWAP,
                reason=(f"{g.ops[producer]} output of {size} bytes read by "
                        f"{len(readers)} backward op(s); {len(groups)} swap-in(s), "
                        f"prefetched {transfer * 1e3:.3f} ms of transfer ahead"),
                bytes_saved=size,
                seconds_added=_exposed_transfer(groups, transfer, g, step_of, elapsed)))
    notes = (f"swap: {len(recipes)} tensor(s) of at least {min_bytes} bytes",
             *_control_flow_note(region))
    return Plan(policy="swap", decisions=tuple(decisions), notes=notes,
                swaps=tuple(recipes))


def _workspace_paired(g, tensor: tuple) -> bool:
    """Whether the tensor's gradient op reads it where oneDNN pairs the two."""
    producer, port = tensor
    return port == 0 and any(
        WORKSPACE_PAIRS.get((g.ops[producer], g.ops[c])) == slot
        for c, slot, p in g.consumers[producer] if p == port)


def _backward_read_by_buffer(g, facts) -> dict:
    """Buffer -> the forward tensors living in it that the backward pass reads."""
    from sntf import graph as graph_model

    phases = facts.phases
    result = {}
    for t, buffer in facts.buffers.items():
        if phases[t[0]] == graph_model.FORWARD and any(
                phases[c] == graph_model.BACKWARD
                for c, _, p in g.consumers[t[0]] if p == t[1]):
            result.setdefault(buffer, set()).add(t)
    return result


def _swap_groups(g, facts, readers, transfer, step_of, elapsed) -> list:
    """Splits readers into swap-in windows and picks each one's prefetch trigger."""
    groups, current = [], []
    window = SWAP_WINDOW_TRANSFERS * transfer
    for reader in readers:
        if current and (elapsed[step_of[reader[0]]]
                        - elapsed[step_of[current[0][0]]]) > window:
            groups.append(current)
            current = []
        current.append(reader)
    if current:
        groups.append(current)
    result = []
    for batch in groups:
        c, slot = batch[0]
        trigger = gradient_ancestor(g, facts, step_of, c, transfer,
                                    g.devices[g.data_inputs[c][slot][0]])
        if trigger is None:
            return []
        result.append(SwapGroup(consumers=tuple((g.names[c], slot) for c, slot in batch),
                                trigger=g.names[trigger]))
    return result


def gradient_ancestor(g, facts, step_of: dict, reader: int, seconds: float,
                      device: Optional[str] = None) -> Optional[int]:
    """The backward op that releases a swap-in needed by `reader`.

    Walks back from `reader` along the backward pass's critical path: at each
    op, to its backward-phase data input scheduled last (the gradient that
    arrives last). It stops at the first op whose estimated compute up to the
    reader covers `seconds`. Being an ancestor of the reader, the trigger
    runs shortly before it in any executor order; an op merely scheduled
    nearby in the predicted order (a shape computation, another branch) can
    run much earlier, bringing the tensor back long before it is needed
    (measured: a 178-layer ResNet peaked 1.24x above baseline that way).

    Args:
      g, facts: the graph index and its analysis.
      step_of: node index -> schedule step.
      reader: the node that needs the tensor.
      seconds: compute to leave between the trigger and the reader.
      device: only ops placed on this device are followed (the trigger's
        control edge must not cross devices); None: any.

    Returns:
      The node index, or None when the reader has no backward input.
    """
    from sntf import graph as graph_model

    covered, node, found = 0.0, reader, None
    while True:
        # Control inputs count: a recomputed clone waits on its trigger.
        preds = [p for p, _ in g.data_inputs[node]] + list(g.control_inputs[node])
        inputs = [p for p in preds if facts.phases[p] == graph_model.BACKWARD
                  and (device is None or g.devices[p] == device)]
        if not inputs:
            return found
        node = max(inputs, key=step_of.get)
        found = node
        covered += facts.op_seconds[step_of[node]]
        if covered >= seconds:
            return node


def _exposed_transfer(groups, transfer, g, step_of, elapsed) -> float:
    """Predicted extra time: the swap-out's transfer (the tensor's forward
    readers wait for it, see Swap.forward_readers), plus each swap-in's
    transfer not hidden behind the ops between its trigger and its first
    reader."""
    exposed = transfer
    for group in groups:
        start = step_of[g.node(group.trigger)]
        end = step_of[g.node(group.consumers[0][0])]
        exposed += max(0.0, transfer - (elapsed[end] - elapsed[start]))
    return exposed
