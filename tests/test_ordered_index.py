"""A plan of order edges alone is evaluated from its base graph's index
(rewrite.ordered_index), and its GraphDef made only when a stage reads it:
the index, the GraphDef and the analysis must be those of the GraphDef the
rewrite makes (apply_plan, then keep_merges, each indexed by
updated_index)."""

import dataclasses
import random

import pytest

from graphs import DT_FLOAT, analyzed, chain
from sntf import analysis, planner, rewrite
from sntf.graph import GraphError, GraphIndex, updated_index
from sntf.rewrite.fusions import kept_merges, merged_pairs
from test_fusions import merge_step_analyzed as _merge_base


def _chain_base():
    graph_def = chain(30)
    props = {n.name: [(DT_FLOAT, (256, 64))] for n in graph_def.node}
    return analyzed(graph_def, [graph_def.node[-1].name], props)


def _rewritten(plan, base, onednn: bool) -> tuple:
    """The reference: the plan applied to the GraphDef, then indexed and
    validated."""
    result = rewrite.apply_plan(base.graph_def, plan, base.index)
    graph_def = result.graph_def
    index = updated_index(base.index, graph_def, result.touched)
    if onednn:
        kept, gave = kept_merges(graph_def, base.index, merged_pairs(base.index), index)
        if kept is not graph_def:
            graph_def, index = kept, updated_index(index, kept, gave)
    return graph_def, rewrite.validate(graph_def, base.index, index)


def _random_plan(base, rng, strict: frozenset) -> planner.Plan:
    """Edges forward in the base's schedule (so acyclic), with repeats,
    none into a pair oneDNN cannot merge with a control input."""
    names = [base.index.names[n] for n in base.facts.schedule]
    pairs = []
    while len(pairs) < 3 or rng.random() < 0.9:
        a, b = sorted(rng.sample(range(len(names)), 2))
        if names[b] not in strict and not names[b].startswith("r"):
            pairs.append((names[a], names[b]))
    pairs += pairs[:3]
    return planner.Plan(policy="t", orders=tuple(
        planner.Order(before=a, after=b) for a, b in pairs))


def _fields(index: GraphIndex) -> dict:
    return {f.name: getattr(index, f.name) for f in dataclasses.fields(index)}


def _evaluated_alike(evaluate, plan, base, onednn: bool):
    """evaluate(plan, base), checked against the reference: the same index,
    GraphDef and analysis, or the same error. Returns it (None on error)."""
    try:
        graph_def, index = _rewritten(plan, base, onednn)
    except GraphError as e:
        with pytest.raises(GraphError) as fast:
            evaluate(plan, base)
        assert str(fast.value) == str(e)
        return None
    fast = rewrite.ordered_index(plan, base.index,
                                 merged_pairs(base.index) if onednn else None)
    assert _fields(fast) == _fields(index)
    assert (fast.topo, fast.has_cycles) == (index.topo, index.has_cycles)
    got = evaluate(plan, base)
    assert isinstance(got.stored, analysis.Pending)
    assert got.graph_def.SerializeToString(deterministic=True) == \
        graph_def.SerializeToString(deterministic=True)
    reference = analysis.analyze_graph(graph_def, index, base.props, None, None, onednn)
    assert got.facts.schedule == reference.facts.schedule
    assert got.peak == reference.peak
    return got


@pytest.mark.parametrize("base_of, onednn", [(_merge_base, True), (_merge_base, False),
                                             (_chain_base, False)])
def test_an_order_plan_is_evaluated_as_its_rewritten_graph(base_of, onednn):
    base = base_of()
    evaluate = rewrite.evaluator(None, onednn)
    rng = random.Random(7)
    strict = frozenset({"conv", "biased"})
    made = 0
    for _ in range(40):
        got = _evaluated_alike(evaluate, _random_plan(base, rng, strict), base, onednn)
        if got is not None:
            # A plan tried on a graph that is itself pending (the held
            # order on top of the weight gradients' edges) is made from it.
            made += _evaluated_alike(evaluate, _random_plan(got, rng, strict), got,
                                     onednn) is not None
    assert made >= 10


def test_an_order_plan_fails_from_the_index_as_its_rewrite_does():
    base = _merge_base()
    evaluate = rewrite.evaluator(None, True)
    for before, after, error in (("x", "conv", GraphError),      # a strict pair
                                 ("nowhere", "sum", ValueError),
                                 ("x", "nowhere", ValueError)):
        plan = planner.Plan(policy="t", orders=(planner.Order(before=before, after=after),))
        with pytest.raises(error) as slow:
            _rewritten(plan, base, True)
        with pytest.raises(error) as fast:
            evaluate(plan, base)
        assert str(fast.value) == str(slow.value)
