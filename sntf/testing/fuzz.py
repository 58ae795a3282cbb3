"""Fuzzes sntf's graph pass with random training graphs (hypothesis).

    python benchmarks/fuzz_pass.py [--cases 1000] [--seed 0] [--mode count|strict]
                                   [--policies recompute,swap,swap+recompute]
                                   [--replay SPEC_JSON] [--inject_fault] [--timeout S]
                                   [--deep] [--verify_all] [--results FILE]
    python -m sntf.testing.fuzz ...        (the same)

Each case is a random training step: a DAG of dense or conv layers,
element-wise ops, normalizations, dropout, pooling, concatenations, splits,
causal self-attention and tf.cond layers, with skip connections (a layer reads any earlier tensor), on an
input whose batch dimension is fixed or unknown (input_signature with None),
its layers on one or two logical CPU devices, trained for two SGD steps
(the update applied directly or under a tf.cond on finite gradients) in
a tf.function that returns the loss, the output and every gradient; in a
quarter of the cases each call runs the step twice inside a
tf.while_loop, as Keras' steps_per_execution does. One case in seven
(every case with --deep) ends in 30 or more pre-activation residual blocks
of its own width, where TensorFlow sums gradients in an order it decides as
it runs (sntf.graph.accumulations); the summary counts them. The
same case is built twice in this one process: once with sntf disabled (the
reference) and once with a random policy ("recompute", "swap",
"swap+recompute"), recompute_mode (speed, memory, auto), budget (none, tiny,
fractions, far beyond memory), swap_min_bytes and batch_size option. The
checks, per case:

  * the outputs, gradients and updated variables of both steps are
    bitwise identical (op determinism on), where no rewritten graph has
    sums TensorFlow adds in arrival order (Grappler's accumulators); where
    one has, sntf holds them to one order, and sntf.verify_graphs checks
    that graph against the one Grappler handed over, from the first step's
    values: its verdict must be "identical" or "identical_up_to_sum_order";
  * no sntf report is an error, and Grappler hands each graph to the pass
    at most twice (its meta-optimizer's iteration cap);
  * every graph the pass rewrote indexes cleanly (no missing inputs, no
    duplicate names) and is acyclic, keeps every fetch and preserve node
    (same op, device and attributes) and every original node, places each
    node sntf adds on the device of the tensor it serves with no new
    cross-device edge (sntf/testing/workers/train_distributed.py's
    check_placement), and is left alone by a second pass (idempotent).

--mode count (the default, the benchmark) runs every case and counts
failures; --mode strict stops at the first and lets hypothesis shrink it to
a minimal failing spec (what tests/test_fuzz.py uses). The last line is

    RESULT {"cases": ..., "failures": ..., "rewritten": ..., ...}

and a summary table precedes it. A step still running after --timeout
seconds is cancelled and its case fails as a hang. --replay runs one spec
(the JSON a failure prints). --inject_fault corrupts every rewritten graph (a reader of a
recomputed or swapped-in tensor reads its negation) to show that the checks
catch a wrong rewrite.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Optional

from sntf.testing.fuzz_cases import DEVICES, POLICIES, build, case_specs, inputs
from sntf.testing import fuzz_tally
from sntf.testing.fuzz_tally import Tally

# ----------------------------------------------------------------- checking


class Harness:
    """One process: sntf loaded once, the pass spied on, cases run in turn."""

    def __init__(self, inject_fault: bool = False, verify_all: bool = False):
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in DEVICES])
        tf.config.experimental.enable_op_determinism()
        import logging

        import sntf
        from sntf import passes

        # Budgets beyond memory warn on every enable(); the checks below read
        # the reports, not the log.
        logging.getLogger("sntf").setLevel(logging.ERROR)
        self.tf, self.sntf, self.passes = tf, sntf, passes
        self.inject_fault = inject_fault
        # Check every rewritten training graph with the verifier too, not
        # only those whose sums sntf holds to one order.
        self.verify_all = verify_all
        self.captured: list = []
        self._original_run_pass = passes.run_pass
        passes.run_pass = self._spy
        # Load the plugin now (policy "off"), then switch the pass off.
        sntf.enable(policy="off")
        sntf.disable()

    def _spy(self, graph_bytes, fetch, preserve, state, *args, **kwargs):
        """passes.run_pass as the plugin calls it, keeping what went in
        and out (and, with --inject-fault, corrupting what goes back)."""
        result = self._original_run_pass(graph_bytes, fetch, preserve, state,
                                         *args, **kwargs)
        if state.enabled:
            if self.inject_fault and result.graph_def is not None:
                _corrupt(result.graph_def)
            self.captured.append((graph_bytes, list(fetch), list(preserve), state,
                                  result))
        return result

    def _train(self, spec: dict) -> list:
        from tensorflow.python.eager import cancellation

        step, variables = build(spec, self.tf)
        concrete = step.get_concrete_function()
        # Cancellable, so that a deadlocked step (the watchdog cancels it)
        # fails that case instead of hanging the whole run.
        self.cancellation = cancellation.CancellationManager()
        call = self.cancellation.get_cancelable_function(concrete)
        outputs = []
        self.first_inputs = None
        for x in inputs(spec):
            if self.first_inputs is None:
                # Read only where the verifier needs them (verify()).
                self.first_inputs = (concrete, x, {id(v.handle): v.numpy() for v in variables})
            outputs += [t.numpy() for t in call(self.tf.constant(x))]
        return outputs + [v.numpy() for v in variables]

    def run_case(self, spec: dict, timeout: float = 120.0) -> dict:
        """Runs one case; returns {"problems": [...], ...counts}.

        A case that has not finished after `timeout` seconds is a hang (a
        deadlocked executor cannot be interrupted from Python): the spec is
        printed and the process exits with status 3."""
        import threading

        done = threading.Event()
        self.hung = False

        def watchdog():
            if done.wait(timeout):
                return
            # Cancel the step (its blocked Recv/ops then fail the case); if
            # that does not end it either, give up on the whole run.
            self.hung = True
            manager = getattr(self, "cancellation", None)
            if manager is not None:
                manager.start_cancel()
            if not done.wait(30.0):
                print(f"\nHUNG after {timeout:.0f} s: SPEC " + json.dumps(spec),
                      flush=True)
                print("RESULT " + json.dumps({"failures": 1, "hung": spec}), flush=True)
                os._exit(3)

        threading.Thread(target=watchdog, daemon=True).start()
        try:
            return self._run_case(spec)
        finally:
            done.set()

    def _run_case(self, spec: dict) -> dict:
        from sntf.runtime import plugin

        sntf = self.sntf
        outcome: dict[str, Any] = {"problems": [], "rewritten": False, "swapped": 0,
                                   "recomputed": 0, "rebuilt": 0, "cache_ops": False,
                                   "graphs": 0, "passed": []}
        sntf.disable()
        try:
            reference = self._train(spec)
        except Exception as e:  # noqa: BLE001 - TensorFlow's own failure, counted
            # A case TensorFlow alone cannot run says nothing about sntf:
            # Grappler's arithmetic optimizer breaks a conv case that splits
            # a softmax, with sntf never imported (docs/tensorflow.md).
            outcome["reference_error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"
            return outcome
        # min_gain 0: a case's plan is applied whatever it saves, so that a
        # small case tests a rewrite rather than the graph left unchanged.
        options = {"recompute_mode": spec["recompute_mode"],
                   "swap_min_bytes": spec["swap_min_bytes"], "min_gain": 0.0}
        if spec["batch_size_option"]:
            options["batch_size"] = spec["batch"]
        self.captured.clear()
        plugin.clear_reports()
        try:
            _enable(sntf, spec, options)
            try:
                got = self._train(spec)
            finally:
                sntf.disable()
        except Exception:  # noqa: BLE001 - a failure of the case, reported
            what = ("hung (the step was cancelled)" if self.hung
                    else "training with sntf raised")
            outcome["problems"].append(f"{what}:\n" + traceback.format_exc(limit=6))
            return outcome
        # Sums added in arrival order: TensorFlow's own step does not repeat
        # its bits there, so the verifier checks the contract instead.
        ordered = any(_holds_sums(c[4]) for c in self.captured)
        checked = [c for c in self.captured if _holds_sums(c[4]) or (
            self.verify_all and c[4].graph_def is not None and c[4].report.get("training"))]
        for graph_bytes, _, _, _, result in checked:
            outcome["problems"] += self.verify(graph_bytes, result.graph_def)
        outcome["ordered_sums"] = ordered
        outcome["verified"] = len(checked)
        if not ordered:
            outcome["problems"] += _bitwise(reference, got)
        for report in sntf.reports():
            if report["action"] == "error":
                outcome["problems"].append(f"error report: {report['reason']}")
            if report["invocations"] > 2:
                outcome["problems"].append(
                    f"graph {report['graph']!r} handed over {report['invocations']} times")
            if report["training"] and report["action"] != "rewritten":
                outcome["passed"].append(report["reason"])
        for graph_bytes, fetch, preserve, state, result in self.captured:
            outcome["graphs"] += 1
            if result.graph_def is None or result.report["action"] != "rewritten":
                continue
            outcome["rewritten"] = True
            outcome["swapped"] += len(result.report["swapped"] or ())
            outcome["recomputed"] += len(result.report["recomputed"] or ())
            outcome["rebuilt"] += rebuilt_count(result.report)
            outcome["cache_ops"] |= any(n.op.startswith("SnCache")
                                        for n in result.graph_def.node)
            outcome["problems"] += self.check_graph(graph_bytes, fetch, preserve, state,
                                                    result.graph_def)
        self.captured.clear()
        return outcome

    def verify(self, graph_bytes: bytes, rewritten) -> list[str]:
        """The verifier's verdict on a rewritten graph from the first step's
        values: a problem unless it is "identical" or
        "identical_up_to_sum_order"."""
        try:
            values = _step_inputs(*self.first_inputs)
            result = self.sntf.verify_graphs(graph_bytes, rewritten, values)
        except ValueError as e:
            return [f"sntf.verify_graphs refused the case's graphs: {e}"]
        if result.ok:
            return []
        return [f"sntf.verify_graphs: {result.verdict} at {result.first_op} "
                f"({result.first_op_type}):\n{result}"]

    def check_graph(self, graph_bytes: bytes, fetch: list, preserve: list, state,
                    rewritten) -> list[str]:
        """Structural checks of one rewritten graph."""
        from tensorflow.core.framework import graph_pb2

        from sntf import graph
        from sntf.graph import names
        from sntf.testing.workers import train_distributed

        problems = []
        original = graph_pb2.GraphDef.FromString(graph_bytes)
        before = graph.build_index(original, fetch, preserve)
        try:
            after = graph.build_index(rewritten, fetch, preserve)
        except graph.GraphError as e:
            return [f"rewritten graph does not index: {e}"]
        if after.has_cycles and not before.has_cycles:
            problems.append("rewritten graph has a cycle")
        new = {n.name: n for n in rewritten.node}
        for text in list(fetch) + list(preserve):
            name = graph.parse_input(text)[0]
            old = next((n for n in original.node if n.name == name), None)
            if old is None:
                continue
            kept = new.get(name)
            if kept is None:
                problems.append(f"fetch/preserve node {name!r} lost")
            elif (kept.op, kept.device) != (old.op, old.device) or \
                    dict(kept.attr) != dict(old.attr):
                problems.append(f"fetch/preserve node {name!r} changed")
        missing = [n.name for n in original.node if n.name not in new]
        if missing:
            problems.append(f"original nodes removed: {missing[:5]}")
        unmarked = [n.name for n in rewritten.node
                    if n.name not in before.index and not names.role_of(n)]
        if unmarked:
            problems.append(f"new nodes without the sntf marker: {unmarked[:5]}")
        placement = train_distributed.check_placement(original, rewritten)
        for key in ("served_mismatch", "input_crossing", "trigger_crossing",
                    "unknown_source", "collectives_changed", "collectives_generated"):
            if placement[key]:
                problems.append(f"placement {key}: {placement[key][:3]}")
        again = self._original_run_pass(rewritten.SerializeToString(), fetch, preserve,
                                        state, None)
        if again.graph_def is not None or again.report["action"] == "error":
            problems.append(f"second pass not idempotent: {again.report['action']} "
                            f"({again.report['reason']})")
        return problems


def _bitwise(reference: list, got: list) -> list[str]:
    """The problem, if any, with two runs' results not bit for bit alike."""
    if len(got) != len(reference):
        return [f"{len(got)} results, expected {len(reference)}"]
    for n, (a, b) in enumerate(zip(reference, got)):
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            return [f"result {n} differs (dtype {a.dtype}/{b.dtype}, shape "
                    f"{a.shape}/{b.shape})"]
    return []


def _holds_sums(result) -> bool:
    """Whether the pass handed back a training graph whose accumulators'
    additions it chained in one order."""
    sums = result.report.get("order_dependent_sums") or {}
    return (result.graph_def is not None and bool(result.report.get("training"))
            and bool(sums.get("accumulations")))


def _step_inputs(concrete, x, before: dict) -> dict:
    """_Arg index -> value of a case's step before it runs on `x`: the data
    argument, then each captured input's value (a variable's from `before`,
    handle id -> value), as sntf.verify builds them.

    Raises:
      ValueError: a captured resource that is none of the case's variables.
    """
    n_data = len(concrete.inputs) - len(concrete.captured_inputs)
    values = {0: x}
    for k, t in enumerate(concrete.captured_inputs):
        if id(t) in before:
            values[n_data + k] = before[id(t)]
        elif t.dtype.is_numpy_compatible:
            values[n_data + k] = t.numpy()
        else:
            raise ValueError(f"the step captures {t!r}, which is none of the case's "
                             "variables")
    return values


def rebuilt_count(report: dict) -> int:
    """How many backward tensors a report's plan rebuilds (planner.rebuild)."""
    from sntf.planner import rebuild

    return sum(1 for d in (report.get("plan") or {}).get("decisions", ())
               if rebuild.is_rebuild(d))


def _enable(sntf, spec: dict, options: dict) -> None:
    """Enables sntf as a case says. Byte budgets below what enable() accepts
    (the cases' graphs are small) go into the switch state directly, so that
    the planner's budget paths run on small graphs too."""
    import dataclasses

    from sntf import config

    budget = spec["budget"]
    small = isinstance(budget, int) and budget < (1 << 20)
    sntf.enable(policy=spec["policy"], budget=None if small else budget, **options)
    if small:
        config.set_state(dataclasses.replace(config.current(),
                                             budget=config.Budget(bytes=budget)))


def _corrupt(graph_def) -> None:
    """A deliberate wrong rewrite (for --inject-fault): the first reader of a
    tensor sntf recomputed or swapped in gets its negation instead (a Neg
    node in between), or, where no such edge has a dtype to go by, the last
    AddV2 becomes a Sub."""
    from tensorflow.core.framework import types_pb2

    from sntf import graph
    from sntf.graph import names

    floats = {types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE, types_pb2.DT_HALF,
              types_pb2.DT_BFLOAT16}
    generated = {n.name: n for n in graph_def.node if names.role_of(n)}
    for node in graph_def.node:
        if node.name in generated:
            continue
        for slot, text in enumerate(node.input):
            source = graph.parse_input(text)[0]
            # Values only: a negated integer may be a shape, and a negative
            # dimension aborts the process (a CHECK in oneDNN's conv backprop).
            if text.startswith("^") or source not in generated \
                    or "T" not in generated[source].attr \
                    or generated[source].attr["T"].type not in floats:
                continue
            neg = graph_def.node.add()
            neg.name, neg.op, neg.device = "fuzz_fault/neg", "Neg", node.device
            neg.input.append(text)
            neg.attr["T"].CopyFrom(generated[source].attr["T"])
            # Marked as sntf's own, so that only the values can give it away
            # (an unmarked node fails the structural checks first).
            neg.attr[names.MARKER_ATTR].CopyFrom(generated[source].attr[names.MARKER_ATTR])
            node.input[slot] = neg.name
            return
    for node in reversed(graph_def.node):
        if node.op == "AddV2" and node.attr["T"].type in floats:
            node.op = "Sub"
            return


# ------------------------------------------------------------------ running


def run(cases: int, seed: int, policies=POLICIES, mode: str = "count",
        inject_fault: bool = False, progress: bool = True,
        timeout: float = 120.0, deep: bool = False, verify_all: bool = False) -> Tally:
    """Runs `cases` hypothesis-generated cases in this process."""
    import hypothesis
    from hypothesis import HealthCheck, Phase, given, settings

    harness = Harness(inject_fault=inject_fault, verify_all=verify_all)
    tally = Tally()
    phases = (Phase.generate,) if mode == "count" else (Phase.generate, Phase.shrink)

    @settings(max_examples=cases, deadline=None, database=None, phases=phases,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(case_specs(policies, deep))
    def fuzz(spec):
        start = time.perf_counter()
        outcome = harness.run_case(spec, timeout=timeout)
        tally.add(spec, outcome, time.perf_counter() - start)
        if progress and tally.cases % 50 == 0:
            print(f"[{tally.cases} cases, {tally.counts['rewritten']} rewritten, "
                  f"{tally.counts['failures']} failures, {tally.seconds:.0f} s]",
                  flush=True)
        if outcome["problems"] and mode == "strict":
            raise AssertionError("sntf fuzz failure\nSPEC " + json.dumps(spec) + "\n"
                                 + "\n".join(outcome["problems"]))

    hypothesis.seed(seed)(fuzz)()
    return tally


def main(argv: Optional[list[str]] = None) -> int:
    """Command-line entry point; returns the exit status."""
    from absl import flags

    fv = flags.FlagValues()
    flags.DEFINE_integer("cases", 1000, "cases to run", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "hypothesis seed", flag_values=fv)
    flags.DEFINE_enum("mode", "count", ["count", "strict"],
                      "count failures, or stop and shrink at the first", flag_values=fv)
    flags.DEFINE_string("policies", ",".join(POLICIES), "policies cases draw from",
                        flag_values=fv)
    flags.DEFINE_string("replay", None, "one spec (JSON) to run", flag_values=fv)
    flags.DEFINE_bool("inject_fault", False, "corrupt every rewritten graph",
                      flag_values=fv)
    flags.DEFINE_bool("quiet", False, "no progress lines", flag_values=fv)
    flags.DEFINE_bool("deep", False, "every case ends in 30 or more residual blocks",
                      flag_values=fv)
    flags.DEFINE_float("timeout", 120.0, "seconds before a case counts as hung (exit 3)",
                       flag_values=fv)
    flags.DEFINE_bool("verify_all", False, "check every rewritten training graph with "
                      "sntf.verify_graphs too", flag_values=fv)
    flags.DEFINE_string("results", None, "append the run's totals as a JSON line to this "
                        "file (benchmarks/results/fuzz.jsonl: one row per shard)",
                        flag_values=fv)
    flags.DEFINE_string("totals", None, "print the totals of a --results file's shards "
                        "and exit", flag_values=fv)
    fv(list(sys.argv if argv is None else argv))
    if fv.totals:
        print(fuzz_tally.shard_totals(fv.totals))
        return 0
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    start = time.perf_counter()
    if fv.replay:
        harness = Harness(inject_fault=fv.inject_fault, verify_all=fv.verify_all)
        outcome = harness.run_case(json.loads(fv.replay), timeout=fv.timeout)
        print("RESULT " + json.dumps(outcome, default=str))
        return 1 if outcome["problems"] else 0
    policies = tuple(p for p in fv.policies.split(",") if p)
    try:
        tally = run(fv.cases, fv.seed, policies, fv.mode, fv.inject_fault,
                    progress=not fv.quiet, timeout=fv.timeout, deep=fv.deep,
                    verify_all=fv.verify_all)
        failed = None
    except Exception as e:  # noqa: BLE001 - strict mode: hypothesis re-raises
        tally, failed = None, e
    return fuzz_tally.report(tally, failed, fv, policies, time.perf_counter() - start)


if __name__ == "__main__":
    sys.exit(main())
