"""Rewrite: Plan + GraphDef -> GraphDef, validated.

    apply     the plan's recipes and orders as new nodes and edges
    fusions   the node pairs oneDNN merged stay merged
    validate  the result indexes, is acyclic and keeps its fetch nodes
    sums      the sums TensorFlow orders at run time keep the original's order
"""

from __future__ import annotations

from typing import Optional

import weakref

from sntf.analysis import Analyzed, Pending, analyze_graph, sized, with_generated
from sntf.graph import updated_index, with_control_inputs
from sntf.planner import KEEP
from sntf.rewrite.apply import (RewriteResult, apply_plan, index_order_inputs,
                                set_cache_limits)
from sntf.rewrite.fusions import keep_merges, kept_merges, merge_controls, merged_pairs
from sntf.rewrite.sums import (PinnedSums, SumsOutcome, hold_after_planning,
                               hold_before_planning, pin_sums)
from sntf.rewrite.validate import validate

__all__ = ["PinnedSums", "RewriteResult", "SumsOutcome", "apply_plan", "evaluator",
           "hold_after_planning", "hold_before_planning", "keep_merges", "pin_sums",
           "set_cache_limits", "validate"]


# Graphs an evaluator keeps the shapes and analysis of: a base, the orders
# tried on it, and the graph before.
KNOWN_GRAPHS = 4


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
    # (graph index, its sized outputs, its analysis) for the last few graphs
    # analyzed here: a graph that differs from one of them in control edges
    # alone (an order tried) has its shapes, and where it runs in the same
    # order, its analysis.
    known: list = []

    def alike(index, base: Analyzed) -> tuple:
        """(sized outputs or None, the analyses) of the known graphs, and
        the base, with index's nodes and data edges."""
        shapes, priors = None, []
        for ref, got, facts in known + [(lambda: base.index, None, base.facts)]:
            g = ref()
            if g is not None and (g is index or (
                    g.data_inputs == index.data_inputs and g.names == index.names
                    and g.ops == index.ops)):
                shapes = shapes or got
                priors.append(facts)
        return shapes, tuple(priors)

    def pairs(base: Analyzed) -> frozenset:
        # The same base graph is evaluated with many plans (the budget
        # search): its merged pairs are found once.
        if merged.get("index") is not base.index:
            merged.update(index=base.index, pairs=merged_pairs(base.index))
        return merged["pairs"]

    def rewritten(plan, base: Analyzed) -> Optional[tuple]:
        """(GraphDef, its index) of the plan applied, None if unchanged."""
        result = apply_plan(base.graph_def, plan, base.index)
        if not result.modified:
            return None
        # Indexing a large graph takes longer than most of its analysis:
        # the rewritten graph's index is the base's, updated where the
        # rewrite changed it.
        graph_def = result.graph_def
        index = updated_index(base.index, graph_def, result.touched)
        if onednn:
            kept, gave = kept_merges(graph_def, base.index, pairs(base), index)
            if kept is not graph_def:
                graph_def, index = kept, updated_index(index, kept, gave)
        return graph_def, index

    def evaluate(plan, base: Analyzed) -> Optional[Analyzed]:
        if _orders_only(plan):
            index = ordered_index(plan, base.index, pairs(base) if onednn else None)
            stored, graph = base.stored, base.index
            graph_def = Pending(lambda: rewritten(
                plan, Analyzed(stored, graph, None, None))[0])
        else:
            made = rewritten(plan, base)
            if made is None:
                return None
            graph_def, index = made
        index = validate(graph_def, base.index, index)
        shapes, priors = alike(index, base)
        if shapes is None:
            shapes = sized(index, with_generated(base.props, index), base.facts.batch)
        analyzed = analyze_graph(graph_def, index, base.props, base.facts.batch,
                                 threads, onednn, shapes=shapes, priors=priors)
        known[:] = [(weakref.ref(index), shapes, analyzed.facts)] + [
            entry for entry in known if entry[0]() not in (None, index)][:KNOWN_GRAPHS - 1]
        # A tried graph is held serialized until a stage reads it.
        return analyzed.packed()

    return evaluate


def _orders_only(plan) -> bool:
    """Whether a plan adds control edges and nothing else."""
    return (bool(plan.orders) and not plan.recomputes and not plan.swaps
            and all(d.action == KEEP for d in plan.decisions))


def ordered_index(plan, index, merged: Optional[frozenset]):
    """The index of the graph of `index` with the plan's orders applied, as
    apply_plan and keep_merges make its GraphDef: a plan of orders alone
    appends control inputs and adds no node.

    Args:
      plan: a plan holding orders alone (_orders_only).
      index: the graph's index.
      merged: merged_pairs of the graph where oneDNN's pass runs, else None.

    Returns:
      The GraphIndex.

    Raises:
      ValueError: as apply_plan and keep_merges.
    """
    index = with_control_inputs(index, index_order_inputs(index, plan.orders))
    gave = merge_controls(index, merged) if merged else {}
    if gave:
        at = index.index
        index = with_control_inputs(index, {at[name]: [at[n] for n in controls]
                                            for name, controls in gave.items()})
    return index
