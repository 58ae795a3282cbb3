"""A budget under a hard limit: does a plan that says it fits train?

    .venv/bin/python benchmarks/bench_hard_budget.py --model allconv_swish \\
        --limits 28,30,32,34 [--repeats 2] [--steps 3] [--out table.md]

For one architecture of sntf.testing.zoo, at the user's settings (oneDNN on,
the default inter-op pool): TensorFlow alone without a limit gives the
reference weights; then, for each limit L (MiB), `sntf.enable(policy="auto",
budget=L MiB)` runs `repeats` times under a hard limit of L MiB
(TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=L), each in a fresh
process (sntf.testing.workers.measure_peak). A run either trains or raises
ResourceExhaustedError; either way the table gives what the report claimed
(`budget_fits`, read from the reports even when the step failed) and the
planned peak. The property checked: every run whose report says the plan
fits trains.
"""

import json
import os
import re
import sys
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from sntf.testing import zoo  # noqa: E402
from sntf.testing.workers import measure_peak  # noqa: E402

MIB = 2**20

flags.DEFINE_string("model", "allconv_swish", "a sntf.testing.zoo architecture")
flags.DEFINE_list("limits", ["28", "30", "32", "34"], "hard limits in MiB (the budget too)")
flags.DEFINE_integer("repeats", 2, "runs per limit", lower_bound=1)
flags.DEFINE_integer("steps", 3, "training steps per run", lower_bound=1)
flags.DEFINE_string("out", None, "markdown file for the table")
FLAGS = flags.FLAGS


def _run(limit_mib=None, budget=None):
    """One fresh process: the result dict, or {"oom": reports or None}."""
    policy = "none" if budget is None else "auto"
    try:
        return measure_peak.measure(f"zoo:{FLAGS.model}", zoo.default_batch(FLAGS.model),
                                    steps=FLAGS.steps, policy=policy, budget=budget,
                                    settings="user", limit_mib=limit_mib, timeout=900)
    except RuntimeError as e:
        if "ResourceExhausted" not in str(e) and "OOM when" not in str(e):
            raise
        found = re.search(r"SNTF_REPORTS (.*)", str(e))
        return {"oom": json.loads(found.group(1)) if found else None}


def _claim(fields) -> tuple:
    """(budget_fits, planned MiB) of the last training report."""
    if not fields or not fields.get("training_reports"):
        return None, None
    report = fields["training_reports"][-1]
    planned = fields.get("planned_peak_bytes")
    return report.get("budget_fits"), planned / MIB if planned else None


def main(argv):
    del argv
    start = time.time()
    base = _run()
    rows, broken = [], 0
    for limit in FLAGS.limits:
        for k in range(FLAGS.repeats):
            result = _run(int(limit), int(float(limit) * MIB))
            fits, planned = _claim(result.get("oom", result))
            trains = "oom" not in result
            broken += bool(fits) and not trains
            peak = f"{result['measured_peak_bytes'] / MIB:.1f}" if trains else ""
            same = (result["weights_sha256"] == base["weights_sha256"]) if trains else ""
            rows.append(f"| {limit} MiB | {k + 1} | {'trains' if trains else 'OOM'} | {peak} | "
                        f"{fits} | {'' if planned is None else f'{planned:.1f}'} | "
                        f"{'' if same == '' else ('yes' if same else 'NO')} |")
            print(rows[-1], flush=True)
    table = "\n".join([
        f"{FLAGS.model}, batch {zoo.default_batch(FLAGS.model)}, {FLAGS.steps} steps; "
        f"TensorFlow alone without a limit: {base['measured_peak_bytes'] / MIB:.1f} MiB",
        "",
        "| limit = budget | run | outcome | peak (MiB) | report: fits | planned (MiB) | identical |",
        "| --- | ---: | --- | ---: | --- | ---: | --- |",
        *rows, "",
        f"Runs whose report said the plan fits and that ran out of memory: {broken}. "
        f"{time.time() - start:.0f} s."])
    print(table)
    if FLAGS.out:
        with open(FLAGS.out, "w", encoding="utf-8") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    app.run(main)
