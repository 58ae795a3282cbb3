"""The zoo under the verifier: does every policy keep TensorFlow's bits?

    python benchmarks/zoo_verify.py [--models preact_resnet,gpt,...]
                                    [--onednn 1,0]
                                    [--policies swap,recompute,swap+recompute]
                                    [--max_minutes 20]
                                    [--results benchmarks/results/zoo_verify.jsonl]
    python benchmarks/zoo_verify.py --table [--results ...]

For every architecture of sntf.testing.zoo and oneDNN setting, one fresh
process builds the model at its default batch (op determinism on, one
inter-op thread) and runs sntf.verify of each policy's rewrite of its
training step on the same batch. One JSON row per policy goes to the
results file: the verdict (identical, identical up to the order of N sums,
different, nondeterministic), the sums it names, what the pass did with the
graph and its predicted and planned peaks.

A run resumes: a (model, oneDNN, policy) already in the results file is
skipped, and no process starts after --max_minutes, so the sweep goes in
shards. --table prints the markdown table and totals for BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from sntf.testing import results  # noqa: E402
RESULTS = os.path.join(REPO, "benchmarks", "results", "zoo_verify.jsonl")
MIB = float(1 << 20)
POLICIES = ("swap", "recompute", "swap+recompute")

FLAGS = flags.FLAGS

WORKER = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
tf.config.experimental.enable_op_determinism()
tf.config.threading.set_inter_op_parallelism_threads(1)
import sntf
from sntf.testing import zoo
name, policies = sys.argv[1], sys.argv[2].split(",")
batch = zoo.default_batch(name)
model = zoo.build(name)
x, y = zoo.make_data(name, batch)
for policy in policies:
    row = {"model": name, "batch": batch, "policy": policy}
    try:
        result = sntf.verify(model, x, y, policy=policy)
        reports = [r for r in sntf.reports() if r.get("training")]
        report = reports[-1] if reports else {}
        row.update(verdict=result.verdict, ordered_sums=list(result.ordered_sums),
                   action=report.get("action"), nodes=report.get("nodes"),
                   swapped=len(report.get("swapped") or ()),
                   recomputed=len(report.get("recomputed") or ()),
                   predicted_peak=report.get("predicted_peak_bytes"),
                   planned_peak=report.get("planned_peak_bytes"))
        if not result.ok:
            row["verify_text"] = str(result)[:2000]
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    print("ROW " + json.dumps(row), flush=True)
"""


def _define_flags() -> None:
    flags.DEFINE_list("models", [], "zoo architectures (default: all)")
    flags.DEFINE_list("onednn", ["1", "0"], "TF_ENABLE_ONEDNN_OPTS values")
    flags.DEFINE_list("policies", list(POLICIES), "sntf policies")
    flags.DEFINE_float("max_minutes", 20.0, "start no process after this long")
    flags.DEFINE_string("results", RESULTS, "JSON-lines results file (appended)")
    flags.DEFINE_bool("table", False, "print the table from the results file and exit")


def _run(name: str, onednn: bool, policies: list) -> list:
    """One fresh process verifying `policies` on one model: its rows."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1" if onednn else "0",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", WORKER, name, ",".join(policies)],
                          capture_output=True, text=True, env=env, cwd=REPO)
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines()
            if line.startswith("ROW ")]
    done = {r["policy"] for r in rows}
    error = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
    rows += [{"model": name, "policy": p, "error": error} for p in policies
             if p not in done]
    for row in rows:
        row["onednn"] = onednn
    return rows


def table(rows: list) -> str:
    """The markdown table and totals of the results file's rows."""
    lines = ["| model | oneDNN | policy | verdict | graph | swapped / recomputed | "
             "predicted -> planned MiB |",
             "| --- | --- | --- | --- | --- | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {'on' if r['onednn'] else 'off'} | "
                         f"{r['policy']} | error: {r['error']} | | | |")
            continue
        verdict = r["verdict"]
        if verdict == "identical_up_to_sum_order":
            verdict = f"up to the order of {len(r['ordered_sums'])} sum(s)"
        peaks = ""
        if r.get("predicted_peak") and r.get("planned_peak"):
            peaks = f"{r['predicted_peak'] / MIB:.1f} -> {r['planned_peak'] / MIB:.1f}"
        lines.append(f"| {r['model']} | {'on' if r['onednn'] else 'off'} | {r['policy']} | "
                     f"{verdict} | {r.get('action')} | {r.get('swapped')} / "
                     f"{r.get('recomputed')} | {peaks} |")
    verdicts = [r.get("verdict") for r in rows]
    lines.append("")
    lines.append(
        f"{len(rows)} runs: {verdicts.count('identical')} identical, "
        f"{verdicts.count('identical_up_to_sum_order')} identical up to the order of "
        f"sums, {verdicts.count('different')} different, "
        f"{verdicts.count('nondeterministic')} nondeterministic, "
        f"{sum('error' in r for r in rows)} failed; "
        f"{sum(r.get('action') == 'rewritten' for r in rows)} rewritten.")
    return "\n".join(lines)


def main(argv) -> int:
    del argv
    if FLAGS.table:
        print(table(results.load(FLAGS.results)))
        return 0
    from sntf.testing import zoo

    models = FLAGS.models or list(zoo.NAMES)
    start = time.time()
    done = {(r["model"], r["onednn"], r["policy"]) for r in results.load(FLAGS.results)
            if "error" not in r}
    os.makedirs(os.path.dirname(FLAGS.results), exist_ok=True)
    for onednn in (v == "1" for v in FLAGS.onednn):
        for name in models:
            todo = [p for p in FLAGS.policies if (name, onednn, p) not in done]
            if not todo:
                continue
            if time.time() - start > FLAGS.max_minutes * 60:
                print("max_minutes reached; resume to go on", flush=True)
                return 0
            rows = _run(name, onednn, todo)
            with open(FLAGS.results, "a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
            print(f"{name} oneDNN {'on' if onednn else 'off'}: "
                  + ", ".join(f"{r['policy']} {r.get('verdict', r.get('error'))}"
                              for r in rows), flush=True)
    return 0


if __name__ == "__main__":
    _define_flags()
    app.run(main)
