"""sntf.verify on sums TensorFlow adds in arrival order (Grappler's
accumulators): the pure parts (which accumulators a graph has, the order it
holds their additions to, the sum in that order) on hand-built graphs, and
the verdicts of verify_graphs on a hand-built accumulator in a fresh
process:

- the same graph: "identical";
- the same terms held to another order: "identical_up_to_sum_order",
  naming the sum;
- an addend swapped for another tensor of the same shape: "different",
  naming the sum and the addition;
- an addition let run before the accumulator's zeroing: "different".
"""

import os

import numpy as np
import pytest

from conftest import REPO, run_python
from sntf.verify import sums
from sntf.verify.core import Node

R = ("float32_ref",)
F = ("float32",)


def _accumulator(order, early=None, extra=()):
    """Three terms added into a zeroed TemporaryVariable in `order` (each
    addition after the one before it); `early`: an addition that adds into
    the variable directly and the zeroing waits for it."""
    nodes = [Node("x", "Placeholder", (), "", F), Node("zeros", "Const", (), "", F)]
    nodes += [Node(f"t{i}", "Mul", ("x", "x"), "", F) for i in range(3)]
    nodes.append(Node("v", "TemporaryVariable", (), "", R))
    nodes.append(Node("init", "Assign", ("v", "zeros") + (
        (f"^add_{early}",) if early is not None else ()), "", R))
    for k, i in enumerate(order):
        ref = "v" if i == early else "init"
        after = (f"^add_{order[k - 1]}",) if k else ()
        nodes.append(Node(f"add_{i}", "AssignAdd", (ref, f"t{i}") + after, "", R))
    nodes.append(Node("sum", "DestroyTemporaryVariable",
                      ("init",) + tuple(f"^add_{i}" for i in range(3)), "", F))
    return nodes + list(extra)


def test_an_accumulator_held_in_one_order_is_found_in_that_order():
    found = sums.accumulators(_accumulator([2, 0, 1]))
    acc = found["sum"]
    assert acc.held and acc.why == ""
    assert [u[0] for u in acc.updates] == ["add_2", "add_0", "add_1"]
    assert [u[2] for u in acc.updates] == ["t2:0", "t0:0", "t1:0"]
    assert (acc.variable, acc.init, acc.init_value, acc.tensor) == (
        "v", "init", "zeros:0", "sum:0")


def test_additions_left_free_are_not_held():
    nodes = [n if n.name != "add_1" else Node("add_1", "AssignAdd", ("init", "t1"), "", R)
             for n in _accumulator([0, 1, 2])]
    acc = sums.accumulators(nodes)["sum"]
    assert not acc.held and "either order" in acc.why


def test_an_addition_before_the_zeroing_is_not_held():
    acc = sums.accumulators(_accumulator([0, 1, 2], early=0))["sum"]
    assert not acc.held and "add_0" in acc.why and "zeroing" in acc.why


def test_a_single_addition_is_no_order_dependent_sum():
    nodes = [n for n in _accumulator([0, 1, 2]) if n.name not in ("add_1", "add_2")]
    assert sums.accumulators(nodes) == {}


def test_ordered_sum_adds_in_the_given_order_in_the_dtype():
    big, one = np.float32(1e8), np.float32(1.0)
    zero = np.zeros(1, np.float32)
    terms = [(1, np.array([one])), (1, np.array([big])), (-1, np.array([big]))]
    assert sums.ordered_sum(zero, terms)[0] == 0.0          # (1 + 1e8) - 1e8
    assert sums.ordered_sum(zero, terms[1:] + terms[:1])[0] == 1.0
    assert sums.ordered_sum(zero, terms).dtype == np.float32


def test_ordered_sum_flushes_denormals_as_tensorflow_does():
    tiny = np.finfo(np.float32).tiny
    denormal = np.array([tiny / 4, -tiny / 4], np.float32)
    got = sums.ordered_sum(np.zeros(2, np.float32), [(1, denormal)])
    assert np.array_equal(got, [0.0, 0.0])            # not +-tiny / 4
    # Flushed to a zero of its sign.
    assert np.signbit(sums.ordered_sum(denormal, [])[1])
    # Two normals whose difference is a denormal.
    a, b = np.array([tiny * 1.5], np.float32), np.array([tiny], np.float32)
    assert sums.ordered_sum(a, [(-1, b)])[0] == 0.0


WORKER = os.path.join(REPO, "sntf", "testing", "workers", "sum_verdicts.py")


@pytest.fixture(scope="module")
def verdicts():
    return run_python(args=[WORKER], timeout=300).result()


def test_the_same_accumulator_is_identical(verdicts):
    got = verdicts["same"]
    assert got["verdict"] == "identical" and got["ok"], got["text"]
    assert got["sums"] == []


def test_the_same_terms_in_another_held_order_are_identical_up_to_that_order(verdicts):
    got = verdicts["reordered"]
    assert got["verdict"] == "identical_up_to_sum_order" and got["ok"], got["text"]
    assert got["sums"] == ["acc"] and got["checked"] == 1, got["text"]
    assert got["first_op"] is None
    assert got["text"].splitlines()[0] == "sntf.verify: IDENTICAL UP TO THE ORDER OF 1 SUM"
    # The settled graphs' Session runs count too: more than the plain check's.
    assert got["runs"] > verdicts["same"]["runs"] + 2, (got["runs"], verdicts["same"]["runs"])


def test_a_changed_addend_is_a_difference_naming_the_sum_and_the_addition(verdicts):
    got = verdicts["addend"]
    assert got["verdict"] == "different" and not got["ok"], got["text"]
    assert (got["first_op"], got["first_op_type"]) == ("acc", "DestroyTemporaryVariable")
    changed = [row for row in got["inputs"] if row[3] is False]
    assert [row[1:3] for row in changed] == [["t1:0", "t2:0"]], got["text"]
    assert "acc/add_1" in changed[0][4]
    assert "acc/add_1 adds other bits" in got["text"]


def test_an_addition_before_the_zeroing_is_a_difference(verdicts):
    got = verdicts["early"]
    assert got["verdict"] == "different" and not got["ok"], got["text"]
    assert got["first_op"] == "acc", got["text"]
    assert "not held after the zeroing acc/init" in got["text"]
