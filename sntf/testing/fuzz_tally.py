"""What a fuzz run counts: per case, what was drawn and what the pass did
with it, so that a run which never reaches a shape of network cannot pass
for one that tested it (sntf.testing.fuzz); the run's table, its RESULT
line, and the totals of a results file's shards."""

from __future__ import annotations

import collections
import json
import os

from sntf.testing.fuzz_cases import DEEP_BLOCKS


class Tally:
    """Counts over a run."""

    def __init__(self):
        self.cases = 0
        self.counts = collections.Counter()
        self.passed = collections.Counter()
        self.failures: list = []
        self.examples: dict = {}
        self.seconds = 0.0

    def add(self, spec: dict, outcome: dict, seconds: float) -> None:
        self.cases += 1
        self.seconds += seconds
        c = self.counts
        c["graphs_checked"] += outcome["graphs"]
        if outcome.get("reference_error"):
            c["TensorFlow alone failed"] += 1
            self.examples.setdefault("TensorFlow alone failed", spec)
        c[f"policy {spec['policy']}"] += 1
        c[f"drawn, {DEEP_BLOCKS}+ residual blocks"] += spec.get("residual_blocks", 0) >= DEEP_BLOCKS
        if outcome["rewritten"] and spec["two_devices"]:
            self.examples.setdefault("rewritten, two devices", spec)   # to replay
        if outcome["rewritten"]:
            c["rewritten"] += 1
            c[f"rewritten, policy {spec['policy']}"] += 1
            c["rewritten, unknown batch"] += spec["unknown_batch"]
            c["rewritten, two devices"] += spec["two_devices"]
            c["rewritten, with budget"] += spec["budget"] is not None
            c["rewritten, update under tf.cond"] += bool(spec.get("guarded_update"))
            ops = {layer["op"] for layer in spec["layers"]}
            acts = {layer.get("act") for layer in spec["layers"]}
            c["rewritten, tf.cond layer"] += "cond" in ops
            c["rewritten, step in a loop"] += bool(spec.get("loop"))
            # The shapes of the zoo's networks, each counted where it was
            # rewritten: a run that never rewrites one has not tested it.
            for op in ("gate", "layernorm", "softmax", "tied", "deconv", "causal"):
                c[f"rewritten, {op}"] += op in ops
            c["rewritten, gelu or swish"] += bool(acts & {"gelu", "swish"})
            c[f"rewritten, {DEEP_BLOCKS}+ residual blocks"] += (
                spec.get("residual_blocks", 0) >= DEEP_BLOCKS)
            # Held to one order and checked by the verifier, not bitwise.
            c["rewritten, accumulators held in one order (verified)"] += bool(
                outcome.get("ordered_sums"))
        c["with swaps"] += outcome["swapped"] > 0
        c["with recomputations"] += outcome["recomputed"] > 0
        c["with backward rebuilds"] += outcome["rebuilt"] > 0
        c["with cache ops"] += outcome["cache_ops"]
        c["tensors swapped"] += outcome["swapped"]
        c["tensors recomputed"] += outcome["recomputed"]
        for reason in outcome["passed"]:
            self.passed[_reason_kind(reason)] += 1
        if outcome["problems"]:
            c["failures"] += 1
            if len(self.failures) < 10:
                self.failures.append({"spec": spec, "problems": outcome["problems"]})

    def summary(self) -> dict:
        return {"cases": self.cases, "failures": self.counts["failures"],
                "rewritten": self.counts["rewritten"], "counts": dict(self.counts),
                "passed_through": dict(self.passed), "seconds": self.seconds,
                "failed_specs": self.failures, "examples": self.examples}


def _reason_kind(reason: str) -> str:
    """A training report's reason without the graph-specific part."""
    tail = reason.split("); ", 1)[-1]
    # Most specific first: a step in a loop carries "planned within it"
    # beside the reason nothing was done.
    for word in ("would not fall", "nothing to recompute", "already rewritten",
                 "0 tensor(s)", "plan crosses devices", "deferred to Grappler",
                 "control flow present", "planned within it"):
        if word in tail:
            return word
    return tail[:60]


# ---------------------------------------------------------------- reporting
def table(summary: dict, wall: float) -> str:
    """A markdown summary of a run."""
    c = summary["counts"]
    cases = max(summary["cases"], 1)
    rows = [("cases", summary["cases"]), ("failures", summary["failures"]),
            ("rewritten", f"{summary['rewritten']} ({summary['rewritten'] / cases:.0%})")]
    rows += [(k, v) for k, v in sorted(c.items())
             if k not in ("failures", "rewritten")]
    rows += [(f"passed through: {k}", v) for k, v in
             sorted(summary["passed_through"].items(), key=lambda kv: -kv[1])]
    rows += [("seconds in cases", f"{summary['seconds']:.1f}"),
             ("seconds per case", f"{summary['seconds'] / cases:.3f}"),
             ("wall seconds", f"{wall:.1f}")]
    return "\n".join(["| | |", "| --- | ---: |"] + [f"| {k} | {v} |" for k, v in rows])


def shard_totals(path: str) -> str:
    """The markdown totals of the shards a --results file holds.

    Args:
      path: the JSON-lines file.

    Returns:
      A table: one row per shard (seed, cases, failures, rewritten, graphs
      whose sums the verifier checked) and the totals.
    """
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    lines = ["| seed | deep | cases | failures | rewritten | accumulators verified | seconds |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    total = collections.Counter()
    for r in rows:
        verified = r["counts"].get("rewritten, accumulators held in one order (verified)", 0)
        lines.append(f"| {r['seed']} | {'yes' if r['deep'] else 'no'} | {r['cases']} | "
                     f"{r['failures']} | {r['rewritten']} | {verified} | "
                     f"{r['wall_seconds']:.0f} |")
        total.update(cases=r["cases"], failures=r["failures"], rewritten=r["rewritten"],
                     verified=verified)
    lines.append(f"| total | | {total['cases']} | {total['failures']} | {total['rewritten']} "
                 f"| {total['verified']} | |")
    return "\n".join(lines)


def report(tally, failed, fv, policies, wall: float) -> int:
    """Prints the run's table and RESULT line; returns the exit status."""
    if failed is not None:
        print(f"FAILED: {failed}", flush=True)
        print("RESULT " + json.dumps({"failures": 1, "error": str(failed)[-4000:]}))
        return 1
    summary = tally.summary()
    print(f"\nsntf fuzz: {fv.cases} cases, seed {fv.seed}, policies "
          f"{','.join(policies)}, mode {fv.mode}\n")
    print(table(summary, wall))
    for entry in summary["failed_specs"]:
        print("\nFAILED SPEC " + json.dumps(entry["spec"]))
        for problem in entry["problems"]:
            # A traceback's last line says what went wrong.
            print("  " + problem.strip().splitlines()[-1])
    summary["wall_seconds"] = wall
    print("RESULT " + json.dumps(summary), flush=True)
    if fv.results:
        # One row per shard: a long run goes in shards of fresh seeds.
        row = {"seed": fv.seed, "cases": summary["cases"], "failures": summary["failures"],
               "deep": fv.deep, "mode": fv.mode, "policies": list(policies),
               "rewritten": summary["rewritten"], "counts": summary["counts"],
               "failed_specs": summary["failed_specs"], "wall_seconds": wall}
        os.makedirs(os.path.dirname(os.path.abspath(fv.results)), exist_ok=True)
        with open(fv.results, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 1 if summary["failures"] else 0
