"""The verifier's TensorFlow part: both graphs run in Sessions of their own
(sntf.verify.session), from the same variable values and inputs, and their
tensors compared chunk by chunk (verify_graphs); sums TensorFlow adds in
arrival order are checked apart (sntf.verify.sum_check).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Optional, Union

import numpy as np

from sntf.graph import names
from sntf.verify import DEFAULT_CHUNK_BYTES, core
from sntf.verify import result as verify_result
from sntf.verify import sums
from sntf.verify.session import ArgSpec, GraphRun, arg_specs
from sntf.verify.sum_check import (SumCheck, check_sums, paired_accumulators, settle,
                                   settled_value)

# The accepted forms, for error messages.
GRAPH_FORMS = "a tf.compat.v1.GraphDef (or its serialized bytes)"
INPUT_FORMS = ("a mapping from each _Arg's index attr to its value: an array for a data "
               "argument, the variable's value (an array) before the step for a "
               "DT_RESOURCE argument")


def _graph_def(value: Any, what: str):
    from tensorflow.core.framework import graph_pb2

    if isinstance(value, graph_pb2.GraphDef):
        return value
    if isinstance(value, (bytes, bytearray)):
        try:
            return graph_pb2.GraphDef.FromString(bytes(value))
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and kin
            raise ValueError(f"sntf.verify_graphs: {what} is not a serialized GraphDef "
                             f"({type(e).__name__}: {e}); expected {GRAPH_FORMS}") from None
    raise ValueError(f"sntf.verify_graphs: {what} must be {GRAPH_FORMS}, got "
                     f"{type(value).__name__}")


def _values(inputs: Any, specs: Mapping[int, ArgSpec]) -> dict:
    """Checks and converts the inputs: _Arg index -> numpy array."""
    import tensorflow as tf
    from tensorflow.core.framework import types_pb2

    if not isinstance(inputs, Mapping):
        raise ValueError(f"sntf.verify_graphs: inputs must be {INPUT_FORMS}; got "
                         f"{type(inputs).__name__}")
    missing = sorted(set(specs) - set(inputs))
    if missing:
        listed = ", ".join(f"{i} ({specs[i].name})" for i in missing[:8])
        raise ValueError(f"sntf.verify_graphs: inputs lack _Arg index(es) {listed}; "
                         f"expected {INPUT_FORMS}")
    extra = sorted(set(inputs) - set(specs), key=repr)
    if extra:
        raise ValueError(f"sntf.verify_graphs: inputs name {extra[:8]!r}, which are not "
                         f"_Arg indexes of the original graph ({sorted(specs)[:8]}...); "
                         f"expected {INPUT_FORMS}")
    out = {}
    for index, spec in specs.items():
        value = inputs[index]
        if hasattr(value, "numpy"):
            value = value.numpy()
        array = np.asarray(value)
        wanted = spec.handle_dtype if spec.dtype == types_pb2.DT_RESOURCE else spec.dtype
        if wanted is not None:
            expected = tf.as_dtype(wanted)
            if array.dtype != expected.as_numpy_dtype:
                raise ValueError(
                    f"sntf.verify_graphs: input {index} ({spec.name}) is {array.dtype}, "
                    f"but the graph's _Arg holds {expected.name}; give an array of "
                    f"{expected.name}")
        out[index] = array
    return out


def _check_same_args(original: Mapping[int, ArgSpec], rewritten: Mapping[int, ArgSpec]) -> None:
    if {i: (s.name, s.dtype) for i, s in original.items()} != \
            {i: (s.name, s.dtype) for i, s in rewritten.items()}:
        raise ValueError("sntf.verify_graphs: the rewritten graph's _Arg nodes (names, "
                         "indexes, types) differ from the original's; pass the two "
                         "GraphDefs of one report (original_graph, rewritten_graph)")


def verify_graphs(original_graph_def: Any, rewritten_graph_def: Any, inputs: Mapping[int, Any],
                  variable_names: Optional[Mapping[int, str]] = None,
                  max_chunk_bytes: Union[int, str] = DEFAULT_CHUNK_BYTES,
                  check_repeat: bool = True) -> verify_result.VerifyResult:
    """Runs one step of both graphs from the same inputs and compares them
    bit for bit: every tensor both compute, each recomputed clone against
    its source, each swapped-in (and parked) tensor against the tensor
    swapped out, the step's outputs, and every variable after the update.

    The tensors are fetched in chunks of at most `max_chunk_bytes` per
    graph, each chunk from a fresh step (the variables assigned their
    initial values first), and only their sha256 digests are kept; the
    verifier stops after the first chunk with a difference.

    Where they differ and the graphs have sums TensorFlow adds in the order
    their terms arrive (Grappler's accumulators), each such sum is checked
    from identical inputs: its terms must be the original's, bit for bit,
    and added in the order the rewritten graph holds them, from its zeroed
    value, they must give the rewritten graph's bits. Both graphs then run
    again with every such sum set to the original's value once its
    additions are done (settle(): in its own buffer, so that its readers
    reuse buffers as before), and everything is compared from identical
    inputs. Every such sum's value is held in memory meanwhile. A sum that passes and differs is named in `ordered_sums`,
    and the verdict is "identical_up_to_sum_order" where nothing else
    differs; one that fails is the first differing op.

    A difference is then checked against a second run of the original
    graph: if that does not repeat its own bits, the verdict is
    "nondeterministic".

    Args:
      original_graph_def: the graph Grappler handed sntf (a report's
        `original_graph` with keep_graphs=True): a GraphDef or its bytes.
      rewritten_graph_def: the graph sntf handed back (`rewritten_graph`).
      inputs: _Arg index -> value: the data arguments' arrays and, for each
        DT_RESOURCE argument, the variable's value before the step.
      variable_names: _Arg index -> a name for the report (default: the
        _Arg node's name).
      max_chunk_bytes: the most bytes of tensors one run fetches from one
        graph: bytes or a size string ("256MiB").
      check_repeat: on a difference, run the original graph again to tell
        a rewrite's difference from a graph that does not repeat itself.

    Returns:
      A VerifyResult (`str()` of it is the readable report).

    Raises:
      ValueError: a graph that is not a GraphDef, inputs that do not match
        the graph's _Arg nodes, a bad max_chunk_bytes.
    """
    from sntf import sizes as sizes_module
    from sntf.runtime import native

    start = time.perf_counter()
    original = _graph_def(original_graph_def, "original_graph_def")
    rewritten = _graph_def(rewritten_graph_def, "rewritten_graph_def")
    chunk_bytes = sizes_module.parse_size(max_chunk_bytes, "max_chunk_bytes")
    specs = arg_specs(original)
    _check_same_args(specs, arg_specs(rewritten))
    values = _values(inputs, specs)
    labels = {i: (variable_names or {}).get(i) or specs[i].name for i in specs}
    if any(n.op.startswith("Sn") for n in rewritten.node):
        native.load_ops()           # the rewritten graph's swap and cache ops
    runs = [GraphRun(original, values, specs), GraphRun(rewritten, values, specs)]

    def make(graph_def) -> GraphRun:
        run = GraphRun(graph_def, values, specs)
        runs.append(run)
        return run

    try:
        result = _compare(tuple(runs[:2]), labels, chunk_bytes, check_repeat, start, make)
        # Every Session's runs, the settled graphs' included.
        return dataclasses.replace(result, runs=sum(r.runs for r in runs))
    finally:
        for run in runs:
            run.close()


@dataclasses.dataclass
class _Sweep:
    """One pass over every chunk of pairs, the step's outputs and its
    variables, from the same feeds in both graphs.

    Attributes:
      found: the first differing pair, or None.
      chunk, digests: the chunk it is in and both graphs' digests of it.
      counts: kind -> pairs compared.
      chunks_run: chunks compared.
      o_out, o_vars: the original's output and variable digests.
      differing: labels of the variables that differ after the step.
      outputs_differ: the step outputs that differ.
    """

    found: Optional[core.Pair]
    chunk: list
    digests: tuple
    counts: dict
    chunks_run: int
    o_out: list
    o_vars: list
    differing: list
    outputs_differ: list

    @property
    def clean(self) -> bool:
        return self.found is None and not self.differing and not self.outputs_differ


def _sweep(runs: tuple, chunks: list, returns: list, variable_indexes: list,
           labels: Mapping[int, str], feeds: Mapping[str, np.ndarray]) -> _Sweep:
    """Compares both graphs chunk by chunk, stopping after the first chunk
    with a difference."""
    first, second = runs
    # The whole step with nothing fetched but its outputs: the variables
    # after it, as the step leaves them when no fetch holds a tensor back.
    o_out, o_vars = first.run(returns, variables=True, feeds=feeds)
    r_out, r_vars = second.run(returns, variables=True, feeds=feeds)
    differing = [labels[i] for i, a, b in zip(variable_indexes, o_vars, r_vars) if a != b]
    outputs_differ = [r for r, a, b in zip(returns, o_out, r_out) if a != b]
    counts = dict.fromkeys(core.KINDS, 0)
    found, chunks_run, chunk, digests = None, 0, [], ({}, {})
    for chunk in chunks:
        chunks_run += 1
        o_fetch = list(dict.fromkeys(p.original for p in chunk))
        r_fetch = list(dict.fromkeys(p.rewritten for p in chunk))
        digests = (dict(zip(o_fetch, first.run(o_fetch, feeds=feeds)[0])),
                   dict(zip(r_fetch, second.run(r_fetch, feeds=feeds)[0])))
        for kind, n in verify_result.counted(chunk).items():
            counts[kind] += n
        found = core.first_difference(chunk, *digests)
        if found is not None:
            break
    return _Sweep(found, chunk, digests, counts, chunks_run, o_out, o_vars, differing,
                  outputs_differ)


def _compare(runs: tuple, labels: Mapping[int, str], chunk_bytes: int, check_repeat: bool,
             start: float, make) -> verify_result.VerifyResult:
    first, second = runs
    o_nodes, r_nodes = first.nodes(), second.nodes()
    match = core.correspond(o_nodes, r_nodes)
    sizes = first.sizes()
    sizes.update(second.sizes())
    chunks = core.chunk_pairs(match.pairs, sizes, chunk_bytes)
    base = dict(tensors_total=len(match.pairs), skipped=dict(match.skipped),
                original_only=match.original_only, rewritten_only=match.rewritten_only,
                chunks_total=len(chunks), nodes=(len(o_nodes), len(r_nodes)))
    notes = []
    returns = [f"{name}:0" for name in first.returns if f"{name}:0" in sizes]
    order = sorted(labels)
    variable_indexes = [i for i in order if i in _resource_indexes(first)]
    feeds: dict = {}
    sweep = _sweep(runs, chunks, returns, variable_indexes, labels, feeds)
    accumulated = paired_accumulators(o_nodes, r_nodes, match) if not sweep.clean else []
    if accumulated:
        # Sums TensorFlow adds in arrival order: both graphs are run again
        # with each such sum set, once its additions are done, to the
        # original's value, so that everything after it is compared from
        # identical inputs; each sum is checked from identical terms.
        settled = (make(settle(first.graph_def, [a for a, _ in accumulated])),
                   make(settle(second.graph_def, [a for _, a in accumulated])))
        values = first.values([a.tensor for a, _ in accumulated])
        feeds = {settled_value(a.sum): v for (a, _), v in zip(accumulated, values)}
        del values
        checks = check_sums(settled, accumulated, feeds, sizes, chunk_bytes)
        failed = next((c for c in checks if not c.same_terms), None)
        if failed is not None:
            result = dict(base, **_fields(sweep, variable_indexes, returns),
                          sums_checked=len(checks))
            return _sum_differs(failed, result, notes, settled, o_nodes, r_nodes,
                                feeds, start)
        sums = tuple(c.sum for c in checks if c.reordered)
        again = _sweep(settled, chunks, returns, variable_indexes, labels, feeds)
        if again.clean and sums:
            result = dict(base, **_fields(again, variable_indexes, returns),
                          sums_checked=len(checks), ordered_sums=sums)
            notes.append(_SUMS_NOTE)
            return _finish(core.IDENTICAL_UP_TO_SUM_ORDER, result, notes, start)
        if not again.clean:
            sweep, runs = again, settled
            base.update(sums_checked=len(checks), ordered_sums=sums)
            if sums:
                notes.append(_SUMS_NOTE)
        else:
            feeds = {}
    first = runs[0]
    result = dict(base, **_fields(sweep, variable_indexes, returns))
    if sweep.clean:
        return _finish(core.IDENTICAL, result, notes, start)
    if check_repeat:
        repeat = _repeat_check(first, sweep.found, sweep.chunk, sweep.digests[0], returns,
                               sweep.o_out, sweep.o_vars, variable_indexes, labels, o_nodes,
                               feeds)
        if repeat is not None:
            result.update(repeat)
            notes.append("the original graph computed other bits in a second run from "
                         "the same inputs (enable op determinism: "
                         "tf.config.experimental.enable_op_determinism()); no difference "
                         "can be blamed on the rewrite")
            return _finish(core.NONDETERMINISTIC, result, notes, start)
    if sweep.found is None:
        notes.append("every fetched tensor matched, yet " + (
            f"{len(sweep.differing)} variable(s)" if sweep.differing else "the step's outputs")
            + " differ after the step run without fetches: fetching held tensors "
            "back from in-place reuse or changed the executor's order")
        return _finish(core.DIFFERENT, result, notes, start)
    result.update(_first_fields(sweep.found, sweep.digests))
    result["inputs"] = _inputs(sweep.found, runs, o_nodes, r_nodes, feeds)
    return _finish(core.DIFFERENT, result, notes, start)


_SUMS_NOTE = ("each sum added in a fixed order was checked from the same terms in both "
              "graphs (added in the rewritten graph's order, they give its bits), then "
              "set in both graphs to the original's value: every other tensor was "
              "compared from identical inputs")


def _fields(sweep: _Sweep, variable_indexes: list, returns: list) -> dict:
    """The result's counts of one sweep."""
    counts = sweep.counts
    return dict(tensors_compared=sum(counts.values()), clones_compared=counts[core.CLONE],
                swap_ins_compared=counts[core.SWAP_IN],
                swap_outs_compared=counts[core.SWAP_OUT],
                variables_compared=len(variable_indexes),
                variables_differing=len(sweep.differing),
                first_variable=sweep.differing[0] if sweep.differing else None,
                outputs_compared=len(returns), chunks_run=sweep.chunks_run)


def _sum_differs(check: SumCheck, result: dict, notes: list, runs: tuple, o_nodes: list,
                 r_nodes: list, feeds: Mapping[str, np.ndarray],
                 start: float) -> verify_result.VerifyResult:
    """The verdict where a sum's check fails: the sum is the first op that
    differs from identical inputs; its terms are shown."""
    tensor = names.tensor_name(check.sum, 0)
    pair = core.Pair(core.TENSOR, tensor, tensor, sums.ACCUMULATOR_SUM, 0)
    result.update(first_op=check.sum, first_op_type=sums.ACCUMULATOR_SUM,
                  first_tensor=tensor, first_original_tensor=tensor,
                  first_kind=core.TENSOR, first_digests=check.digests)
    result["inputs"] = _inputs(pair, runs, o_nodes, r_nodes, feeds)
    notes.append(f"sum {check.sum}, checked from identical inputs: {check.why}")
    return _finish(core.DIFFERENT, result, notes, start)


def _resource_indexes(run: GraphRun) -> set:
    """_Arg indexes whose values are variables (read after each step)."""
    from tensorflow.core.framework import types_pb2

    return {n.attr["index"].i for n in run.graph_def.node
            if n.op == "_Arg" and n.attr["T"].type == types_pb2.DT_RESOURCE}


def _first_fields(pair: core.Pair, digests: tuple) -> dict:
    return dict(first_op=pair.node, first_op_type=pair.op, first_tensor=pair.rewritten,
                first_original_tensor=pair.original, first_kind=pair.kind,
                first_digests=(digests[0][pair.original].hex(),
                               digests[1][pair.rewritten].hex()))


def _repeat_check(first: GraphRun, found: Optional[core.Pair], chunk: list, digests: dict,
                  returns: list, o_out: list, o_vars: list, variable_indexes: list,
                  labels: Mapping[int, str], o_nodes: list,
                  feeds: Mapping[str, np.ndarray]) -> Optional[dict]:
    """Runs the original graph's differing chunk (or its whole step) again;
    returns the result fields naming what did not repeat, or None."""
    if found is not None:
        fetch = list(digests)
        again = dict(zip(fetch, first.run(fetch, feeds=feeds)[0]))
        ops = {n.name: n.op for n in o_nodes}
        for pair in chunk:
            tensor = pair.original
            if again[tensor] != digests[tensor]:
                node = names.split_tensor(tensor)[0]
                return dict(first_op=node, first_op_type=ops.get(node, "?"),
                            first_tensor=tensor, first_original_tensor=tensor,
                            first_kind=core.TENSOR,
                            first_digests=(digests[tensor].hex(), again[tensor].hex()))
        return None
    out, after = first.run(returns, variables=True, feeds=feeds)
    if out != o_out or after != o_vars:
        moved = [labels[i] for i, a, b in zip(variable_indexes, o_vars, after) if a != b]
        return dict(first_variable=moved[0] if moved else None)
    return None


def _inputs(pair: core.Pair, runs: tuple, o_nodes: list, r_nodes: list,
            feeds: Mapping[str, np.ndarray]) -> tuple:
    """The first differing op's inputs with their digests, from one more
    step of each graph that fetches just them."""
    rows = verify_result.input_rows(pair, o_nodes, r_nodes)
    o_kinds = {n.name: n.outputs for n in o_nodes}
    r_kinds = {n.name: n.outputs for n in r_nodes}

    def why_not(tensor: str, kinds: Mapping[str, tuple]) -> Optional[str]:
        if not tensor:
            return "absent"
        node, port = names.split_tensor(tensor)
        outputs = kinds.get(node, ())
        if port >= len(outputs):
            return "no such output"
        return core.comparable(outputs[port])

    fetch = ([r[1] for r in rows if why_not(r[1], o_kinds) is None],
             [r[2] for r in rows if why_not(r[2], r_kinds) is None])
    got = []
    for run, tensors in zip(runs, fetch):
        unique = list(dict.fromkeys(tensors))
        got.append(dict(zip(unique, run.run(unique, feeds=feeds)[0])))
    out = []
    for slot, o_in, r_in, via in rows:
        o_why, r_why = why_not(o_in, o_kinds), why_not(r_in, r_kinds)
        note = ""
        if o_why is not None and r_why is not None:
            note = (f"({o_why}, not fetched)" if o_why == r_why
                    else f"({o_why} | {r_why}, not fetched)")
        out.append(verify_result.InputDigest(
            slot, o_in, r_in,
            got[0][o_in].hex() if o_why is None else None,
            got[1][r_in].hex() if r_why is None else None, via, note))
    return tuple(out)


def _finish(verdict: str, fields: dict, notes: list,
            start: float) -> verify_result.VerifyResult:
    """The result; verify_graphs counts the runs of every Session."""
    return verify_result.VerifyResult(verdict=verdict, notes=tuple(notes),
                                      seconds=time.perf_counter() - start, **fields)
