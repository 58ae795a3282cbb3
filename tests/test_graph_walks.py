"""The native graph walks (tf_ops/graph_walks.cc) against their Python
reference: the index's topological order and the executor's order, on real
graphs (the corpus, oneDNN's merged kernels included) and on random ones
with loops' back edges and cycles."""

import importlib
import os
import random

import pytest

from conftest import REPO
from sntf.graph import fusions, index as index_module
from sntf.testing import corpus

# The module: sntf.analysis exports its function under the same name.
schedule_module = importlib.import_module("sntf.analysis.schedule")

# Built by tools/bootstrap.sh with the other native libraries: a missing
# build is a failure here, not a skip.
from sntf import _graph_walks as walks  # noqa: E402
FOLDER = os.path.join(REPO, "tests", "corpus", "graphs")


def _both_orders(g) -> list:
    """(native, Python) pairs of every walk of g."""
    args = (g.data_inputs, g.control_inputs, g.consumers, g.control_consumers)
    native, cyclic = walks.topological_order(*args, index_module.back_edge_flags(g.ops),
                                             index_module.int_objects(len(g)))
    python, python_cyclic = index_module._python_topological_order(g.ops, *args)
    pairs = [((tuple(native), cyclic), (tuple(python), python_cyclic))]
    merged = fusions.merged_kernels(g)
    for last_first in (False, True):
        for kernels in (None, merged):
            pairs.append((schedule_module.schedule(g, last_first, kernels),
                          schedule_module._python_schedule(g, last_first, kernels)))
    return pairs


def test_the_walks_are_native_where_sntf_is_built():
    assert index_module._walks is walks and schedule_module._walks is walks


def test_native_walks_order_corpus_graphs_as_the_python_ones():
    from tensorflow.core.framework import graph_pb2

    merged = 0
    for name in ("family-unet", "zoo-gpt", "zoo-allconv_swish", "zoo-se_resnet",
                 "deep-preact50-accumulators"):
        entry = corpus.load(os.path.join(FOLDER, name + ".json.gz"))
        g = index_module.build_index(graph_pb2.GraphDef.FromString(entry.graph),
                                     entry.fetch, entry.preserve)
        for native, python in _both_orders(g):
            assert native == python, name
        merged += bool(fusions.merged_kernels(g))
    assert merged


def _random_graph(rng: random.Random, n: int):
    """A GraphDef of n nodes: data and control edges mostly forward, some
    loops' back edges (NextIteration), and now and then a cycle."""
    from tensorflow.core.framework import graph_pb2

    g = graph_pb2.GraphDef()
    ops = ["Conv2D", "Identity", "Relu", "Shape", "NextIteration", "Conv2DBackpropFilter",
           "BiasAddGrad", "AddN", "Const"]
    for i in range(n):
        node = g.node.add(name=f"n{i}", op=rng.choice(ops))
        for _ in range(rng.randint(0, 3)):
            if i and rng.random() < 0.95:
                p = rng.randrange(i)
            else:
                p = rng.randrange(n)   # backwards: a back edge or a cycle
            node.input.append(f"n{p}:{rng.randint(0, 2)}" if rng.random() < 0.3 else f"n{p}")
        if i and rng.random() < 0.3:
            node.input.append(f"^n{rng.randrange(i)}")
    return g


def test_native_walks_order_random_graphs_as_the_python_ones():
    cyclic = looped = 0
    for seed in range(60):
        rng = random.Random(seed)
        g = index_module.build_index(_random_graph(rng, rng.randint(1, 200)))
        for native, python in _both_orders(g):
            assert native == python, seed
        cyclic += g.has_cycles
        looped += bool(index_module.back_edges(g.ops))
    assert cyclic and cyclic < 60 and looped


def test_native_walks_refuse_malformed_input():
    with pytest.raises(IndexError):
        walks.topological_order((((5, 0),),), ((),), ((),), ((),), b"\0", [0])
    with pytest.raises(ValueError):
        walks.schedule(((),), ((),), ((),), ((),), b"", b"\0", False, {}, [0])
    with pytest.raises(ValueError):
        walks.schedule(((),), ((),), ((),), ((),), b"\0", b"\0", False, {}, [])
    with pytest.raises(TypeError):
        walks.schedule(((0,),), ((),), ((),), ((),), b"\0", b"\0", False, {}, [0])


def test_the_shared_ints_hold_k_at_k_whichever_threads_grow_them(monkeypatch):
    """Orders a native walk returns index the shared list by node number:
    growing it from several threads (Grappler may run passes side by side)
    must never repeat or skip a number."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(index_module, "_INTS", [])
    sizes = [500 * k for k in range(1, 80)] * 4
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(index_module.int_objects, sizes))
    ints = index_module._INTS
    assert len(ints) >= max(sizes) and ints == list(range(len(ints)))
