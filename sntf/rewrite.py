"""Rewrite: Plan + GraphDef -> new GraphDef.

Never mutates its input. Generated nodes carry the marker attribute from
`sntf.names`, which is what makes the pass idempotent.
"""

from __future__ import annotations

import dataclasses

from sntf import graph, names, planner


@dataclasses.dataclass(frozen=True)
class RewriteResult:
    """The rewritten graph and whether anything changed."""

    graph_def: object
    modified: bool


def apply_plan(graph_def, plan: planner.Plan) -> RewriteResult:
    """Applies a plan to a copy of `graph_def`.

    Args:
      graph_def: the input GraphDef (left untouched).
      plan: the plan to apply.

    Returns:
      A RewriteResult holding a new GraphDef.

    Raises:
      NotImplementedError: for actions whose rewrite does not exist yet.
      ValueError: a recipe names a node the graph does not have.
    """
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    pending = [d for d in plan.decisions if d.action not in (planner.KEEP, planner.RECOMPUTE)]
    if pending:
        raise NotImplementedError(
            f"rewrite for action {pending[0].action!r} is not implemented")
    nodes = {node.name: node for node in out.node}
    groups = 0   # a running index keeps every clone's name unique
    for recipe in plan.recomputes:
        _apply_recompute(out, nodes, recipe, groups)
        groups += len(recipe.groups)
    return RewriteResult(graph_def=out, modified=bool(plan.recomputes))


def _apply_recompute(out, nodes: dict, recipe: planner.Recompute, first: int) -> None:
    """Clones a recipe's chain once per group and rewires the group's readers."""
    producer, _, port = recipe.tensor.rpartition(":")
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
                src, src_port, control = graph.parse_input(text)
                if not control and src in clones:
                    clone.input.append(f"{clones[src]}:{src_port}")
                    roots_only = False
                else:
                    clone.input.append(text)
            if roots_only:
                # Held back until the backward pass reaches this point;
                # without it TensorFlow runs the clone at once and nothing
                # is saved. Control inputs go after data inputs.
                clone.input.append("^" + group.trigger)
            clones[name] = clone.name
        for consumer, slot in group.consumers:
            _set_data_input(_node(nodes, consumer), slot, f"{clones[producer]}:{port}")


def _node(nodes: dict, name: str):
    if name not in nodes:
        raise ValueError(f"plan names node {name!r}, which the graph does not have")
    return nodes[name]


def _set_data_input(node, slot: int, text: str) -> None:
    """Replaces the slot-th data input of a NodeDef."""
    data = [i for i, t in enumerate(node.input) if not t.startswith("^")]
    node.input[data[slot]] = text
