"""Runs sntf.verify_graphs on a hand-built Grappler accumulator against
rewrites of it and prints each verdict (tests/test_verify_sums.py):

- "same": the same graph;
- "reordered": the same terms, held by control edges to another order;
- "addend": another order, and one addition given another term of the
  same shape;
- "early": one addition adds into the variable before its zeroing.

The terms x * c_i are chosen so that their order changes the sum's bits:
(x + 1e8 x) - 1e8 x is not x + (1e8 x - 1e8 x) in float32.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FLOAT = 'attr { key: "T" value { type: DT_FLOAT } }'
UPDATE = FLOAT + ' attr { key: "use_locking" value { b: false } }'
ZEROING = (FLOAT + ' attr { key: "use_locking" value { b: true } }'
           ' attr { key: "validate_shape" value { b: true } }')
VARIABLE = ('attr { key: "dtype" value { type: DT_FLOAT } } '
            'attr { key: "shape" value { shape { dim { size: 4 } } } } '
            'attr { key: "var_name" value { s: "acc" } }')
SUM = FLOAT + ' attr { key: "var_name" value { s: "acc" } }'
FACTORS = ([1.0, 2.0, 3.0, 4.0], [1e8, 1e8, -1e8, 3e7], [-1e8, -1e8, 1e8, -3e7])


def _const(name: str, values: list) -> str:
    listed = " ".join(f"float_val: {v!r}" for v in values)
    return (f'node {{ name: "{name}" op: "Const" '
            'attr { key: "dtype" value { type: DT_FLOAT } } '
            'attr { key: "value" value { tensor { dtype: DT_FLOAT '
            f'tensor_shape {{ dim {{ size: {len(values)} }} }} {listed} }} }} }} }}')


def _node(name: str, op: str, inputs: list, attrs: str = FLOAT) -> str:
    listed = " ".join(f'input: "{i}"' for i in inputs)
    return f'node {{ name: "{name}" op: "{op}" {listed} {attrs} }}'


def graph(order: list, terms: dict = None, early: int = None):
    """A function body: terms t_i = x * c_i added into accumulator "acc" in
    `order` (each addition after the one before it), relu(acc) * x returned.

    Args:
      order: the additions' order.
      terms: addition -> the tensor it adds instead of its own term.
      early: an addition that adds into the variable itself, with the
        zeroing waiting for it.

    Returns:
      The GraphDef.
    """
    from google.protobuf import text_format
    from tensorflow.core.framework import graph_pb2

    terms = terms or {}
    parts = [_node("x", "_Arg", [], FLOAT + ' attr { key: "index" value { i: 0 } }'),
             _const("zeros", [0.0] * 4)]
    for i, factor in enumerate(FACTORS):
        parts += [_const(f"c{i}", factor), _node(f"t{i}", "Mul", ["x", f"c{i}"])]
    parts.append(_node("acc/tmp_var", "TemporaryVariable", [], VARIABLE))
    waits = [f"^acc/add_{early}"] if early is not None else []
    parts.append(_node("acc/init", "Assign", ["acc/tmp_var", "zeros"] + waits, ZEROING))
    for k, i in enumerate(order):
        ref = "acc/tmp_var" if i == early else "acc/init"
        after = [f"^acc/add_{order[k - 1]}"] if k else []
        parts.append(_node(f"acc/add_{i}", "AssignAdd",
                           [ref, terms.get(i, f"t{i}")] + after, UPDATE))
    parts.append(_node("acc", "DestroyTemporaryVariable",
                       ["acc/init"] + [f"^acc/add_{i}" for i in order], SUM))
    parts += [_node("r", "Relu", ["acc"]), _node("y", "Mul", ["r", "x"]),
              _node("out", "_Retval", ["y"], FLOAT + ' attr { key: "index" value { i: 0 } }')]
    return text_format.Parse("\n".join(parts), graph_pb2.GraphDef())


def main() -> None:
    import numpy as np

    import sntf

    inputs = {0: np.ones(4, np.float32)}
    original = graph([0, 1, 2])
    cases = {"same": graph([0, 1, 2]), "reordered": graph([1, 2, 0]),
             "addend": graph([1, 2, 0], terms={1: "t2"}),
             "early": graph([0, 1, 2], early=0)}
    out = {}
    for label, rewritten in cases.items():
        result = sntf.verify_graphs(original, rewritten, inputs)
        out[label] = {"verdict": result.verdict, "ok": result.ok,
                      "first_op": result.first_op, "first_op_type": result.first_op_type,
                      "sums": list(result.ordered_sums), "checked": result.sums_checked,
                      "runs": result.runs,
                      "inputs": [[i.slot, i.original, i.rewritten, i.same, i.via]
                                 for i in result.inputs],
                      "text": str(result)}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
