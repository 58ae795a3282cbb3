"""Rewrite: Plan + GraphDef -> GraphDef, validated.

    apply     the plan's recipes and orders as new nodes and edges
    fusions   the node pairs oneDNN merged stay merged
    validate  the result indexes, is acyclic and keeps its fetch nodes
    sums      the sums TensorFlow orders at run time keep the original's order
"""

from __future__ import annotations

from typing import Optional

import weakref

from sntf.analysis import Analyzed, analyze_graph, sized, with_generated
from sntf.rewrite.apply import RewriteResult, apply_plan, set_cache_limits
from sntf.graph import updated_index
from sntf.rewrite.fusions import keep_merges, kept_merges, merged_pairs
from sntf.rewrite.sums import (PinnedSums, SumsOutcome, hold_after_planning,
                               hold_before_planning, pin_sums)
from sntf.rewrite.validate import validate

__all__ = ["PinnedSums", "RewriteResult", "SumsOutcome", "apply_plan", "evaluator",
           "hold_after_planning", "hold_before_planning", "keep_merges", "pin_sums",
           "set_cache_limits", "validate"]


# Graphs whose sized outputs an evaluator keeps: a base and its ordered try,
# and the one before.
KNOWN_SHAPES = 4


def evaluator(threads: Optional[int], onednn: bool = False):
    """The planner's Context.evaluate: applies a plan to an analyzed graph,
    validates the result and analyzes it.

    Args:
      threads: intra-op threads of the device, for the analysis.
      onednn: whether TensorFlow's oneDNN graph pass runs, for the analysis.

    Returns:
      A callable (plan, Analyzed) -> Analyzed of the rewritten graph, or
      None when the plan changes nothing; a malformed or cyclic result, or
      one that would change what oneDNN merges (keep_merges), raises
      GraphError.
    """
    merged: dict = {}    # the last base graph's index and its merged pairs
    # (graph index, its sized outputs) for the last few graphs tried with
    # order edges alone: the orders tried on one graph share them.
    known: list = []

    def shapes_of(g):
        return next((shapes for ref, shapes in known if ref() is g), None)

    def evaluate(plan, base: Analyzed) -> Optional[Analyzed]:
        result = apply_plan(base.graph_def, plan, base.index)
        if not result.modified:
            return None
        # Indexing a large graph takes longer than most of its analysis:
        # the rewritten graph's index is the base's, updated where the
        # rewrite changed it.
        graph_def = result.graph_def
        index = updated_index(base.index, graph_def, result.touched)
        if onednn:
            # The same base graph is evaluated with many plans (the budget
            # search): its merged pairs are found once.
            if merged.get("index") is not base.index:
                merged.update(index=base.index, pairs=merged_pairs(base.index))
            kept, gave = kept_merges(graph_def, base.index, merged["pairs"], index)
            if kept is not graph_def:
                graph_def, index = kept, updated_index(index, kept, gave)
        index = validate(graph_def, base.index, index)
        shapes = None
        if index.data_inputs == base.index.data_inputs:
            # Order edges alone: the same nodes and data edges, so the same
            # resolved shapes and sizes.
            shapes = shapes_of(base.index)
            if shapes is None:
                shapes = sized(index, with_generated(base.props, index), base.facts.batch)
            known[:] = [(weakref.ref(g), shapes) for g in (base.index, index)] + [
                entry for entry in known
                if entry[0]() not in (None, base.index, index)][:KNOWN_SHAPES - 2]
        return analyze_graph(graph_def, index, base.props, base.facts.batch,
                             threads, onednn, shapes=shapes)

    return evaluate
