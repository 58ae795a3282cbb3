"""Swapping: plan and rewrite on a hand-built step; bit-identical training
with "swap" and "swap+recompute" on the six model families (fresh processes);
a 200-step soak without pool or peak growth."""

import os

import pytest

from conftest import assert_identical, train_family
from graphs import DT_FLOAT, DT_INT32, DT_RESOURCE, GraphBuilder, properties_fn
from sntf import analysis, config, planner, rewrite
from sntf.graph import names
from sntf.planner import budget as budget_planning
from sntf.planner import reasons
from sntf.planner import room as room_module
from sntf.planner.room import Room
from sntf.planner import heuristics
from sntf.planner.backward import backward_read_by_buffer
from sntf.planner.swap import default_min_bytes, threshold_at_peak
from sntf import graph as G

from sntf.testing.workers import measure_peak  # noqa: E402

MIB = 1 << 20


def dense_step(width=MIB // 4):
    """h1 = relu(x W1); h2 = h1 W2; loss = sum(h2); SGD on W1.

    The backward pass reads x (for dW1), h1 (ReluGrad) and W2; h1 (1 MiB)
    is the one worth parking."""
    b = GraphBuilder()
    (b.arg("x").arg("w1", DT_RESOURCE).read("w1_read", "w1")
     .arg("w2", DT_RESOURCE).read("w2_read", "w2")
     .op("MatMul", "h1_pre", ["x", "w1_read"], T=DT_FLOAT)
     .op("Relu", "h1", ["h1_pre"], T=DT_FLOAT)
     .op("MatMul", "h2", ["h1", "w2_read"], T=DT_FLOAT)
     .const("axes", [0], DT_INT32)
     .op("Sum", "loss", ["h2", "axes"], T=DT_FLOAT)
     .const("grad/ones", 1.0)
     .op("Mul", "grad/seed", ["grad/ones", "loss"], T=DT_FLOAT)
     .op("MatMul", "grad/h1", ["grad/seed", "w2_read"], T=DT_FLOAT, transpose_b=True)
     .op("ReluGrad", "grad/relu", ["grad/h1", "h1"], T=DT_FLOAT)
     .op("MatMul", "grad/w1", ["x", "grad/relu"], T=DT_FLOAT, transpose_a=True)
     .const("lr", 0.1)
     .op("Mul", "sgd/mul1", ["lr", "grad/w1"], T=DT_FLOAT)
     .op("AssignSubVariableOp", "sgd/update1", ["w1", "sgd/mul1"], dtype=DT_FLOAT)
     .retval("ret", "loss"))
    props = {}
    for node in b.build().node:
        if node.op in ("_Retval", "AssignSubVariableOp"):
            props[node.name] = []
        elif node.name in ("w1", "w2"):
            props[node.name] = [(DT_RESOURCE, ())]
        elif node.name in ("h1_pre", "h1", "grad/h1", "grad/relu"):
            props[node.name] = [(DT_FLOAT, (width,))]
        elif node.name == "x":
            props[node.name] = [(DT_FLOAT, (1024,))]
        else:
            props[node.name] = [(DT_FLOAT, (16,))]
    return b.build(), props


def planned_swaps(g, props, min_bytes=MIB):
    """(index, analysis, swap plan) of a hand-built step."""
    idx = G.build_index(g, ["ret"])
    facts = analysis.analyze(idx, props)
    dtypes = {(idx.node(n), p): o[0] for n, outs in props.items()
              for p, o in enumerate(outs)}
    return idx, facts, planner.plan_swap(idx, facts, dtypes, min_bytes, 1e9,
                                         frozenset(idx.fetch))


def rewritten_peak(g, props, plan) -> int:
    """The predicted peak of the step with the plan applied."""
    out = rewrite.apply_plan(g, plan).graph_def
    new_idx = G.build_index(out, ["ret"])
    return analysis.analyze(new_idx, analysis.with_generated(props, new_idx)).predicted_peak_bytes


def swap_plan(min_bytes=MIB, bandwidth=1e9):
    g, props = dense_step()
    idx = G.build_index(g, ["ret"])
    facts = analysis.analyze(idx, props)
    dtypes = {(idx.node(n), p): o[0] for n, outs in props.items()
              for p, o in enumerate(outs)}
    plan = planner.plan_swap(idx, facts, dtypes, min_bytes, bandwidth,
                             frozenset(idx.fetch))
    return g, props, idx, facts, plan


def test_plan_swaps_the_large_tensor_the_backward_pass_reads():
    _, _, idx, facts, plan = swap_plan()
    # h1 lives in h1_pre's buffer (Relu runs in place); h1 is the only
    # tensor in it that the backward pass reads, so parking h1 frees it.
    assert facts.buffer_of((idx.node("h1"), 0)) == (idx.node("h1_pre"), 0)
    assert [s.tensor for s in plan.swaps] == ["h1:0"]
    assert plan.tensors(planner.SWAP) == ["h1:0"]
    # Every other forward tensor the backward pass reads is kept, and the
    # plan says why: the loss is a scalar (4 bytes, one 256-byte allocator
    # granule), far below swap_min_bytes.
    kept = {d.tensor: d.why for d in plan.decisions if d.action == planner.KEEP}
    assert kept == {"loss:0": (reasons.reason(reasons.BELOW_THRESHOLD, "swap", bytes=256,
                                              min_bytes=1048576),)}
    swap = plan.swaps[0]
    assert swap.dtype == DT_FLOAT
    readers = sorted(c for g_ in swap.groups for c in g_.consumers)
    assert readers == [("grad/relu", 1)]
    decision = plan.decisions[0]
    assert decision.action == planner.SWAP and decision.bytes_saved == MIB
    # Below the threshold nothing is swapped.
    assert swap_plan(min_bytes=2 * MIB)[4].swaps == ()


@pytest.mark.parametrize("onednn", [True, False])
def test_a_max_pool_read_by_its_gradient_is_swapped_only_without_onednn(onednn):
    """dense_step with h1 = MaxPool(h1_pre) and its gradient MaxPoolGrad(
    h1_pre, h1, dy): oneDNN pairs the two through a workspace only while
    MaxPoolGrad reads h1 straight from the MaxPool (benchmarks/fuzz_pass.py
    found a 1-ulp gradient when a swap-in stood between them)."""
    g, props = dense_step()
    for node in g.node:
        if node.name == "h1":
            node.op = "MaxPool"
        elif node.name == "grad/relu":
            node.op = "MaxPoolGrad"
            node.input[:] = ["h1_pre", "h1", "grad/h1"]
    idx = G.build_index(g, ["ret"])
    facts = analysis.analyze(idx, props)
    dtypes = {(idx.node(n), p): o[0] for n, outs in props.items()
              for p, o in enumerate(outs)}
    plan = planner.plan_swap(idx, facts, dtypes, 1, 1e9, frozenset(idx.fetch),
                             workspace_pairs=onednn)
    swapped = [sw.tensor for sw in plan.swaps]
    assert ("h1:0" in swapped) is not onednn, swapped
    assert "h1_pre:0" in swapped        # the gradient's other input is free to go


def test_prefetch_trigger_runs_before_the_first_reader_and_covers_the_transfer():
    _, _, idx, facts, plan = swap_plan(bandwidth=1e15)     # transfer ~ free
    step_of = {n: s for s, n in enumerate(facts.schedule)}
    group = plan.swaps[0].groups[0]
    first_reader = min(step_of[idx.node(c)] for c, _ in group.consumers)
    trigger = step_of[idx.node(group.trigger)]
    assert trigger < first_reader
    assert facts.node_phases[idx.node(group.trigger)] == G.BACKWARD
    # A slow link moves the trigger earlier (never later).
    _, _, _, slow_facts, slow = swap_plan(bandwidth=1e3)
    slow_trigger = step_of[idx.node(slow.swaps[0].groups[0].trigger)]
    assert slow_trigger <= trigger
    assert slow.decisions[0].seconds_added > 0


def early_gradient_step():
    """dense_step with a GELU-like gradient: grad/early = Exp(h1) reads
    forward values only, so the executor runs it in the forward pass, and
    only grad/mix = grad/h1 * grad/early combines it with a gradient."""
    g, props = dense_step()
    for node in g.node:
        if node.name == "grad/relu":
            node.input[:] = ["grad/mix", "h1"]
    extra = GraphBuilder()
    (extra.op("Exp", "grad/early", ["h1"], T=DT_FLOAT)
     .op("Mul", "grad/mix", ["grad/h1", "grad/early"], T=DT_FLOAT)
     # W2 trained too, so that h2 is the output layer the loss waits for.
     .op("MatMul", "grad/w2", ["h1", "grad/seed"], T=DT_FLOAT, transpose_a=True)
     .op("Mul", "sgd/mul2", ["lr", "grad/w2"], T=DT_FLOAT)
     .op("AssignSubVariableOp", "sgd/update2", ["w2", "sgd/mul2"], dtype=DT_FLOAT))
    g.node.extend(extra.build().node)
    props["grad/early"] = props["grad/mix"] = props["h1"]
    props["grad/w2"] = props["sgd/mul2"] = props["loss"]
    props["sgd/update2"] = []
    return g, props


def test_a_tensor_first_read_by_an_early_gradient_op_is_swapped():
    """h1's swap-in for grad/early, which waits for no gradient, is released
    by a backward op upstream of grad/mix, the first op that combines
    grad/early with a gradient, and never by one downstream of grad/early
    (that would be a cycle). Before, no trigger was found and h1 stayed on
    the device from the forward pass on."""
    g, props = early_gradient_step()
    idx = G.build_index(g, ["ret"])
    facts = analysis.analyze(idx, props)
    early = idx.node("grad/early")
    assert facts.node_phases[early] == G.BACKWARD
    assert early not in G.waits_for_loss(idx)
    assert idx.node("grad/mix") in G.waits_for_loss(idx)
    dtypes = {(idx.node(n), p): o[0] for n, outs in props.items()
              for p, o in enumerate(outs)}
    plan = planner.plan_swap(idx, facts, dtypes, 1, 1e15, frozenset(idx.fetch))
    recipes = {r.tensor: r for r in plan.swaps}
    assert "h1:0" in recipes, [d for d in plan.decisions if d.tensor == "h1:0"]
    (group,) = [grp for grp in recipes["h1:0"].groups
                if ("grad/early", 0) in grp.consumers]
    trigger = idx.node(group.trigger)
    assert trigger in G.ancestors(idx, [idx.node("grad/mix")])
    assert trigger not in G.descendants(idx, [early], control=True)
    out = rewrite.apply_plan(g, plan).graph_def
    assert not G.build_index(out, ["ret"]).has_cycles


def test_a_tensor_the_backward_pass_reads_through_a_view_is_swapped():
    """h2 and grad/relu read h1 through a Reshape, as a Dense layer on a 3-D
    input and its weight gradient read the input (Tensordot). The view is
    swapped, and with it the buffer goes: it holds no other tensor the
    backward pass reads. Before, the view was kept ("Reshape is a view of
    its input") and the buffer with it."""
    g, props = dense_step()
    extra = GraphBuilder()
    extra.const("h1_shape", [-1], DT_INT32).op("Reshape", "h1_view", ["h1", "h1_shape"],
                                                T=DT_FLOAT, Tshape=DT_INT32)
    g.node.extend(extra.build().node)
    for node in g.node:
        if node.name == "grad/relu":
            node.input[1] = "h1_view"
        elif node.name == "h2":
            node.input[0] = "h1_view"
    props["h1_view"] = props["h1"]
    props["h1_shape"] = [(DT_INT32, (1,))]
    _, facts, plan = planned_swaps(g, props)
    assert [s.tensor for s in plan.swaps] == ["h1_view:0"], plan.decisions
    assert rewritten_peak(g, props, plan) < facts.predicted_peak_bytes


def test_a_tensor_whose_buffer_another_tensor_lends_to_a_shape_op_is_swapped():
    """h1 (Relu, in place) lives in h1_pre's buffer, and a backward op
    reads h1_pre's shape only, as the gradient of a residual join reads its
    input's shape when the batch is unknown. A Shape op runs as soon as its
    input exists, so swapping h1 still frees the buffer. Before, h1_pre
    counted as a tensor the backward pass reads and h1 was kept ("its
    buffer holds other tensors the backward pass reads"): in an SE-ResNet
    fed by tf.data, every block's output stayed on the device."""
    g, props = dense_step()
    extra = GraphBuilder()
    (extra.op("Shape", "grad/h1_pre_shape", ["h1_pre"], T=DT_FLOAT, out_type=DT_INT32)
     .op("Reshape", "grad/h1_shaped", ["grad/h1", "grad/h1_pre_shape"], T=DT_FLOAT,
         Tshape=DT_INT32))
    g.node.extend(extra.build().node)
    for node in g.node:
        if node.name == "grad/relu":
            node.input[0] = "grad/h1_shaped"
    props["grad/h1_pre_shape"] = [(DT_INT32, (1,))]
    props["grad/h1_shaped"] = props["grad/h1"]
    idx, facts, plan = planned_swaps(g, props)
    assert facts.node_phases[idx.node("grad/h1_pre_shape")] == G.BACKWARD
    assert facts.buffer_of((idx.node("h1"), 0)) == (idx.node("h1_pre"), 0)
    assert [s.tensor for s in plan.swaps] == ["h1:0"], plan.decisions
    assert rewritten_peak(g, props, plan) < facts.predicted_peak_bytes


def test_the_default_threshold_comes_down_where_small_tensors_hold_the_bytes():
    """Without swap_min_bytes, a step whose tensors are all below 1 MiB (a
    transformer at a small batch) still gets its largest ones swapped: the
    threshold comes down until the tensors above it hold most of the bytes
    the backward pass reads. Before, 1 MiB was fixed, and a ViT kept every
    activation. Where large tensors hold those bytes, it stays at 1 MiB."""
    for width, expected in ((MIB // 16, MIB // 4), (MIB // 4, MIB)):
        g, props = dense_step(width)
        idx, facts, fixed = planned_swaps(g, props, MIB)
        assert (default_min_bytes(facts, backward_read_by_buffer(idx, facts))
                == min(heuristics.SWAP_MIN_BYTES, expected))
        _, _, default = planned_swaps(g, props, None)
        assert [s.tensor for s in default.swaps] == ["h1:0"], default.decisions
        assert [s.tensor for s in fixed.swaps] == ([] if width < MIB // 4 else ["h1:0"])


def test_the_threshold_reaches_the_kept_activations_at_the_planned_peak():
    """threshold_at_peak names the size that reaches a kept activation live
    at the peak (h1, 512 KiB, under a 1 MiB threshold), and nothing where
    the threshold already reaches it."""
    g, props = dense_step(MIB // 8)
    idx, facts, _ = planned_swaps(g, props, MIB)
    h1 = facts.buffer_of((idx.node("h1"), 0))
    start, stop = facts.buffer_intervals[h1]
    assert start <= facts.peak_step <= stop
    assert threshold_at_peak(idx, facts, MIB) == MIB // 2
    assert threshold_at_peak(idx, facts, MIB // 2) is None


@pytest.mark.slow
def test_the_swap_stage_reaches_small_tensors_held_at_the_peak():
    """The zoo's U-Net keeps half-MiB encoder outputs across its decoder:
    under the 1 MiB default threshold they stayed on the device, live at
    the planned peak (21.0 MiB, 1.98 times its lower bound). The threshold
    that reaches them is tried too, and its plan is lower."""
    import os

    from sntf.testing import corpus

    entry = corpus.load(os.path.join(os.path.dirname(__file__), "corpus", "graphs",
                                     "zoo-unet_transpose.json.gz"))
    report = corpus.run(entry, {"policy": "swap+recompute", "budget": None,
                                "options": {}}).report
    assert report["action"] == "rewritten", report["reason"]
    swapped = [d for d in report["plan"]["decisions"] if d["action"] == "swap"]
    assert any(d["bytes_saved"] < heuristics.SWAP_MIN_BYTES for d in swapped), report["reason"]
    assert report["planned_peak_bytes"] <= 1.8 * report["lower_bound_bytes"], report["reason"]


@pytest.mark.parametrize("device, waits", [
    ("", True), ("/device:CPU:0", True), ("/job:gpu_workers/replica:0/task:0/device:CPU:0", True),
    ("/job:localhost/replica:0/task:0/device:GPU:0", False), ("/GPU:0", False)])
def test_forward_readers_wait_for_the_swap_out_only_on_a_cpu(device, waits):
    """On a GPU the swap-out completes with its copy, which holds the tensor
    by itself: a forward reader waiting for it would put the copy on the
    compute path. On a CPU the readers wait, so the buffer dies with them."""
    g, props, idx, facts, plan = swap_plan()
    (recipe,) = plan.swaps
    assert recipe.forward_readers == ("h2",)
    for node in g.node:
        node.device = device
    nodes = {n.name: n for n in rewrite.apply_plan(g, plan).graph_def.node}
    edge = "^" + names.swap_out_name("h1", 0)
    assert (edge in nodes["h2"].input) == waits
    placed = G.build_index(g, ["ret"])
    dtypes = {(placed.node(n), p): o[0] for n, outs in props.items() for p, o in enumerate(outs)}
    replanned = planner.plan_swap(placed, analysis.analyze(placed, props), dtypes, MIB, 1e9,
                                  frozenset(placed.fetch))
    (swapped,) = [d for d in replanned.decisions if d.action == planner.SWAP]
    # The swap-out's transfer is exposed only where the readers wait for it.
    assert (swapped.seconds_added >= swapped.bytes_saved / 1e9) == waits, swapped


def test_edges_acyclic_sees_a_cycle_that_added_edges_close():
    """The check plan_swap runs over the edges of swap-ins timed by ops that
    are not their readers' ancestors: grad/relu -> h1 closes a cycle
    (h1 -> ... -> grad/relu), grad/h1 -> grad/early does not."""
    from sntf.planner import backward

    g, _ = early_gradient_step()
    idx = G.build_index(g, ["ret"])
    assert backward.edges_acyclic(idx, [])
    assert backward.edges_acyclic(idx, [(idx.node("grad/h1"), idx.node("grad/early"))])
    assert not backward.edges_acyclic(idx, [(idx.node("grad/relu"), idx.node("h1"))])


def test_rewrite_adds_swap_nodes_and_lowers_the_predicted_peak():
    g, props, idx, facts, plan = swap_plan()
    out = rewrite.apply_plan(g, plan).graph_def
    by_role = {}
    for node in out.node:
        by_role.setdefault(names.role_of(node), []).append(node)
    (swap_out,) = by_role[names.ROLE_SWAP_OUT]
    swap_ins = by_role[names.ROLE_SWAP_IN]
    producer = "h1"
    assert swap_out.op == "SnSwapOut" and list(swap_out.input) == [producer]
    assert swap_out.attr["T"].type == DT_FLOAT
    assert names.swap_source(swap_out.name) == (producer, 0)
    for swap_in, group in zip(swap_ins, plan.swaps[0].groups):
        assert list(swap_in.input) == [swap_out.name, "^" + group.trigger]
        assert names.swap_source(swap_in.name) == (producer, 0)
    nodes = {n.name: n for n in out.node}
    assert nodes["grad/relu"].input[1].startswith("sntf/swap_in/")
    assert nodes["h2"].input[0] == "h1"                 # forward reader unchanged
    new_idx = G.build_index(out, ["ret"])
    assert not new_idx.has_cycles
    new_facts = analysis.analyze(new_idx, analysis.with_generated(props, new_idx))
    # h1's device buffer now dies in the forward pass; the backward pass
    # reads the swapped-in copy, allocated no earlier than its trigger.
    h1_buffer = (new_idx.node("h1_pre"), 0)
    swap_in_step = new_facts.schedule.index(new_idx.node(swap_ins[0].name))
    trigger_step = new_facts.schedule.index(new_idx.node(plan.swaps[0].groups[0].trigger))
    relu_grad_step = new_facts.schedule.index(new_idx.node("grad/relu"))
    assert trigger_step < swap_in_step < relu_grad_step
    assert new_facts.buffer_intervals[h1_buffer][1] < swap_in_step
    assert facts.buffer_intervals[(idx.node("h1_pre"), 0)][1] == facts.schedule.index(
        idx.node("grad/relu"))
    # Idempotent: the pass leaves a graph holding sntf nodes alone.
    assert new_idx.sntf_nodes


def test_with_a_budget_swaps_go_through_the_tensor_cache():
    g, props, idx, facts, plan = swap_plan()
    plan = planner.Plan("swap", plan.decisions, swaps=tuple(
        planner.Swap(s.tensor, s.dtype, s.groups, shape=(-1, 3)) for s in plan.swaps),
        cache_budget=10 * MIB)
    out = rewrite.apply_plan(g, plan).graph_def
    by_op = {n.op: n for n in out.node}
    cache_out, cache_in = by_op[names.CACHE_OUT_OP], by_op[names.CACHE_IN_OP]
    assert "SnSwapOut" not in by_op and "SnSwapIn" not in by_op
    assert cache_out.attr["uses"].i == len(plan.swaps[0].groups)
    assert [d.size for d in cache_in.attr["shape"].shape.dim] == [-1, 3]
    assert names.role_of(cache_in) == names.ROLE_SWAP_IN
    # The run-time limits land on the cache's swap-out as given; a negative
    # headroom (a plan over its budget) keeps nothing on the device.
    for budget, headroom, written in ((10 * MIB, 3 * MIB, 3 * MIB),
                                      (10 * MIB, -MIB, 0)):
        tuned = rewrite.set_cache_limits(out, budget, headroom)
        (node,) = [n for n in tuned.node if n.op == names.CACHE_OUT_OP]
        assert (node.attr["budget"].i, node.attr["headroom"].i) == (budget, written)
    assert out.SerializeToString() == rewrite.apply_plan(g, plan).graph_def.SerializeToString()


class _Facts:
    """The figures the cache headroom reads from an Analysis: a variable of
    5 MiB, an activation of 1 MiB and two scratch buffers."""

    def __init__(self, peak: int, scratch: int):
        self.budget_peak_bytes = peak
        self.buffer_bytes = {(0, 0): 5 * MIB, (3, 0): MIB,
                             (1, analysis.SCRATCH_PORT): scratch,
                             (2, analysis.SCRATCH_PORT): scratch // 2}
        self.persistent_buffers = frozenset({(0, 0)})


def test_the_cache_headroom_is_the_budget_left_over_the_planned_peak():
    # budget 10 MiB - 0.5 MiB held outside - 2 MiB slack (the largest
    # request, here a scratch buffer, which the allocator may serve from a
    # chunk twice its size) - 5 MiB planned peak = 2.5 MiB. The variable,
    # allocated before the step, is no request of it.
    facts = _Facts(peak=5 * MIB, scratch=2 * MIB)
    assert room_module.allocator_slack(facts) == 2 * MIB
    assert room_module.allocator_slack(_Facts(peak=5 * MIB, scratch=0)) == MIB
    assert Room(10 * MIB, 0.0, MIB // 2).headroom(facts) == 5 * MIB // 2
    note = Room(10 * MIB, 0.0, MIB // 2).cache_note(facts)
    assert note == (f"tensor cache: up to {5 * MIB // 2} bytes of swapped tensors stay "
                    f"on the device (budget {10 * MIB} - {MIB // 2} held outside the "
                    f"graph - {2 * MIB} allocator slack - planned peak {5 * MIB})")
    # Over budget: the headroom is negative and every swap copies.
    assert Room(6 * MIB, 0.0).headroom(facts) == -MIB
    assert Room(6 * MIB, 0.0).cache_note(facts).endswith("every swap copies")
    # The budget's margin is held back for the analysis' error: with 0.1,
    # 9 MiB - 0.5 - 2 - 5 = 1.5 MiB.
    assert Room(10 * MIB, 0.1, MIB // 2).headroom(facts) == 3 * MIB // 2
    assert Room(10 * MIB, 0.1, MIB // 2).cache_note(facts).startswith(
        f"tensor cache: up to {3 * MIB // 2} bytes of swapped tensors stay on the "
        f"device (budget {10 * MIB} x (1 - margin 0.1) - {MIB // 2} held outside")


CUDNN_WORKSPACE_ENV = "TF_CUDNN_WORKSPACE_LIMIT_IN_MB"


@pytest.mark.parametrize("device", ["", "/device:GPU:0"])
def test_a_budget_reports_the_cudnn_workspace_limit_and_sets_nothing(monkeypatch, device):
    # TensorFlow reads TF_CUDNN_WORKSPACE_LIMIT_IN_MB once per process, and
    # the pass runs on Grappler's thread: the limit is reported, the
    # environment left alone, through the plugin's own entry point.
    from sntf.runtime import plugin

    g, props = dense_step()
    for node in g.node:
        node.device = device
    monkeypatch.delenv(CUDNN_WORKSPACE_ENV, raising=False)
    state = config.State(enabled=True, policy="swap", budget=config.Budget(bytes=64 * MIB))
    monkeypatch.setattr(config, "current", lambda: state)
    plugin.clear_reports()
    for _ in range(2):       # Grappler's two iterations: the first is deferred
        out = plugin._optimize(g.SerializeToString(), ["ret"], [], properties_fn(props))
    assert out is not None
    report = plugin.reports()[-1]
    assert report["action"] == "rewritten" and report["swapped"] == ["h1:0"], report
    assert report["cudnn_workspace_limit_mb"] == budget_planning.cudnn_workspace_limit_mb(
        64 * MIB, report["planned_peak_bytes"])
    assert "tensor cache" in report["reason"]
    assert CUDNN_WORKSPACE_ENV not in os.environ


def test_swap_source_parses_only_sntf_names():
    assert names.swap_source(names.swap_in_name("a/b", 2, 3)) == ("a/b", 2)
    assert names.swap_source(names.swap_out_name("a/b", 0)) == ("a/b", 0)
    assert names.swap_source("a/b") is None
    assert names.swap_source("sntf/swap_in/x") is None


@pytest.mark.slow
# Five families, to keep the suite's run short: the MLP's graph replays under
# both swap policies in tests/test_corpus.py, and the fuzzer trains random
# dense chains with swaps bit for bit.
@pytest.mark.parametrize("family", ["vgg", "resnet", "densenet", "transformer",
                                    "mobilenet"])
def test_swap_policies_train_bit_identically(fresh_python, tmp_path, family):
    base, weights = train_family(fresh_python, tmp_path / "base.npz", family)
    for policy in ("swap", "swap+recompute"):
        # At batch 8 the activations are small: a 4 KiB threshold swaps them.
        result, got = train_family(fresh_python, tmp_path / "p.npz", family,
                             "--sntf", policy, "--swap-min-bytes", "4096")
        assert_identical((base, weights), (result, got), (family, policy))
        training = [r for r in result["reports"] if r["training"]]
        assert any(r["action"] == "rewritten" and r["swapped"] for r in training), training
        swap = result["stats"]["swap"]
        assert swap["swap_out_ops"] > 0 and swap["failed_ops"] == 0
        assert swap["swap_in_ops"] >= swap["swap_out_ops"]


SOAK = """
import json, os
os.environ.update(TF_ENABLE_ONEDNN_OPTS="0", TF_CPU_ALLOCATOR_USE_BFC="true")
import numpy as np
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras
import sntf
from sntf import models

sntf.enable(policy="swap+recompute", batch_size=8, swap_min_bytes=4096)
keras.utils.set_random_seed(3)
model = models.build("resnet", 1)
x, y = models.make_data("resnet", 8 * 200, seed=3)
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
rows = []

class Soak(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        info = tf.config.experimental.get_memory_info("CPU:0")
        stats = sntf.stats()
        rows.append([info["peak"], info["current"], stats["pool"]["bytes_in_use"],
                     stats["pool"]["bytes_reserved"], stats["pool"]["peak_bytes_in_use"],
                     stats["swap"]["swap_out_ops"], stats["swap"]["swap_in_ops"]])

model.fit(data, epochs=1, verbose=0, callbacks=[Soak()])
print("RESULT " + json.dumps(rows))
"""


@pytest.mark.slow
def test_pool_soak_200_steps_no_growth(fresh_python):
    rows = fresh_python(code=SOAK, timeout=900).result()
    assert len(rows) == 200
    peak, current, in_use, reserved, pool_peak, outs, ins = zip(*rows)
    # Every parked tensor goes back to the pool within its step...
    assert set(in_use) == {0}
    # ...and after step 2 neither the pool nor the device grows.
    assert len(set(reserved[2:])) == 1 and len(set(pool_peak[2:])) == 1
    # The device allocator's peak may move by a chunk when tf.data's thread
    # allocates at a different moment (seen: +0.9 MiB once in 200 steps, with
    # and without sntf); a leak would grow it step after step.
    assert peak[-1] <= peak[2] * 1.02
    assert max(current[2:]) <= current[2] + (1 << 20)
    # The same swaps run every step.
    per_step = {(outs[i] - outs[i - 1], ins[i] - ins[i - 1]) for i in range(1, 200)}
    assert len(per_step) == 1 and per_step.pop()[0] > 0


@pytest.mark.slow
def test_tensor_cache_moves_nothing_under_a_roomy_budget_and_fits_a_tight_one():
    def run(**kw):
        return measure_peak.measure("resnet", 32, steps=2, depth=4,
                                    policy="swap+recompute", **kw)

    roomy = run(budget=1 << 30)
    swap = roomy["sntf_stats"]["swap"]
    # Far above the peak every swapped tensor stays cached: no bytes move.
    assert swap["swap_out_ops"] > 0 and swap["swap_in_ops"] > 0
    assert swap["bytes_to_host"] == 0 and swap["bytes_to_device"] == 0
    assert swap["cache_hits"] == swap["swap_in_ops"] and swap["cache_misses"] == 0
    # The tight budget comes from the unrewritten graph's predicted peak, which
    # is the same in every run; TensorFlow's own measured peak is not (95.6 to
    # 118.3 MB on this network at one inter-op thread), and half of its low
    # end sat below what the plan could reach.
    tight_budget = int(0.6 * roomy["predicted_peak_bytes"])
    tight = run(budget=tight_budget)
    swap = tight["sntf_stats"]["swap"]
    assert swap["bytes_to_host"] > 0 and swap["cache_misses"] > 0
    assert tight["measured_peak_bytes"] <= tight_budget, (tight["measured_peak_bytes"],
                                                          tight_budget)
    assert tight["measured_peak_bytes"] < 0.6 * roomy["measured_peak_bytes"]
    assert tight["losses"] == roomy["losses"]
