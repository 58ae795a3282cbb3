"""The zoo benchmark: sntf's policies on architectures it was not tuned on.

    python benchmarks/bench_zoo.py [--models preact_resnet,gpt,...]
                                   [--settings user,lab] [--repeats 3] [--steps 3]
                                   [--configs recompute,swap+recompute,auto@0.5,
                                              swap+recompute:free]
                                   [--out BENCHMARKS_zoo.md]

For every architecture of sntf.testing.zoo (or --models) and every setting
(user: oneDNN on and TensorFlow's default inter-op pool, as users run; lab:
oneDNN off and one inter-op thread), it trains `steps` steps in fresh
processes (sntf/testing/workers/measure_peak.py), `repeats` times each:

  TensorFlow        the unchanged model, sntf never imported
  recompute         policy "recompute"
  swap+recompute    policy "swap+recompute"
  auto@F            policy "auto" with a budget of F x TensorFlow's median peak
  CONFIG:free       the same with the option pin_order=False (the executor
                    free to reorder the planned allocations)

and tabulates, per configuration: the CPU:0 allocator peak (min-max over the
repeats); the worst run's peak over TensorFlow's best (a ratio above 1 means
some run was above TensorFlow's); the median peak over the lower bound of
the training graph, and the same for the steps after the first (the first
step's peak also holds what a growing allocator wastes while it makes its
regions); the median step time over TensorFlow's; the planned peak
(with the tensor cache's, under a budget) plus what the device held outside
the graph when it was planned, over the median measured one; and
whether every run trained identically to TensorFlow (same losses and weight
digest). Progress goes to stdout; the
table and the command go to --out.
"""

from __future__ import annotations

import os
import shlex
import statistics
import sys
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from sntf.testing import zoo  # noqa: E402
from sntf.testing.workers import measure_peak  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("models", list(zoo.NAMES), "zoo architectures")
flags.DEFINE_list("settings", ["user", "lab"], "user and/or lab")
flags.DEFINE_list("configs", ["recompute", "swap+recompute", "auto@0.5"],
                  "sntf configurations: a policy, or auto@FRACTION; a suffix "
                  "':free' runs it with pin_order=False")
flags.DEFINE_integer("repeats", 3, "fresh processes per configuration")
flags.DEFINE_integer("steps", 3, "training steps per run")
flags.DEFINE_integer("timeout", 1800, "seconds per run")
flags.DEFINE_string("out", None, "markdown file for the table")

MIB = float(1 << 20)


def _runs(model: str, settings: str, policy: str, budget=None,
          pin_order: bool = True) -> list:
    runs = []
    for _ in range(FLAGS.repeats):
        try:
            runs.append(measure_peak.measure(
                f"zoo:{model}", zoo.default_batch(model), steps=FLAGS.steps,
                policy=policy, budget=budget, settings=settings,
                timeout=FLAGS.timeout, pin_order=pin_order))
        except Exception as e:  # noqa: BLE001 - a failed run is a table row
            runs.append({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
    return runs


def _peaks(runs: list) -> list:
    return [r["measured_peak_bytes"] for r in runs if "error" not in r]


def _budget_cell(runs: list, budget) -> str:
    """Worst measured peak over the budget, and whether the reports said the
    plan fits it (the target: at most 1.05 wherever they say it fits)."""
    if budget is None:
        return ""
    planned = [t.get("budget_fits") for r in runs for t in (r["training_reports"] or [])
               if t.get("budget_bytes")]
    # No report with a budget (the pass failed, or nothing was planned):
    # nothing was said to fit.
    fits = bool(planned) and all(planned)
    return f"{max(_peaks(runs)) / budget:.2f} ({'fits' if fits else 'best effort'})"


def _row(model: str, settings: str, label: str, runs: list, base: list,
         budget=None) -> str:
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return f"| {model} | {settings} | {label} | failed: {errors[0]} | | | | | | | |"
    peaks, base_peaks = _peaks(runs), _peaks(base)
    median = statistics.median(peaks)
    span = f"{min(peaks) / MIB:.1f}-{max(peaks) / MIB:.1f}"
    if label == "TensorFlow":
        step = statistics.median(r["seconds_per_step"] for r in runs)
        return (f"| {model} | {settings} | {label} | {span} | | | | {step:.3f} s | | | |")
    worst = max(peaks) / min(base_peaks)
    lower = [r["lower_bound_bytes"] for r in runs if r.get("lower_bound_bytes")]
    # Under a budget the tensor cache keeps swapped tensors in the plan's
    # headroom; its prediction counts them (cached_peak_bytes). The device
    # measures what it holds outside the graph too (a dataset's tensors),
    # which the plan's peak leaves out.
    planned = [(r.get("cached_peak_bytes") or r["planned_peak_bytes"])
               + (r.get("outside_bytes") or 0) for r in runs if r.get("planned_peak_bytes")]
    # Each run's peak over its steps after the first.
    later = [max(r["own_step_peaks_bytes"][1:]) for r in runs
             if len(r.get("own_step_peaks_bytes") or ()) > 1]
    later_cell = f"{statistics.median(later) / statistics.median(lower):.2f}" if later else ""
    steps = statistics.median(r["seconds_per_step"] for r in runs)
    base_step = statistics.median(r["seconds_per_step"] for r in base)
    same = all(r["losses"] == base[0]["losses"]
               and r["weights_sha256"] == base[0]["weights_sha256"] for r in runs)
    actions = {t["action"] for r in runs for t in (r["training_reports"] or [])}
    return (f"| {model} | {settings} | {label} | {span} | {worst:.2f} | "
            f"{median / statistics.median(lower):.2f} | {later_cell} | {steps / base_step:.2f} | "
            f"{(statistics.median(planned) / median) if planned else float('nan'):.2f} | "
            f"{_budget_cell(runs, budget)} | "
            f"{'yes' if same else 'NO'} ({'/'.join(sorted(actions))}) |")


def _config(text: str, base_median: float) -> tuple:
    """(policy, budget or None, pin_order) of a --configs entry."""
    text, _, suffix = text.partition(":")
    if suffix not in ("", "free"):
        raise app.UsageError(f"--configs: unknown suffix {suffix!r} (accepted: ':free')")
    if "@" in text:
        policy, fraction = text.split("@")
        return policy, int(float(fraction) * base_median), not suffix
    return text, None, not suffix


def main(argv) -> int:
    """absl entry point: runs every configuration, prints the table."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    start = time.perf_counter()
    rows = ["| model | settings | configuration | peak MiB (min-max) | worst / TF best "
            "| / lower bound | after step 1 / lower bound | step time / TF "
            "| planned / measured | worst / budget | identical |",
            "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for model in FLAGS.models:
        for settings in FLAGS.settings:
            base = _runs(model, settings, "none")
            print(rows.append(_row(model, settings, "TensorFlow", base, base))
                  or rows[-1], flush=True)
            if not _peaks(base):
                continue
            for text in FLAGS.configs:
                policy, budget, pin = _config(text, statistics.median(_peaks(base)))
                runs = _runs(model, settings, policy, budget, pin)
                print(rows.append(_row(model, settings, text, runs, base, budget))
                      or rows[-1], flush=True)
    command = "python benchmarks/bench_zoo.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:])
    text = "\n".join(rows) + (f"\n\nProduced by `{command}` "
                              f"({time.perf_counter() - start:.0f} s).\n")
    print("\n" + text)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    app.run(main)
