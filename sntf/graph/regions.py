"""Regions of a graph the pass leaves alone: loops, conditionals, XLA clusters.

A training step need not sit at a graph's top level. Keras'
`steps_per_execution` and a `tf.range` loop in a `tf.function` put the whole
step inside a while loop's frame, and Keras guards it with a conditional (is
there another batch?). After lowering, every node of such a step lives in
one *context*: the same loop frame and the same taken branch of the same
predicates. Inside one context the step is an ordinary dataflow graph, the
pass plans it like a top-level step, and a node it generates lives in that
context too because every one of its inputs does.
"""

from __future__ import annotations

import dataclasses

from sntf.graph import names, optable
from sntf.graph.index import GraphIndex, descendants, memoized
from sntf.graph.training import variable_access

# A context is a tuple of steps from the top level inwards: ("frame", name)
# for a loop frame entered, ("body", predicate tensor, port) for a loop's
# Switch on its LoopCond, ("branch", predicate tensor, port) for the taken
# branch of any other Switch. MIXED marks a node whose inputs come from contexts no
# one context contains (for example two loop frames): TensorFlow's executor
# rejects a generated node there, and the pass never plans one.
MIXED = None
_FRAME = "frame"


@dataclasses.dataclass(frozen=True)
class StepRegions:
    """Where the training step lies, and what around and inside it the pass
    leaves alone.

    Attributes:
      step: the context of the training step (() at the top level).
      region: indices of the nodes left alone: every node outside the step's
        context, and every node downstream of a control-flow op inside it.
      loops: types of the loop ops inside the step: the pass models no
        iteration, so a step that contains a loop is left alone.
    """

    step: tuple
    region: frozenset
    loops: tuple


def contexts(g: GraphIndex) -> list:
    """Each node's control-flow context, as TensorFlow's executor assigns
    frames (graph/control_flow.cc, BuildControlFlowInfo), with the taken
    branches of Switch ops added.

    An Enter opens a frame, an Exit closes the innermost one, a Merge joins
    its inputs' contexts to their common part, a Switch's output port p adds
    the branch (predicate, p); every other node takes the deepest context of
    its inputs. NextIteration back edges are not followed.

    Args:
      g: the graph index (its `frames` give each Enter's frame name).

    Returns:
      Per node, a context tuple, or MIXED (a list shared by every caller:
      not to be changed).
    """
    return memoized(g, "contexts", _contexts)


def _contexts(g: GraphIndex) -> list:
    ctx: list = [()] * len(g.names)
    for i in g.topo:
        op = g.ops[i]
        inputs = [_output_context(g, ctx, p, port) for p, port in g.data_inputs[i]
                  if g.ops[p] not in optable.NEXT_ITERATION_OPS]
        inputs += [ctx[p] for p in g.control_inputs[i]
                   if g.ops[p] not in optable.NEXT_ITERATION_OPS]
        if op in optable.MERGE_OPS:
            ctx[i] = _common(inputs)
            continue
        joined = _deepest(inputs)
        if joined is MIXED:
            ctx[i] = MIXED
        elif op in optable.ENTER_OPS:
            frame = g.frames[i] if g.frames else ""
            ctx[i] = joined + ((_FRAME, frame),)
        elif op in optable.EXIT_OPS:
            ctx[i] = _outside_frame(joined)
        else:
            ctx[i] = joined
    return ctx


def _output_context(g: GraphIndex, ctx: list, node: int, port: int):
    here = ctx[node]
    if here is MIXED or g.ops[node] not in optable.SWITCH_OPS:
        return here
    predicate = g.data_inputs[node][1] if len(g.data_inputs[node]) > 1 else None
    key = names.tensor_name(g.names[predicate[0]], predicate[1]) if predicate else ""
    kind = "body" if predicate and g.ops[predicate[0]] == "LoopCond" else "branch"
    return here + ((kind, key, port),)


def _frames(context: tuple) -> tuple:
    return tuple(step for step in context if step[0] == _FRAME)


def _deepest(inputs: list):
    """The context containing all of `inputs`, or MIXED: all must share one
    loop frame, and their branches must nest."""
    deepest = ()
    for c in inputs:
        if c is MIXED:
            return MIXED
        if len(c) > len(deepest):
            c, deepest = deepest, c
        if deepest[:len(c)] != c:
            return MIXED
    if any(_frames(c) != _frames(deepest) for c in inputs):
        return MIXED
    return deepest


def _common(inputs: list):
    """The longest context every input lies in (a Merge's)."""
    known = [c for c in inputs if c is not MIXED]
    if len(known) != len(inputs) or not known:
        return MIXED if inputs else ()
    common = known[0]
    for c in known[1:]:
        k = 0
        while k < min(len(common), len(c)) and common[k] == c[k]:
            k += 1
        common = common[:k]
    return common


def _outside_frame(context: tuple):
    """An Exit's context: the innermost frame and its branches left."""
    for k in range(len(context) - 1, -1, -1):
        if context[k][0] == _FRAME:
            return context[:k]
    return MIXED


def _step_context(g: GraphIndex, ctx: list) -> tuple:
    """The context of the training step: the common context of its variable
    reads and updates (the top level when there is no step or it is MIXED)."""
    updates, readers = variable_access(g)
    anchors = [i for nodes in updates.values() for i in nodes]
    anchors += [i for nodes in readers.values() for i in nodes]
    step = _common([ctx[i] for i in anchors])
    return step if step is not MIXED else ()


def step_regions(g: GraphIndex) -> StepRegions:
    """The training step's context and the regions the pass leaves alone.

    A node downstream of a Switch inside the step may receive a dead tensor
    (the branch not taken) and pass its deadness on; one downstream of a
    functional If runs after a whole branch. The pass leaves all of them
    alone: it neither recomputes nor swaps their outputs, nor rewires a
    tensor one of them reads. So it does every node outside the step's
    context: the machinery of a loop or conditional around the step. Inside
    the context all nodes live or die together, so what the pass adds there,
    whose inputs are all in the context, does too.

    Args:
      g: the graph index.

    Returns:
      The StepRegions (an empty region without control flow).
    """
    return memoized(g, "regions", _step_regions)


def _step_regions(g: GraphIndex) -> StepRegions:
    flow = optable.CONTROL_FLOW_OPS | optable.FUNCTIONAL_CONTROL_FLOW_OPS
    if not any(op in flow for op in g.ops):
        return StepRegions(step=(), region=frozenset(), loops=())
    ctx = contexts(g)
    step = _step_context(g, ctx)
    inside = [i for i, c in enumerate(ctx) if c is not MIXED and c[:len(step)] == step]
    # The NextIteration ops of a loop around the step end its body: they
    # are left alone, but what they feed (the loop's head) is not inside.
    closing = {i for i in inside if g.ops[i] in optable.NEXT_ITERATION_OPS
               and len(_frames(ctx[i])) == len(_frames(step))}
    seeds = [i for i in inside if g.ops[i] in flow and i not in closing]
    region = descendants(g, seeds, control=True) if seeds else set()
    region.update(i for i, c in enumerate(ctx) if c != step)
    region.update(closing)
    loops = tuple(sorted({g.ops[i] for i in inside if g.ops[i] in optable.LOOP_OPS
                          and _nested_loop(g, ctx, i, len(_frames(step)))}))
    return StepRegions(step=step, region=frozenset(region), loops=loops)


def _nested_loop(g: GraphIndex, ctx: list, node: int, step_frames: int) -> bool:
    """Whether loop op `node` belongs to a loop inside the step (not to one
    around it): a functional While, or an op of a frame deeper than the
    step's (an Exit is judged by what it reads, inside its frame)."""
    if g.ops[node] in optable.FUNCTIONAL_CONTROL_FLOW_OPS:
        return True
    context = ctx[node]
    if g.ops[node] in optable.EXIT_OPS and g.data_inputs[node]:
        context = ctx[g.data_inputs[node][0][0]]
    return context is MIXED or len(_frames(context)) > step_frames


def control_flow_region(g: GraphIndex) -> frozenset:
    """The nodes the pass leaves alone (see step_regions).

    Args:
      g: the graph index.

    Returns:
      The indices of the region's nodes (empty without control flow).
    """
    return step_regions(g).region


def loop_ops(g: GraphIndex) -> tuple[str, ...]:
    """Types of loop ops inside the training step (see step_regions)."""
    return step_regions(g).loops


def new_mixed_nodes(before: GraphIndex, after: GraphIndex) -> list:
    """Names of nodes whose inputs a rewrite took from contexts no one context
    contains, where the original graph had none such: TensorFlow would reject
    the graph ("inputs from different frames") or run a node on a dead input."""
    flow = optable.CONTROL_FLOW_OPS
    if not any(op in flow for op in after.ops):
        return []
    was = {name for name, c in zip(before.names, contexts(before)) if c is MIXED}
    return [name for name, c in zip(after.names, contexts(after))
            if c is MIXED and name not in was]


def xla_compiled(graph_def) -> bool:
    """Whether the graph is marked for XLA compilation."""
    for node in graph_def.node:
        for key in optable.XLA_COMPILE_ATTRS:
            if key in node.attr and node.attr[key].b:
                return True
    return False
