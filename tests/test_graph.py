"""Tests for sntf.graph: the GraphDef index and structural training detection."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import graphs  # noqa: E402  (the helper module next to this file)

from sntf import graph  # noqa: E402
from sntf.graph import names  # noqa: E402


def index_of(graph_def, fetch=(), preserve=()):
    return graph.build_index(graph_def, fetch, preserve)


def named(g, indices):
    return {g.names[i] for i in indices}


def topo_names(g):
    return [g.names[i] for i in g.topo]


def assert_topological(g):
    position = {node: k for k, node in enumerate(g.topo)}
    assert sorted(g.topo) == list(range(len(g)))
    for i in range(len(g)):
        preds = [p for p, _ in g.data_inputs[i]] + list(g.control_inputs[i])
        for p in preds:
            if g.ops[p] in ("NextIteration", "RefNextIteration"):
                continue
            assert position[p] < position[i], (g.names[p], g.names[i])


# --------------------------------------------------------------------------
# The helper module itself.
# --------------------------------------------------------------------------

def test_builder_produces_nodes_inputs_and_attrs():
    gd = (graphs.GraphBuilder()
          .arg("x")
          .arg("w", dtype=graphs.DT_RESOURCE)
          .op("ReadVariableOp", "r", ["w"], dtype=graphs.DT_FLOAT)
          .op("MatMul", "mm", ["x", "r", "^w"], device="/device:CPU:0",
              T=graphs.DT_FLOAT, transpose_a=True, alpha=0.5, padding="SAME",
              strides=[1, 2])
          .retval("out", "mm:0")
          .build())
    assert [(n.name, n.op, list(n.input)) for n in gd.node] == [
        ("x", "_Arg", []), ("w", "_Arg", []), ("r", "ReadVariableOp", ["w"]),
        ("mm", "MatMul", ["x", "r", "^w"]), ("out", "_Retval", ["mm:0"])]
    x, w, r, mm, out = gd.node
    assert (x.attr["T"].type, x.attr["index"].i) == (graphs.DT_FLOAT, 0)
    assert (w.attr["T"].type, w.attr["index"].i) == (graphs.DT_RESOURCE, 1)
    assert r.attr["dtype"].type == graphs.DT_FLOAT
    assert mm.device == "/device:CPU:0"
    assert mm.attr["transpose_a"].b is True
    assert mm.attr["alpha"].f == 0.5
    assert mm.attr["padding"].s == b"SAME"
    assert list(mm.attr["strides"].list.i) == [1, 2]
    assert (out.attr["T"].type, out.attr["index"].i) == (graphs.DT_FLOAT, 0)


def test_builder_const_and_copy():
    builder = graphs.GraphBuilder().const("c", [1, 2], graphs.DT_INT32)
    first = builder.build()
    builder.const("d", 2.0, inputs=["^c"])
    assert len(first.node) == 1
    tensor = first.node[0].attr["value"].tensor
    assert tensor.dtype == graphs.DT_INT32
    assert list(tensor.int_val) == [1, 2]
    assert [d.size for d in tensor.tensor_shape.dim] == [2]
    second = builder.build()
    assert list(second.node[1].input) == ["^c"]
    assert list(second.node[1].attr["value"].tensor.float_val) == [2.0]


def test_families_serialize():
    for family in (graphs.train_mlp, graphs.adam_style_train, graphs.conv_train,
                   graphs.train_mlp2_weight_decay,
                   graphs.embedding_train, graphs.embedding_dense_train,
                   graphs.forward_only, graphs.metrics_only,
                   graphs.forward_with_residual_and_metric, graphs.while_loop):
        gd = family()
        again = type(gd).FromString(gd.SerializeToString())
        assert again == gd
        assert len({n.name for n in gd.node}) == len(gd.node)


# --------------------------------------------------------------------------
# parse_input
# --------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("node", ("node", 0, False)),
    ("node:0", ("node", 0, False)),
    ("node:2", ("node", 2, False)),
    ("scope/node:13", ("scope/node", 13, False)),
    ("^node", ("node", -1, True)),
    ("^scope/node", ("scope/node", -1, True)),
    ("a:b", ("a:b", 0, False)),
    ("node:", ("node:", 0, False)),
    ("a:b:3", ("a:b", 3, False)),
])
def test_parse_input(text, expected):
    assert graph.parse_input(text) == expected


# --------------------------------------------------------------------------
# build_index
# --------------------------------------------------------------------------

def _edges_graph():
    """a (two outputs), b, c; m reads a:1, b and a, and waits for c; n
    reads m and waits for c and m."""
    return (graphs.GraphBuilder()
            .op("Split", "a", [], num_split=2)
            .const("b", 1.0)
            .op("NoOp", "c")
            .op("AddN", "m", ["a:1", "^c", "b", "a"], N=3)
            .op("Identity", "n", ["m", "^c", "^m"])
            .build())


def test_index_edges_slots_and_ports():
    gd = _edges_graph()
    g = index_of(gd)
    a, b, c, m, n = range(5)
    assert len(g) == 5
    assert g.names == ("a", "b", "c", "m", "n")
    assert g.ops == ("Split", "Const", "NoOp", "AddN", "Identity")
    assert g.devices == ("", "", "", "", "")
    assert g.index == {"a": a, "b": b, "c": c, "m": m, "n": n}
    assert g.node("m") == m
    assert g.data_inputs == ((), (), (), ((a, 1), (b, 0), (a, 0)), ((m, 0),))
    assert g.control_inputs == ((), (), (), (c,), (c, m))
    assert g.consumers == (((m, 0, 1), (m, 2, 0)), ((m, 1, 0),), (), ((n, 0, 0),),
                           ())
    assert g.control_consumers == ((), (), (m, n), (n,), ())
    assert g.topo == (a, b, c, m, n)
    assert g.has_cycles is False
    assert g.fetch == frozenset() and g.preserve == frozenset()
    assert g.sntf_nodes == ()


def test_index_devices():
    gd = (graphs.GraphBuilder().arg("x", device="/job:localhost/device:GPU:0")
          .op("Neg", "y", ["x"], device="/device:CPU:0").build())
    assert index_of(gd).devices == ("/job:localhost/device:GPU:0", "/device:CPU:0")


def test_index_fetch_and_preserve_keep_existing_nodes_only():
    gd = graphs.train_mlp()
    g = index_of(gd, fetch=["identity_retval", "loss/Sum:0", "nope:1"],
                 preserve=["^" + graphs.W_HANDLE, "missing"])
    assert g.fetch == frozenset({g.node("identity_retval"), g.node("loss/Sum")})
    assert g.preserve == frozenset({g.node(graphs.W_HANDLE)})


def test_index_does_not_mutate_graph():
    gd = graphs.adam_style_train()
    before = gd.SerializeToString(deterministic=True)
    index_of(gd, fetch=["identity_retval"])
    assert gd.SerializeToString(deterministic=True) == before


def test_index_marks_sntf_nodes():
    gd = graphs.chain(4)
    names.mark(gd.node[2], names.ROLE_SWAP_IN)
    names.mark(gd.node[3], names.ROLE_RECOMPUTE)
    assert index_of(gd).sntf_nodes == (2, 3)


def test_empty_graph():
    g = index_of(graphs.GraphBuilder().build())
    assert len(g) == 0
    assert g.topo == () and g.has_cycles is False
    assert graph.name_hint(g) == "empty"
    info = graph.detect_training(g)
    assert (info.training, info.reason) == (False, "no variable is updated")


def test_duplicate_name_raises():
    with pytest.raises(graph.GraphError) as excinfo:
        index_of(graphs.duplicate_name())
    assert str(excinfo.value) == "duplicate node name 'y'"
    assert isinstance(excinfo.value, ValueError)


@pytest.mark.parametrize("family", [graphs.missing_input,
                                    graphs.missing_control_input])
def test_missing_input_raises(family):
    with pytest.raises(graph.GraphError) as excinfo:
        index_of(family())
    assert str(excinfo.value) == "node 'y' reads missing node 'nowhere'"


def test_updated_index_equals_a_full_build_after_appending_and_rewiring():
    gd = _edges_graph()
    before = index_of(gd, fetch=["n"], preserve=["c"])
    after = type(gd)()
    after.CopyFrom(gd)
    clone = after.node.add()
    clone.CopyFrom(after.node[3])
    clone.name = "m/clone"
    names.mark(clone, names.ROLE_RECOMPUTE)
    del after.node[4].input[:]
    after.node[4].input.extend(["m/clone", "^b", "^c"])   # n reads the clone
    after.node[1].input.append("^c")                       # b waits for c
    got = graph.updated_index(before, after, {"n", "b"})
    assert got == index_of(after, fetch=["n"], preserve=["c"])
    assert got.consumers[3] == () and got.control_consumers[2] == (1, 3, 4, 5)


def test_updated_index_refuses_a_taken_name_and_a_missing_input():
    gd = graphs.chain(3)
    before = index_of(gd)
    taken = type(gd)()
    taken.CopyFrom(gd)
    taken.node.add().CopyFrom(gd.node[1])
    with pytest.raises(graph.GraphError, match="duplicate node name"):
        graph.updated_index(before, taken, ())
    missing = type(gd)()
    missing.CopyFrom(gd)
    missing.node[2].input.append("^nowhere")
    with pytest.raises(graph.GraphError, match="reads missing node 'nowhere'"):
        graph.updated_index(before, missing, {missing.node[2].name})


# --------------------------------------------------------------------------
# Topological order
# --------------------------------------------------------------------------

def test_topo_chain():
    g = index_of(graphs.chain(5))
    assert topo_names(g) == ["n0", "n1", "n2", "n3", "n4"]


def test_topo_chain_listed_backwards():
    gd = graphs.chain(5)
    reversed_gd = type(gd)()
    reversed_gd.node.extend(reversed(gd.node))
    g = index_of(reversed_gd)
    assert g.topo == (4, 3, 2, 1, 0)
    assert topo_names(g) == ["n0", "n1", "n2", "n3", "n4"]


def test_topo_diamond_in_non_topological_node_order():
    g = index_of(graphs.diamond())
    assert g.names == ("d", "b", "c", "a")
    assert g.topo == (3, 1, 2, 0)
    assert topo_names(g) == ["a", "b", "c", "d"]
    assert_topological(g)


def test_topo_is_stable_lowest_index_first():
    # Ready at the start: q (1) and r (3). Lowest index first gives q, then r
    # and p (unlocked by r), then sink.
    g = index_of(graphs.two_sources())
    assert g.names == ("sink", "q", "p", "r")
    assert g.topo == (1, 3, 2, 0)


def test_topo_skip_connection():
    g = index_of(graphs.skip_connection())
    assert g.names == ("out", "f2", "f1", "x")
    assert topo_names(g) == ["x", "f1", "f2", "out"]


def test_topo_respects_control_edges():
    gd = (graphs.GraphBuilder()
          .op("NoOp", "late", ["^early"])
          .op("NoOp", "early", ["^first"])
          .op("NoOp", "first")
          .build())
    assert topo_names(index_of(gd)) == ["first", "early", "late"]


@pytest.mark.parametrize("family", [graphs.train_mlp, graphs.adam_style_train,
                                    graphs.conv_train, graphs.embedding_train,
                                    graphs.train_mlp2_weight_decay,
                                    graphs.metrics_only,
                                    graphs.forward_with_residual_and_metric])
def test_topo_valid_on_families(family):
    g = index_of(family())
    assert g.has_cycles is False
    assert_topological(g)


def test_topo_while_loop_ignores_next_iteration_back_edge():
    g = index_of(graphs.while_loop())
    assert g.has_cycles is False
    assert topo_names(g) == [
        "i0", "while/Enter", "while/Merge", "while/Less/y", "while/Less",
        "while/LoopCond", "while/Switch", "while/Identity", "while/add/y",
        "while/add", "while/NextIteration", "while/Exit", "result"]
    assert_topological(g)
    merge = g.node("while/Merge")
    assert g.data_inputs[merge] == ((g.node("while/Enter"), 0),
                                    (g.node("while/NextIteration"), 0))
    assert g.consumers[g.node("while/Switch")] == (
        (g.node("while/Identity"), 0, 1), (g.node("while/Exit"), 0, 0))


def test_real_cycle_sets_has_cycles_and_keeps_every_node():
    g = index_of(graphs.real_cycle())
    assert g.has_cycles is True
    # c is ordered; the nodes left on the cycle follow in index order.
    assert g.topo == (2, 0, 1)


def test_cycle_through_identity_beside_while_loop():
    gd = graphs.while_loop()
    for node in gd.node:
        if node.name == "while/Merge":
            # The back edge now comes from an Identity, not NextIteration.
            node.input[1] = "result"
    g = index_of(gd)
    assert g.has_cycles is True
    assert sorted(g.topo) == list(range(len(g)))


# --------------------------------------------------------------------------
# ancestors / descendants
# --------------------------------------------------------------------------

def state_graph():
    """upd writes h; rd reads h after upd; rd2 reads h after a NoOp."""
    return index_of(graphs.GraphBuilder()
                    .arg("h", graphs.DT_RESOURCE)
                    .arg("v")
                    .op("AssignAddVariableOp", "upd", ["h", "v"])
                    .read("rd", "h", ["^upd"])
                    .op("NoOp", "other", ["^v"])
                    .read("rd2", "h", ["^other"])
                    .op("AddV2", "sum", ["rd", "rd2"])
                    .build())


def test_ancestors_data_and_control():
    g = index_of(graphs.diamond())
    assert named(g, graph.ancestors(g, [g.node("d")])) == {"a", "b", "c", "d"}
    assert named(g, graph.ancestors(g, [g.node("b")])) == {"a", "b"}
    assert named(g, graph.ancestors(g, [g.node("a")])) == {"a"}
    assert named(g, graph.ancestors(g, [g.node("b"), g.node("c")])) == {"a", "b", "c"}
    assert graph.ancestors(g, []) == set()


def test_ancestors_control_flag():
    g = state_graph()
    rd2 = g.node("rd2")
    assert named(g, graph.ancestors(g, [rd2])) == {"rd2", "h", "other", "v"}
    assert named(g, graph.ancestors(g, [rd2], control=False)) == {"rd2", "h"}


def test_ancestors_state_follows_control_edges_from_updates_only():
    g = state_graph()
    rd, rd2, total = g.node("rd"), g.node("rd2"), g.node("sum")
    assert named(g, graph.ancestors(g, [rd], control=False, state=True)) == {
        "rd", "h", "upd", "v"}
    assert named(g, graph.ancestors(g, [rd], control=False, state=False)) == {
        "rd", "h"}
    assert named(g, graph.ancestors(g, [rd2], control=False, state=True)) == {
        "rd2", "h"}
    assert named(g, graph.ancestors(g, [total], control=False, state=True)) == {
        "sum", "rd", "rd2", "h", "upd", "v"}
    # control=True already follows every control edge.
    assert named(g, graph.ancestors(g, [total], control=True, state=True)) == {
        "sum", "rd", "rd2", "h", "upd", "v", "other"}


def test_descendants():
    g = index_of(graphs.diamond())
    a, b, c, d = (g.node(x) for x in "abcd")
    assert named(g, graph.descendants(g, [a])) == {"a", "b", "c", "d"}
    assert named(g, graph.descendants(g, [b])) == {"b", "d"}
    assert named(g, graph.descendants(g, [d])) == {"d"}
    assert named(g, graph.descendants(g, [a], within={b, d})) == {"a", "b", "d"}
    # Starts are kept even outside `within`; nothing is reached through c.
    assert named(g, graph.descendants(g, [a], within={c})) == {"a", "c"}
    assert named(g, graph.descendants(g, [a], within=set())) == {"a"}


def test_descendants_control_flag():
    g = state_graph()
    upd = g.node("upd")
    assert named(g, graph.descendants(g, [upd])) == {"upd"}
    assert named(g, graph.descendants(g, [upd], control=True)) == {"upd", "rd", "sum"}
    v = g.node("v")
    assert named(g, graph.descendants(g, [v], control=True)) == {
        "v", "upd", "rd", "sum", "other", "rd2"}


# --------------------------------------------------------------------------
# is_update_op
# --------------------------------------------------------------------------

@pytest.mark.parametrize("op", [
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "Assign",
    "AssignAdd", "AssignSub", "ResourceApplyAdam", "ResourceApplyGradientDescent",
    "ResourceSparseApplyAdagrad", "ResourceScatterAdd", "ResourceScatterUpdate",
    "ResourceScatterNdUpdate", "ApplyAdam", "SparseApplyFtrl", "ScatterAdd",
    "ScatterUpdate", "ScatterNdAdd",
])
def test_is_update_op_true(op):
    assert graph.is_update_op(op) is True


@pytest.mark.parametrize("op", [
    "ReadVariableOp", "VarHandleOp", "MatMul", "ResourceGather", "Identity",
    "VariableShape", "VarIsInitializedOp", "NoOp", "TensorScatterUpdate",
    "TensorScatterAdd", "", "assignvariableop", "Add",
])
def test_is_update_op_false(op):
    assert graph.is_update_op(op) is False


@pytest.mark.parametrize("op", ["ScatterNd", "ScatterNdNonAliasingAdd"])
def test_is_update_op_stateless_scatter(op):
    assert graph.is_update_op(op) is False


# --------------------------------------------------------------------------
# detect_training
# --------------------------------------------------------------------------

def detect(graph_def):
    return graph.detect_training(index_of(graph_def))


def test_detect_train_mlp():
    info = detect(graphs.train_mlp())
    assert info == graph.TrainingInfo(
        training=True,
        reason=(f"variable {graphs.W_HANDLE!r} is updated from a weight "
                f"gradient ({graphs.DW!r})"),
        trained_variables=(graphs.W_HANDLE,),
        gradient_ops=(graphs.DW,),
        updated_variables=1)


def test_detect_adam_style_train():
    info = detect(graphs.adam_style_train())
    assert info.training is True
    assert info.trained_variables == (graphs.W_HANDLE,)
    assert info.gradient_ops == (graphs.DW,)
    assert info.updated_variables == 3  # W, m and the iteration counter


def test_detect_adam_without_the_state_edge_still_sees_the_slot_update():
    # Without ^M_UPDATE the weight update no longer depends on the gradient,
    # but the gradient still feeds an update (of m): still a training step.
    info = detect(graphs.adam_style_train(control_edge=False))
    assert info.training is True
    assert info.gradient_ops == (graphs.DW,)


def test_detect_a_gradient_that_feeds_no_update_is_not_training():
    # A forward pass plus a weight gradient that is computed but never used
    # to update anything (the update writes a constant).
    b = graphs.GraphBuilder()
    b._graph.CopyFrom(graphs.train_mlp())
    for node in b._graph.node:
        if node.name == graphs.SGD_UPDATE:
            node.input[1] = "SGD/learning_rate"
    info = detect(b.build())
    assert info.training is False


def test_detect_prefers_the_variable_with_most_readers():
    # Both weights are trained; W2 (two readers: forward and weight decay) is
    # examined first and detection stops at the first trained variable.
    info = detect(graphs.train_mlp2_weight_decay())
    assert info == graph.TrainingInfo(
        training=True,
        reason=(f"variable {graphs.W2_HANDLE!r} is updated from a weight "
                f"gradient ({graphs.DW2!r})"),
        trained_variables=(graphs.W2_HANDLE,),
        gradient_ops=(graphs.DW2,),
        updated_variables=2)


def test_detect_finds_the_weight_behind_thousands_of_busier_variables():
    # A deep network's optimizer slots and normalization statistics can
    # outnumber the weights and have more readers: 5,000 state variables,
    # each read twice and updated from its own reads, come before W (read
    # once) in the order detection examines them; W is still found.
    b = graphs.GraphBuilder()
    b._graph.CopyFrom(graphs.train_mlp())
    for k in range(5000):
        h = f"state{k}/resource"
        (b.arg(h, graphs.DT_RESOURCE)
         .read(f"state{k}/read", h).read(f"state{k}/read_1", h)
         .op("AddV2", f"state{k}/add", [f"state{k}/read", f"state{k}/read_1"],
             T=graphs.DT_FLOAT)
         .op("AssignVariableOp", f"state{k}/assign", [h, f"state{k}/add"],
             dtype=graphs.DT_FLOAT))
    info = detect(b.build())
    assert (info.training, info.trained_variables, info.updated_variables) == (
        True, (graphs.W_HANDLE,), 5001)


def test_detect_first_layer_alone():
    # Without W2's updates, W1 is found through dW1 = x^T ReluGrad(dh W2^T).
    gd = graphs.train_mlp2_weight_decay()
    kept = [n for n in gd.node if n.name not in (
        "SGD/AssignVariableOp", "SGD/AssignSubVariableOp_1")]
    del gd.node[:]
    gd.node.extend(kept)
    info = detect(gd)
    assert (info.training, info.trained_variables, info.gradient_ops,
            info.updated_variables) == (True, (graphs.W1_HANDLE,), (graphs.DW1,), 1)


def test_detect_conv_train():
    info = detect(graphs.conv_train())
    assert info.training is True
    assert info.trained_variables == (graphs.CONV_FILTER_HANDLE,)
    assert info.gradient_ops == (graphs.CONV_FILTER_GRAD,)


def test_detect_embedding_followed_by_dense_layer():
    info = detect(graphs.embedding_dense_train())
    assert info.training is True
    assert info.trained_variables == (graphs.TABLE_HANDLE,)
    # Either piece of evidence proves the gradient: the op that consumes the
    # ids with the upstream gradient, or the sparse update keyed by the ids.
    assert info.gradient_ops[0] in (graphs.D_EMB, graphs.SCATTER)
    assert info.updated_variables == 1


def test_detect_embedding_train():
    info = detect(graphs.embedding_train())
    assert info.training is True
    assert info.trained_variables == (graphs.TABLE_HANDLE,)
    assert info.gradient_ops == (graphs.SCATTER,)


def test_detect_forward_only():
    assert detect(graphs.forward_only()) == graph.TrainingInfo(
        False, "no variable is updated")


def test_detect_metrics_only():
    assert detect(graphs.metrics_only()) == graph.TrainingInfo(
        False, "2 variable(s) updated, none from a gradient (metrics or state "
        "updates only)", updated_variables=2)


def test_detect_forward_with_residual_and_metric():
    assert detect(graphs.forward_with_residual_and_metric()) == graph.TrainingInfo(
        False, "2 variable(s) updated, none from a gradient (metrics or state "
        "updates only)", updated_variables=2)


def test_detect_does_not_use_names():
    # Renaming every node (and rewriting inputs) keeps the answer.
    gd = graphs.train_mlp()
    rename = {node.name: f"n{i}" for i, node in enumerate(gd.node)}
    for node in gd.node:
        node.name = rename[node.name]
        for k, text in enumerate(node.input):
            name, port, control = graph.parse_input(text)
            node.input[k] = ("^" if control else "") + rename[name] + (
                f":{port}" if port > 0 else "")
    info = detect(gd)
    assert info.training is True
    assert info.trained_variables == (rename[graphs.W_HANDLE],)
    assert info.gradient_ops == (rename[graphs.DW],)


def test_detect_read_through_pass_through_ops():
    # W's read reaches the MatMul through Identity and Cast.
    gd = graphs.train_mlp()
    extra = (graphs.GraphBuilder()
             .op("Identity", "w/Identity", [graphs.W_READ])
             .op("Cast", "w/Cast", ["w/Identity"]).build())
    gd.node.extend(extra.node)
    for node in gd.node:
        if node.name == graphs.FWD_MATMUL:
            node.input[1] = "w/Cast"
    info = detect(gd)
    assert info.training is True and info.gradient_ops == (graphs.DW,)


def test_detect_handle_forwarded_through_identity():
    gd = graphs.train_mlp()
    gd.node.add(name="call/input/_1", op="Identity").input.append(graphs.W_HANDLE)
    for node in gd.node:
        if node.name == graphs.W_READ:
            node.input[0] = "call/input/_1"
    info = detect(gd)
    assert info.training is True
    assert info.gradient_ops == (graphs.DW,)


def test_detect_stateless_scatter_nd_is_not_training():
    assert detect(graphs.scatter_nd_residual_forward()) == graph.TrainingInfo(
        False, "no variable is updated")


def test_detect_variable_updated_without_reads_is_not_a_candidate():
    # W is written from a gradient-like value but never read: nothing meets
    # its value, so there is no weight gradient to find.
    gd = (graphs.GraphBuilder()
          .arg("x").arg("w", graphs.DT_RESOURCE)
          .op("Square", "sq", ["x"])
          .op("AssignSubVariableOp", "upd", ["w", "sq"]).build())
    assert detect(gd) == graph.TrainingInfo(
        False, "1 variable(s) updated, none from a gradient (metrics or state "
        "updates only)", updated_variables=1)


def test_detect_needs_gradient_downstream_of_the_forward_op():
    # v.assign(v * s + s^2): F = Mul(read v, s) meets v's value and s, and
    # Square(s) also consumes s and feeds the update, but it is not downstream
    # of F, so it is not a weight gradient.
    gd = (graphs.GraphBuilder()
          .arg("x").arg("v", graphs.DT_RESOURCE)
          .const("axes", [0, 1], graphs.DT_INT32)
          .op("Sum", "s", ["x", "axes"])
          .read("v/read", "v")
          .op("Mul", "mul", ["v/read", "s"])
          .op("Square", "sq", ["s"])
          .op("AddV2", "add", ["mul", "sq"])
          .op("AssignVariableOp", "upd", ["v", "add"]).build())
    assert detect(gd) == graph.TrainingInfo(
        False, "1 variable(s) updated, none from a gradient (metrics or state "
        "updates only)", updated_variables=1)


def test_detect_shared_constant_is_not_an_activation():
    # acc.assign((acc * c + s) * c) with one shared Const c (as Grappler
    # dedups constants): the second Mul consumes c downstream of the first
    # and upstream of the update, but a constant is not an activation.
    gd = (graphs.GraphBuilder()
          .arg("x").arg("acc", graphs.DT_RESOURCE)
          .const("c", 0.5)
          .const("axes", [0, 1], graphs.DT_INT32)
          .op("Sum", "s", ["x", "axes"])
          .read("acc/read", "acc")
          .op("Mul", "decay", ["acc/read", "c"])
          .op("AddV2", "add", ["decay", "s"])
          .op("Mul", "scale", ["add", "c"])
          .op("AssignVariableOp", "upd", ["acc", "scale"]).build())
    assert detect(gd).training is False


def test_detect_counts_distinct_handles():
    gd = graphs.metrics_only()
    gd.node.add(name="extra", op="AssignAddVariableOp").input.extend(
        [graphs.TOTAL_HANDLE, "mean/Sum"])
    assert detect(gd).updated_variables == 2


# --------------------------------------------------------------------------
# control-flow regions / xla_compiled / name_hint
# --------------------------------------------------------------------------

def test_functional_control_flow_starts_a_region():
    functional = (graphs.GraphBuilder().arg("x").arg("y")
                  .op("Neg", "before", ["x"])
                  .op("StatelessIf", "i", ["before", "x"])
                  .op("Neg", "after", ["i"]).op("Neg", "beside", ["y"]).build())
    g = index_of(functional)
    assert graph.loop_ops(g) == ()
    assert {g.names[i] for i in graph.control_flow_region(g)} == {"i", "after"}
    with_loop = (graphs.GraphBuilder().arg("x").op("While", "w", ["x"]).build())
    assert graph.loop_ops(index_of(with_loop)) == ("While",)


def test_xla_compiled():
    assert graph.xla_compiled(graphs.train_mlp()) is False
    for key in ("_XlaCompile", "_XlaMustCompile"):
        gd = graphs.train_mlp()
        gd.node[3].attr[key].b = True
        assert graph.xla_compiled(gd) is True
        gd.node[3].attr[key].b = False
        assert graph.xla_compiled(gd) is False
    gd = graphs.train_mlp()
    gd.node[3].attr["_XlaScope"].s = b"jit_scope_0"
    assert graph.xla_compiled(gd) is False


def test_name_hint():
    assert graph.name_hint(index_of(graphs.train_mlp())) == (
        "gradient_tape,sequential,loss")
    assert graph.name_hint(index_of(graphs.adam_style_train())) == (
        "Adam,gradient_tape,sequential")
    assert graph.name_hint(index_of(graphs.train_mlp()), limit=1) == "gradient_tape"
    assert graph.name_hint(index_of(graphs.metrics_only())) == "mean,sequential"
    # No scoped names: the first node's name.
    assert graph.name_hint(index_of(graphs.diamond())) == "d"


def test_name_hint_ties_keep_first_seen_order():
    gd = (graphs.GraphBuilder().op("NoOp", "b/x").op("NoOp", "a/x")
          .op("NoOp", "c/x").op("NoOp", "a/y").op("NoOp", "b/y").build())
    assert graph.name_hint(index_of(gd)) == "b,a,c"
    assert graph.name_hint(index_of(gd), limit=2) == "b,a"


def test_loop_ops_and_control_flow_region():
    g = index_of(graphs.while_loop())
    assert graph.loop_ops(g) == ("Enter", "Exit", "LoopCond", "NextIteration")
    # Everything from the Enter on is in the region; the initial value is not.
    assert graph.control_flow_region(g) == frozenset(
        i for i, name in enumerate(g.names) if name != "i0")
    plain = index_of(graphs.train_mlp())
    assert graph.loop_ops(plain) == () and graph.control_flow_region(plain) == frozenset()


def test_a_transposed_convolution_is_a_forward_layer():
    """Conv2DBackpropInput is a gradient kernel by type, but a transposed
    convolution runs it in the forward pass. Taken for the start of the
    backward pass, it hid every layer after it from the planner (a U-Net's
    whole decoder)."""
    g = graph.build_index(graphs.transposed_conv_train(), ["loss_retval"])
    phases = graph.classify_phases(g)
    phase = dict(zip(g.names, phases))
    assert phase["up/conv2d_transpose"] == graph.FORWARD
    assert phase["conv/Conv2D"] == graph.FORWARD
    for name in ("grad/dup", "grad/dup_filter", "grad/dconv_filter"):
        assert phase[name] == graph.BACKWARD, name
    anchors = {g.names[i] for i in graph.weight_consumers(g)}
    assert anchors == {"up/conv2d_transpose", "conv/Conv2D"}


@pytest.mark.parametrize("returns_weights", [False, True])
def test_a_backward_pass_without_gradient_kernels_is_told_apart(returns_weights):
    """Dense layers with swish and a loss whose gradient meets no gradient
    kernel: the backward pass is MatMuls and Muls, told apart only by the
    structure of the weight users (dx = dy W^T). Its ops were labelled
    "other" (no backward pass at all), or "forward" where the step returns
    a weight read after its update (the fuzzer's steps do): the planner
    then saw nothing to plan. The swish gradient's sigmoid(x), which waits
    on dh by a control edge only, is backward as well.

    Where the step returns an updated weight, what it returns counts as
    forward up to the first op downstream of a backward weight user: the
    loss seed and the last layer's weight gradient stay forward there."""
    g = graph.build_index(graphs.swish_step(returns_weights=returns_weights)[0],
                          ["ret"])
    phase = dict(zip(g.names, graph.classify_phases(g)))
    for name in ("pre", "gate", "h", "y", "loss"):
        assert phase[name] == graph.FORWARD, name
    backward = ["grad/h", "grad/sig", "grad/sub", "grad/act", "grad/pre", "grad/w1",
                "sgd/update1"]
    if not returns_weights:
        backward += ["grad/y", "grad/w2", "sgd/update2"]
    for name in backward:
        assert phase[name] == graph.BACKWARD, (name, phase[name])
