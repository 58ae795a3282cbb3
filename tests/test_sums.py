"""Order-dependent sums: finding them, the decisions an order makes, and
the edges that hold a rewritten graph to them (sntf.graph.accumulations,
sntf.rewrite.sums), on hand-built graphs."""

import pytest

from graphs import DT_FLOAT, DT_INT32, DT_RESOURCE, GraphBuilder
from sntf import analysis, graph
from sntf.graph import accumulations
from sntf.rewrite import pin_sums
from sntf.rewrite import sums as sums_stage


def _accumulator():
    """Grappler's memory-optimizer rewrite of AddN(a, b, c) (SchedulingPass):
    a TemporaryVariable, zeros assigned, one unordered AssignAdd per input."""
    b = GraphBuilder().arg("x")
    for name in ("a", "b", "c"):
        b.op("Relu", name, ["x"], T=DT_FLOAT)
    b.op("TemporaryVariable", "s/tmp_var", ["^a"], dtype=DT_FLOAT)
    b.op("ZerosLike", "s/tmp_var_zeros", ["a"], T=DT_FLOAT)
    b.op("Assign", "s/tmp_var_initializer", ["s/tmp_var", "s/tmp_var_zeros"], T=DT_FLOAT)
    for i, name in enumerate(("a", "b", "c")):
        b.op("AssignAdd", f"s/tmp_var_accum_{i}", ["s/tmp_var_initializer", name],
             T=DT_FLOAT)
    b.op("DestroyTemporaryVariable", "s", ["s/tmp_var_initializer", "^s/tmp_var_accum_0",
                                          "^s/tmp_var_accum_1", "^s/tmp_var_accum_2"],
         T=DT_FLOAT)
    return b.retval("out", "s").build()


def _shared_addn():
    """AddN(g, p, q) where g is also read by a filter gradient: the AddN
    forwards g only if it runs after that reader (a residual block's input
    gradient)."""
    return (GraphBuilder().arg("x").arg("w", dtype=DT_RESOURCE)
            .op("ReadVariableOp", "r", ["w"], dtype=DT_FLOAT)
            .op("Relu", "g", ["x"], T=DT_FLOAT)
            .op("MatMul", "dw", ["x", "g"], T=DT_FLOAT)
            .op("Neg", "p", ["x"], T=DT_FLOAT)
            .op("Neg", "q", ["r"], T=DT_FLOAT)
            .op("AddN", "sum", ["g", "p", "q"], T=DT_FLOAT, N=3)
            .retval("out", "sum").retval("out2", "dw", index=1).build())


def _order(g, names):
    """Node indices with `names` first, in that order, then the rest."""
    first = [g.index[n] for n in names]
    return first + [i for i in range(len(g.names)) if i not in first]


def test_the_assign_adds_of_an_accumulator_are_one_group_behind_the_initializer():
    g = graph.build_index(_accumulator())
    assert accumulations.target_root(g, g.index["s/tmp_var_accum_1"]) == g.index["s/tmp_var"]
    assert accumulations.accumulation_groups(g) == [
        tuple(g.index[f"s/tmp_var_accum_{i}"] for i in range(3))]


def test_accumulation_pins_chain_the_updates_in_the_given_order():
    g = graph.build_index(_accumulator())
    order = _order(g, ["x", "c", "a", "b", "s/tmp_var", "s/tmp_var_zeros",
                       "s/tmp_var_initializer", "s/tmp_var_accum_2",
                       "s/tmp_var_accum_0", "s/tmp_var_accum_1"])
    pins = accumulations.accumulation_pins(g, order)
    assert [(p.before, p.after) for p in pins] == [
        ("s/tmp_var_accum_2", "s/tmp_var_accum_0"), ("s/tmp_var_accum_0", "s/tmp_var_accum_1")]
    assert {p.sum_node for p in pins} == {"s/tmp_var"}


def test_updates_already_in_order_need_no_pin():
    g = graph.build_index(GraphBuilder().arg("v", dtype=DT_RESOURCE).arg("x")
                          .op("AssignAddVariableOp", "u1", ["v", "x"], dtype=DT_FLOAT)
                          .op("AssignAddVariableOp", "u2", ["v", "x", "^u1"], dtype=DT_FLOAT)
                          .build())
    assert len(accumulations.accumulation_groups(g)) == 1
    assert accumulations.accumulation_pins(g, list(range(len(g.names)))) == []


def test_addn_forwards_its_first_input_only_when_it_runs_after_that_inputs_readers():
    g = graph.build_index(_shared_addn())
    node = g.index["sum"]
    late = _order(g, ["x", "w", "r", "g", "p", "q", "dw", "sum"])
    early = _order(g, ["x", "w", "r", "g", "p", "q", "sum", "dw"])
    assert accumulations.forwarded_slot(g, node, late) == 0
    # Before the filter gradient, g is still held: the kernel forwards p
    # and moves it to the front of the sum.
    assert accumulations.forwarded_slot(g, node, early) == 1
    assert accumulations.reordering_sums(g) == [node]


def test_a_variables_value_is_never_forwarded():
    g = graph.build_index(GraphBuilder().arg("w", dtype=DT_RESOURCE)
                          .op("ReadVariableOp", "r", ["w"], dtype=DT_FLOAT)
                          .op("Neg", "p", ["r"], T=DT_FLOAT)
                          .op("AddN", "sum", ["r", "r", "p"], T=DT_FLOAT, N=3).build())
    assert accumulations.forwarded_slot(g, g.index["sum"], range(len(g.names))) == 2


@pytest.mark.parametrize("first, expected", [
    ("dw", [("dw", "sum")]),         # the filter gradient ran first: it stays first
    ("sum", [("sum", "dw")]),        # the sum ran first: the reader waits for it
])
def test_sum_pins_hold_a_rewritten_graph_to_the_original_decision(first, expected):
    original = graph.build_index(_shared_addn())
    rest = ["sum", "dw"] if first == "sum" else ["dw", "sum"]
    order = _order(original, ["x", "w", "r", "g", "p", "q"] + rest)
    pins, lost = accumulations.sum_pins(original, order, original)
    assert lost == []
    assert [(p.before, p.after) for p in pins if p.before in ("dw", "sum")
            and p.after in ("dw", "sum")] == expected
    held = pin_sums(_shared_addn(), original, original, order)
    node = {n.name: n for n in held.graph_def.node}
    waiting = "sum" if first == "dw" else "dw"
    assert "^" + ("dw" if first == "dw" else "sum") in node[waiting].input
    # The pinned graph's emulated order takes the same decision.
    again = analysis.schedule(held.index)
    assert accumulations.forwarded_slot(held.index, held.index.index["sum"], again) == (
        0 if first == "dw" else 1)


def test_a_sum_no_edge_can_hold_is_reported_lost():
    original = graph.build_index(_shared_addn())
    order = _order(original, ["x", "w", "r", "g", "p", "q", "sum", "dw"])
    # A rewrite that gives the sum a copy of g with no other reader: the
    # kernel would forward it, where the original forwarded p.
    b = (GraphBuilder().arg("x").arg("w", dtype=DT_RESOURCE)
         .op("ReadVariableOp", "r", ["w"], dtype=DT_FLOAT)
         .op("Relu", "g", ["x"], T=DT_FLOAT)
         .op("MatMul", "dw", ["x", "g"], T=DT_FLOAT)
         .op("Relu", "g_clone", ["x"], T=DT_FLOAT)
         .op("Neg", "p", ["x"], T=DT_FLOAT)
         .op("Neg", "q", ["r"], T=DT_FLOAT)
         .op("AddN", "sum", ["g_clone", "p", "q"], T=DT_FLOAT, N=3)
         .retval("out", "sum").retval("out2", "dw", index=1).build())
    _, lost = accumulations.sum_pins(original, order, graph.build_index(b))
    assert lost == ["sum"]


def _step_with_accumulator():
    """The dense step of graphs.mlp_step with a Grappler accumulator summing
    three gradient terms of its last layer."""
    from tensorflow.core.framework import graph_pb2

    from graphs import mlp_step

    graph_def, props = mlp_step()
    extra = (GraphBuilder()
             .op("Neg", "acc/b", ["grad/pre4"], T=DT_FLOAT)
             .op("Relu", "acc/c", ["grad/pre4"], T=DT_FLOAT)
             .op("TemporaryVariable", "acc/tmp_var", ["^grad/pre4"], dtype=DT_FLOAT)
             .op("ZerosLike", "acc/tmp_var_zeros", ["grad/pre4"], T=DT_FLOAT)
             .op("Assign", "acc/tmp_var_initializer", ["acc/tmp_var", "acc/tmp_var_zeros"],
                 T=DT_FLOAT))
    for i, term in enumerate(("grad/pre4", "acc/b", "acc/c")):
        extra.op("AssignAdd", f"acc/tmp_var_accum_{i}", ["acc/tmp_var_initializer", term],
                 T=DT_FLOAT)
    extra.op("DestroyTemporaryVariable", "acc", ["acc/tmp_var_initializer"]
             + [f"^acc/tmp_var_accum_{i}" for i in range(3)], T=DT_FLOAT)
    merged = graph_pb2.GraphDef()
    merged.CopyFrom(graph_def)
    merged.node.extend(extra.build().node)
    props = dict(props)
    for node in extra.build().node:
        props[node.name] = [(DT_FLOAT, (512, 128))]
    return merged, props


def _pass_with_accumulator(determinism: bool, policy: str = "swap+recompute", **options):
    from graphs import properties_fn
    from sntf import config, passes

    graph_def, props = _step_with_accumulator()
    state = config.State(enabled=True, policy=policy,
                         options=config.parse_options(options))
    return passes.run_pass(graph_def.SerializeToString(), ["ret"], [], state,
                           properties_fn(props),
                           passes.Environment(op_determinism=determinism))


def _chained(graph_def) -> bool:
    """Whether the accumulator's three additions wait for each other in a
    chain: one waits for none, each other for exactly one."""
    nodes = {n.name: n for n in graph_def.node}
    waits = {name: [i[1:] for i in nodes[name].input if i.startswith("^acc/tmp_var_accum")]
             for name in nodes if name.startswith("acc/tmp_var_accum")}
    return sorted(len(w) for w in waits.values()) == [0, 1, 1]


@pytest.mark.parametrize("determinism", [False, True])
def test_a_graph_with_an_accumulator_is_rewritten_with_its_additions_in_one_order(
        determinism):
    result = _pass_with_accumulator(determinism)
    sums = result.report["order_dependent_sums"]
    assert sums["accumulations"] == 2      # three additions, two edges to order them
    assert result.report["action"] == "rewritten" and sums["code"] is None
    assert result.report["swapped"] or result.report["recomputed"]
    assert _chained(result.graph_def)


def test_exact_sums_leaves_a_graph_with_an_accumulator_unchanged_under_determinism():
    result = _pass_with_accumulator(True, exact_sums=True)
    sums = result.report["order_dependent_sums"]
    assert result.graph_def is None and result.report["action"] == "unchanged"
    assert sums["code"] == sums_stage.UNPINNABLE and sums["accumulations"] == 2
    assert "exact_sums=True" in result.report["reason"]
    # Without determinism there are no bits of TensorFlow's to keep.
    assert _pass_with_accumulator(False, exact_sums=True).report["action"] == "rewritten"


@pytest.mark.parametrize("determinism", [False, True])
def test_a_plan_that_saves_nothing_goes_back_held_only_under_determinism(determinism):
    """Under determinism the user asked for repeatable results, which the
    accumulator's arrival order does not give: the graph goes back with
    its additions chained and nothing else changed."""
    result = _pass_with_accumulator(determinism, min_gain=0.99)
    report = result.report
    assert not report["swapped"] and not report["recomputed"]
    if not determinism:
        assert result.graph_def is None and report["action"] == "unchanged"
        return
    assert report["action"] == "rewritten" and _chained(result.graph_def)
    original, _ = _step_with_accumulator()
    # Only control inputs were added.
    before = {n.name: [i for i in n.input if not i.startswith("^")] for n in original.node}
    after = {n.name: [i for i in n.input if not i.startswith("^")]
             for n in result.graph_def.node}
    assert before == after
    assert "held to one order" in report["reason"]
    from sntf.runtime import plugin

    assert plugin.short_reason(report).startswith("order-dependent sums held to one order")
    # Policy "off" inspects only.
    assert _pass_with_accumulator(True, policy="off").graph_def is None


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_malformed_exact_sums_is_a_value_error_naming_it(value):
    from sntf import config

    with pytest.raises(ValueError, match=f"exact_sums must be True or False, got {value!r}"):
        config.parse_options({"exact_sums": value})


def test_an_edge_to_a_merged_filter_gradient_is_given_to_its_bias_gradient_too():
    """oneDNN merges Conv2DBackpropFilter and BiasAddGrad of one output
    gradient only where both have the same control inputs; an edge that
    makes the filter gradient wait for the sum must reach the bias gradient
    too, or the pair runs unmerged and its bits change."""
    def build():
        return (GraphBuilder().arg("x")
                .const("sizes", [3, 3, 4, 4], DT_INT32)
                .op("Relu", "g", ["x"], T=DT_FLOAT)
                .op("Conv2DBackpropFilter", "dw", ["x", "sizes", "g"], T=DT_FLOAT)
                .op("BiasAddGrad", "db", ["g"], T=DT_FLOAT)
                .op("Neg", "p", ["x"], T=DT_FLOAT)
                .op("Neg", "q", ["x"], T=DT_FLOAT)
                .op("AddN", "sum", ["g", "p", "q"], T=DT_FLOAT, N=3)
                .retval("out", "sum").retval("out2", "dw", index=1)
                .retval("out3", "db", index=2).build())

    original = graph.build_index(build())
    order = _order(original, ["x", "sizes", "g", "p", "q", "sum", "dw", "db"])
    for onednn, both in ((False, False), (True, True)):
        held = pin_sums(build(), original, original, order, onednn=onednn)
        node = {n.name: n for n in held.graph_def.node}
        assert "^sum" in node["dw"].input or "^sum" in node["db"].input
        assert ("^sum" in node["dw"].input and "^sum" in node["db"].input) == both
