"""Budgets resolve against what the graph's device allocator may hand out:
its bytes_limit (a GPU's after memory_limit, the CPU's under a BFC limit),
for the device the graph is placed on, not a hard-coded GPU:0."""

import textwrap
import types

import pytest

from graphs import analyzed, context, mlp_step, properties_fn
from sntf import config, graph, passes, planner
from sntf.analysis import bfc, memory, tensor_cache
from sntf.graph import names
from sntf.planner import device_limit
from sntf.planner.room import Room
from sntf.runtime import environment
from sntf.testing.workers import measure_peak

MIB = 1 << 20


@pytest.mark.parametrize("devices, expected", [
    ((), "CPU:0"),
    (("/job:localhost/replica:0/task:0/device:CPU:0",), "CPU:0"),
    (("/job:localhost/replica:0/task:0/device:GPU:1",), "GPU:1"),
    (("", "/device:CPU:0", "/device:GPU:0"), "GPU:0"),
    (("/device:gpu:3",), "GPU:3"),
])
def test_graph_device_names_the_graphs_gpu(devices, expected):
    class Index:
        pass

    index = Index()
    index.devices = devices
    assert passes.graph_device(index) == expected


@pytest.mark.parametrize("name, short", [
    ("CPU:0", "CPU:0"), ("GPU:1", "GPU:1"),
    ("/job:localhost/replica:0/task:0/device:GPU:2", "GPU:2"), ("/device:CPU:0", "CPU:0"),
])
def test_device_names_shorten(name, short):
    assert environment._short_device(name) == short


def _budget_report(budget, device, env):
    g, props = mlp_step()
    for node in g.node:
        node.device = device
    state = config.State(enabled=True, policy="auto", budget=budget,
                         options=config.parse_options({}))
    return passes.run_pass(g.SerializeToString(), ["ret"], [], state,
                           properties_fn(props), env=env).report


def test_fractions_resolve_against_the_graphs_own_device():
    limits = {"GPU:0": 1000 * MIB, "GPU:1": 200 * MIB, "CPU:0": 64 * 1024 * MIB}
    env = passes.Environment(device_memory=lambda d: limits[d])
    on_gpu1 = _budget_report(config.Budget(fraction=0.5),
                             "/job:localhost/replica:0/task:0/device:GPU:1", env)
    assert on_gpu1["budget_bytes"] == 100 * MIB
    auto = _budget_report(config.Budget(auto=True),
                          "/job:localhost/replica:0/task:0/device:GPU:1", env)
    assert auto["budget_bytes"] == 200 * MIB


def test_auto_binds_on_the_cpu_only_under_an_allocator_limit():
    cpu = "/job:localhost/replica:0/task:0/device:CPU:0"
    unlimited = passes.Environment(device_memory=lambda d: 64 * 1024 * MIB)
    assert _budget_report(config.Budget(auto=True), cpu, unlimited)["budget_bytes"] is None
    limited = passes.Environment(device_memory=lambda d: 300 * MIB,
                                 allocator_limit=lambda d: 300 * MIB)
    assert _budget_report(config.Budget(auto=True), cpu, limited)["budget_bytes"] == 300 * MIB


@pytest.mark.slow
def test_fit_reads_the_cpu_allocator_limit(fresh_python):
    """Under TF_CPU_BFC_MEM_LIMIT_IN_MB the CPU allocator's bytes_limit is
    what budget "auto" and fractions resolve against, read when fit()
    starts (enable() creates no device)."""
    run = fresh_python("""
        import json
        import numpy as np
        import keras
        import sntf
        from sntf.runtime import environment
        sntf.enable(policy="auto", budget="auto")
        before = environment.allocator_limit("CPU:0")
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model.compile("sgd", "mse")
        model.fit(np.zeros((16, 8), np.float32), np.zeros((16, 4), np.float32),
                  epochs=1, verbose=0)
        budgets = [r["budget_bytes"] for r in sntf.reports() if r["training"]]
        print("RESULT " + json.dumps({"before": before, "budgets": budgets,
                                      "after": environment.allocator_limit("CPU:0")}))
        """, env={"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "300"})
    result = run.result()
    assert result["before"] is None
    assert result["after"] == 300 * MIB
    assert result["budgets"] and set(result["budgets"]) == {300 * MIB}


def _auto_without_budget(limit, result=False):
    g, props = mlp_step()
    state = config.State(enabled=True, policy="auto", budget=None,
                         options=config.parse_options({}))
    env = passes.Environment(allocator_limit=lambda d: limit)
    run = passes.run_pass(g.SerializeToString(), ["ret"], [], state,
                          properties_fn(props), env=env)
    return run if result else run.report


def test_a_plan_that_would_still_run_out_of_memory_says_so():
    unlimited = _auto_without_budget(None)
    planned = unlimited["planned_peak_bytes"]
    roomy = _auto_without_budget(4 * planned)
    assert roomy["device_limit_fits"] is True
    assert "device_limit_fits" not in unlimited
    tight = _auto_without_budget(planned // 2, result=True)
    assert tight.report["action"] == "rewritten"
    assert tight.report["device_limit_fits"] is False
    assert any("predicted to run out of memory under CPU:0's allocator limit" in w
               for w in tight.warnings), tight.warnings


def test_auto_without_budget_leaves_a_graph_that_fits_the_device_limit():
    """enable() alone on a device with a limit: no overhead where the step
    fits it, and the lowest plan where it does not."""
    unlimited = _auto_without_budget(None)
    assert unlimited["action"] == "rewritten", unlimited["reason"]
    peak = unlimited["predicted_peak_bytes"]
    roomy = _auto_without_budget(2 * peak)
    assert roomy["action"] == "unchanged", roomy["reason"]
    assert "fits CPU:0's allocator limit" in roomy["reason"]
    assert roomy["device_limit_bytes"] == 2 * peak
    tight = _auto_without_budget(peak // 2)
    assert tight["action"] == "rewritten", tight["reason"]
    # The policy's plan without a limit, held to the executor's order: under
    # a limit the allocator model judges a prediction the run must reach.
    g, props = mlp_step()
    executor = planner.plan("auto", analyzed(g, ["ret"], props), context(memory_order=False))
    assert tight["planned_peak_bytes"] == executor.planned.peak
    assert "to the planned order" in tight["reason"], tight["reason"]


# A dense step whose budget plans the allocator model runs out of memory
# on, under a limit equal to the budget, at some budgets and not others.
WIDE_MLP = dict(widths=(256, 192, 320, 128, 256), batch=2048)


def _budget_plan(share, limit=True, **options):
    """Policy "auto" on WIDE_MLP under share x its unplanned peak, on a
    device whose allocator limit is the budget (or has none)."""
    g, props = mlp_step(**WIDE_MLP)
    unplanned = passes.run_pass(g.SerializeToString(), ["ret"], [], config.State(
        enabled=True, policy="off", budget=None, options=config.parse_options({})),
        properties_fn(props)).report["predicted_peak_bytes"]
    budget = int(share * unplanned)
    state = config.State(enabled=True, policy="auto", budget=config.Budget(bytes=budget),
                         options=config.parse_options({"keep_graphs": True, **options}))
    env = passes.Environment(allocator_limit=lambda d: budget if limit else None)
    return passes.run_pass(g.SerializeToString(), ["ret"], [], state,
                           properties_fn(props), env=env), budget


def _notes(report, prefix):
    return [n for n in report["reason"].split("; ") if n.startswith(prefix)]


def _room(budget):
    """The room the pass sees under a limit equal to the budget."""
    return Room(margin=0.1, limit=budget, grows=True)


def test_under_a_budget_a_plan_the_allocator_model_runs_out_on_is_fitted_lower():
    """A budget's plan fits its target, yet under a hard limit its large
    requests find no chunk in the allocator's regions: it is fitted again
    under a lower target, to a plan the allocator model fits."""
    unlimited, budget = _budget_plan(0.85, limit=False)
    first = unlimited.report["planned_analysis_result"]
    assert unlimited.report["budget_fits"] is True
    assert _room(budget).runs_out(first)
    run, _ = _budget_plan(0.85)
    report = run.report
    assert report["budget_fits"] is True and report["device_limit_fits"] is True
    assert report["fit"] == "refit_fits"
    planned = report["planned_analysis_result"]
    assert planned.budget_peak_bytes < first.budget_peak_bytes
    assert not _room(budget).runs_out(planned)


def test_the_allocator_model_holds_back_the_largest_request():
    """The model replays one order and the executor's threads run another,
    so a plan judged to fit leaves room for the step's largest request."""
    run, budget = _budget_plan(1.0, limit=False)
    planned = run.report["planned_analysis_result"]
    largest = max(n for b, n in planned.buffer_bytes.items()
                  if b not in planned.persistent_buffers)
    # The least limit (in steps of 256 KiB) under which the model fits.
    fits = next(limit for limit in range(MIB, 4 * budget, MIB // 4)
                if memory.runs_out_of_memory(planned, limit) is None)
    assert memory.runs_out_of_memory(planned, fits - largest) is not None
    assert Room(margin=0.0, limit=fits, grows=True).runs_out(planned)
    assert not Room(margin=0.0, limit=fits + largest, grows=True).runs_out(planned)


def test_where_the_allocator_model_runs_out_on_every_plan_the_lowest_is_taken(
        monkeypatch):
    """Near the limit whether a step finds its chunks turns on the
    executor's order: the plan that leaves the most room is taken, and
    the report does not say it fits."""
    from sntf.planner import finish

    run, _ = _budget_plan(0.7)
    report = run.report
    assert report["fit"] == "device_runs_out"
    assert report["budget_fits"] is False and report["device_limit_fits"] is False
    g, props = mlp_step(**WIDE_MLP)
    # Under a limit the plan holds the executor's order; without a budget
    # the planner may offer a memory-aware one, which this comparison
    # leaves out. The unmet budget's plan is the lowest of the budget
    # search's and the policies' (sntf.planner.fit): at most theirs.
    monkeypatch.setattr(finish, "memory_orders", lambda g, facts, held: ())
    lowest = passes.run_pass(g.SerializeToString(), ["ret"], [], config.State(
        enabled=True, policy="swap+recompute", budget=None,
        options=config.parse_options({})), properties_fn(props)).report
    assert report["planned_peak_bytes"] <= lowest["planned_peak_bytes"]
    assert any("even as planned" in w for w in run.warnings), run.warnings


def test_where_every_plan_runs_out_budget_behaviour_unchanged_leaves_the_graph():
    run, _ = _budget_plan(0.7, budget_behaviour="unchanged")
    report = run.report
    assert report["action"] == "unchanged", report["reason"]
    assert _notes(report, "device: a model of CPU:0's allocator runs out of memory")
    assert report["budget_fits"] is False and report["device_limit_fits"] is False


def test_under_a_limit_alone_a_policy_plan_that_runs_out_is_searched_lower(monkeypatch):
    """Without a budget, where the allocator model runs out of memory on
    the policy's plan in either order, the fit loop takes the plan the
    budget's steps find with the limit for the budget, if the model fits
    it. A fallback that plans nothing stands for any policy that stops
    above what the step needs."""
    import dataclasses

    from sntf.planner import policies

    g, props = mlp_step(**WIDE_MLP)
    unplanned = passes.run_pass(g.SerializeToString(), ["ret"], [], config.State(
        enabled=True, policy="off", budget=None, options=config.parse_options({})),
        properties_fn(props)).report["predicted_peak_bytes"]
    limit = int(0.8 * unplanned)
    auto = policies.POLICIES["auto"]
    monkeypatch.setitem(policies.POLICIES, "auto",
                        dataclasses.replace(auto, fallback=policies.Then(())))
    state = config.State(enabled=True, policy="auto", budget=None,
                         options=config.parse_options({"keep_graphs": True}))
    env = passes.Environment(allocator_limit=lambda d: limit)
    run = passes.run_pass(g.SerializeToString(), ["ret"], [], state,
                          properties_fn(props), env=env)
    report = run.report
    assert report["fit"] == "limit_searched", report["reason"]
    assert report["device_limit_fits"] is True and report["action"] == "rewritten"
    assert report.get("budget_fits") is None and report.get("budget_target_bytes") is None
    room = Room(margin=0.1, limit=limit, grows=True)
    assert room.runs_out(report["analysis_result"])      # the policy's plan: none
    assert not room.runs_out(report["planned_analysis_result"])
    assert report["planned_peak_bytes"] < unplanned
    assert not any("run out of memory" in w for w in run.warnings), run.warnings


def test_the_tensor_cache_keeps_no_more_than_the_allocator_model_leaves():
    """The cache fills the chunks of tensors the plan counted as gone;
    under a hard limit its headroom is cut to what the allocator model,
    with the cache keeping what it allows, fits."""
    unlimited, _ = _budget_plan(0.75, limit=False)
    run, budget = _budget_plan(0.75)
    assert _headrooms(unlimited.graph_def) and min(_headrooms(unlimited.graph_def)) > 0
    cut = _notes(run.report, "tensor cache: 0 bytes, not ")
    assert cut, run.report["reason"]
    assert _headrooms(run.graph_def) == {0}
    planned = run.report["planned_analysis_result"]
    index = graph.build_index(run.graph_def, ["ret"], [])
    wanted = int(cut[0].split("not ")[1].split(":")[0])
    assert _room(budget).runs_out(planned, tensor_cache.cached_lifetimes(index, planned, wanted))


def _headrooms(graph_def) -> set:
    return {n.attr["headroom"].i for n in graph_def.node if n.op == names.CACHE_OUT_OP}


@pytest.mark.parametrize("share", [0.0, 1.0, 2.5, 100.0])
def test_the_cache_model_keeps_swapped_tensors_within_its_headroom(share):
    """analysis.tensor_cache: a kept tensor stays allocated until its
    swap-ins are done, the swap-in that hands it on allocates nothing, and
    what the cache keeps past the plan's own lifetimes never exceeds the
    headroom at any step."""
    run, _ = _budget_plan(0.75, limit=False)
    planned = run.report["planned_analysis_result"]
    index = graph.build_index(run.graph_def, ["ret"], [])
    outs = [i for i, op in enumerate(index.ops) if op == names.CACHE_OUT_OP]
    swapped = {planned.buffers[index.data_inputs[i][0]] for i in outs}
    largest = max(planned.buffer_bytes[b] for b in swapped)
    headroom = int(share * largest)
    sizes, lifetimes = tensor_cache.cached_lifetimes(index, planned, headroom)
    assert sizes == dict(planned.buffer_bytes)
    held = {b: span for b, span in lifetimes.items()
            if span[1] > planned.buffer_intervals[b][1]}
    assert set(held) <= swapped
    if share == 0.0:
        assert lifetimes == dict(planned.buffer_intervals)
        return
    assert held
    for step in range(len(planned.schedule)):
        kept = sum(sizes[b] for b, (start, stop) in held.items()
                   if planned.buffer_intervals[b][1] < step <= stop)
        assert kept <= headroom
    if share == 100.0:
        # Room for all: every swap-in hands its tensor on.
        ins = [i for i, op in enumerate(index.ops) if op == names.CACHE_IN_OP]
        assert all(planned.buffers[(i, 0)] not in lifetimes for i in ins)


def test_a_budget_plan_predicts_the_peak_with_the_tensor_cache():
    """The planned peak counts every swap as a copy; the cache keeps
    swapped tensors in the headroom, and cached_peak_bytes counts them."""
    run, _ = _budget_plan(0.85, limit=False)
    report = run.report
    planned = report["planned_analysis_result"]
    index = graph.build_index(run.graph_def, ["ret"], [])
    headroom = min(_headrooms(run.graph_def))
    assert headroom > 0
    assert report["cached_peak_bytes"] == tensor_cache.cached_peak(index, planned, headroom)
    assert report["cached_peak_bytes"] > report["planned_peak_bytes"]
    assert tensor_cache.cached_peak(index, planned, 0) == report["planned_peak_bytes"]
    assert _auto_without_budget(None)["cached_peak_bytes"] is None


def _cache_steps(c_bytes):
    """A hand-built schedule, one node per step: tensors a and b (1 KiB
    each) go into the cache, a is read back once, c (c_bytes) goes in,
    then b, a again and c are read back."""
    ops = ["A", "B", names.CACHE_OUT_OP, names.CACHE_OUT_OP, names.CACHE_IN_OP, "C",
           names.CACHE_OUT_OP, names.CACHE_IN_OP, names.CACHE_IN_OP, names.CACHE_IN_OP]
    inputs = [(), (), ((0, 0),), ((1, 0),), ((2, 0),), (), ((5, 0),), ((3, 0),),
              ((2, 0),), ((6, 0),)]
    g = types.SimpleNamespace(ops=ops, data_inputs=inputs)
    sizes = {(0, 0): 1024, (1, 0): 1024, (5, 0): c_bytes, (4, 0): 1024, (7, 0): 1024,
             (8, 0): 1024, (9, 0): c_bytes}
    intervals = {(0, 0): (0, 2), (1, 0): (1, 3), (5, 0): (5, 6), (4, 0): (4, 5),
                 (7, 0): (7, 8), (8, 0): (8, 9), (9, 0): (9, 9)}
    facts = types.SimpleNamespace(schedule=tuple(range(10)), buffers={b: b for b in sizes},
                                  buffer_bytes=sizes, buffer_intervals=intervals)
    return tensor_cache.cached_lifetimes(g, facts, 2048)[1]


def test_a_cache_hit_makes_its_tensor_the_last_to_be_evicted():
    """As cache_core.h's Take: a hit moves the entry to the back of the
    LRU list, so c evicts b, not a, and a's second read is a hit too."""
    lifetimes = _cache_steps(1024)
    assert lifetimes[(1, 0)] == (1, 6)           # b: evicted when c comes in
    assert (7, 0) in lifetimes                   # b's read: a miss, allocated
    assert lifetimes[(0, 0)] == (0, 9)           # a: kept to its last reader
    assert (4, 0) not in lifetimes and (8, 0) not in lifetimes   # a's reads: hits


def test_a_tensor_larger_than_the_headroom_evicts_every_cached_one():
    """As ChooseVictimsLocked: over the cap, every cached tensor goes, and
    the large one is not kept either."""
    lifetimes = _cache_steps(4096)
    assert lifetimes[(0, 0)] == (0, 6) and lifetimes[(1, 0)] == (1, 6)
    assert all(b in lifetimes for b in [(7, 0), (8, 0), (9, 0)])   # misses
    assert lifetimes[(5, 0)] == (5, 6)


@pytest.mark.slow
def test_the_cpu_bfc_allocator_without_a_limit_sets_none(fresh_python):
    """TF_CPU_ALLOCATOR_USE_BFC alone gives the CPU allocator a bytes_limit
    of the host's RAM: that is no limit the user asked for, and enable()
    alone must still plan (not leave every CPU graph unchanged)."""
    run = fresh_python("""
        import json
        import numpy as np
        import keras
        import sntf
        from sntf.runtime import environment
        sntf.enable()
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model.compile("sgd", "mse")
        model.fit(np.zeros((16, 8), np.float32), np.zeros((16, 4), np.float32),
                  epochs=1, verbose=0)
        limits = [r.get("device_limit_bytes") for r in sntf.reports() if r["training"]]
        print("RESULT " + json.dumps({"limit": environment.allocator_limit("CPU:0"),
                                      "limits": limits}))
        """, env={"TF_CPU_ALLOCATOR_USE_BFC": "true"})
    result = run.result()
    assert result["limit"] is None and result["limits"] and not any(result["limits"])


def _regions_outcome(limit_mib: int, one_region: bool = False) -> str:
    """What analysis.bfc says of the sequence REGIONS runs in TensorFlow: a
    small allocation at startup, two 20 MiB tensors, the first freed, then
    one of 40 MiB; one_region: after the startup region, the rest of the
    limit is taken as one region (as sntf has the CPU's allocator do)."""
    sim = bfc.BfcModel(limit=limit_mib * MIB)
    sim.allocate(256)
    if one_region:
        sim.free(sim.allocate(limit_mib * MIB - sim.reserved))
    first = sim.allocate(20 * MIB)
    sim.allocate(20 * MIB)
    sim.free(first)
    try:
        sim.allocate(40 * MIB)
    except bfc.OutOfMemory:
        return "out of memory"
    return "trains"


def test_the_allocator_model_runs_out_of_memory_under_the_limit_in_bytes():
    # Regions of 2, 32 and 32 MiB; 72 MiB in use would fit 100, but the
    # free 32 MiB chunk is too small for 40 and only 34 MiB are left for a
    # new region.
    assert _regions_outcome(100) == "out of memory"
    assert _regions_outcome(110) == "trains"         # a new region of 44 MiB
    sim = bfc.BfcModel()
    sim.allocate(10**12)                             # no limit, no failure
    with pytest.raises(bfc.OutOfMemory):
        bfc.BfcModel(limit=MIB).allocate(2 * MIB)


REGIONS = """
    import json
    import tensorflow as tf
    MIB = 1 << 20
    a = tf.zeros([20 * MIB // 4])
    b = tf.zeros([20 * MIB // 4])
    del a
    try:
        c = tf.zeros([40 * MIB // 4])
        outcome = "trains"
    except tf.errors.ResourceExhaustedError:
        outcome = "out of memory"
    print("RESULT " + json.dumps(outcome))
"""


@pytest.mark.parametrize("limit_mib", [80, 100, 110])
def test_the_allocator_model_agrees_with_tensorflow_under_a_limit(fresh_python, limit_mib):
    run = fresh_python(REGIONS, env={"TF_ENABLE_ONEDNN_OPTS": "0",
                                     "TF_CPU_ALLOCATOR_USE_BFC": "true",
                                     "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(limit_mib)})
    assert run.result() == _regions_outcome(limit_mib)


@pytest.mark.parametrize("limit_mib", [80, 100])
def test_sntf_has_the_cpu_allocator_take_its_limit_as_one_region(fresh_python, limit_mib):
    """Growing regions fail the 40 MiB request under 100 MiB with 72 MiB in
    use (above); once sntf has read the limit, the rest of it is one region
    and the request finds its chunk there. Under 80 MiB the request fails in
    one region too: the first 20 MiB tensor's chunk is too small for it."""
    first = textwrap.dedent("""
        import sntf
        from sntf.runtime import environment
        sntf.enable()
        import tensorflow as tf
        environment.record_device_limits()
        region = environment._one_region.get("CPU:0")
        grows = environment.allocator_grows("CPU:0")
        info = tf.config.experimental.get_memory_info("CPU:0")
        """)
    then = textwrap.dedent(REGIONS).replace(
        'json.dumps(outcome)', 'json.dumps([outcome, region, grows, info])')
    run = fresh_python(first + then,
        env={"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPU_ALLOCATOR_USE_BFC": "true",
             "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(limit_mib)})
    outcome, region, grows, info = run.result()
    assert outcome == _regions_outcome(limit_mib, one_region=True)
    assert outcome == ("trains" if limit_mib == 100 else "out of memory")
    assert 0 < region <= limit_mib * MIB and region % 256 == 0 and not grows
    # The region, allocated whole for a moment, is not the allocator's peak.
    assert info["peak"] - info["current"] < MIB, info


@pytest.mark.parametrize("limit, options", [(None, ""), ("100", "one_region=False")])
def test_without_a_limit_set_or_with_one_region_off_the_allocator_keeps_growing(
        fresh_python, limit, options):
    run = fresh_python(f"""
        import json
        import sntf
        from sntf.runtime import environment
        sntf.enable({options})
        environment.record_device_limits()
        print("RESULT " + json.dumps([environment._one_region,
                                      environment.allocator_grows("CPU:0")]))
        """, env={"TF_CPU_ALLOCATOR_USE_BFC": "true",
                  **({"TF_CPU_BFC_MEM_LIMIT_IN_MB": limit} if limit else {})})
    assert run.result() == [{}, True]


@pytest.mark.slow
def test_a_step_whose_peak_fits_but_whose_regions_do_not_is_planned(tmp_path):
    """A ResNet of 2 blocks per stage peaks at about 63 MiB without a limit,
    yet TensorFlow alone runs out of memory under 80 MiB: its 25 MiB
    convolution scratch finds no chunk in the allocator's regions. Judged by
    its peak, enable() left it unchanged and it ran out of memory too."""
    def run(policy, limit_mib=80):
        try:
            return measure_peak.measure("resnet", 32, steps=2, depth=2, policy=policy,
                                        limit_mib=limit_mib)
        except RuntimeError as e:
            assert "ResourceExhaustedError" in str(e), str(e)[-2000:]
            return None

    assert run("none") is None
    trained = run("auto")
    assert trained is not None
    report = trained["training_reports"][-1]
    assert report["action"] == "rewritten", report["reason"]
    assert trained["measured_peak_bytes"] <= 80 * MIB
    base = run("none", limit_mib=None)
    assert trained["losses"] == base["losses"]
    assert trained["weights_sha256"] == base["weights_sha256"]


def test_a_gpu_without_memory_growth_is_one_region():
    """TensorFlow's GPU allocator takes its whole limit at the first
    allocation unless memory growth is on: the sequence that runs out of
    memory in growing regions under 100 MiB fits in one region of 100."""
    sizes = {("p", 0): 256, ("a", 0): 20 * MIB, ("b", 0): 20 * MIB, ("c", 0): 40 * MIB}
    intervals = {("a", 0): (0, 1), ("b", 0): (0, 5), ("c", 0): (2, 5)}

    def simulate(grows):
        try:
            bfc.simulate(sizes, {("p", 0)}, intervals, 5, lambda b: False,
                         limit=100 * MIB, grows=grows)
        except bfc.OutOfMemory as e:
            return e.step
        return None

    assert simulate(grows=True) == 2
    assert simulate(grows=False) is None


def test_which_allocators_grow(monkeypatch):
    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH", raising=False)
    assert environment.allocator_grows("CPU:0")
    monkeypatch.setitem(environment._one_region, "CPU:0", 64 * MIB)
    assert not environment.allocator_grows("/device:CPU:0")
    assert not environment.allocator_grows("/device:GPU:1")
    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    assert environment.allocator_grows("GPU:1")


def test_a_budget_in_bytes_never_asks_the_device():
    # Asking would, on a GPU without a read limit, warn about fractions and
    # probe the CUDA runtime from Grappler's thread, for a number not used.
    def device_memory(device):
        raise AssertionError(f"asked {device}'s memory for a budget in bytes")

    index = graph.build_index(mlp_step()[0], ["ret"])
    state = config.State(enabled=True, policy="auto", budget=config.Budget(bytes=64 << 20))
    env = passes.Environment(device_memory=device_memory)
    assert passes._budget_bytes(state, index, env) == 64 << 20
