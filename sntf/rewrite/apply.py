"""Plan + GraphDef -> new GraphDef.

Never mutates its input. Generated nodes carry the marker attribute from
`sntf.graph.names`, which is what makes the pass idempotent. A plan's
conditional swaps (Plan.cache_budget set) become the tensor cache's ops,
unconditional ones the swap ops.
"""

from __future__ import annotations

import dataclasses

from sntf import planner
from sntf.graph import names
from sntf.graph.index import on_gpu, parse_input


@dataclasses.dataclass(frozen=True)
class RewriteResult:
    """The rewritten graph and whether anything changed."""

    graph_def: object
    modified: bool
    # Names of the input graph's nodes whose inputs changed (new nodes
    # come after the input graph's, which keep their positions).
    touched: frozenset = frozenset()


class _Nodes:
    """A GraphDef's nodes by name: those of its index by position (naming
    every node of a large graph costs more than the rewrite), then those
    added."""

    def __init__(self, graph_def, index=None):
        self._node = graph_def.node
        self._at = index.index if index is not None else {
            node.name: k for k, node in enumerate(graph_def.node)}
        self._added: dict = {}

    def __contains__(self, name: str) -> bool:
        return name in self._added or name in self._at

    def __getitem__(self, name: str):
        node = self._added.get(name)
        return node if node is not None else self._node[self._at[name]]

    def __setitem__(self, name: str, node) -> None:
        self._added[name] = node


def apply_plan(graph_def, plan: planner.Plan, index=None) -> RewriteResult:
    """Applies a plan to a copy of `graph_def`.

    Args:
      graph_def: the input GraphDef (left untouched).
      plan: the plan to apply.
      index: graph_def's GraphIndex, where the caller has it.

    Returns:
      A RewriteResult holding a new GraphDef.

    Raises:
      ValueError: a recipe names a node the graph does not have, or a
        decision has no recipe.
    """
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    recipes = {planner.SWAP: {r.tensor for r in plan.swaps},
               planner.RECOMPUTE: {r.tensor for r in plan.recomputes}}
    for d in plan.decisions:
        if d.action != planner.KEEP and d.tensor not in recipes[d.action]:
            raise ValueError(f"plan decides {d.action} for {d.tensor} but holds "
                             "no recipe for it")
    nodes = _Nodes(out, index)
    touched: set = set()
    groups = 0   # a running index keeps every clone's name unique
    for recipe in plan.recomputes:
        _apply_recompute(out, nodes, recipe, groups, touched)
        groups += len(recipe.groups)
    for recipe in plan.swaps:
        _apply_swap(out, nodes, recipe, plan.cache_budget, touched)
    _add_orders(nodes, plan.orders, touched)
    return RewriteResult(graph_def=out,
                         modified=bool(plan.recomputes or plan.swaps or plan.orders),
                         touched=frozenset(touched))


def _check_device(node, trigger, tensor: str) -> None:
    """Refuses a control edge from a trigger on another device.

    A generated node runs on its tensor's device; a control edge to it from
    another device ties the two devices' executors together (TensorFlow
    turns it into a Send/Recv pair when it partitions the graph), and on two
    logical CPU devices such an edge deadlocked the step. The pass then
    hands the graph back unchanged, with the reason in its report.

    Raises:
      ValueError: naming the tensor, the trigger and both devices.
    """
    if node.device and trigger.device and node.device != trigger.device:
        raise _crossing(tensor, node.name, node.device, trigger.name, trigger.device)


def _crossing(tensor: str, name: str, device: str, trigger: str,
              trigger_device: str) -> ValueError:
    return ValueError(f"plan crosses devices: {tensor} needs {name!r} on {device} "
                      f"released by {trigger!r} on {trigger_device}")


def _apply_swap(out, nodes: _Nodes, recipe: planner.Swap, cache_budget, touched: set) -> None:
    """Adds a swap-out after the producer and one swap-in per group, each
    released by its prefetch trigger, and rewires the group's readers.

    Without a cache budget the pair is SnSwapOut/SnSwapIn (always copies);
    with one it is SnCacheOut/SnCacheIn, which copy only under pressure."""
    producer, port = names.split_tensor(recipe.tensor)
    source = _node(nodes, producer)
    cached = cache_budget is not None
    swap_out = _new_node(out, names.swap_out_name(producer, port),
                         names.CACHE_OUT_OP if cached else names.SWAP_OUT_OP,
                         [recipe.tensor if port else producer], source.device,
                         recipe.dtype, names.ROLE_SWAP_OUT)
    if cached:
        swap_out.attr["budget"].i = int(cache_budget)
        swap_out.attr["uses"].i = len(recipe.groups)
    for reader in _waiting_readers(nodes, recipe, source):
        reader.input.append("^" + swap_out.name)
        touched.add(reader.name)
    for j, group in enumerate(recipe.groups):
        _node(nodes, group.trigger)     # a missing trigger is a ValueError
        swap_in = _new_node(out, names.swap_in_name(producer, port, j),
                            names.CACHE_IN_OP if cached else names.SWAP_IN_OP,
                            [swap_out.name, "^" + group.trigger], source.device,
                            recipe.dtype, names.ROLE_SWAP_IN)
        _check_device(swap_in, nodes[group.trigger], recipe.tensor)
        if cached:
            _set_shape(swap_in.attr["shape"].shape, recipe.shape)
        for consumer, slot in group.consumers:
            _set_data_input(_node(nodes, consumer), slot, swap_in.name)
            touched.add(consumer)


def _waiting_readers(nodes: _Nodes, recipe: planner.Swap, source) -> list:
    """The forward readers that wait for the tensor's swap-out.

    On a CPU the swap-out copies on the executor's thread, and left alone
    the executor may run it after the forward readers, holding the buffer
    meanwhile: the readers wait for it, so the copy is made while they hold
    the tensor anyway. On a GPU the swap-out is an asynchronous kernel that
    completes when its copy does, and the copy holds a reference to the
    tensor until then, as TensorFlow's own device-to-host copy does
    (GPUUtil::CopyGPUTensorToCPU keeps a TensorReference to its source): a
    reader waiting for it would put the whole copy on the compute path. A
    reader on another device already waits for the tensor through
    TensorFlow's Send/Recv; a control edge across devices on top of it would
    tie the devices' executors together for nothing.
    """
    if on_gpu(source.device):
        return []
    readers = [_node(nodes, name) for name in recipe.forward_readers]
    return [r for r in readers
            if not (r.device and source.device and r.device != source.device)]


def _set_shape(proto, shape) -> None:
    """Fills a TensorShapeProto: None is an unknown rank, -1 an unknown dim.

    A scalar's shape has no field to fill; SetInParent still marks the
    enclosing AttrValue as holding a shape (an AttrValue with nothing set is
    read by TensorFlow as an unbound placeholder: "Failed to bind all
    placeholders" when the function is instantiated)."""
    proto.SetInParent()
    if shape is None:
        proto.unknown_rank = True
        return
    for d in shape:
        proto.dim.add().size = int(d)


def _new_node(out, name: str, op: str, inputs: list, device: str, dtype: int, role: str):
    node = out.node.add()
    node.name, node.op, node.device = name, op, device
    node.input.extend(inputs)
    node.attr["T"].type = dtype
    names.mark(node, role)
    return node


def _apply_recompute(out, nodes: _Nodes, recipe: planner.Recompute, first: int,
                     touched: set) -> None:
    """Clones a recipe's chain once per group and rewires the group's readers."""
    producer, port = names.split_tensor(recipe.tensor)
    for j, group in enumerate(recipe.groups):
        clones = {}
        for name in recipe.chain:
            original = _node(nodes, name)
            clone = out.node.add()
            clone.CopyFrom(original)
            clone.name = names.recompute_name(name, first + j)
            names.mark(clone, names.ROLE_RECOMPUTE)
            del clone.input[:]
            roots_only = True
            for text in original.input:
                src, src_port, control = parse_input(text)
                if not control and src in clones:
                    clone.input.append(names.tensor_name(clones[src], src_port))
                    roots_only = False
                else:
                    clone.input.append(text)
            if roots_only:
                # Held back until the backward pass reaches this point;
                # without it TensorFlow runs the clone at once and nothing
                # is saved. Control inputs go after data inputs.
                _check_device(clone, _node(nodes, group.trigger), recipe.tensor)
                clone.input.append("^" + group.trigger)
            clones[name] = clone.name
            nodes[clone.name] = clone
        for consumer, slot in group.consumers:
            _set_data_input(_node(nodes, consumer), slot,
                            names.tensor_name(clones[producer], port))
            touched.add(consumer)


def _add_orders(nodes: _Nodes, orders, touched: set) -> None:
    """Makes each order's `after` node wait for its `before` node
    (order_inputs). A held order can bring hundreds of thousands of edges
    to a deep network's graph, so each node's inputs are read and extended
    once, not once per edge."""
    def controls(name: str):
        return (text[1:] for text in _node(nodes, name).input if text.startswith("^"))

    added = order_inputs(orders, controls, lambda name: _node(nodes, name).device)
    touched.update(added)
    for name, before in added.items():
        if before:
            _node(nodes, name).input.extend("^" + b for b in before)


def order_inputs(orders, controls, device) -> dict:
    """The control inputs a plan's orders append: to each order's `after`
    node, its `before` node, after the node's inputs, in the plan's order,
    each once and none the node has already, on the same device only
    (_check_device).

    Args:
      orders: the plan's Order edges.
      controls: node name -> the names of its control inputs; raises
        ValueError for a node the graph does not have.
      device: node name -> its device; raises ValueError likewise.

    Returns:
      `after` node name -> the names of the control inputs appended to it
      (an empty list where it has them all already).

    Raises:
      ValueError: an order names a missing node or crosses devices.
    """
    devices: dict = {}
    have: dict = {}      # node name -> its control inputs, those added included
    added: dict = {}     # node name -> control inputs to append, in order
    for order in orders:
        after, before = order.after, order.before
        if after not in have:
            have[after] = set(controls(after))
            added[after] = []
            devices[after] = device(after)
        if before not in devices:
            devices[before] = device(before)
        here, there = devices[after], devices[before]
        if here and there and here != there:
            raise _crossing(after, after, here, before, there)
        if before not in have[after]:
            have[after].add(before)
            added[after].append(before)
    return added


def index_order_inputs(index, orders) -> dict:
    """order_inputs over a graph's index, for a plan of orders alone: node
    -> the producers of the control inputs appended to it, by position.

    Raises:
      ValueError: as order_inputs.
    """
    names, control_inputs, devices = index.names, index.control_inputs, index.devices

    def at(name: str) -> int:
        k = index.index.get(name)
        if k is None:
            raise _missing(name)
        return k

    added = order_inputs(orders, lambda name: (names[p] for p in control_inputs[at(name)]),
                         lambda name: devices[at(name)])
    return {at(name): [at(b) for b in before] for name, before in added.items()}


def _node(nodes: _Nodes, name: str):
    if name not in nodes:
        raise _missing(name)
    return nodes[name]


def _missing(name: str) -> ValueError:
    return ValueError(f"plan names node {name!r}, which the graph does not have")


def _set_data_input(node, slot: int, text: str) -> None:
    """Replaces the slot-th data input of a NodeDef."""
    data = [i for i, t in enumerate(node.input) if not t.startswith("^")]
    node.input[data[slot]] = text


def set_cache_limits(graph_def, budget: int, headroom: int):
    """A copy of a graph with every tensor-cache swap-out given its run-time
    limits: the device budget (its live-bytes test, a guard for a plan that
    under-estimates) and the headroom (its cap on the device's cached
    bytes; a negative headroom leaves none, and every swap copies).

    Args:
      graph_def: a rewritten GraphDef (left untouched).
      budget: the device budget in bytes.
      headroom: bytes of swapped tensors the device may keep.

    Returns:
      The new GraphDef.
    """
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for node in out.node:
        if node.op == names.CACHE_OUT_OP:
            node.attr["budget"].i = budget
            node.attr["headroom"].i = max(0, headroom)
    return out
