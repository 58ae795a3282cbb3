"""Recomputation: plan and rewrite on hand-built steps; bit-identical training
with every mode on the six model families, and memory-centric's measured peak
on a deep ResNet (fresh processes)."""

import dataclasses

import pytest

from conftest import assert_identical, train_family
from graphs import (DT_BOOL, DT_FLOAT, DT_INT32, DT_RESOURCE, GraphBuilder, analyzed,
                    context, mlp_step, properties_fn, swish_step)
from sntf import analysis, config, passes, planner, rewrite
from sntf.graph import names
from sntf import graph as G

from sntf.planner import budget, modes, reasons, rebuild  # noqa: E402
from sntf.testing.workers.measure_peak import measure  # noqa: E402


def pool_step(cond: str = ""):
    """h = x W; r = relu(h); p = sigmoid(r); loss = sum(p); W -= lr x^T dh.

    p stands for a pooling layer (its static shape is a quarter of r's), a
    cheap op whose gradient reads its output; MaxPool itself is never
    recomputed (see optable.NEVER_RECOMPUTE_OPS). The backward pass reads p
    (SigmoidGrad), so p is kept from forward to backward unless it is
    recomputed from r, which the backward pass reads anyway.

    With a tf.cond lowered to Switch ops: cond="update": the update runs
    only when the gradient is finite, as under Keras' loss-scale optimizer
    (mixed_float16), the variable's handle and the gradient reaching it
    through Switch ops; cond="forward": p is computed from the Switch of r
    (a tf.cond in a layer), so p may be a dead tensor and must be left
    alone."""
    b = GraphBuilder()
    (b.arg("x").arg("w", DT_RESOURCE).read("w_read", "w")
     .op("MatMul", "h", ["x", "w_read"], T=DT_FLOAT)
     .op("Relu", "r", ["h"], T=DT_FLOAT))
    if cond == "forward":
        (b.const("flag", True, DT_BOOL)
         .op("Switch", "cond/r", ["r", "flag"], T=DT_FLOAT)
         .op("Sigmoid", "p", ["cond/r:1"], T=DT_FLOAT))
    else:
        b.op("Sigmoid", "p", ["r"], T=DT_FLOAT)
    (b.const("axes", [0], DT_INT32)
     .op("Sum", "loss", ["p", "axes"], T=DT_FLOAT)
     .const("grad/ones", 1.0)
     .op("Mul", "grad/seed", ["grad/ones", "loss"], T=DT_FLOAT)
     .op("SigmoidGrad", "grad/pool", ["p", "grad/seed"], T=DT_FLOAT)
     .op("ReluGrad", "grad/relu", ["grad/pool", "r"], T=DT_FLOAT)
     .op("MatMul", "grad/w", ["x", "grad/relu"], T=DT_FLOAT, transpose_a=True)
     .const("lr", 0.1)
     .op("Mul", "sgd/mul", ["lr", "grad/w"], T=DT_FLOAT))
    if cond != "update":
        b.op("AssignSubVariableOp", "sgd/update", ["w", "sgd/mul"], dtype=DT_FLOAT)
    else:
        (b.op("IsFinite", "finite", ["grad/w"], T=DT_FLOAT)
         .op("All", "all_finite", ["finite", "axes"])
         .op("Switch", "cond/w", ["w", "all_finite"], T=DT_RESOURCE)
         .op("Switch", "cond/mul", ["sgd/mul", "all_finite"], T=DT_FLOAT)
         .op("Identity", "cond/w_id", ["cond/w:1"], T=DT_RESOURCE)
         .op("AssignSubVariableOp", "sgd/update", ["cond/w_id", "cond/mul:1"],
             dtype=DT_FLOAT))
    return b.retval("ret", "loss").build()


def _props(g):
    idx = G.build_index(g)
    props = {}
    for name, op in zip(idx.names, idx.ops):
        if op in ("_Retval", "AssignSubVariableOp"):
            props[name] = []
        elif name == "w":
            props[name] = [(DT_RESOURCE, ())]
        elif op in ("Const", "Sum"):
            props[name] = [(DT_FLOAT, ())]
        elif name == "p":
            props[name] = [(DT_FLOAT, (256,))]
        elif name == "grad/seed":
            props[name] = [(DT_FLOAT, ())]
        else:
            props[name] = [(DT_FLOAT, (1024,))]
    return props


def plan_for(mode):
    g = pool_step()
    idx = G.build_index(g, ["ret"])
    facts = analysis.analyze(idx, _props(g))
    return g, idx, planner.plan_recompute(idx, facts, mode, frozenset(idx.fetch))


def test_plan_recomputes_the_pooled_tensor_from_the_kept_relu():
    _, _, plan = plan_for("speed")
    assert [r.tensor for r in plan.recomputes] == ["p:0"]
    recipe = plan.recomputes[0]
    assert recipe.chain == ("p",)            # r is read by backward: kept, not re-run
    assert recipe.groups == (planner.RecomputeGroup(
        consumers=(("grad/pool", 0),), trigger="grad/seed"),)
    decision = plan.decisions[0]
    assert decision.action == planner.RECOMPUTE and decision.bytes_saved == 1024


def _dtypes(idx):
    """(node, port) -> dtype for plan_swap: float everywhere but handles."""
    return {(i, port): DT_RESOURCE if op in ("_Arg", "Switch") and "w" in name
            else DT_FLOAT
            for i, (name, op) in enumerate(zip(idx.names, idx.ops)) for port in (0, 1)}


def _cond_props(g):
    props = _props(g)
    idx = G.build_index(g)
    for name, op in zip(idx.names, idx.ops):
        if op == "Switch":
            props[name] = [props[idx.names[idx.data_inputs[idx.node(name)][0][0]]][0]] * 2
        elif name in ("flag", "all_finite"):
            props[name] = [(10, ())]
        elif name == "cond/w_id":
            props[name] = [(DT_RESOURCE, ())]
    return props


@pytest.mark.parametrize("cond", ["update", "forward"])
def test_a_conditional_is_left_alone_and_the_rest_planned(cond):
    forward_cond = cond == "forward"
    g = pool_step(cond)
    idx = G.build_index(g, ["ret"])
    info = G.detect_training(idx)
    assert info.training, info.reason        # the handle is found through Switch
    region = G.control_flow_region(idx)
    assert idx.node("sgd/update") in region or forward_cond
    facts = analysis.analyze(idx, _cond_props(g))
    for plan in (planner.plan_recompute(idx, facts, "speed", frozenset(idx.fetch)),
                 planner.plan_swap(idx, facts, _dtypes(idx), 1, 1e9,
                                   frozenset(idx.fetch))):
        assert any("control flow present" in n for n in plan.lines), plan.lines
        touched = {d.tensor for d in planner.acting(plan.decisions)}
        kept = {d.tensor: d.codes for d in plan.decisions if d.action == planner.KEEP}
        if forward_cond:
            assert kept["p:0"] in ((reasons.CONTROL_FLOW,),
                                   (reasons.READ_UNDER_CONTROL_FLOW,)), kept
            # p may be dead: neither recomputed nor swapped; r is read by the
            # Switch, so it stays as it is too.
            assert not touched & {"p:0", "r:0"}, touched
        else:
            assert "p:0" in touched, touched


def scaled_step():
    """h = x W; m = h * s (a BatchNorm-style scale); r = relu(m); loss = sum(r).

    Relu runs in place over m, so r lives in m's buffer. The backward pass
    reads h (for ds) and r (ReluGrad); r is rebuilt from h by re-running m
    and r, which frees m's buffer between forward and backward."""
    b = GraphBuilder()
    (b.arg("x").arg("w", DT_RESOURCE).read("w_read", "w")
     .arg("v", DT_RESOURCE).read("s", "v")
     .op("MatMul", "h", ["x", "w_read"], T=DT_FLOAT)
     .op("Mul", "m", ["h", "s"], T=DT_FLOAT)
     .op("Relu", "r", ["m"], T=DT_FLOAT)
     .const("axes", [0], DT_INT32)
     .op("Sum", "loss", ["r", "axes"], T=DT_FLOAT)
     .const("grad/ones", 1.0)
     .op("Mul", "grad/seed", ["grad/ones", "loss"], T=DT_FLOAT)
     .op("ReluGrad", "grad/relu", ["grad/seed", "r"], T=DT_FLOAT)
     .op("Mul", "grad/ds", ["grad/relu", "h"], T=DT_FLOAT)
     .op("Mul", "grad/m", ["grad/relu", "s"], T=DT_FLOAT)
     .op("MatMul", "grad/w", ["x", "grad/m"], T=DT_FLOAT, transpose_a=True)
     .const("lr", 0.1)
     .op("Mul", "sgd/mul", ["lr", "grad/w"], T=DT_FLOAT)
     .op("AssignSubVariableOp", "sgd/update", ["w", "sgd/mul"], dtype=DT_FLOAT)
     .op("Sum", "grad/s", ["grad/ds", "axes"], T=DT_FLOAT)
     .op("AssignSubVariableOp", "sgd/update_s", ["v", "grad/s"], dtype=DT_FLOAT)
     .retval("ret", "loss"))
    return b.build()


def test_a_tensor_computed_in_place_is_recomputed_as_its_buffer():
    g = scaled_step()
    idx = G.build_index(g, ["ret"])
    props = _props(g)
    props.update(s=[(DT_FLOAT, ())], v=[(DT_RESOURCE, ())])
    props["grad/s"] = [(DT_FLOAT, ())]
    props["sgd/update_s"] = []
    facts = analysis.analyze(idx, props)
    r, m = (idx.node("r"), 0), (idx.node("m"), 0)
    assert facts.buffer_of(r) == m          # the Relu ran in place
    plan = planner.plan_recompute(idx, facts, "speed", frozenset(idx.fetch))
    assert [x.tensor for x in plan.recomputes] == ["r:0"]
    assert plan.recomputes[0].chain == ("m", "r")
    assert plan.decisions[0].bytes_saved == facts.buffer_bytes[m]
    # The rewritten graph no longer keeps m's buffer into the backward pass.
    out = rewrite.apply_plan(g, plan).graph_def
    new_idx = G.build_index(out, ["ret"])
    new_facts = analysis.analyze(new_idx, analysis.with_generated(props, new_idx))
    backward_start = new_facts.timeline.backward_start
    assert facts.buffer_intervals[m][1] > facts.timeline.backward_start
    assert new_facts.buffer_intervals[(new_idx.node("m"), 0)][1] < backward_start


def test_rewrite_clones_holds_back_and_rewires():
    g, idx, plan = plan_for("memory")
    out = rewrite.apply_plan(g, plan).graph_def
    nodes = {n.name: n for n in out.node}
    clones = [n for n in out.node if names.role_of(n) == names.ROLE_RECOMPUTE]
    assert len(clones) == len(plan.recomputes[0].groups)
    for clone, group in zip(clones, plan.recomputes[0].groups):
        assert names.recompute_source(clone.name) == "p"
        assert list(clone.input) == ["r", "^" + group.trigger]
        assert clone.op == "Sigmoid" and clone.attr["T"] == nodes["p"].attr["T"]
        for consumer, slot in group.consumers:
            data = [t for t in nodes[consumer].input if not t.startswith("^")]
            assert data[slot] == clone.name + ":0"
    # The forward reader keeps the original.
    assert list(nodes["loss"].input) == ["p", "axes"]
    # The input graph is untouched, and the result is a valid acyclic graph.
    assert not any(names.role_of(n) for n in g.node)
    new = G.build_index(out, ["ret"])
    assert not new.has_cycles


def test_pass_keeps_a_graph_the_plan_would_not_improve_and_is_idempotent():
    g = pool_step()
    state = config.State(enabled=True, policy="recompute",
                         options=config.Options(recompute_mode="speed"))
    properties = properties_fn(_props(g))

    first = passes.run_pass(g.SerializeToString(), ["ret"], [], state, properties)
    # Re-running p does not lower this graph's predicted peak (the peak is
    # elsewhere), so the pass keeps the graph and says why.
    assert first.graph_def is None
    assert first.report["action"] == "unchanged", first.report
    assert "planned but not applied" in first.report["reason"]
    assert first.report["planned_peak_bytes"] == first.report["predicted_peak_bytes"]
    # A graph sntf already rewrote is recognized and left alone.
    _, _, plan = plan_for("speed")
    rewritten = rewrite.apply_plan(g, plan).graph_def
    again = passes.run_pass(rewritten.SerializeToString(), ["ret"], [], state,
                              properties)
    assert again.graph_def is None and "already rewritten" in again.report["reason"]


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError):
        config.parse_options({"recompute_mode": "fast"})
    with pytest.raises(ValueError):
        plan_for("fast")
    # "auto" chooses between the planner's two modes on the planned
    # timeline, in sntf.planner.modes; plan_recompute itself refuses it.
    with pytest.raises(ValueError):
        plan_for("auto")


def test_auto_mode_plans_on_the_planned_timeline():
    g = scaled_step()
    props = _props(g)
    props.update(s=[(DT_FLOAT, ())], v=[(DT_RESOURCE, ())])
    props["grad/s"] = [(DT_FLOAT, ())]
    props["sgd/update_s"] = []
    base, ctx = analyzed(g, ["ret"], props), context()
    plan, planned = modes.auto_recompute(base, ctx)
    assert plan.lines[0].startswith("recompute (auto): 1 tensor(s), speed-centric")
    assert [r.tensor for r in plan.recomputes] == ["r:0"]
    # What comes back is the analysis of exactly that plan's graph.
    again = ctx.evaluate(plan, base)
    assert planned.facts.predicted_peak_bytes == again.facts.predicted_peak_bytes
    assert planned.index.names == again.index.names
    # The pass keeps or drops it on that analysis, and says which.
    state = config.State(enabled=True, policy="recompute",
                         options=config.Options(recompute_mode="auto"))
    report = passes.run_pass(g.SerializeToString(), ["ret"], [], state,
                               properties_fn(props)).report
    assert ("recompute (auto)" in report["reason"]
            or "would not fall" in report["reason"]), report["reason"]
    assert "plan_recompute" in report["stage_seconds"]


def test_the_lower_of_two_release_orders_is_kept(monkeypatch):
    """Release points picked on the executor order and on the order with
    consumers last first: the planner keeps the plan planned lower, and a
    plan that changes nothing only when neither changes anything."""
    g = pool_step()
    idx = G.build_index(g, ["ret"])
    props = _props(g)
    facts = analysis.analyze(idx, props)
    base = analyzed(g, ["ret"], props)
    real = context().evaluate(planner.plan_recompute(idx, facts, "speed",
                                                     frozenset(idx.fetch)), base)
    orders = []

    def plan_recompute(index, facts, mode, protected, memory_tensors, order=None,
                       segment_checkpoints=0):
        orders.append(order)
        return planner.Plan(policy="recompute", notes=(f"order {len(orders)}",))

    def with_peaks(*peaks):
        """An evaluate giving each call's plan the next peak (None: no change)."""
        it = iter(peaks)

        def planned(plan, *args):
            peak = next(it)
            if peak is None:
                return None
            facts_ = dataclasses.replace(real.facts, device_timelines={},
                                         predicted_peak_bytes=peak)
            return dataclasses.replace(real, facts=facts_)
        return planned

    monkeypatch.setattr(modes, "plan_recompute", plan_recompute)
    for peaks, chosen in (((200, 100), "order 2"), ((100, 200), "order 1"),
                          ((100, 100), "order 1"), ((None, 300), "order 2"),
                          ((300, None), "order 1"), ((None, None), "order 1")):
        orders.clear()
        ctx = planner.Context(evaluate=with_peaks(*peaks))
        plan, planned = modes.lowest_recompute(base, ctx, "speed")
        assert plan.lines == (chosen,), (peaks, plan.lines)
        assert orders[0] is None
        assert orders[1] == analysis.schedule(idx, consumers_last_first=True)
        expected = peaks[int(chosen[-1]) - 1]
        assert (planned is None if expected is None
                else planned.facts.budget_peak_bytes == expected), peaks


@pytest.mark.slow
def test_memory_centric_measures_under_0_6x_on_a_178_layer_resnet():
    """Issue #4's memory target, measured: CPU:0 allocator peak in fresh
    processes, the planned peak within 15% of it."""
    base = measure("resnet", 32, steps=2, policy="off", depth=8)
    memory = measure("resnet", 32, steps=2, policy="recompute", depth=8,
                     recompute_mode="memory")
    ratio = memory["measured_peak_bytes"] / base["measured_peak_bytes"]
    assert ratio <= 0.6, (ratio, memory["training_reports"][-1]["reason"])
    planned = memory["planned_peak_bytes"] / memory["measured_peak_bytes"]
    assert abs(planned - 1.0) <= 0.15, planned


@pytest.mark.slow
def test_densenet_memory_centric_stays_below_speed_centric_after_the_first_step():
    """Issue #4's order of modes on DenseNet, measured over three steps.

    Without the update edges (planner.plan_update_order) memory-centric
    measured 75.2 MiB in the first step and 95.6-101.2 MiB from the second
    on, above speed-centric's 96.5: variables copied mid-step fragmented the
    allocator. With them every step peaks alike, as the planned peak says.
    """
    speed = measure("densenet", 32, steps=3, policy="recompute", recompute_mode="speed")

    def steps_alike(run):
        # The fragmentation this guards against added over a quarter from the
        # second step on; identical steps still differ by a MiB or so (about
        # 2%: 77.7 then 79.1 MiB) with the allocator's history.
        steps = run["step_peaks_bytes"]
        return steps[-1] <= steps[0] * 1.03

    # Without the edges every run fragmented. With them, one run inside a
    # full two-process suite measured [75.1, 98.6, 98.6] MiB, while eighteen
    # runs alone or beside CPU hogs stayed within 2%: one inter-op thread
    # does not fix the executor's order entirely (the input iterator answers
    # from another thread). Two runs of three must hold.
    runs = []
    while sum(map(steps_alike, runs)) < 2 and len(runs) - sum(map(steps_alike, runs)) < 2:
        runs.append(measure("densenet", 32, steps=3, policy="recompute",
                            recompute_mode="memory"))
    assert sum(map(steps_alike, runs)) >= 2, [r["step_peaks_bytes"] for r in runs]
    memory = next(r for r in runs if steps_alike(r))
    assert memory["measured_peak_bytes"] <= speed["measured_peak_bytes"], (
        memory["measured_peak_bytes"], speed["measured_peak_bytes"])
    planned = memory["planned_peak_bytes"] / memory["measured_peak_bytes"]
    assert abs(planned - 1.0) <= 0.15, planned


# The MLP's Dense layers with ReLU are one fused op each (TensorFlow's
# remapper makes a _FusedMatMul of MatMul, BiasAdd and Relu): the paper's
# rule finds no cheap tensor (speed and auto leave the graph), only segments
# that re-run the fused MatMuls save anything.
EXPECTED_RECOMPUTE = {("mlp", "speed"): "unchanged", ("mlp", "auto"): "unchanged"}


@pytest.mark.slow
# Four families, to keep the suite's run short: the MLP's and VGG's graphs
# replay under every policy in tests/test_corpus.py, VGG trains under
# swap+recompute in tests/test_swap.py, and the fuzzer trains random dense and
# convolutional chains bit for bit.
@pytest.mark.parametrize("family", ["resnet", "densenet", "transformer", "mobilenet"])
def test_every_mode_trains_bit_identically(fresh_python, tmp_path, family):
    base, weights = train_family(fresh_python, tmp_path / "base.npz", family)
    planned = {}
    for mode in ("speed", "memory", "auto"):
        result, got = train_family(fresh_python, tmp_path / f"{mode}.npz", family,
                             "--sntf", "recompute", "--recompute-mode", mode)
        assert_identical((base, weights), (result, got), (family, mode))
        training = [r for r in result["reports"] if r["training"]]
        # What each mode does to each family at batch 8, pinned: a pass that
        # rewrote nothing cannot pass for an identical rewrite.
        expected = EXPECTED_RECOMPUTE.get((family, mode), "rewritten")
        assert training and training[-1]["action"] == expected, (family, mode, training)
        if expected == "rewritten":
            assert training[-1]["recomputed"], training[-1]
        planned[mode] = {r["graph"]: r["planned_peak_bytes"] for r in training}
    # Memory-centric is never planned above speed-centric
    # (sntf.planner.modes.memory_recompute falls back to the speed plan).
    for graph_name, peak in planned["memory"].items():
        speed = planned["speed"].get(graph_name)
        if peak is not None and speed is not None:
            assert peak <= speed, (family, graph_name, peak, speed)


def test_segments_re_run_matmuls_from_each_segments_input():
    g, props = mlp_step(widths=(64, 64, 64, 64, 64), batch=64)
    idx = G.build_index(g, ["ret"])
    facts = analysis.analyze(idx, props)
    protected = frozenset(idx.fetch)

    def chains(per_segment):
        plan = planner.plan_recompute(idx, facts, "memory", protected,
                                      segment_checkpoints=per_segment)
        return plan, {r.tensor: r.chain for r in plan.recomputes}

    # The paper's rule keeps every MatMul output (pre_i, which ReluGrad
    # reads) and rebuilds each Relu from it. (The last layer's buffers have
    # no earlier backward op to release a clone.)
    assert chains(0)[1] == {"h1:0": ("h1",), "h2:0": ("h2",), "h3:0": ("h3",)}
    # One MatMul per segment: each MatMul's input h_i is kept and the MatMul
    # is re-run from it.
    assert chains(1)[1] == {"pre1:0": ("pre1",), "pre2:0": ("pre2",),
                            "pre3:0": ("pre3",)}
    # Two: pre3 would be the third MatMul since x, so h2 (its input) is
    # kept; everything before it is rebuilt from x, pre3 and h3 from h2.
    segmented, got = chains(2)
    assert got == {"pre1:0": ("pre1",), "h1:0": ("pre1", "h1"),
                   "pre2:0": ("pre1", "h1", "pre2"),
                   "pre3:0": ("pre3",), "h3:0": ("pre3", "h3")}
    # The rewrite clones the MatMul with its attributes and reads the kept
    # tensor and the forward read of the weight.
    out = rewrite.apply_plan(g, segmented).graph_def
    clones = [n for n in out.node if n.op == "MatMul"
              and names.recompute_source(n.name) == "pre3"]
    assert clones and all(list(c.input)[:2] == ["h2", "w3_read"] for c in clones)
    assert not G.build_index(out, ["ret"]).has_cycles


def test_segments_keep_the_input_of_each_residual_block():
    """a_k = relu(m_2k(relu(m_2k-1(a_k-1))) + a_k-1): the chain of a block's
    first MatMul would run back along the shortcut into the blocks before,
    so with two MatMuls per segment the blocks' inputs are kept."""
    b = GraphBuilder().arg("x").arg("w", DT_RESOURCE).read("w_read", "w")
    b.op("MatMul", "m0", ["x", "w_read"], T=DT_FLOAT).op("Relu", "a0", ["m0"], T=DT_FLOAT)
    for k in range(1, 4):
        (b.op("MatMul", f"m{2 * k - 1}", [f"a{k - 1}", "w_read"], T=DT_FLOAT)
         .op("Relu", f"h{k}", [f"m{2 * k - 1}"], T=DT_FLOAT)
         .op("MatMul", f"m{2 * k}", [f"h{k}", "w_read"], T=DT_FLOAT)
         .op("AddV2", f"add{k}", [f"m{2 * k}", f"a{k - 1}"], T=DT_FLOAT)
         .op("Relu", f"a{k}", [f"add{k}"], T=DT_FLOAT))
    g = b.build()
    idx = G.build_index(g)
    facts = analysis.analyze(idx, {n: [(DT_FLOAT, (64,))] for n in idx.names})

    def recomputable(i):
        return idx.ops[i] in ("MatMul", "Relu", "AddV2")

    kept = planner.segment_inputs(idx, facts, recomputable, 2)
    assert {idx.names[i] for i in kept} == {"h1", "a1", "a2"}


def gradient_step(w_device="", reader_after_w=False):
    """A convolution's output gradient dy read by its filter gradient (W),
    its input gradient (I), its bias gradient (B) and a Shape op."""
    b = (GraphBuilder().arg("x").arg("dy").arg("k")
         .const("fsizes", [3, 3, 1, 1], DT_INT32).const("isizes", [1, 8, 8, 1], DT_INT32))
    conv = dict(T=DT_FLOAT, strides=[1, 1, 1, 1], padding="SAME")
    b.op("Conv2DBackpropFilter", "W", ["x", "fsizes", "dy"], device=w_device, **conv)
    b.op("Conv2DBackpropInput", "I", ["isizes", "k", "dy"] + (["^W"] if reader_after_w
                                                             else []), **conv)
    b.op("Shape", "S", ["dy"], T=DT_FLOAT)
    b.op("BiasAddGrad", "B", ["dy"], T=DT_FLOAT)
    return (b.retval("r0", "W").retval("r1", "I").retval("r2", "S", DT_INT32)
            .retval("r3", "B").build())


def test_weight_gradients_are_ordered_before_the_input_gradient():
    g = gradient_step()
    orders = planner.plan_gradient_order(G.build_index(g))
    # Not before the bias gradient, which oneDNN may fuse with W.
    assert orders == (planner.Order(before="W", after="I"),)
    out = rewrite.apply_plan(g, planner.Plan(policy="recompute", orders=orders))
    assert out.modified
    assert list({n.name: n for n in out.graph_def.node}["I"].input)[-1] == "^W"
    # Applied to the result again, the edge is not doubled.
    twice = rewrite.apply_plan(out.graph_def, planner.Plan(policy="recompute",
                                                           orders=orders))
    assert [t for t in {n.name: n for n in twice.graph_def.node}["I"].input
            if t == "^W"] == ["^W"]
    # Already ordered, or on another device: no edge.
    assert planner.plan_gradient_order(G.build_index(gradient_step(
        reader_after_w=True))) == ()
    assert planner.plan_gradient_order(G.build_index(gradient_step(
        w_device="/device:CPU:1"))) == ()


def test_bias_gradients_are_ordered_first_only_where_onednn_does_not_fuse_them():
    # Without oneDNN's graph pass the bias gradient is an op of its own,
    # deferred by the executor like a filter gradient.
    orders = planner.plan_gradient_order(G.build_index(gradient_step()), onednn=False)
    assert {(o.before, o.after) for o in orders} == {("W", "I"), ("B", "I")}
    # Never between the two weight gradients, which oneDNN would fuse.
    assert planner.plan_gradient_order(G.build_index(gradient_step()), onednn=True) == (
        planner.Order(before="W", after="I"),)


def test_a_weight_gradient_downstream_of_its_reader_is_not_ordered_first():
    # W reads I's result (as a clone released by I would): W -> I would
    # close a cycle.
    g = gradient_step()
    nodes = {n.name: n for n in g.node}
    nodes["W"].input[0] = "I"
    assert planner.plan_gradient_order(G.build_index(g)) == ()


def test_variable_updates_wait_for_the_readers_of_their_reads():
    g, _ = mlp_step(widths=(64, 64, 64, 64), batch=64)
    idx = G.build_index(g, ["ret"])
    # w_i's read feeds the forward MatMul (an ancestor of the update, no
    # edge needed) and grad/h_{i-1}, which nothing orders against the update.
    assert set(planner.plan_update_order(idx)) == {
        planner.Order(before="grad/h1", after="sgd/update2"),
        planner.Order(before="grad/h2", after="sgd/update3")}
    # A reader through an Identity of the read holds the same buffer.
    b = GraphBuilder()
    b.arg("w", DT_RESOURCE).read("w_read", "w").op("Identity", "w_id", ["w_read"])
    b.op("Neg", "late", ["w_id"]).arg("x").op("Mul", "step", ["x", "w_read"])
    b.op("AssignSubVariableOp", "update", ["w", "step"])
    # Reads placed after the update see the new value: no edge for them, and
    # none from a reader that waits for the update (it would close a cycle).
    b.read("w_after", "w", ["^update"]).op("Neg", "next", ["w_after"])
    b.op("Neg", "waits", ["w_id", "^update"])
    assert planner.plan_update_order(G.build_index(b.build())) == (
        planner.Order(before="late", after="update"),)


def test_clones_reading_a_variable_hold_back_its_update():
    # Memory-centric segments of two re-run pre1 = x W1 to rebuild h1 for
    # grad/w2, reading W1's forward read late in the backward pass; nothing
    # orders that clone against W1's update. Likewise pre3's clone for h3.
    g, props = mlp_step(widths=(64, 64, 64, 64, 64), batch=64)
    idx = G.build_index(g, ["ret"])
    facts = analysis.analyze(idx, props)
    plan = planner.plan_recompute(idx, facts, "memory", frozenset(idx.fetch),
                                  segment_checkpoints=2)
    out = rewrite.apply_plan(g, plan).graph_def
    orders = planner.plan_update_order(G.build_index(out, ["ret"]))
    cloned = {(names.recompute_source(o.before), o.after) for o in orders
              if names.recompute_source(o.before)}
    assert cloned == {("pre1", "sgd/update1"), ("pre3", "sgd/update3")}
    # The rewrite finds the clones it made by name.
    ordered = rewrite.apply_plan(g, dataclasses.replace(plan, orders=orders)).graph_def
    update = {n.name: n for n in ordered.node}["sgd/update1"]
    assert any(names.recompute_source(t.lstrip("^")) == "pre1" for t in update.input
               if t.startswith("^"))
    assert not G.build_index(ordered, ["ret"]).has_cycles
    # The planner's recompute stage adds them.
    chosen, planned = modes.recompute(analyzed(g, ["ret"], props),
                                      context(recompute_mode="memory"))
    assert "edge(s) ordering variable updates after" in chosen.lines[0]
    assert planner.plan_update_order(planned.index) == ()


def test_with_segments_shape_readers_keep_the_original():
    g = pool_step()
    # The gradient seed is reshaped to p's shape (as Keras' dynamic-batch
    # graphs do with Shape ops on forward tensors).
    shape = g.node.add(name="grad/shape", op="Shape", input=["p"])
    shape.attr["T"].type = DT_FLOAT
    reshape = g.node.add(name="grad/seed_r", op="Reshape",
                         input=["grad/seed", "grad/shape"])
    reshape.attr["T"].type = DT_FLOAT
    nodes = {n.name: n for n in g.node}
    nodes["grad/pool"].input[1] = "grad/seed_r"
    idx = G.build_index(g, ["ret"])
    props = _props(g)
    props["grad/shape"] = [(DT_INT32, (1,))]
    props["grad/seed_r"] = [(DT_FLOAT, (256,))]
    facts = analysis.analyze(idx, props)
    assert facts.node_phases[idx.node("grad/shape")] == G.BACKWARD
    # Under the paper's rule a tensor whose shape the backward pass reads
    # is kept (see plan_recompute).
    assert not planner.plan_recompute(idx, facts, "memory",
                                      frozenset(idx.fetch)).recomputes
    plan = planner.plan_recompute(idx, facts, "memory", frozenset(idx.fetch),
                                  segment_checkpoints=2)
    recipes = {r.tensor: r for r in plan.recomputes}
    assert set(recipes) == {"r:0", "p:0"}   # r with its MatMul
    readers = {c for group in recipes["p:0"].groups for c, _ in group.consumers}
    assert readers == {"grad/pool"}


def test_order_edges_that_close_a_cycle_together_are_not_both_taken():
    """a -> b and c -> d: the edges b -> c and d -> a are each fine alone
    and close a cycle together. A transposed convolution's filter gradient
    made such a pair (its third input is the forward activation, not an
    output gradient), and the rewrite failed with a cycle."""
    from sntf.planner import order

    b = GraphBuilder()
    (b.arg("x").op("Identity", "a", ["x"], T=DT_FLOAT).op("Identity", "b", ["a"], T=DT_FLOAT)
     .op("Identity", "c", ["x"], T=DT_FLOAT).op("Identity", "d", ["c"], T=DT_FLOAT)
     .retval("rb", "b").retval("rd", "d"))
    g = G.build_index(b.build(), ["rb", "rd"])
    n = {name: i for i, name in enumerate(g.names)}
    edges = order._new_orders(g, [(n["b"], n["c"]), (n["d"], n["a"]), (n["a"], n["d"])])
    assert [(e.before, e.after) for e in edges] == [("b", "c"), ("a", "d")]


@pytest.mark.parametrize("widths,batch,applied", [
    ((512, 512, 512), 16, False),        # plans 0.8% lower: within the error
    ((512, 512, 512, 512), 256, True),   # plans 17.6% lower
])
def test_a_plan_within_the_analysis_error_is_not_applied(widths, batch, applied):
    graph_def, props = mlp_step(widths, batch)
    base = analyzed(graph_def, ["ret"], props)
    outcome = planner.plan("recompute", base, context())
    if applied:
        assert outcome.planned is not None and outcome.plan.changes_graph
        assert outcome.planned.peak < 0.95 * base.peak
        return
    assert outcome.planned is None and not outcome.plan.changes_graph
    assert "would not fall by 5%" in outcome.plan.lines[-1], outcome.plan.lines
    # The tensors the rejected plan moved are kept, each with the reason.
    kept = [r for d in outcome.plan.decisions for r in d.why
            if r.code == reasons.BELOW_MIN_GAIN]
    assert kept and all(r.param("percent") == 5 for r in kept), outcome.plan.decisions


def _swish(graph_def=None, mode: str = "speed"):
    """(analyzed swish_step, its rebuild plan)."""
    g, props = swish_step()
    base = analyzed(graph_def or g, ["ret"], props)
    idx = base.index
    return base, rebuild.plan_rebuilds(idx, base.facts, mode, frozenset(idx.fetch))


@pytest.mark.parametrize("mode", ["speed", "memory"])
def test_a_backward_tensor_read_twice_is_rebuilt_for_its_later_reader(mode):
    """TensorFlow's swish gradient reads sigmoid(x) for 1 - sigmoid(x) and
    again three ops later, so dh, sigmoid(x), 1 - sigmoid(x) and x are live
    at once: the zoo's swish all-convolutional network measured 24.1 MiB
    there, 2.06 times its lower bound, whatever the plan did with forward
    tensors. Re-run from x for its last reader, sigmoid(x) dies at its first,
    and the step holds one activation less."""
    base, plan = _swish(mode=mode)
    assert [r.tensor for r in plan.recomputes] == ["grad/sig:0"]
    rebuilt = plan.recomputes[0]
    assert rebuilt.chain == ("grad/sig",)
    assert rebuilt.groups == (planner.RecomputeGroup(
        consumers=(("grad/act", 0),), trigger="grad/add"),)
    assert rebuild.is_rebuild(plan.decisions[0])
    assert not rebuild.is_rebuild(plan_for("speed")[2].decisions[0])

    # On the graph recomputation leaves (h rebuilt for grad/w2), where the
    # swish gradient holds the peak.
    ctx = context()
    recomputed = modes.recompute(base, ctx)[1]
    idx = recomputed.index
    again = rebuild.plan_rebuilds(idx, recomputed.facts, mode, frozenset(idx.fetch))
    assert [r.tensor for r in again.recomputes] == ["grad/sig:0"]
    activation = 512 * 256 * 4
    assert ctx.evaluate(again, recomputed).peak <= recomputed.peak - activation
    rewritten = rewrite.apply_plan(base.graph_def, plan).graph_def
    nodes = {n.name: n for n in rewritten.node}
    clone = nodes[nodes["grad/act"].input[0].split(":")[0]]
    assert clone.op == "Sigmoid" and clone.name != "grad/sig"
    assert list(clone.input) == ["pre", "^grad/h", "^grad/add"]
    assert list(nodes["grad/sub"].input) == ["grad/one", "grad/sig"]


def test_the_recompute_policy_rebuilds_after_recomputing():
    """The rebuild stage runs on the graph recomputation left, and stands
    where it plans lower."""
    g, props = swish_step()
    base = analyzed(g, ["ret"], props)
    outcome = planner.plan("recompute", base, context())
    assert {"h:0", "grad/sig:0"} <= {r.tensor for r in outcome.plan.recomputes}
    forward_only = modes.recompute(base, context())[1]
    assert outcome.planned.peak < forward_only.peak


def test_a_backward_tensor_computed_from_another_is_not_rebuilt():
    """A clone that read a backward tensor would keep that one alive until
    the clone instead: only chains rooted in forward tensors and constants
    are rebuilt."""
    g, _ = swish_step()
    node = next(n for n in g.node if n.name == "grad/sig")
    node.input[0] = "grad/h"
    _, plan = _swish(graph_def=g)
    assert plan.recomputes == ()


def test_a_rebuild_chain_runs_through_a_recomputed_input():
    """Where the swish's input is recomputed (EfficientNet's, a batch
    normalization's output), sigmoid(x) reads the clone, a cheap backward
    op: the rebuild re-runs it too, from the kept tensors it reads."""
    g, props = swish_step()
    next(n for n in g.node if n.name == "pre").name = "pre/matmul"
    more = (GraphBuilder().op("Square", "pre", ["pre/matmul"], T=DT_FLOAT)
            .const("grad/two", 2.0)
            .op("Mul", "grad/dsq", ["grad/two", "pre/matmul"], T=DT_FLOAT)
            .op("Mul", "grad/pre0", ["grad/pre", "grad/dsq"], T=DT_FLOAT).build())
    g.node.extend(more.node)
    next(n for n in g.node if n.name == "grad/w1").input[1] = "grad/pre0"
    props = dict(props, **{name: props["pre"] for name in
                           ("pre/matmul", "grad/dsq", "grad/pre0")},
                 **{"grad/two": [(DT_FLOAT, ())]})
    base = analyzed(g, ["ret"], props)
    idx = base.index
    forward = planner.plan_recompute(idx, base.facts, "speed", frozenset(idx.fetch))
    assert "pre:0" in {r.tensor for r in forward.recomputes}
    recomputed = context().evaluate(forward, base)
    plan = rebuild.plan_rebuilds(recomputed.index, recomputed.facts, "speed",
                                 frozenset(recomputed.index.fetch))
    recipe = {r.tensor: r for r in plan.recomputes}["grad/sig:0"]
    assert [names.recompute_source(n) for n in recipe.chain] == ["pre", ""]
    assert recipe.chain[1] == "grad/sig"


@pytest.mark.parametrize("peak_at_rebuilt", [True, False])
def test_deferred_rebuilds_not_live_at_the_rivals_peak_stop_the_run(peak_at_rebuilt):
    """The composition with deferred rebuilds runs a swap stage and order
    edges of its own (family-resnet's pass went 1.60 -> 2.23 s with them).
    Where no rebuilt tensor is live at the peak of the same composition
    without them (its rival), they cannot lower that peak: the run is void
    there, before the stages after them."""
    from sntf.planner import policies

    g, props = swish_step()
    base = analyzed(g, ["ret"], props)
    ctx = context()
    recomputed = modes.recompute(base, ctx)[1]
    facts = recomputed.facts
    sig = facts.buffer_of((recomputed.index.node("grad/sig"), 0))
    start, stop = facts.buffer_intervals[sig]
    step = start if peak_at_rebuilt else next(
        s for s in range(len(facts.schedule)) if not start <= s <= stop)
    rival = dataclasses.replace(recomputed, facts=dataclasses.replace(facts, peak_step=step))
    part = policies.SWAP_AND_RECOMPUTE.parts[1]
    proposals: dict = {}
    run = part.run(base, ctx, proposals, rival)
    swaps = [k for k in proposals if k[0] == policies.SWAP_STAGE]
    assert run.void is not peak_at_rebuilt
    assert len(swaps) == (1 if peak_at_rebuilt else 0)
    assert ("grad/sig:0" in {r.tensor for r in run.recomputes}) is peak_at_rebuilt
