"""Policy "auto" down a ladder of budgets, on every zoo model.

    python benchmarks/budget_ladder.py [--models preact_resnet,gpt,...]
                                       [--fractions 0.9,0.8,0.7,0.6,0.5,0.4,0.3]
                                       [--repeats 3] [--steps 3] [--max_minutes 20]
                                       [--results benchmarks/results/budget_ladder.jsonl]
    python benchmarks/budget_ladder.py --table [--results ...]

At the user's defaults (oneDNN on, TensorFlow's default inter-op pool),
each model at its default batch trains `steps` steps in fresh processes
(sntf/testing/workers/measure_peak.py, settings "user"):

  tf           TensorFlow alone, `repeats` runs: its median measured peak
               sets the budgets
  POLICY       swap, recompute and swap+recompute, one run each, for the
               plan each makes of the graph (its planned peak)
  auto@F       policy "auto" with a budget of F x TensorFlow's median peak,
               `repeats` runs

One JSON row per run goes to the results file as it finishes; a run
resumes where the file stops (a row already there is not run again), and
no process starts after --max_minutes, so the sweep goes in shards.

--table prints, per model and budget: auto's planned peak against the
lowest policy's, the measured peaks (min-max) and the worst over the
budget, what the report said (fits, or the fit code), and three checks:
  lowest  where the budget is not met, auto plans no higher than the
          lowest policy's plan, compared between runs where the device
          held the same bytes outside the graph (within SAME_OUTSIDE, and
          allowing for the difference) when the plan was made: a plan's
          peak is modelled on top of them, and whether a dataset's tensor
          is on the device then varies by run ("n/a" where no run matches)
  planned auto's planned peak does not rise as the budget falls: each run
          against every run at a budget above it, between runs where the
          device held the same bytes outside the graph, as for "lowest"
  falls   the median measured peak does not rise as the budget falls,
          beyond the spread of the runs at the budget above
  1.05    where the report says the plan fits, the worst run is at most
          1.05 x the budget
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from sntf.testing import results  # noqa: E402
RESULTS = os.path.join(REPO, "benchmarks", "results", "budget_ladder.jsonl")
MIB = float(1 << 20)
SAME_OUTSIDE = 64 << 10
POLICIES = ("swap", "recompute", "swap+recompute")
FRACTIONS = ("0.9", "0.8", "0.7", "0.6", "0.5", "0.4", "0.3")

FLAGS = flags.FLAGS


def _define_flags() -> None:
    flags.DEFINE_list("models", [], "zoo architectures (default: all)")
    flags.DEFINE_list("fractions", list(FRACTIONS), "budgets, fractions of TensorFlow's peak")
    flags.DEFINE_integer("repeats", 3, "fresh processes for TensorFlow and per budget")
    flags.DEFINE_integer("steps", 3, "training steps per run")
    flags.DEFINE_integer("timeout", 1200, "seconds per run")
    flags.DEFINE_float("max_minutes", 20.0, "start no process after this long")
    flags.DEFINE_string("results", RESULTS, "JSON-lines results file (appended)")
    flags.DEFINE_bool("table", False, "print the table from the results file and exit")


def _measure(model: str, policy: str, budget=None) -> dict:
    """One fresh process's run, as a results row's measured part."""
    from sntf.testing import zoo
    from sntf.testing.workers import measure_peak

    try:
        r = measure_peak.measure(f"zoo:{model}", zoo.default_batch(model),
                                 steps=FLAGS.steps, policy=policy, budget=budget,
                                 settings="user", timeout=FLAGS.timeout)
    except Exception as e:  # noqa: BLE001 - a failed run is a row
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    reports = [t for t in (r.get("training_reports") or []) if t.get("budget_bytes")]
    last = reports[-1] if reports else {}
    return {"measured_peak": r["measured_peak_bytes"],
            "planned_peak": r.get("planned_peak_bytes"),
            "cached_peak": r.get("cached_peak_bytes"),
            "outside": r.get("outside_bytes"),
            "budget_fits": last.get("budget_fits"), "fit": last.get("fit"),
            "target": last.get("budget_target_bytes"),
            "achievable": last.get("achievable_peak_bytes"),
            "losses": r.get("losses"), "weights": r.get("weights_sha256")}


def _todo(model: str, rows: list) -> list:
    """(config, fraction, repeat) runs of one model not in the results yet,
    TensorFlow's first (its peak sets the budgets)."""
    have = {(r["config"], r["repeat"]) for r in rows if r["model"] == model
            and "error" not in r}
    runs = [("tf", None, k) for k in range(FLAGS.repeats)]
    runs += [(p, None, 0) for p in POLICIES]
    runs += [(f"auto@{f}", float(f), k) for f in FLAGS.fractions
             for k in range(FLAGS.repeats)]
    return [r for r in runs if (r[0], r[2]) not in have]


def _tf_peak(model: str, rows: list):
    peaks = [r["measured_peak"] for r in rows if r["model"] == model
             and r["config"] == "tf" and "error" not in r]
    return int(statistics.median(peaks)) if len(peaks) >= FLAGS.repeats else None


def sweep() -> int:
    from sntf.testing import zoo

    start = time.time()
    os.makedirs(os.path.dirname(FLAGS.results), exist_ok=True)
    for model in FLAGS.models or list(zoo.NAMES):
        for config, fraction, repeat in _todo(model, results.load(FLAGS.results)):
            if time.time() - start > FLAGS.max_minutes * 60:
                print("max_minutes reached; resume to go on", flush=True)
                return 0
            budget = None
            if fraction is not None:
                tf_peak = _tf_peak(model, results.load(FLAGS.results))
                if tf_peak is None:
                    print(f"{model}: TensorFlow's peak unknown; skipped", flush=True)
                    break
                budget = int(fraction * tf_peak)
            policy = {"tf": "none"}.get(config, "auto" if fraction else config)
            row = {"model": model, "config": config, "fraction": fraction,
                   "repeat": repeat, "budget": budget, **_measure(model, policy, budget)}
            with open(FLAGS.results, "a") as f:
                f.write(json.dumps(row) + "\n")
            peak = row.get("measured_peak")
            print(f"{model} {config} #{repeat}: "
                  + (f"{peak / MIB:.1f} MiB" if peak else row.get("error", "")), flush=True)
    return 0


def _apart(run: dict, other: dict) -> int:
    """The difference between the bytes two runs' devices held outside the
    graph when their plans were made."""
    return abs((run.get("outside") or 0) - (other.get("outside") or 0))


def _mib(value) -> str:
    return "" if value is None else f"{value / MIB:.1f}"


def table(rows: list) -> str:
    """The markdown table and totals of the results file's rows."""
    lines = ["| model | budget | MiB | auto planned | lowest policy planned | "
             "measured min-max | worst / budget | report | lowest | planned | falls | 1.05 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | --- | --- |"]
    failed = {"lowest": 0, "planned": 0, "falls": 0, "1.05": 0}
    checked = dict.fromkeys(failed, 0)
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and "error" not in r]
        plans = [r for r in mine if r["config"] in POLICIES and r.get("planned_peak")]
        best = min(plans, key=lambda r: r["planned_peak"]) if plans else None
        lowest = best["planned_peak"] if best else None
        above = None     # (median, spread) at the budget above
        higher = []      # the runs at every budget above
        for fraction in sorted({r["fraction"] for r in mine if r["fraction"]}, reverse=True):
            runs = [r for r in mine if r["fraction"] == fraction]
            peaks = [r["measured_peak"] for r in runs]
            budget = runs[0]["budget"]
            planned = statistics.median(r["planned_peak"] for r in runs
                                        if r.get("planned_peak") is not None)
            fits = [r.get("budget_fits") for r in runs]
            said = "fits" if all(fits) else (runs[0].get("fit") or "no")
            cells = {}
            lowest_cell = ""
            if not all(fits) and best is not None:
                apart = {id(r): _apart(r, best) for r in runs}
                same = [r for r in runs if r.get("planned_peak") is not None
                        and apart[id(r)] <= SAME_OUTSIDE]
                if same:
                    # Bytes held outside shift the modelled peak by as much.
                    cells["lowest"] = all(r["planned_peak"] <= lowest + apart[id(r)]
                                          for r in same)
                else:
                    lowest_cell = "n/a"
            median = statistics.median(peaks)
            planned_cell = ""
            if above is not None:
                pairs = [(r, h) for r in runs for h in higher
                         if r.get("planned_peak") is not None
                         and h.get("planned_peak") is not None
                         and _apart(r, h) <= SAME_OUTSIDE]
                if pairs:
                    cells["planned"] = all(r["planned_peak"] <= h["planned_peak"] + _apart(r, h)
                                           for r, h in pairs)
                else:
                    planned_cell = "n/a"
                cells["falls"] = median <= above[0] + above[1]
            above = (median, max(peaks) - min(peaks))
            higher += runs
            if all(fits):
                cells["1.05"] = max(peaks) <= 1.05 * budget
            for key, ok in cells.items():
                checked[key] += 1
                failed[key] += not ok
            marks = [("yes" if cells[k] else "**no**") if k in cells else ""
                     for k in ("lowest", "planned", "falls", "1.05")]
            marks[0] = marks[0] or lowest_cell
            marks[1] = marks[1] or planned_cell
            lines.append(f"| {model} | {fraction:g} | {_mib(budget)} | {_mib(planned)} | "
                         f"{_mib(lowest)} | {_mib(min(peaks))}-{_mib(max(peaks))} | "
                         f"{max(peaks) / budget:.2f} | {said} | " + " | ".join(marks) + " |")
    errors = sum("error" in r for r in rows)
    lines.append("")
    lines.append(f"{len(rows)} runs, {errors} failed. Checks that hold: " + ", ".join(
        f"{k} {checked[k] - failed[k]} of {checked[k]}" for k in checked) + ".")
    return "\n".join(lines)


def main(argv) -> int:
    del argv
    return results.table_or_sweep(FLAGS.table, FLAGS.results, table, sweep)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
