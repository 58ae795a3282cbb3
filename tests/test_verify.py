"""sntf.verify: the pure correspondence, order and chunking on hand-built
graphs, and the verifier itself on a tiny CNN in a fresh process: identical
under every rewriting policy, and naming the op of a rewrite broken on
purpose."""

import json
import os
import textwrap

import numpy as np
import pytest

from conftest import REPO, run_python
from sntf.verify import core
from sntf.verify import result as verify_result
from sntf.verify.core import CLONE, SWAP_IN, SWAP_OUT, TENSOR, Node, Pair

F = ("float32",)


# ---------------------------------------------------------------- hand-built graphs
def _original():
    """x -> relu -> mul(relu, w) -> out; a ref accumulator; a resource."""
    return [
        Node("x", "Placeholder", (), "", F),
        Node("v", "VarHandleOp", (), "", ("resource",)),
        Node("w", "ReadVariableOp", ("v",), "", F),
        Node("relu", "Relu", ("x",), "", F),
        Node("mul", "Mul", ("relu", "w"), "", F),
        Node("acc", "TemporaryVariable", (), "", ("float32_ref",)),
        Node("acc/add", "AssignAdd", ("acc", "mul"), "", ("float32_ref",)),
        Node("sum", "DestroyTemporaryVariable", ("acc", "^acc/add"), "", F),
        Node("grad", "ReluGrad", ("sum", "relu"), "", F),
    ]


CLONE_NAME = "sntf/recompute/0/relu"
SWAP_OUT_NAME = "sntf/swap_out/mul/0"
SWAP_IN_NAME = "sntf/swap_in/mul/0/0"


def _rewritten():
    """The original with relu recomputed for grad and mul swapped."""
    nodes = [n for n in _original() if n.name != "grad"]
    return nodes + [
        Node(SWAP_OUT_NAME, "SnSwapOut", ("mul",), "swap_out", F),
        Node(SWAP_IN_NAME, "SnSwapIn", (SWAP_OUT_NAME, "^sum"), "swap_in", F),
        Node(CLONE_NAME, "Relu", ("x", "^sum"), "recompute", F),
        Node("grad", "ReluGrad", ("sum", CLONE_NAME), "", F),
        Node("use", "Identity", (SWAP_IN_NAME,), "", F),
    ]


def test_topological_order_breaks_ties_by_given_order_and_skips_back_edges():
    nodes = [Node("b", "Identity", ("a",)), Node("a", "Const"), Node("c", "Const"),
             Node("m", "Merge", ("c", "n")), Node("n", "NextIteration", ("m",)),
             Node("lost", "Identity", ("lost2",)), Node("lost2", "Identity", ("lost",))]
    assert core.topological_order(nodes) == ["a", "b", "c", "m", "n", "lost", "lost2"]


def test_control_flow_nodes_stop_at_merge_and_exit():
    nodes = [Node("p", "Const"), Node("s", "Switch", ("p", "p")),
             Node("t", "Identity", ("s:1",)), Node("dep", "NoOp", ("^t",)),
             Node("m", "Merge", ("t", "s")), Node("after", "Identity", ("m",)),
             Node("e", "Enter", ("p",)), Node("body", "Neg", ("e",)),
             Node("x", "Exit", ("body",)), Node("out", "Identity", ("x",))]
    assert core.control_flow_nodes(nodes) == {"s", "t", "dep", "e", "body"}


def test_correspondence_pairs_common_tensors_clones_and_swaps_in_order():
    match = core.correspond(_original(), _rewritten())
    got = [(p.kind, p.original, p.rewritten, p.op, p.position) for p in match.pairs]
    # Topological order of the original: x v w relu mul acc acc/add sum grad.
    assert got == [
        (TENSOR, "x:0", "x:0", "Placeholder", 0),
        (TENSOR, "w:0", "w:0", "ReadVariableOp", 2),
        (TENSOR, "relu:0", "relu:0", "Relu", 3),
        (CLONE, "relu:0", CLONE_NAME + ":0", "Relu", 3),
        (TENSOR, "mul:0", "mul:0", "Mul", 4),
        (SWAP_OUT, "mul:0", SWAP_OUT_NAME + ":0", "SnSwapOut", 4),
        (SWAP_IN, "mul:0", SWAP_IN_NAME + ":0", "SnSwapIn", 4),
        (TENSOR, "sum:0", "sum:0", "DestroyTemporaryVariable", 7),
        (TENSOR, "grad:0", "grad:0", "ReluGrad", 8),
    ]
    assert match.pairs[3].node == CLONE_NAME
    assert match.skipped == {core.SKIP_REF: 2, core.SKIP_RESOURCE: 1}
    assert match.original_only == 0
    assert match.rewritten_only == 1          # "use": the rewrite's own reader


def test_origin_follows_a_swap_of_a_clone_and_leaves_tickets_alone():
    original = {n.name: n for n in _original()}
    clone_swap_in = "sntf/swap_in/" + CLONE_NAME + "/0/1"
    rewritten = {n.name: n for n in _rewritten()}
    rewritten[clone_swap_in] = Node(clone_swap_in, "SnSwapIn",
                                    ("sntf/swap_out/" + CLONE_NAME + "/0",), "swap_in", F)
    rewritten["sntf/swap_out/relu/0"] = Node("sntf/swap_out/relu/0", "SnCacheOut",
                                             ("relu",), "swap_out", ("int64",))
    assert core.origin(clone_swap_in + ":0", rewritten, original) == ("relu:0", SWAP_IN)
    assert core.origin(CLONE_NAME + ":0", rewritten, original) == ("relu:0", CLONE)
    assert core.origin("sntf/swap_out/relu/0:0", rewritten, original) is None
    assert core.origin("use:0", rewritten, original) is None
    assert core.origin("grad:0", rewritten, original) == ("grad:0", TENSOR)


def test_tensors_in_control_flow_are_counted_not_paired():
    nodes = [Node("p", "Placeholder", (), "", ("bool",)),
             Node("x", "Placeholder", (), "", F),
             Node("s", "Switch", ("x", "p"), "", F * 2),
             Node("t", "Neg", ("s:1",), "", F),
             Node("m", "Merge", ("t", "s"), "", ("float32", "int32"))]
    match = core.correspond(nodes, nodes)
    assert [p.original for p in match.pairs] == ["p:0", "x:0", "m:0", "m:1"]
    assert match.skipped == {core.SKIP_CONTROL_FLOW: 3}


def _pairs(*names):
    return [Pair(TENSOR, n, n, "Op", i) for i, n in enumerate(names)]


def test_chunks_stay_within_the_byte_limit_on_each_side():
    pairs = _pairs("a:0", "b:0", "c:0", "e:0", "d:0")
    pairs.insert(1, Pair(CLONE, "a:0", "clone:0", "Op", 0))
    sizes = {"a:0": 40, "clone:0": 40, "b:0": 50, "c:0": 5, "d:0": 300, "e:0": None}

    def chunked(*args):
        return [[p.rewritten for p in c] for c in core.chunk_pairs(pairs, sizes, *args)]

    # a is fetched once from the original (40) and twice over from the
    # rewritten graph (a and its clone: 80); b would take that side to 130.
    # e's size is unknown: the largest known (300) by default; d is larger
    # than the limit and gets a chunk of its own.
    assert chunked(100) == [["a:0", "clone:0"], ["b:0", "c:0"], ["e:0"], ["d:0"]]
    assert chunked(100, 5) == [["a:0", "clone:0"], ["b:0", "c:0", "e:0"], ["d:0"]]
    assert chunked(10 ** 9) == [[p.rewritten for p in pairs]]
    assert sum(core.chunk_pairs(pairs, sizes, 100), []) == pairs


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "64MiB"])
def test_chunk_limit_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_chunk_bytes must be a positive"):
        core.chunk_pairs(_pairs("a:0"), {}, bad)


def test_digest_sees_dtype_shape_and_bits():
    a = np.arange(6, dtype=np.float32)
    assert core.digest(a) == core.digest(a.copy())
    assert core.digest(a) != core.digest(a.reshape(2, 3))
    assert core.digest(a) != core.digest(a.view(np.int32))
    b = a.copy()
    b[3] = np.nextafter(b[3], np.float32(10))         # one ulp
    assert core.digest(a) != core.digest(b)
    assert core.digest(np.array([b"ab", b"c"], dtype=object)) != \
        core.digest(np.array([b"a", b"bc"], dtype=object))
    assert len(core.digest(np.float32(1))) == 32


def test_first_difference_is_the_first_in_order():
    pairs = _pairs("a:0", "b:0", "c:0")
    same = {"a:0": b"1", "b:0": b"2", "c:0": b"3"}
    assert core.first_difference(pairs, same, same) is None
    assert core.first_difference(pairs, same, dict(same, **{"b:0": b"x", "c:0": b"y"})) \
        == pairs[1]


def test_input_rows_show_a_ref_input_through_its_writers():
    original, rewritten = _original(), _rewritten()
    match = core.correspond(original, rewritten)
    total = next(p for p in match.pairs if p.original == "sum:0")
    assert verify_result.input_rows(total, original, rewritten) == [
        (0, "acc:0", "acc:0", ""), (-1, "mul:0", "mul:0", "acc/add (AssignAdd)")]
    grad = next(p for p in match.pairs if p.original == "grad:0")
    assert verify_result.input_rows(grad, original, rewritten) == [
        (0, "sum:0", "sum:0", ""), (1, "relu:0", CLONE_NAME + ":0", "")]
    swap_in = next(p for p in match.pairs if p.kind == SWAP_IN)
    assert verify_result.input_rows(swap_in, original, rewritten) == [
        (0, "mul:0", SWAP_OUT_NAME + ":0", "")]


def test_report_text_names_the_op_and_its_inputs():
    result = verify_result.VerifyResult(
        verdict=core.DIFFERENT, first_op="AddN_1", first_op_type="DestroyTemporaryVariable",
        first_tensor="AddN_1:0", first_original_tensor="AddN_1:0", first_kind=TENSOR,
        first_digests=("ab" * 32, "cd" * 32),
        inputs=(verify_result.InputDigest(0, "t:0", "t:0", None, None, note="(ref, not fetched)"),
                verify_result.InputDigest(-1, "g:0", "g:0", "12" * 32, "12" * 32,
                                 via="AddN_1/tmp_var_accum_0 (AssignAdd)"),
                verify_result.InputDigest(1, "a:0", "b:0", "12" * 32, "34" * 32)),
        first_variable="dense/kernel", variables_compared=4, variables_differing=2,
        tensors_compared=10, tensors_total=30, clones_compared=1, swap_ins_compared=2,
        chunks_run=1, chunks_total=3, runs=7, graph="train step of 'm'", policy="swap",
        action="rewritten", nodes=(100, 110), skipped={"ref": 3})
    assert not result.identical
    assert str(result).splitlines() == [
        "sntf.verify: train step of 'm': DIFFERENT",
        "  policy 'swap', graph rewritten, 100 -> 110 nodes",
        "  first differing op: AddN_1 (DestroyTemporaryVariable)",
        "    output AddN_1:0",
        "    original  sha256 abababababababab",
        "    rewritten sha256 cdcdcdcdcdcdcdcd",
        "    inputs (original | rewritten):",
        "      0 t:0  (ref, not fetched)",
        "      via AddN_1/tmp_var_accum_0 (AssignAdd): g:0  1212121212121212 | "
        "1212121212121212  same",
        "      1 a:0 | b:0  1212121212121212 | 3434343434343434  DIFFERENT",
        "  first variable that differs after the update: dense/kernel (2 of 4 differ)",
        "  compared: 10 of 30 tensor pairs (1 recomputed clones, 2 swapped-in, 0 parked), "
        "4 variables after the update, 0 step outputs; 7 runs",
        "  stopped after chunk 1 of 3 (the first with a difference)",
        "  not compared (outputs of the original): 3 ref",
    ]


# ---------------------------------------------------------------- the verifier, end to end
# One fresh process (sntf's plugin cannot be unregistered): a tiny CNN whose
# normalization and ReLU outputs recompute and whose activations swap,
# verified under each rewriting policy with op determinism and one inter-op
# thread; then its rewritten graphs broken on purpose and handed to
# verify_graphs.
WORKER = textwrap.dedent("""
    import json
    import numpy as np
    import tensorflow as tf
    tf.config.experimental.enable_op_determinism()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    import sntf
    from sntf.graph import names
    from tensorflow.core.framework import graph_pb2

    keras.utils.set_random_seed(1)
    L = keras.layers
    model = keras.Sequential([keras.Input((16, 16, 3)),
        L.Conv2D(8, 3, padding="same"), L.BatchNormalization(), L.ReLU(),
        L.Conv2D(8, 3, padding="same"), L.BatchNormalization(), L.ReLU(),
        L.Conv2D(8, 3, padding="same"), L.BatchNormalization(), L.ReLU(),
        L.GlobalAveragePooling2D(), L.Dense(10)], name="tiny_cnn")
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    r = np.random.RandomState(0)
    x, y = r.rand(16, 16, 16, 3).astype("float32"), r.randint(0, 10, 16)
    weights = [w.copy() for w in model.get_weights()]
    out = {"policies": {}}

    def fields(result):
        return {"verdict": result.verdict, "first_op": result.first_op,
                "first_op_type": result.first_op_type, "first_kind": result.first_kind,
                "first_tensor": result.first_tensor,
                "first_original_tensor": result.first_original_tensor,
                "inputs": [[i.slot, i.original, i.rewritten, i.same]
                           for i in result.inputs],
                "tensors": result.tensors_compared, "total": result.tensors_total,
                "clones": result.clones_compared, "swap_ins": result.swap_ins_compared,
                "variables": result.variables_compared,
                "variables_differing": result.variables_differing,
                "action": result.action, "chunks": [result.chunks_run, result.chunks_total],
                "text": str(result)}

    graphs = {}
    for policy in ("recompute", "swap", "swap+recompute"):
        # Small chunks: several runs per graph, as on a large network.
        result = sntf.verify(model, x, y, policy=policy, min_gain=0.0,
                             swap_min_bytes=4096, max_chunk_bytes="1MiB")
        out["policies"][policy] = fields(result)
        report = [r for r in sntf.reports() if r.get("training")][-1]
        graphs[policy] = report["original_graph"], report["rewritten_graph"]
    out["weights_restored"] = all(np.array_equal(a, b)
                                  for a, b in zip(weights, model.get_weights()))
    out["sntf_off_again"] = not sntf.config.current().enabled

    # The inputs of those graphs, as sntf.verify builds them.
    step = tf.function(model.train_step)
    data = (tf.constant(x), tf.constant(y))
    concrete = step.get_concrete_function(data)
    n_data = len(concrete.inputs) - len(concrete.captured_inputs)
    by_handle = {id(v.handle): v for v in concrete.variables}
    inputs = {0: x, 1: y.astype(np.int64)}
    for k, t in enumerate(concrete.captured_inputs):
        inputs[n_data + k] = by_handle[id(t)].numpy()

    def nodes(graph_def):
        return {n.name: n for n in graph_def.node}

    # (1) A recomputed ReLU clone made a LeakyReLU with alpha 0.2.
    original, rewritten = graphs["recompute"]
    broken = graph_pb2.GraphDef()
    broken.CopyFrom(rewritten)
    clone = next(n for n in broken.node
                 if n.name.startswith("sntf/recompute/") and n.op == "Relu")
    clone.op = "LeakyRelu"
    clone.attr["alpha"].f = 0.2
    result = sntf.verify_graphs(original, broken, inputs)
    out["clone"] = dict(fields(result), expected=clone.name)

    # (2) A backward reader of a swapped-in ReLU output reads another ReLU
    # output of the same shape instead.
    original, rewritten = graphs["swap"]
    broken = graph_pb2.GraphDef()
    broken.CopyFrom(rewritten)
    relus = [n.name for n in original.node if n.op == "Relu"]
    reader, slot, other = None, None, None
    for n in broken.node:
        if not n.name.startswith("gradient_tape/") or reader is not None:
            continue
        for k, text in enumerate(n.input):
            served = names.swap_source(text.split(":")[0])
            if text.startswith("sntf/swap_in/") and served and served[0] in relus:
                source = served[0]
                reader, slot = n, k
                other = next(r for r in relus if r != source)
                break
    reader.input[slot] = other
    result = sntf.verify_graphs(original, broken, inputs)
    out["rewired"] = dict(fields(result), expected=reader.name, expected_op=reader.op,
                          slot=slot, other=other + ":0")

    # A graph that does not repeat its own bits (a stateful random op draws
    # new numbers on each run), "rewritten" with another op: the difference
    # cannot be blamed on the rewrite.
    from google.protobuf import text_format
    noisy = text_format.Parse('''
        node { name: "x" op: "_Arg" attr { key: "T" value { type: DT_FLOAT } }
               attr { key: "index" value { i: 0 } } }
        node { name: "shape" op: "Const" attr { key: "dtype" value { type: DT_INT32 } }
               attr { key: "value" value { tensor { dtype: DT_INT32
                      tensor_shape { dim { size: 1 } } int_val: 4 } } } }
        node { name: "noise" op: "RandomUniform" input: "shape"
               attr { key: "T" value { type: DT_INT32 } }
               attr { key: "dtype" value { type: DT_FLOAT } }
               attr { key: "seed" value { i: 1 } } attr { key: "seed2" value { i: 2 } } }
        node { name: "sum" op: "AddV2" input: "x" input: "noise"
               attr { key: "T" value { type: DT_FLOAT } } }
        node { name: "out" op: "_Retval" input: "sum"
               attr { key: "T" value { type: DT_FLOAT } } attr { key: "index" value { i: 0 } } }
    ''', graph_pb2.GraphDef())
    changed = graph_pb2.GraphDef()
    changed.CopyFrom(noisy)
    next(n for n in changed.node if n.name == "sum").op = "Sub"
    out["noisy"] = fields(sntf.verify_graphs(noisy, changed, {0: np.ones(4, np.float32)}))
    out["noisy_alone"] = fields(sntf.verify_graphs(noisy, noisy,
                                                   {0: np.ones(4, np.float32)}))

    # Bad input: named, with the accepted forms.
    errors = {}
    for label, call in {
            "graph": lambda: sntf.verify_graphs(b"not a graph", rewritten, inputs),
            "inputs": lambda: sntf.verify_graphs(original, rewritten, {0: x}),
            "dtype": lambda: sntf.verify_graphs(original, rewritten,
                                                {**inputs, 0: x.astype("float64")}),
            "chunk": lambda: sntf.verify_graphs(original, rewritten, inputs,
                                                max_chunk_bytes="lots"),
            "model": lambda: sntf.verify("model", x, y),
            "policy": lambda: sntf.verify(model, x, y, policy="sometimes")}.items():
        try:
            call()
            errors[label] = None
        except ValueError as e:
            errors[label] = str(e)
    out["errors"] = errors
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def verified():
    return run_python(WORKER, timeout=600).result()


@pytest.mark.parametrize("policy", ["recompute", "swap", "swap+recompute"])
def test_rewritten_graphs_verify_identical(verified, policy):
    got = verified["policies"][policy]
    assert got["verdict"] == "identical", got["text"]
    assert got["action"] == "rewritten", got["text"]
    assert got["first_op"] is None and got["variables_differing"] == 0
    assert got["tensors"] == got["total"] > 300, got["text"]
    assert got["variables"] > 30
    # Small chunks: the tensors took several runs, all compared.
    assert got["chunks"][0] == got["chunks"][1] > 1, got["text"]
    if policy == "recompute":
        assert got["clones"] > 0, got["text"]
    if policy == "swap":
        assert got["swap_ins"] > 0, got["text"]
    if policy == "swap+recompute":
        assert got["clones"] + got["swap_ins"] > 0, got["text"]
    assert "IDENTICAL" in got["text"].splitlines()[0]


def test_verify_leaves_weights_and_switch_as_they_were(verified):
    assert verified["weights_restored"]
    assert verified["sntf_off_again"]


def test_a_clone_with_another_op_and_attribute_is_named(verified):
    got = verified["clone"]
    assert got["verdict"] == "different", got["text"]
    assert got["first_op"] == got["expected"], got["text"]
    assert got["first_op_type"] == "LeakyRelu"
    assert got["first_kind"] == "clone"
    assert got["first_original_tensor"] == got["expected"].split("/", 3)[3] + ":0"
    # Its inputs are the same in both graphs: the op itself differs.
    assert got["inputs"] and all(row[3] is True for row in got["inputs"]), got["text"]
    assert f"first differing op: {got['expected']} (LeakyRelu)" in got["text"]
    assert got["variables_differing"] > 0


def test_a_reader_given_another_tensor_of_the_same_shape_is_named(verified):
    got = verified["rewired"]
    assert got["verdict"] == "different", got["text"]
    assert got["first_op"] == got["expected"], got["text"]
    assert got["first_op_type"] == got["expected_op"]
    assert got["first_kind"] == "tensor"
    rows = {row[0]: row for row in got["inputs"]}
    slot = rows[got["slot"]]
    assert slot[2] == got["other"] and slot[3] is False, got["text"]
    assert all(row[3] is True for s, row in rows.items() if s != got["slot"]), got["text"]


def test_a_graph_that_does_not_repeat_itself_is_not_blamed_on_the_rewrite(verified):
    got = verified["noisy"]
    assert got["verdict"] == "nondeterministic", got["text"]
    assert got["first_op"] == "noise" and got["first_op_type"] == "RandomUniform", got["text"]
    assert "first op the original graph does not repeat: noise (RandomUniform)" in got["text"]
    # Both Sessions draw in step, run for run: the same graph is identical.
    assert verified["noisy_alone"]["verdict"] == "identical"


@pytest.mark.parametrize("label, words", [
    ("graph", ["original_graph_def", "serialized GraphDef"]),
    ("inputs", ["lack _Arg index", "expected a mapping"]),
    ("dtype", ["float64", "float32"]),
    ("chunk", ["max_chunk_bytes", "'lots'"]),
    ("model", ["compiled keras.Model", "str"]),
    ("policy", ["'sometimes'", "accepted policies"])])
def test_bad_input_is_a_value_error_naming_it(verified, label, words):
    message = verified["errors"][label]
    assert message is not None, label
    for word in words:
        assert word in message, (label, message)


# ---------------------------------------------------------------- sntf_dump --verify
TINY_MODEL = textwrap.dedent("""
    import keras


    def build_model():
        L = keras.layers
        model = keras.Sequential([keras.Input((16, 16, 3)),
            L.Conv2D(8, 3, padding="same"), L.BatchNormalization(), L.ReLU(),
            L.Conv2D(8, 3, padding="same"), L.BatchNormalization(), L.ReLU(),
            L.GlobalAveragePooling2D(), L.Dense(10)], name="tiny_cnn")
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
""")


def test_sntf_dump_verify_writes_the_report(tmp_path):
    model = tmp_path / "tiny.py"
    model.write_text(TINY_MODEL)
    out = tmp_path / "out"
    run = run_python(args=[os.path.join(REPO, "tools", "sntf_dump"), "--model", str(model),
                           "--batch", "16", "--policy", "swap", "--out", str(out),
                           "--verify", "--verify_chunk_bytes", "1MiB"], timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    text = (out / "verify.txt").read_text()
    assert text.startswith("sntf.verify: train step of 'tiny_cnn': IDENTICAL\n"), text
    assert text in run.stdout
    document = json.loads((out / "verify.json").read_text())
    assert document["verdict"] == "identical" and document["identical"] is True
    assert document["tensors_compared"] == document["tensors_total"] > 100
    assert document["policy"] == "swap"


def test_sntf_dump_refuses_a_bad_chunk_size(tmp_path):
    model = tmp_path / "tiny.py"
    model.write_text(TINY_MODEL)
    run = run_python(args=[os.path.join(REPO, "tools", "sntf_dump"), "--model", str(model),
                           "--batch", "4", "--verify", "--verify_chunk_bytes", "0"],
                     timeout=120)
    assert run.returncode == 2
    assert "--verify_chunk_bytes" in run.stderr and "'0'" in run.stderr, run.stderr
