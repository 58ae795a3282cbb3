"""Property-based fuzzing of the graph pass (issue #7, part 4).

sntf.testing.fuzz (run as benchmarks/fuzz_pass.py) generates random training steps with hypothesis (DAGs of
dense/conv/element-wise/normalization/dropout/pool/concat/split layers with
skip connections, fixed or unknown batch, one or two devices, random
policies, recompute modes, budgets and swap thresholds), runs each with sntf
disabled and enabled in one process, and checks bitwise-identical outputs,
gradients and updated variables, no error reports, at most two invocations
per graph, and, for every rewritten graph: it indexes, is acyclic, keeps
its fetch and preserve nodes and every original node, adds nothing across
devices, and a second pass leaves it alone. The CI runs a few hundred cases
(strict mode: a failure is shrunk to a minimal spec and fails the test);
`python benchmarks/fuzz_pass.py --cases 1000` is the benchmark-size run.
"""

from __future__ import annotations

import json

import pytest

from sntf.testing import fuzz_cases

CI_CASES = 200

# Cases the fuzzer found, kept as regression tests (replayed one by one):
REGRESSIONS = {
    # Thirty residual conv blocks: an edge holding an AddN's sum in the
    # original's order (sntf.rewrite.sums) made a filter gradient wait and
    # left its bias gradient alone, so oneDNN ran the pair unmerged and a
    # bias gradient changed in its last bits. Both now get the edge.
    "sum order edge split a merged filter and bias gradient":
    {"kind": "conv", "hw": 8, "dims": [4, 6, 3],
     "layers": [{"op": "linear", "inputs": [0], "device": 0, "units": 6, "act": "relu",
                 "kernel": 3},
                {"op": "linear", "inputs": [1], "device": 0, "units": 3, "act": "none",
                 "kernel": 1}],
     "extra_loss": None, "batch": 8, "unknown_batch": False, "two_devices": False,
     "guarded_update": False, "policy": "swap+recompute", "recompute_mode": "auto",
     "budget": None, "swap_min_bytes": 0, "batch_size_option": True, "seed": 3,
     "loop": 0, "writer": "sub", "residual_blocks": 30},
    # Memory-centric recomputation in segments re-ran a Conv2D -> BiasAdd
    # pair from the convolution's kept input, holding the cloned Conv2D
    # back by a control edge, which oneDNN's merge of the pair refuses: the
    # rewrite's check failed the pass (an error report, the graph left
    # unchanged). Such a chain is no longer planned.
    "segment chain held at a merged convolution":
    {'kind': 'conv',
     'hw': 5,
     'dims': [11, 13, 11, 11, 13, 11, 13, 5],
     'layers': [{'op': 'linear',
                 'inputs': [0],
                 'device': 0,
                 'units': 13,
                 'act': 'none',
                 'kernel': 1},
                {'op': 'pool', 'inputs': [0], 'device': 0, 'pool': 'max'},
                {'op': 'act', 'inputs': [0], 'device': 0, 'act': 'relu'},
                {'op': 'layernorm', 'inputs': [1], 'device': 0},
                {'op': 'pool', 'inputs': [2], 'device': 0, 'pool': 'max'},
                {'op': 'add', 'inputs': [1, 1], 'device': 0},
                {'op': 'linear',
                 'inputs': [6],
                 'units': 5,
                 'act': 'none',
                 'device': 0,
                 'kernel': 1}],
     'extra_loss': 6,
     'batch': 4,
     'unknown_batch': False,
     'two_devices': False,
     'guarded_update': False,
     'policy': 'recompute',
     'recompute_mode': 'memory',
     'budget': '64MiB',
     'swap_min_bytes': 0,
     'batch_size_option': True,
     'seed': 400,
     'loop': 0},
    # Order edges for weight gradients: a transposed convolution's filter
    # gradient reads the forward activation where others read the output
    # gradient, and two edges, each fine alone, closed a cycle together
    # ("the rewrite created a cycle", two devices, memory-centric).
    "order edges closing a cycle together": {
        "kind": "conv", "hw": 4, "dims": [3, 3, 3, 3, 3, 3, 9, 9, 13, 5],
        "layers": [
            {"op": "act", "inputs": [0], "device": 1, "act": "tanh"},
            {"op": "layernorm", "inputs": [0], "device": 1},
            {"op": "act", "inputs": [1], "device": 1, "act": "softplus"},
            {"op": "softmax", "inputs": [1], "device": 1},
            {"op": "norm", "inputs": [2], "device": 0},
            {"op": "deconv", "inputs": [2], "device": 0, "units": 9, "act": "tanh", "kernel": 3},
            {"op": "norm", "inputs": [6], "device": 0},
            {"op": "linear", "inputs": [7], "device": 0, "units": 13, "act": "swish", "kernel": 3},
            {"op": "linear", "inputs": [8], "units": 5, "act": "none", "device": 0, "kernel": 1}],
        "extra_loss": 5, "batch": 6, "unknown_batch": False, "two_devices": True,
        "guarded_update": False, "policy": "swap+recompute", "recompute_mode": "memory",
        "budget": 1024, "swap_min_bytes": 4096, "batch_size_option": False, "seed": 129},
    # The planner released a recomputed clone by the backward op scheduled
    # right before its reader: a variable update downstream of a BiasAddGrad
    # that oneDNN fuses with the reader's Conv2DBackpropFilter after Grappler,
    # and TensorFlow failed the step with "N nodes in a cycle" (single device).
    "trigger after a fused gradient": {'kind': 'conv',
     'hw': 12,
     'dims': [1, 1, 1, 1, 9, 1, 4, 2, 7, 8],
     'layers': [{'op': 'norm', 'inputs': [0], 'device': 0},
                {'op': 'norm', 'inputs': [0], 'device': 0},
                {'op': 'norm', 'inputs': [0], 'device': 0},
                {'op': 'linear',
                 'inputs': [1],
                 'device': 0,
                 'units': 9,
                 'act': 'elu',
                 'kernel': 3},
                {'op': 'mul', 'inputs': [0, 2], 'device': 0},
                {'op': 'linear',
                 'inputs': [5],
                 'device': 0,
                 'units': 4,
                 'act': 'sigmoid',
                 'kernel': 3},
                {'op': 'split', 'inputs': [4], 'device': 0, 'sizes': [2, 7]},
                {'op': 'linear',
                 'inputs': [8],
                 'units': 8,
                 'act': 'none',
                 'device': 0,
                 'kernel': 1}],
     'extra_loss': 5,
     'batch': 11,
     'unknown_batch': True,
     'two_devices': False,
     'policy': 'swap+recompute',
     'recompute_mode': 'speed',
     'budget': 7309,
     'swap_min_bytes': 0,
     'batch_size_option': True,
     'seed': 253},
    # A reader without a backward input: the planner fell back to the op
    # scheduled before it ("40 nodes in a cycle" again, single device).
    "reader without a backward input": {'kind': 'conv',
     'hw': 3,
     'dims': [8, 7, 1, 7, 1, 14, 12, 9, 19, 7, 7, 1, 8, 1, 5],
     'layers': [{'op': 'split', 'inputs': [0], 'device': 0, 'sizes': [7, 1]},
                {'op': 'add', 'inputs': [1, 1], 'device': 0},
                {'op': 'norm', 'inputs': [2], 'device': 0},
                {'op': 'linear',
                 'inputs': [2],
                 'device': 0,
                 'units': 14,
                 'act': 'elu',
                 'kernel': 3},
                {'op': 'linear',
                 'inputs': [2],
                 'device': 0,
                 'units': 12,
                 'act': 'relu',
                 'kernel': 1},
                {'op': 'linear',
                 'inputs': [4],
                 'device': 0,
                 'units': 9,
                 'act': 'softplus',
                 'kernel': 3},
                {'op': 'concat', 'inputs': [6, 3], 'device': 0},
                {'op': 'act', 'inputs': [1], 'device': 0, 'act': 'tanh'},
                {'op': 'linear',
                 'inputs': [4],
                 'device': 0,
                 'units': 7,
                 'act': 'softplus',
                 'kernel': 3},
                {'op': 'norm', 'inputs': [4], 'device': 0},
                {'op': 'split', 'inputs': [7], 'device': 0, 'sizes': [8, 1]},
                {'op': 'linear',
                 'inputs': [13],
                 'units': 5,
                 'act': 'none',
                 'device': 0,
                 'kernel': 1}],
     'extra_loss': 11,
     'batch': 4,
     'unknown_batch': False,
     'two_devices': False,
     'policy': 'recompute',
     'recompute_mode': 'memory',
     'budget': 223,
     'swap_min_bytes': 256,
     'batch_size_option': False,
     'seed': 4455},
    # A swap-in between a MaxPool and its MaxPoolGrad: oneDNN pairs the two
    # through a workspace only on a direct edge, and TensorFlow's own
    # gradient kernel broke a tie among equal maxima (after dropout)
    # differently: one gradient 1 ulp off (optable.WORKSPACE_PAIRS).
    "max pool swapped away from its gradient": {'kind': 'conv',
      'hw': 11,
      'dims': [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 5, 4, 8],
      'layers': [{'op': 'dropout', 'inputs': [0], 'device': 0, 'rate': 0.5},
                 {'op': 'norm', 'inputs': [1], 'device': 0},
                 {'op': 'pool', 'inputs': [2], 'device': 0, 'pool': 'max'},
                 {'op': 'mul', 'inputs': [2, 1], 'device': 0},
                 {'op': 'linear',
                  'inputs': [0],
                  'device': 0,
                  'units': 9,
                  'act': 'elu',
                  'kernel': 1},
                 {'op': 'mul', 'inputs': [2, 0], 'device': 0},
                 {'op': 'add', 'inputs': [2, 3], 'device': 0},
                 {'op': 'mul', 'inputs': [0, 0], 'device': 0},
                 {'op': 'norm', 'inputs': [2], 'device': 0},
                 {'op': 'act', 'inputs': [0], 'device': 0, 'act': 'sigmoid'},
                 {'op': 'mul', 'inputs': [10, 10], 'device': 0},
                 {'op': 'split', 'inputs': [7], 'device': 0, 'sizes': [5, 4]},
                 {'op': 'linear',
                  'inputs': [13],
                  'units': 8,
                  'act': 'none',
                  'device': 0,
                  'kernel': 1}],
      'extra_loss': 2,
      'batch': 8,
      'unknown_batch': False,
      'two_devices': False,
      'policy': 'swap',
      'recompute_mode': 'memory',
      'budget': None,
      'swap_min_bytes': 256,
      'batch_size_option': False,
      'seed': 5772},
    # Two devices, swap+recompute: a recomputed clone's output was swapped,
    # and the report's per-device lists looked its node up in the original
    # graph (KeyError; the pass handed the graph back unchanged).
    "clone swapped on two devices": {'kind': 'conv',
      'hw': 2,
      'dims': [1, 1, 1, 1, 13, 1],
      'layers': [{'op': 'add', 'inputs': [0, 0], 'device': 1},
                 {'op': 'act', 'inputs': [0], 'device': 0, 'act': 'relu'},
                 {'op': 'linear',
                  'inputs': [0],
                  'device': 0,
                  'units': 1,
                  'act': 'relu',
                  'kernel': 1},
                 {'op': 'linear',
                  'inputs': [3],
                  'device': 1,
                  'units': 13,
                  'act': 'softplus',
                  'kernel': 1},
                 {'op': 'linear',
                  'inputs': [4],
                  'units': 1,
                  'act': 'none',
                  'device': 1,
                  'kernel': 1}],
      'extra_loss': None,
      'batch': 10,
      'unknown_batch': False,
      'two_devices': True,
      'guarded_update': True,
      'policy': 'swap+recompute',
      'recompute_mode': 'speed',
      'budget': None,
      'swap_min_bytes': 0,
      'batch_size_option': False,
      'seed': 0},
    # Two devices: a clone on CPU:1 released from CPU:0 deadlocked the step.
    "clone released from the other device": {'kind': 'conv',
     'hw': 2,
     'dims': [4, 7, 10, 1],
     'layers': [{'op': 'linear',
                 'inputs': [0],
                 'device': 1,
                 'units': 7,
                 'act': 'softplus',
                 'kernel': 1},
                {'op': 'linear',
                 'inputs': [1],
                 'device': 0,
                 'units': 10,
                 'act': 'sigmoid',
                 'kernel': 1},
                {'op': 'linear',
                 'inputs': [2],
                 'units': 1,
                 'act': 'none',
                 'device': 1,
                 'kernel': 1}],
     'extra_loss': 0,
     'batch': 3,
     'unknown_batch': False,
     'two_devices': True,
     'policy': 'recompute',
     'recompute_mode': 'memory',
     'budget': 39188,
     'swap_min_bytes': 256,
     'batch_size_option': False,
     'seed': 4740},
    # Segmented memory-centric recomputation ordered each Conv2DBackpropFilter
    # before every other reader of its output gradient, BiasAddGrad
    # included; oneDNN fuses that pair after Grappler, and with the edge the
    # bias gradient came out with other bits (optable.INPUT_GRADIENT_OPS).
    "filter gradient ordered before its fused bias gradient": {'kind': 'conv',
      'hw': 3,
      'dims': [12, 12, 12, 6, 6, 6, 12, 8, 8, 8, 6],
      'layers': [{'op': 'pool', 'inputs': [0], 'device': 0, 'pool': 'avg'},
                 {'op': 'act', 'inputs': [0], 'device': 0, 'act': 'softplus'},
                 {'op': 'split', 'inputs': [0], 'device': 0, 'sizes': [6, 6]},
                 {'op': 'mul', 'inputs': [3, 3], 'device': 0},
                 {'op': 'dropout', 'inputs': [0], 'device': 0, 'rate': 0.5},
                 {'op': 'linear',
                  'inputs': [4],
                  'device': 0,
                  'units': 8,
                  'act': 'tanh',
                  'kernel': 3},
                 {'op': 'add', 'inputs': [7, 7], 'device': 0},
                 {'op': 'add', 'inputs': [8, 7], 'device': 0},
                 {'op': 'linear',
                  'inputs': [9],
                  'units': 6,
                  'act': 'none',
                  'device': 0,
                  'kernel': 1}],
      'extra_loss': None,
      'batch': 10,
      'unknown_batch': True,
      'two_devices': False,
      'guarded_update': True,
      'policy': 'recompute',
      'recompute_mode': 'memory',
      'budget': None,
      'swap_min_bytes': 0,
      'batch_size_option': False,
      'seed': 338},
}

# Two devices, rewritten by swap+recompute (5 tensors swapped through the
# cache, a BatchNorm recomputed on CPU:1; found by the fuzzer's generator):
# test_a_plan_crossing_devices_is_refused forces its triggers onto the other
# device. (The case used before this one is no longer rewritten since the
# analysis predicts the executor's order: its plan would not lower the peak.)
TWO_DEVICE_SPEC = {'kind': 'dense',
                   'hw': None,
                   'dims': [12, 12, 16, 16, 12, 2],
                   'layers': [{'op': 'norm', 'inputs': [0], 'device': 1},
                              {'op': 'linear',
                               'inputs': [0],
                               'device': 0,
                               'units': 16,
                               'act': 'tanh'},
                              {'op': 'act', 'inputs': [2], 'device': 1, 'act': 'tanh'},
                              {'op': 'norm', 'inputs': [1], 'device': 0},
                              {'op': 'linear',
                               'inputs': [4],
                               'units': 2,
                               'act': 'none',
                               'device': 0}],
                   'extra_loss': None,
                   'batch': 40,
                   'unknown_batch': True,
                   'two_devices': True,
                   'guarded_update': True,
                   'policy': 'swap+recompute',
                   'recompute_mode': 'auto',
                   'budget': 20258,
                   'swap_min_bytes': 256,
                   'batch_size_option': True,
                   'seed': 5844}


def test_cache_swap_of_a_scalar_sets_its_shape_attribute():
    """Found by the fuzzer: a swapped scalar (a moments count) left
    SnCacheIn's shape AttrValue empty, which TensorFlow reads as an unbound
    placeholder ("Failed to bind all placeholders")."""
    from tensorflow.core.framework import graph_pb2

    from sntf import planner, rewrite
    from sntf.graph import names

    g = graph_pb2.GraphDef()
    for name, op, inputs in [("x", "Placeholder", []), ("count", "Size", ["x"]),
                             ("cast", "Cast", ["count"]), ("trigger", "Identity", ["x"]),
                             ("div", "RealDiv", ["trigger", "cast"])]:
        node = g.node.add()
        node.name, node.op = name, op
        node.input.extend(inputs)
    plan = planner.Plan(policy="swap", cache_budget=1 << 20, swaps=(planner.Swap(
        tensor="cast:0", dtype=1, shape=(),
        groups=(planner.SwapGroup(consumers=(("div", 1),), trigger="trigger"),)),))
    out = rewrite.apply_plan(g, plan).graph_def
    swap_in = next(n for n in out.node if n.name == names.swap_in_name("cast", 0))
    assert swap_in.op == names.CACHE_IN_OP
    assert swap_in.attr["shape"].WhichOneof("value") == "shape"
    assert list(swap_in.attr["shape"].shape.dim) == []
    assert not swap_in.attr["shape"].shape.unknown_rank


def _tool(fresh_python, *args, timeout: int = 600) -> tuple[int, dict, str]:
    run = fresh_python(args=["-m", "sntf.testing.fuzz", "--quiet", *args], timeout=timeout)
    return run.returncode, run.result(returncode=None), run.stdout + run.stderr[-3000:]


@pytest.mark.slow
def test_random_training_graphs_are_rewritten_correctly(fresh_python):
    rc, result, output = _tool(fresh_python, "--cases", str(CI_CASES), "--seed", "0",
                               "--mode", "strict", "--timeout", "60")
    assert rc == 0 and result["failures"] == 0, output[-6000:]
    counts = result["counts"]
    assert result["cases"] == CI_CASES
    assert counts["graphs_checked"] >= CI_CASES // 2, counts
    # A fuzz run that never rewrites cannot fail: demand a real share of
    # rewritten graphs, with both techniques and the harder inputs among them.
    assert result["rewritten"] >= CI_CASES // 10, counts
    assert counts.get("with swaps", 0) >= 5, counts
    assert counts.get("with recomputations", 0) >= 2, counts
    # Backward rebuilds are demanded on a fixed spec
    # (test_a_swish_gradient_rebuilt_for_its_later_readers_is_identical):
    # 200 random cases now draw them too rarely to count on (BENCHMARKS.md,
    # "Identical results on deep networks").
    assert counts.get("with cache ops", 0) >= 2, counts
    assert counts.get("rewritten, unknown batch", 0) >= 2, counts
    # The zoo's shapes among the rewritten: squeeze-and-excitation gates,
    # layer normalization, weights read twice, GELU and swish, causal
    # self-attention.
    for shape in ("gate", "layernorm", "tied", "gelu or swish", "causal"):
        assert counts.get(f"rewritten, {shape}", 0) >= 2, (shape, counts)
    # Steps inside a tf.while_loop (Keras' steps_per_execution).
    assert counts.get("rewritten, step in a loop", 0) >= 2, counts
    # Deep residual chains are drawn here too (test_deep_residual_chains_...
    # rewrites them); next to small layers they often leave nothing to plan.
    assert counts.get(f"drawn, {fuzz_cases.DEEP_BLOCKS}+ residual blocks", 0) >= 10, counts


@pytest.mark.parametrize("fault", [False, True])
def test_the_verifier_oracle_passes_a_rewrite_and_names_a_wrong_one(fresh_python, fault):
    """The oracle for graphs whose sums sntf holds to one order, which
    small random cases seldom have (Grappler makes accumulators only near
    the device's memory): sntf.verify_graphs on every rewritten training
    graph, from the case's first step."""
    spec = REGRESSIONS["sum order edge split a merged filter and bias gradient"]
    args = ["--replay", json.dumps(spec), "--verify_all"] + (["--inject_fault"] if fault
                                                              else [])
    rc, result, output = _tool(fresh_python, *args)
    assert result["rewritten"] and result["verified"] >= 1, output[-3000:]
    if not fault:
        assert rc == 0 and result["problems"] == [], output[-3000:]
        return
    verdicts = [p for p in result["problems"] if p.startswith("sntf.verify_graphs:")]
    assert rc == 1 and verdicts, output[-3000:]
    assert verdicts[0].startswith("sntf.verify_graphs: different at "), verdicts[0]
    assert "fuzz_fault/neg:0" in verdicts[0] and "DIFFERENT" in verdicts[0]


@pytest.mark.slow
def test_deep_residual_chains_are_rewritten_correctly(fresh_python):
    """Every case ends in 30 or more residual blocks, where TensorFlow sums
    gradients in an order it decides as it runs (sntf.graph.accumulations)."""
    rc, result, output = _tool(fresh_python, "--cases", "16", "--seed", "7", "--deep",
                               "--mode", "strict", "--timeout", "90")
    assert rc == 0 and result["failures"] == 0, output[-6000:]
    counts = result["counts"]
    deep = f"{fuzz_cases.DEEP_BLOCKS}+ residual blocks"
    assert counts[f"drawn, {deep}"] == result["cases"] == 16, counts
    assert counts.get(f"rewritten, {deep}", 0) >= 4, counts
    assert counts.get("with swaps", 0) >= 2, counts


# Two transposed convolutions around a convolution. Before the forward
# Conv2DBackpropInput counted as a forward layer, everything after it was
# taken for the backward pass and nothing was swapped.
TRANSPOSED = {
    "kind": "conv", "hw": 10, "dims": [8, 12, 12, 12, 4],
    "layers": [
        {"op": "deconv", "inputs": [0], "device": 0, "units": 12, "act": "relu", "kernel": 3},
        {"op": "linear", "inputs": [1], "device": 0, "units": 12, "act": "relu", "kernel": 3},
        {"op": "deconv", "inputs": [2], "device": 0, "units": 12, "act": "gelu", "kernel": 3},
        {"op": "linear", "inputs": [3], "device": 0, "units": 4, "act": "none", "kernel": 1}],
    "extra_loss": None, "batch": 12, "unknown_batch": False, "two_devices": False,
    "guarded_update": False, "policy": "swap+recompute", "recompute_mode": "speed",
    "budget": None, "swap_min_bytes": 0, "batch_size_option": True, "seed": 5}


@pytest.mark.slow
def test_transposed_convolutions_are_rewritten_and_identical(fresh_python):
    rc, result, output = _tool(fresh_python, "--replay", json.dumps(TRANSPOSED),
                               "--timeout", "60", timeout=200)
    assert rc == 0 and result["problems"] == [], output[-3000:]
    assert result["rewritten"] and result["swapped"] > 0, result


# Dense layers with swish and a squared-error loss: the loss gradient meets
# no gradient kernel, and phases found no backward pass to plan; the swish
# gradient reads its recomputed sigmoid twice (sntf.planner.rebuild).
SWISH_DENSE = {
    "kind": "dense", "hw": None, "dims": [12, 48, 48, 5],
    "layers": [
        {"op": "linear", "inputs": [0], "device": 0, "units": 48, "act": "swish"},
        {"op": "linear", "inputs": [1], "device": 0, "units": 48, "act": "swish"},
        {"op": "linear", "inputs": [2], "units": 5, "act": "none", "device": 0}],
    "extra_loss": None, "batch": 48, "unknown_batch": False, "two_devices": False,
    "guarded_update": False, "policy": "recompute", "recompute_mode": "speed",
    "budget": None, "swap_min_bytes": 0, "batch_size_option": True, "seed": 7}


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recompute", "swap+recompute"])
def test_a_swish_gradient_rebuilt_for_its_later_readers_is_identical(fresh_python,
                                                                      policy):
    spec = dict(SWISH_DENSE, policy=policy)
    rc, result, output = _tool(fresh_python, "--replay", json.dumps(spec),
                               "--timeout", "60", timeout=200)
    assert rc == 0 and result["problems"] == [], output[-3000:]
    assert result["rewritten"] and result["rebuilt"] == 2, result


@pytest.mark.slow
def test_the_checks_catch_a_wrong_rewrite(fresh_python):
    """With every rewritten graph deliberately corrupted (an AddV2 turned
    into a Sub, or one activation into another) the same run must fail."""
    rc, result, output = _tool(fresh_python, "--cases", "40", "--seed", "0",
                               "--inject_fault", "--timeout", "60")
    assert rc == 1, output[-3000:]
    assert result["failures"] >= 1 and result["rewritten"] >= 1, result["counts"]
    problems = [p for f in result["failed_specs"] for p in f["problems"]]
    # Caught by the values, or by the placement check that names the
    # injected node (it has no known source among the rewrite's own nodes).
    assert any("differs" in p or "fuzz_fault" in p for p in problems), problems[:5]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_regression(fresh_python, name):
    rc, result, output = _tool(fresh_python, "--replay", json.dumps(REGRESSIONS[name]),
                               "--timeout", "60", timeout=200)
    assert rc == 0 and result["problems"] == [], output[-3000:]
    assert result["graphs"] >= 1


# Run in a fresh process by the test below: the planner's trigger search is
# replaced by one that returns a backward op of the *other* device (a planner
# regression, simulated), and the case must be refused, not deadlocked.
FORCE_CROSS_DEVICE = """
import json
from sntf.testing import fuzz
harness = fuzz.Harness()
spec = json.loads({spec!r})
plain = harness.run_case(spec, timeout=60)
from sntf.planner import backward
original = backward.gradient_ancestor

def elsewhere(g, facts, step_of, reader, seconds, device=None):
    found = original(g, facts, step_of, reader, seconds, None)
    if found is None:
        return None
    others = [n for n in facts.schedule[:step_of[found]]
              if facts.node_phases[n] == "backward" and g.devices[n] != g.devices[found]]
    return others[-1] if others else found

backward.gradient_ancestor = elsewhere
forced = harness.run_case(spec, timeout=60)
errors = [r["reason"] for r in harness.sntf.reports() if r["action"] == "error"]
print("RESULT " + json.dumps({{"plain": plain, "forced": forced, "errors": errors}}))
"""


@pytest.mark.slow
def test_a_plan_crossing_devices_is_refused_not_deadlocked(fresh_python):
    """A trigger on another device than its clone or swap-in deadlocked a
    two-device step; sntf/rewrite.py refuses such a plan, so the graph runs
    as TensorFlow built it and the report says why."""
    run = fresh_python(FORCE_CROSS_DEVICE.format(
        spec=json.dumps(TWO_DEVICE_SPEC)),
        timeout=300)
    result = run.result()
    # As planned (triggers on the tensor's device), the case is rewritten.
    assert result["plain"]["rewritten"] and result["plain"]["problems"] == []
    forced = result["forced"]
    assert not forced["rewritten"], forced
    # The only problem is the refusal itself: results identical, no hang.
    assert forced["problems"] and all("plan crosses devices" in p
                                      for p in forced["problems"]), forced["problems"]
    assert result["errors"] and all("plan crosses devices" in e
                                    for e in result["errors"]), result["errors"]
