"""Tests for the graph pass (sntf.passes) and its stages: planner, rewrite, names.

run_pass is called directly on serialized GraphDefs; no TensorFlow runtime,
no Grappler.
"""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import graphs  # noqa: E402  (the helper module next to this file)

from sntf import config, passes, planner, rewrite  # noqa: E402
from sntf.graph import names  # noqa: E402
from sntf.planner import budget as budget_planning  # noqa: E402
from sntf.planner import reasons  # noqa: E402

REPORT_KEYS = {"graph", "training", "nodes", "action", "reason", "policy",
               "predicted_peak_bytes", "planned_peak_bytes", "lower_bound_bytes",
               "pass_seconds", "swapped", "recomputed", "fetch", "devices", "per_device",
               "error", "invocations", "batch", "analysis", "analysis_error", "stage_seconds",
               "cudnn_workspace_limit_mb", "budget_bytes", "budget_fits",
               "achievable_peak_bytes", "predicted_seconds_added", "batch_source",
               "outside_bytes", "peak_breakdown", "cached_peak_bytes",
               "order_dependent_sums", "training_reason", "notes", "deferred", "fit",
               "budget_target_bytes", "skip"}
OFF = config.State(enabled=True, policy="off")
OFF_IDENTITY = config.State(enabled=True, policy="off",
                            options=config.Options(identity_rewrite=True))
MLP_REASON = (f"variable {graphs.W_HANDLE!r} is updated from a weight gradient "
              f"({graphs.DW!r})")
OFF_NOTE = "policy 'off': graph left as TensorFlow built it"


def run(graph_def_or_bytes, state=OFF, fetch=("identity_retval",), preserve=()):
    data = graph_def_or_bytes
    if not isinstance(data, bytes):
        data = data.SerializeToString()
    return passes.run_pass(data, list(fetch), list(preserve), state)


def assert_common(report):
    assert REPORT_KEYS <= set(report)
    assert type(report["pass_seconds"]) is float
    assert 0.0 <= report["pass_seconds"] < 5.0
    assert report["invocations"] == 1
    json.dumps(report)  # every report is JSON-serializable


# --------------------------------------------------------------------------
# run_pass
# --------------------------------------------------------------------------

def test_new_report_has_every_key():
    report = passes.new_report("g", 3)
    assert set(report) == REPORT_KEYS
    assert (report["graph"], report["nodes"], report["action"]) == ("g", 3, "unchanged")
    assert report["training"] is False
    assert report["error"] is None
    assert passes.new_report() is not passes.new_report()


def test_training_graph_policy_off_is_unchanged():
    result = run(graphs.train_mlp())
    assert result.graph_def is None
    report = result.report
    assert_common(report)
    assert set(report) == REPORT_KEYS | {"plan"}
    assert report["action"] == passes.UNCHANGED == "unchanged"
    assert report["training"] is True
    assert report["reason"] == f"training graph ({MLP_REASON}); {OFF_NOTE}"
    assert (report["training_reason"], report["notes"]) == (MLP_REASON, [OFF_NOTE])
    assert report["policy"] == "off"
    assert report["nodes"] == len(graphs.train_mlp().node) == 23
    assert report["graph"] == "gradient_tape,sequential,loss"
    assert report["fetch"] == ["identity_retval"]
    assert report["devices"] == []
    assert report["swapped"] == [] and report["recomputed"] == []
    assert report["predicted_peak_bytes"] is None
    assert report["planned_peak_bytes"] is None
    assert report["lower_bound_bytes"] is None
    assert report["error"] is None
    assert report["plan"] == planner.identity_plan("off", OFF_NOTE).to_dict()


def test_adam_graph_is_training():
    report = run(graphs.adam_style_train()).report
    assert (report["action"], report["training"]) == ("unchanged", True)
    assert graphs.DW in report["reason"]


def test_identity_rewrite_returns_equal_graph():
    original = graphs.train_mlp()
    result = run(original, OFF_IDENTITY)
    assert result.report["action"] == passes.REWRITTEN == "rewritten"
    assert result.report["training"] is True
    assert result.report["reason"] == f"training graph ({MLP_REASON}); {OFF_NOTE}"
    assert type(result.graph_def) is type(original)
    assert result.graph_def == original
    assert result.graph_def.SerializeToString(deterministic=True) == (
        original.SerializeToString(deterministic=True))
    assert result.report["swapped"] == [] and result.report["recomputed"] == []
    assert_common(result.report)


@pytest.mark.parametrize("family, why", [
    (graphs.forward_only, "no variable is updated"),
    (graphs.metrics_only, "2 variable(s) updated, none from a gradient (metrics "
     "or state updates only)"),
    (graphs.forward_with_residual_and_metric, "2 variable(s) updated, none from "
     "a gradient (metrics or state updates only)"),
])
@pytest.mark.parametrize("state", [OFF, OFF_IDENTITY], ids=["off", "identity"])
def test_non_training_graph_is_skipped(family, why, state):
    result = run(family(), state)
    assert result.graph_def is None
    report = result.report
    assert_common(report)
    assert report["action"] == passes.SKIPPED == "skipped"
    assert report["training"] is False
    assert report["reason"] == f"not a training graph: {why}"
    assert report["nodes"] == len(family().node)
    assert report["swapped"] is None and report["recomputed"] is None
    assert "plan" not in report


def test_non_training_graph_skipped_before_unimplemented_policy():
    state = config.State(enabled=True, policy="auto")
    report = run(graphs.forward_only(), state).report
    assert (report["action"], report["policy"]) == ("skipped", "auto")


def test_empty_graph_is_skipped():
    report = run(b"", fetch=()).report
    assert (report["action"], report["graph"], report["nodes"]) == (
        "skipped", "empty", 0)
    assert report["reason"] == "not a training graph: no variable is updated"


@pytest.mark.parametrize("data", [b"\x0a\xff", b"garbage", b"\xff" * 16],
                         ids=["truncated", "text", "ff"])
def test_garbage_bytes_report_error(data):
    result = run(data)
    assert result.graph_def is None
    report = result.report
    assert_common(report)
    assert report["action"] == passes.ERROR == "error"
    assert report["reason"].startswith("DecodeError: ")
    assert report["error"].startswith("Traceback (most recent call last):")
    assert "DecodeError" in report["error"]
    assert report["training"] is False
    assert (report["graph"], report["nodes"]) == ("", 0)
    assert report["fetch"] == ["identity_retval"]


def test_not_bytes_reports_error():
    result = passes.run_pass(None, [], [], OFF)
    assert result.graph_def is None
    assert result.report["action"] == "error"
    assert result.report["reason"].startswith("TypeError: ")


@pytest.mark.parametrize("family, reason", [
    (graphs.missing_input, "GraphError: node 'y' reads missing node 'nowhere'"),
    (graphs.duplicate_name, "GraphError: duplicate node name 'y'"),
])
def test_malformed_graph_reports_error(family, reason):
    result = run(family())
    assert result.graph_def is None
    assert result.report["action"] == "error"
    assert result.report["reason"] == reason
    assert "GraphError" in result.report["error"]


@pytest.mark.parametrize("budget", [None, config.Budget(bytes=1)])
def test_auto_without_static_shapes_leaves_the_graph_and_says_why(budget):
    result = run(graphs.train_mlp(), config.State(enabled=True, policy="auto",
                                                  budget=budget))
    assert result.graph_def is None
    report = result.report
    assert report["action"] == "unchanged"
    assert report["training"] is True
    assert report["analysis_error"] == "no static properties were handed over"
    assert "no analysis: graph left unchanged" in report["reason"]


@pytest.mark.parametrize("state", [OFF, OFF_IDENTITY], ids=["off", "identity"])
def test_already_rewritten_graph_is_unchanged(state):
    gd = graphs.train_mlp()
    swap = gd.node.add(name=names.swap_out_name(graphs.RELU, 0), op=names.SWAP_OUT_OP)
    swap.input.append(graphs.RELU)
    names.mark(swap, names.ROLE_SWAP_OUT)
    result = run(gd, state)
    assert result.graph_def is None
    report = result.report
    assert_common(report)
    assert report["action"] == "unchanged"
    assert "already rewritten" in report["reason"]
    assert report["reason"] == ("already rewritten by sntf (1 sntf nodes); the "
                                "pass is idempotent")
    assert report["training"] is True
    assert report["nodes"] == 24


def test_already_rewritten_checked_before_planning():
    # Even a policy with no planner leaves a rewritten graph alone.
    gd = graphs.train_mlp()
    names.mark(gd.node[5], names.ROLE_RECOMPUTE)
    names.mark(gd.node[6], names.ROLE_SWAP_IN)
    report = run(gd, config.State(enabled=True, policy="auto")).report
    assert report["action"] == "unchanged"
    assert report["reason"].startswith("already rewritten by sntf (2 sntf nodes)")


@pytest.mark.parametrize("key", ["_XlaMustCompile", "_XlaCompile"])
@pytest.mark.parametrize("state", [OFF, OFF_IDENTITY], ids=["off", "identity"])
def test_xla_training_graph_is_skipped(key, state):
    gd = graphs.train_mlp()
    gd.node[3].attr[key].b = True
    result = run(gd, state)
    assert result.graph_def is None
    report = result.report
    assert report["action"] == "skipped"
    assert report["training"] is True
    assert "XLA" in report["reason"]
    assert report["reason"] == ("XLA-compiled graph: custom ops cannot run inside "
                                "an XLA cluster, so sntf leaves it alone")


def test_xla_attr_false_is_not_skipped():
    gd = graphs.train_mlp()
    gd.node[3].attr["_XlaMustCompile"].b = False
    assert run(gd).report["action"] == "unchanged"


def test_report_lists_devices_and_fetch():
    gd = graphs.train_mlp()
    gd.node[0].device = "/job:localhost/replica:0/task:0/device:GPU:0"
    gd.node[2].device = "/job:localhost/replica:0/task:0/device:CPU:0"
    gd.node[3].device = "/job:localhost/replica:0/task:0/device:GPU:0"
    report = run(gd, fetch=("identity_retval:0", "loss/Sum")).report
    assert report["devices"] == ["/job:localhost/replica:0/task:0/device:CPU:0",
                                 "/job:localhost/replica:0/task:0/device:GPU:0"]
    assert report["fetch"] == ["identity_retval:0", "loss/Sum"]


def test_run_pass_is_deterministic():
    data = graphs.adam_style_train().SerializeToString()
    first = passes.run_pass(data, ["identity_retval"], [], OFF_IDENTITY)
    second = passes.run_pass(data, ["identity_retval"], [], OFF_IDENTITY)
    for report in (first.report, second.report):
        report.pop("pass_seconds")
        assert set(report.pop("stage_seconds")) == {"parse", "index", "detect",
                                                    "sums", "rewrite"}
    assert first.report == second.report
    assert first.graph_def == second.graph_def


# --------------------------------------------------------------------------
# planner
# --------------------------------------------------------------------------

WHY = (reasons.reason(reasons.MET_WITHOUT, "budget"),)


def test_decision_validates_action():
    with pytest.raises(ValueError) as excinfo:
        planner.Decision("a:0", "drop", WHY)
    assert str(excinfo.value) == (
        "unknown action 'drop'; actions: ('keep', 'swap', 'recompute')")
    with pytest.raises(ValueError):
        planner.Decision("a:0", "SWAP", WHY)
    with pytest.raises(ValueError, match="unknown reason code 'why'"):
        reasons.reason("why")


def test_decision_fields_and_reasons_as_codes():
    swapped = reasons.reason(reasons.SWAPPED, op="Relu", bytes=4096, readers=2,
                             swap_ins=1, transfer_seconds=2e-3)
    d = planner.Decision("a:0", planner.SWAP, (swapped,), bytes_saved=10,
                         seconds_added=0.5)
    assert (d.tensor, d.action, d.kind, d.codes, d.bytes_saved, d.seconds_added) == (
        "a:0", "swap", "swap", ("swapped",), 10, 0.5)
    assert d.reason == ("Relu output of 4096 bytes read by 2 backward op(s); 1 swap-in(s), "
                        "prefetched 2.000 ms of transfer ahead")
    assert swapped.param("bytes") == 4096
    keep = planner.keep("b:1", reasons.reason(reasons.BELOW_THRESHOLD, "swap", bytes=8,
                                              min_bytes=1024),
                        reasons.reason(reasons.NO_RELEASE, "recompute"))
    assert (keep.bytes_saved, keep.kind, keep.codes) == (
        0, "keep", ("below_threshold", "no_release"))
    assert keep.reason == ("swap: 8 bytes, below swap_min_bytes (1024); "
                           "recompute: no backward op can release its recomputation")
    rebuilt = planner.Decision("c:0", planner.RECOMPUTE, (reasons.reason(
        reasons.REBUILT, op="Sigmoid", readers=3, ops=1, per_reader=False),))
    assert (rebuilt.action, rebuilt.kind) == ("recompute", "rebuild")


def make_plan_with_decisions():
    return planner.Plan(
        policy="auto",
        decisions=(planner.Decision("a:0", "swap", WHY, 100, 0.25),
                   planner.Decision("b:0", "keep", WHY),
                   planner.Decision("c:1", "recompute", WHY, 50, 0.01),
                   planner.Decision("d:0", "swap", WHY)),
        predicted_peak_bytes=1000, planned_peak_bytes=850, lower_bound_bytes=400,
        notes=("n1", "n2"))


def test_plan_tensors_in_decision_order():
    plan = make_plan_with_decisions()
    assert plan.tensors(planner.SWAP) == ["a:0", "d:0"]
    assert plan.tensors(planner.RECOMPUTE) == ["c:1"]
    assert plan.tensors(planner.KEEP) == ["b:0"]
    assert plan.tensors("other") == []


def test_plan_changes_graph():
    assert make_plan_with_decisions().changes_graph is True
    assert planner.Plan("off").changes_graph is False
    keep_only = planner.Plan("auto", (planner.Decision("a:0", "keep", WHY),))
    assert keep_only.changes_graph is False
    one_recompute = planner.Plan("auto", (planner.Decision("a:0", "keep", WHY),
                                          planner.Decision("b:0", "recompute", WHY)))
    assert one_recompute.changes_graph is True


def test_plan_to_json_round_trips():
    plan = make_plan_with_decisions()
    loaded = json.loads(plan.to_json())
    why = [{"code": "met_without", "stage": "budget", "params": {}}]
    assert loaded == {
        "policy": "auto",
        "decisions": [
            {"tensor": "a:0", "action": "swap", "kind": "swap",
             "reason": "budget: met without it", "why": why, "bytes_saved": 100,
             "seconds_added": 0.25},
            {"tensor": "b:0", "action": "keep", "kind": "keep",
             "reason": "budget: met without it", "why": why, "bytes_saved": None,
             "seconds_added": None},
            {"tensor": "c:1", "action": "recompute", "kind": "recompute",
             "reason": "budget: met without it", "why": why,
             "bytes_saved": 50, "seconds_added": 0.01},
            {"tensor": "d:0", "action": "swap", "kind": "swap",
             "reason": "budget: met without it", "why": why, "bytes_saved": None,
             "seconds_added": None},
        ],
        "predicted_peak_bytes": 1000,
        "planned_peak_bytes": 850,
        "lower_bound_bytes": 400,
        "notes": ["n1", "n2"],
        "recomputes": [],
        "swaps": [],
        "cache_budget": None,
        "orders": [],
    }
    rebuilt = planner.Plan(
        policy=loaded["policy"],
        decisions=tuple(planner.Decision.from_dict(d) for d in loaded["decisions"]),
        predicted_peak_bytes=loaded["predicted_peak_bytes"],
        planned_peak_bytes=loaded["planned_peak_bytes"],
        lower_bound_bytes=loaded["lower_bound_bytes"],
        notes=tuple(loaded["notes"]))
    assert rebuilt == plan
    assert plan.to_json(indent=None) == json.dumps(plan.to_dict())
    assert "\n" in plan.to_json() and "\n" not in plan.to_json(indent=None)


def test_identity_and_off_plans():
    assert planner.identity_plan("off") == planner.Plan(policy="off")
    assert planner.identity_plan("swap", "why") == planner.Plan("swap", notes=("why",))
    assert planner.policies.OFF_NOTE == OFF_NOTE
    assert planner.identity_plan("off", OFF_NOTE).changes_graph is False


def test_user_policies_are_compositions_of_three_questions():
    from sntf.planner import heuristics, policies

    table = policies.POLICIES
    assert set(table) == set(config.POLICIES)
    assert isinstance(table["off"], policies.Keep)
    assert table["recompute"] == policies.Then((policies.RECOMPUTE_STAGE,
                                                policies.REBUILD_STAGE))
    assert table["swap"] == policies.Then((policies.SWAP_STAGE,))
    # The rebuilds' gain shows only once swap has moved the forward tensors
    # around them: the composition with them is judged finished, against
    # the one without, and must plan lower by a margin.
    assert table["swap+recompute"] == policies.LowerOf((
        policies.Then((policies.RECOMPUTE_STAGE, policies.SWAP_STAGE)),
        policies.Then((policies.RECOMPUTE_STAGE, policies.REBUILD_STAGE.held_back(),
                       policies.SWAP_STAGE), margin=heuristics.REBUILD_PEAK_SHARE),
        policies.Then((policies.SWAP_STAGE,))))
    assert table["auto"].fallback is table["swap+recompute"]
    assert table["auto"].others == (table["recompute"],)
    assert table["auto"].compositions == (table["swap+recompute"], table["recompute"])
    assert len(table["auto"].sources) == 2


# --------------------------------------------------------------------------
# rewrite
# --------------------------------------------------------------------------

def test_apply_plan_copies_without_mutating():
    gd = graphs.adam_style_train()
    before = gd.SerializeToString(deterministic=True)
    result = rewrite.apply_plan(gd, planner.identity_plan("off", OFF_NOTE))
    assert gd.SerializeToString(deterministic=True) == before
    assert result.modified is False
    assert result.graph_def == gd
    assert result.graph_def is not gd
    result.graph_def.node[0].name = "changed"
    assert gd.SerializeToString(deterministic=True) == before


def test_apply_plan_keep_decisions_change_nothing():
    gd = graphs.train_mlp()
    plan = planner.Plan("auto", (planner.Decision(f"{graphs.RELU}:0", "keep", WHY),))
    result = rewrite.apply_plan(gd, plan)
    assert (result.graph_def == gd, result.modified) == (True, False)


@pytest.mark.parametrize("action", ["swap", "recompute"])
def test_apply_plan_refuses_a_decision_without_its_recipe(action):
    gd = graphs.train_mlp()
    before = gd.SerializeToString(deterministic=True)
    plan = planner.Plan("auto", (planner.Decision("x:0", "keep", WHY),
                                 planner.Decision(f"{graphs.RELU}:0", action, WHY)))
    with pytest.raises(ValueError) as excinfo:
        rewrite.apply_plan(gd, plan)
    assert str(excinfo.value) == (f"plan decides {action} for {graphs.RELU}:0 "
                                  "but holds no recipe for it")
    assert gd.SerializeToString(deterministic=True) == before


# --------------------------------------------------------------------------
# names
# --------------------------------------------------------------------------

def test_generated_names():
    assert names.swap_out_name("dense/Relu", 0) == "sntf/swap_out/dense/Relu/0"
    assert names.swap_out_name("x", 2) == "sntf/swap_out/x/2"
    assert names.swap_in_name("dense/Relu", 1) == "sntf/swap_in/dense/Relu/1/0"
    assert names.swap_in_name("a/b/c", 0, 3) == "sntf/swap_in/a/b/c/0/3"
    assert names.recompute_name("dense/Relu") == "sntf/recompute/0/dense/Relu"
    assert names.recompute_name("y", 4) == "sntf/recompute/4/y"
    for name in (names.swap_out_name("a", 0), names.swap_in_name("a", 0),
                 names.recompute_name("a")):
        assert name.startswith(names.SCOPE + "/")


def test_generated_names_distinct_per_tensor_and_index():
    generated = {names.swap_out_name("n", 0), names.swap_out_name("n", 1),
                 names.swap_in_name("n", 0), names.swap_in_name("n", 0, 1),
                 names.swap_in_name("n", 1), names.recompute_name("n"),
                 names.recompute_name("n", 1), names.recompute_name("m")}
    assert len(generated) == 8


def test_swap_names_are_injective():
    assert names.swap_out_name("a/b", 0) != names.swap_out_name("a_b", 0)
    assert names.swap_in_name("a/b", 0) != names.swap_in_name("a_b", 0)


def test_marker_constants():
    assert names.MARKER_ATTR == "_sntf_role"
    assert names.MARKER_ATTR.startswith("_")
    assert names.ROLES == ("swap_out", "swap_in", "recompute")
    assert (names.SWAP_OUT_OP, names.SWAP_IN_OP) == ("SnSwapOut", "SnSwapIn")


@pytest.mark.parametrize("role", names.ROLES)
def test_mark_and_role_of_round_trip(role):
    node = graphs.GraphBuilder().op("Identity", "n", ["x"]).build().node[0]
    assert names.role_of(node) == ""
    names.mark(node, role)
    assert names.role_of(node) == role
    assert node.attr[names.MARKER_ATTR].s == role.encode()
    again = type(node).FromString(node.SerializeToString())
    assert names.role_of(again) == role


def test_mark_rejects_unknown_role():
    node = graphs.GraphBuilder().op("Identity", "n").build().node[0]
    with pytest.raises(ValueError) as excinfo:
        names.mark(node, "swap")
    assert str(excinfo.value) == (
        "unknown sntf role 'swap'; roles: ('swap_out', 'swap_in', 'recompute')")
    assert names.MARKER_ATTR not in node.attr


def test_role_of_undecodable_bytes():
    node = graphs.GraphBuilder().op("Identity", "n").build().node[0]
    node.attr[names.MARKER_ATTR].s = b"\xffswap_in"
    assert names.role_of(node) == "\ufffdswap_in"


# --------------------------------------------------------------------------
# cuDNN workspace limit from the budget's headroom
# --------------------------------------------------------------------------

@pytest.mark.parametrize("budget, peak, expected", [
    (1 << 30, 256 << 20, 768),          # 1 GiB budget, 256 MiB planned: 768 MiB left
    (300 << 20, 299 << 20, 32),         # less than the floor: the floor
    (100 << 20, 200 << 20, 32),         # over budget: the floor, never 0
])
def test_cudnn_workspace_limit_is_the_headroom(budget, peak, expected):
    assert budget_planning.cudnn_workspace_limit_mb(budget, peak) == expected


def test_a_training_graph_is_deferred_to_the_last_call_and_nothing_else():
    data = graphs.train_mlp().SerializeToString()
    recompute = config.State(enabled=True, policy="recompute")
    first = passes.run_pass(data, ["identity_retval"], [], recompute, defer=True)
    assert first.deferred and first.graph_def is None
    assert first.report["training"] and passes.DEFERRED in first.report["reason"]
    assert first.report["action"] == passes.UNCHANGED
    # Policy "off", graphs that are not training steps: nothing to wait for.
    assert not passes.run_pass(data, ["identity_retval"], [], OFF, defer=True).deferred
    forward = graphs.forward_only().SerializeToString()
    assert not passes.run_pass(forward, [], [], recompute, defer=True).deferred
    later = passes.run_pass(data, ["identity_retval"], [], recompute)
    assert not later.deferred and passes.DEFERRED not in later.report["reason"]


def test_order_edges_are_added_once_each_after_the_inputs_in_the_plans_order():
    """The rewrite batches a plan's control edges per node; the result is
    what adding them one by one gives: each edge appended once, after the
    node's inputs and its existing control inputs, in the plan's order, and
    an edge between two devices refused."""
    import random

    g = graphs.chain(12)
    g.node[5].input.append("^n1")
    rng = random.Random(3)
    pairs = [(f"n{rng.randrange(12)}", f"n{rng.randrange(12)}") for _ in range(80)]
    pairs += [("n1", "n5"), ("n2", "n5"), ("n2", "n5")]
    plan = planner.Plan(policy="swap", orders=tuple(
        planner.Order(before=b, after=a) for b, a in pairs))
    before_rewrite = {n.name: list(n.input) for n in g.node}
    expected = {n.name: list(n.input) for n in g.node}
    for before, after in pairs:
        if "^" + before not in expected[after]:
            expected[after].append("^" + before)
    result = rewrite.apply_plan(g, plan)
    assert {n.name: list(n.input) for n in result.graph_def.node} == expected
    assert result.touched == frozenset(a for _, a in pairs)
    assert {n.name: list(n.input) for n in g.node} == before_rewrite   # left untouched
    g.node[3].device = "/device:CPU:1"
    g.node[4].device = "/device:CPU:0"
    with pytest.raises(ValueError, match="plan crosses devices.*'n4'.*'n3'"):
        rewrite.apply_plan(g, planner.Plan(policy="swap", orders=(
            planner.Order(before="n3", after="n4"),)))
    with pytest.raises(ValueError, match="the graph does not have"):
        rewrite.apply_plan(g, planner.Plan(policy="swap", orders=(
            planner.Order(before="nowhere", after="n4"),)))
