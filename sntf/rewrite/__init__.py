"""Rewrite: Plan + GraphDef -> GraphDef, validated.

    apply     the plan's recipes and orders as new nodes and edges
    fusions   the node pairs oneDNN merged stay merged
    validate  the result indexes, is acyclic and keeps its fetch nodes
    sums      the sums TensorFlow orders at run time keep the original's order
"""

from __future__ import annotations

from typing import Optional

from sntf.analysis import Analyzed, analyze_graph
from sntf.rewrite.apply import RewriteResult, apply_plan, set_cache_limits
from sntf.graph import updated_index
from sntf.rewrite.fusions import keep_merges, kept_merges, merged_pairs
from sntf.rewrite.sums import (PinnedSums, SumsOutcome, hold_after_planning,
                               hold_before_planning, pin_sums)
from sntf.rewrite.validate import validate

__all__ = ["PinnedSums", "RewriteResult", "SumsOutcome", "apply_plan", "evaluator",
           "hold_after_planning", "hold_before_planning", "keep_merges", "pin_sums",
           "set_cache_limits", "validate"]


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
        return analyze_graph(graph_def, index, base.props, base.facts.batch,
                             threads, onednn)

    return evaluate
