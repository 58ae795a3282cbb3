"""The node pairs TensorFlow's oneDNN pass merges stay merged in a rewritten
graph (sntf.graph.fusions, sntf.rewrite.fusions): a control input on one
node of a pair stops the merge, and the unmerged kernels round differently."""

import pytest

from graphs import DT_FLOAT, GraphBuilder
from sntf import rewrite


def _merge_step():
    """x -> Pad -> _FusedConv2D, x -> Conv2D -> BiasAdd and, in the backward
    pass, the filter gradient and BiasAddGrad of one output gradient g: the
    three kinds of pairs oneDNN merges. `other` is an op ahead of them all."""
    b = GraphBuilder()
    (b.arg("x").arg("f").arg("g").arg("bias").arg("paddings")
     .op("Relu", "other", ["x"], T=DT_FLOAT)
     .op("Pad", "pad", ["x", "paddings"], T=DT_FLOAT)
     .op("_FusedConv2D", "fconv", ["pad", "f", "bias"], T=DT_FLOAT, num_args=1)
     .op("Conv2D", "conv", ["x", "f"], T=DT_FLOAT)
     .op("BiasAdd", "biased", ["conv", "bias"], T=DT_FLOAT)
     .op("Shape", "fshape", ["f"], T=DT_FLOAT)
     .op("Conv2DBackpropFilter", "dfilter", ["x", "fshape", "g"], T=DT_FLOAT)
     .op("BiasAddGrad", "dbias", ["g"], T=DT_FLOAT)
     .op("AddN", "sum", ["biased", "other", "fconv"], T=DT_FLOAT, N=3)
     .retval("r1", "sum").retval("r2", "dfilter").retval("r3", "dbias"))
    return b.build()


def merge_step_analyzed():
    """_merge_step analyzed, its activations 64x32x32x16 floats."""
    from graphs import analyzed

    shape = (64, 32, 32, 16)
    props = {n: [(DT_FLOAT, shape)] for n in
             ("x", "g", "other", "pad", "fconv", "conv", "biased", "dfilter", "sum")}
    props.update({"f": [(DT_FLOAT, (3, 3, 16, 16))], "bias": [(DT_FLOAT, (16,))],
                  "paddings": [(3, (4, 2))], "fshape": [(3, (4,))],
                  "dbias": [(DT_FLOAT, (16,))], "r1": [], "r2": [], "r3": []})
    return analyzed(_merge_step(), ["r1", "r2", "r3"], props)


def test_the_pairs_onednn_merges_are_found():
    from sntf.graph import build_index
    from sntf.graph.fusions import merge_pairs

    g = build_index(_merge_step(), ["r1", "r2", "r3"])
    found = {(g.names[p.first], g.names[p.second], p.strict) for p in merge_pairs(g)}
    assert found == {("pad", "fconv", False), ("conv", "biased", True),
                     ("dfilter", "dbias", False)}


def _with_control(graph_def, node_name, source):
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    next(n for n in out.node if n.name == node_name).input.append("^" + source)
    return out


def _controls(graph_def, name):
    node = next(n for n in graph_def.node if n.name == name)
    return sorted(t[1:] for t in node.input if t.startswith("^"))


def test_a_control_input_on_one_node_of_a_merged_pair_goes_to_both():
    """A control input on BiasAddGrad alone kept oneDNN from merging it with
    its filter gradient, and the unmerged kernels changed a Keras CNN's
    loss in the last bits (tests/test_e2e_keras.py caught it)."""
    from sntf.graph import build_index

    original = _merge_step()
    before = build_index(original, ["r1", "r2", "r3"])
    repaired = rewrite.keep_merges(_with_control(original, "dbias", "other"), before)
    assert _controls(repaired, "dbias") == _controls(repaired, "dfilter") == ["other"]
    repaired = rewrite.keep_merges(_with_control(original, "pad", "other"), before)
    assert _controls(repaired, "pad") == _controls(repaired, "fconv") == ["other"]
    # Untouched where nothing differs.
    assert rewrite.keep_merges(original, before) is original


def test_a_merged_pair_that_cannot_stay_merged_is_an_error():
    from sntf.graph import GraphError, build_index

    original = _merge_step()
    before = build_index(original, ["r1", "r2", "r3"])
    # TensorFlow aborts when it merges a Conv2D -> BiasAdd pair with control inputs.
    with pytest.raises(GraphError, match="Conv2D -> BiasAdd"):
        rewrite.keep_merges(_with_control(original, "biased", "other"), before)
    # The filter gradient would have to wait for itself.
    with pytest.raises(GraphError, match="wait for each other"):
        rewrite.keep_merges(_with_control(original, "dbias", "dfilter"), before)


def test_a_pad_that_feeds_another_reader_is_no_pair():
    """TensorFlow merges a Pad into its convolution only where the Pad
    feeds nothing else: a recompute clone of the convolution that reads the
    same Pad makes the pair go away, and nothing may be copied onto the
    forward Pad (it would wait for the backward pass: a cycle)."""
    from sntf.graph import build_index
    from sntf.graph.fusions import merge_pairs

    b = GraphBuilder()
    (b.arg("x").arg("f").arg("paddings")
     .op("Pad", "pad", ["x", "paddings"], T=DT_FLOAT)
     .op("Conv2D", "conv", ["pad", "f"], T=DT_FLOAT)
     .op("Conv2D", "sntf/recompute/0/conv", ["pad", "f", "^x"], T=DT_FLOAT)
     .op("AddN", "sum", ["conv", "sntf/recompute/0/conv"], T=DT_FLOAT, N=2)
     .retval("r", "sum"))
    g = build_index(b.build(), ["r"])
    assert merge_pairs(g) == ()


def test_a_pair_the_original_did_not_merge_is_left_as_it_is():
    from sntf.graph import build_index

    original = _with_control(_merge_step(), "dbias", "other")
    before = build_index(original, ["r1", "r2", "r3"])
    changed = _with_control(original, "dbias", "x")
    assert rewrite.keep_merges(changed, before) is changed
