"""A training step inside a loop and a conditional (Keras'
`steps_per_execution`): planned within its context like a top-level step,
and every node the rewrite adds stays in that context."""

import pytest

from conftest import assert_identical, train_family
from graphs import (DT_FLOAT, DT_INT32, GraphBuilder, LOOP_FRAME, analyzed, context,
                    in_loop, mlp_step, while_loop)
from sntf import graph as G
from sntf import planner, rewrite
from sntf.graph import regions

STEP = (("frame", LOOP_FRAME), ("body", "while/cond:0", 1), ("branch", "while/has:0", 1))


def _wrapped():
    graph_def, props = in_loop(*mlp_step())
    return graph_def, props, G.build_index(graph_def, ["ret"])


def test_contexts_follow_frames_and_taken_branches():
    _, _, g = _wrapped()
    ctx = dict(zip(g.names, regions.contexts(g)))
    frame = STEP[:1]
    assert ctx["x"] == () and ctx["while/enter/x"] == frame
    assert ctx["while/i"] == frame              # the Merge: the Enter's side only
    assert ctx["step/in/x"] == STEP[:2]         # the Switch node lives in the body
    assert ctx["h1"] == ctx["sgd/update1"] == ctx["lr"] == STEP
    assert ctx["step/else"] == STEP[:2] + (("branch", "while/has:0", 0),)
    assert ctx["step/out"] == STEP[:2]          # both branches merged
    assert ctx["while/exit"] == ctx["ret"] == ()


def test_the_step_is_found_and_only_its_surroundings_are_left_alone():
    _, _, g = _wrapped()
    found = regions.step_regions(g)
    assert found.step == STEP and found.loops == ()
    left = {g.names[i] for i in found.region}
    step_nodes = {n.name for n in mlp_step()[0].node if n.op not in ("_Arg", "_Retval")}
    assert not left & step_nodes
    assert {"while/i", "while/exit", "step/out", "step/in/w1", "x", "ret"} <= left


def test_a_step_that_is_the_loop_body_is_planned_and_its_loop_closed_alone():
    """A tf.while_loop around the step: the body's NextIteration ops are in
    the step's context; they end the body and are no loop inside the step."""
    graph_def, props = in_loop(*mlp_step(), guarded=False)
    g = G.build_index(graph_def, ["ret"])
    found = regions.step_regions(g)
    assert found.step == STEP[:2] and found.loops == ()
    assert g.node("while/i_next") in found.region
    assert not {g.node(n) for n in ("h1", "grad/w1", "sgd/update1")} & found.region
    outcome = planner.plan("swap", analyzed(graph_def, ["ret"], props),
                           context(swap_min_bytes=4096))
    assert outcome.planned is not None and outcome.plan.swaps, outcome.plan.lines
    after = outcome.planned.index
    ctx = regions.contexts(after)
    assert all(ctx[i] == STEP[:2] for i in after.sntf_nodes)


def test_mixed_inputs_are_marked():
    b = (GraphBuilder().const("a", 1.0)
         .op("Enter", "e1", ["a"], T=DT_FLOAT, frame_name="f1")
         .op("Enter", "e2", ["a"], T=DT_FLOAT, frame_name="f2")
         .op("AddV2", "two_frames", ["e1", "e2"], T=DT_FLOAT)
         .op("AddV2", "frame_and_top", ["e1", "a"], T=DT_FLOAT)
         .const("p", True, 10)
         .op("Switch", "s", ["a", "p"], T=DT_FLOAT)
         .op("AddV2", "both_branches", ["s", "s:1"], T=DT_FLOAT)
         .op("Neg", "downstream", ["both_branches"], T=DT_FLOAT)
         .op("Merge", "m", ["s", "s:1"], T=DT_FLOAT, N=2))
    g = G.build_index(b.build())
    ctx = dict(zip(g.names, regions.contexts(g)))
    for name in ("two_frames", "frame_and_top", "both_branches", "downstream"):
        assert ctx[name] is regions.MIXED, name
    assert ctx["m"] == () and ctx["e1"] == (("frame", "f1"),)


@pytest.mark.parametrize("policy", ["recompute", "swap", "swap+recompute"])
def test_a_step_in_a_loop_is_planned_as_the_same_step_at_top_level(policy):
    graph_def, props, g = _wrapped()
    top_def, top_props = mlp_step()
    top_base = analyzed(top_def, ["ret"], top_props)
    top = planner.plan(policy, top_base, context(swap_min_bytes=4096))
    base = analyzed(graph_def, ["ret"], props)
    inside = planner.plan(policy, base, context(swap_min_bytes=4096))
    assert inside.planned is not None, inside.plan.lines
    # The same tensors are freed. Whether one is swapped or recomputed may
    # differ: the loop's pivot makes the step's constants wait, which moves
    # them in the predicted order, and a near tie can tip.
    acted = {d.tensor for d in planner.acting(inside.plan.decisions)}
    assert acted and acted == {d.tensor for d in planner.acting(top.plan.decisions)}
    ratio = inside.planned.peak / base.facts.predicted_peak_bytes
    assert ratio <= top.planned.peak / top_base.facts.predicted_peak_bytes + 0.05
    assert any("training step inside 1 loop(s) and 1 conditional branch(es)" in n
               for n in inside.plan.lines), inside.plan.lines
    after = inside.planned.index
    ctx = regions.contexts(after)
    assert after.sntf_nodes and all(ctx[i] == STEP for i in after.sntf_nodes)
    # The loop and the conditional around the step are untouched.
    before = {n.name: n for n in graph_def.node}
    rewritten = {n.name: n for n in inside.planned.graph_def.node}
    for i in regions.step_regions(g).region:
        name = g.names[i]
        assert rewritten[name] == before[name], name


@pytest.mark.parametrize("source", ["x", "step/else"])
def test_validate_rejects_a_node_reading_across_frames_or_branches(source):
    graph_def, props, g = _wrapped()
    outcome = planner.plan("swap", analyzed(graph_def, ["ret"], props),
                           context(swap_min_bytes=4096, pin_order=False))
    good = outcome.planned.graph_def
    rewrite.validate(good, g)
    bad = type(good)()
    bad.CopyFrom(good)
    swap_in = next(n for n in bad.node if n.op == "SnSwapIn")
    swap_in.input.append("^" + source)
    with pytest.raises(G.GraphError, match="different loop frames or branches"):
        rewrite.validate(bad, g)


def test_a_loop_inside_the_step_still_leaves_it_alone():
    """A loop the step runs (an RNN's) is not modelled: no iteration count."""
    graph_def, props = mlp_step()
    loop = while_loop()
    graph_def.node.extend(loop.node)
    props = dict(props)
    for node in loop.node:
        props[node.name] = ([(DT_INT32, ())] * (2 if node.op in ("Switch", "Merge") else 1)
                            if node.op != "LoopCond" else [(10, ())])
    g = G.build_index(graph_def, ["ret"])
    assert regions.step_regions(g).step == ()
    assert regions.loop_ops(g) == ("Enter", "Exit", "LoopCond", "NextIteration")
    outcome = planner.plan("swap", analyzed(graph_def, ["ret"], props),
                           context(swap_min_bytes=4096))
    assert outcome.planned is None
    assert any("control flow present (a loop)" in n for n in outcome.plan.lines)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recompute", "swap+recompute"])
def test_keras_steps_per_execution_is_rewritten_and_bit_identical(fresh_python,
                                                                  tmp_path, policy):
    """fit() with steps_per_execution=4: two calls of four steps each."""
    flags = ("--steps-per-execution", "4")
    kwargs = dict(steps=8, batch=16)
    base = train_family(fresh_python, tmp_path / "base.npz", "resnet", *flags, **kwargs)
    run = train_family(fresh_python, tmp_path / "run.npz", "resnet", *flags,
                       "--sntf", policy, "--swap-min-bytes", "65536", **kwargs)
    assert len(base[0]["losses"]) == 2
    assert_identical(base, run, policy)
    training = [r for r in run[0]["reports"] if r["training"]]
    rewritten = [r for r in training if r["action"] == "rewritten"]
    assert rewritten, [(r["action"], r["reason"]) for r in training]
    assert all("training step inside 1 loop(s)" in r["reason"] for r in rewritten)
    assert all(r["swapped"] or r["recomputed"] for r in rewritten)


def test_regions_are_computed_once_per_graph():
    """The planners ask once per plan they try; a budget search tries dozens."""
    graph_def, _, g = _wrapped()
    assert regions.step_regions(g) is regions.step_regions(g)
    assert regions.contexts(g) is regions.contexts(g)
    again = G.build_index(graph_def, ["ret"])
    assert regions.step_regions(again) is not regions.step_regions(g)
    assert regions.step_regions(again) == regions.step_regions(g)
