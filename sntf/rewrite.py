"""Rewrite: Plan + GraphDef -> new GraphDef.

Never mutates its input. Generated nodes carry the marker attribute from
`sntf.names`, which is what makes the pass idempotent.
"""

from __future__ import annotations

import dataclasses

from sntf import planner


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
    """
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    pending = [d for d in plan.decisions if d.action != planner.KEEP]
    if pending:
        raise NotImplementedError(
            f"rewrite for action {pending[0].action!r} is not implemented")
    return RewriteResult(graph_def=out, modified=False)
