"""Do runs repeat under TensorFlow's default inter-op pool?

    python benchmarks/pool_repeat.py [--blocks 30] [--batch 32] [--runs 3]
                                     [--policies none,swap,recompute,swap+recompute]
                                     [--onednn 1] [--steps 4]
                                     [--results benchmarks/results/pool_repeat.jsonl]
    python benchmarks/pool_repeat.py --table [--results ...]

Trains the pre-activation ResNet of sntf/testing/workers/resnet_identity.py
with op determinism on and TensorFlow's default inter-op pool (no
one-thread setting), in `runs` fresh processes per policy ("none":
TensorFlow alone), and appends a row per run to the results file: the
weights' digest, the losses and what sntf did with the graph. --table
prints, per configuration and policy, how many distinct digests the runs
gave.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "sntf", "testing", "workers", "resnet_identity.py")
RESULTS = os.path.join(REPO, "benchmarks", "results", "pool_repeat.jsonl")

FLAGS = flags.FLAGS


def _define_flags() -> None:
    flags.DEFINE_integer("blocks", 30, "residual blocks")
    flags.DEFINE_integer("batch", 32, "batch size")
    flags.DEFINE_integer("runs", 3, "fresh processes per policy")
    flags.DEFINE_list("policies", ["none", "swap", "recompute", "swap+recompute"],
                      "sntf policies (none: TensorFlow alone)")
    flags.DEFINE_string("onednn", "1", "TF_ENABLE_ONEDNN_OPTS")
    flags.DEFINE_integer("steps", 4, "training steps per run")
    flags.DEFINE_string("results", RESULTS, "JSON-lines results file (appended)")
    flags.DEFINE_bool("table", False, "print the table from the results file and exit")


def table(rows: list) -> str:
    """Per configuration and policy: runs, distinct digests, rewritten."""
    groups = collections.OrderedDict()
    for r in rows:
        key = (r["blocks"], r["batch"], r["onednn"], r["steps"], r["policy"])
        groups.setdefault(key, []).append(r)
    lines = ["| blocks | batch | oneDNN | steps | policy | runs | distinct weight digests | "
             "graph |", "| ---: | ---: | --- | ---: | --- | ---: | ---: | --- |"]
    for (blocks, batch, onednn, steps, policy), runs in groups.items():
        digests = {r.get("digest") for r in runs}
        actions = sorted({str(r.get("action")) for r in runs})
        lines.append(f"| {blocks} | {batch} | {'on' if onednn == '1' else 'off'} | {steps} "
                     f"| {policy} | {len(runs)} | {len(digests)} | {', '.join(actions)} |")
    return "\n".join(lines) + "\n"


def main(argv) -> int:
    del argv
    if FLAGS.table:
        with open(FLAGS.results) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return 0
    os.makedirs(os.path.dirname(FLAGS.results), exist_ok=True)
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=FLAGS.onednn, TF_CPP_MIN_LOG_LEVEL="2")
    for policy in FLAGS.policies:
        for _ in range(FLAGS.runs):
            args = [sys.executable, WORKER, "--blocks", str(FLAGS.blocks), "--batch",
                    str(FLAGS.batch), "--steps", str(FLAGS.steps), "--policy", policy,
                    "--pool"]
            proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO)
            result = next((json.loads(line[len("RESULT "):])
                           for line in reversed(proc.stdout.splitlines())
                           if line.startswith("RESULT ")), None)
            row = {"blocks": FLAGS.blocks, "batch": FLAGS.batch, "onednn": FLAGS.onednn,
                   "steps": FLAGS.steps, "policy": policy}
            if result is None:
                row["error"] = (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
            else:
                row.update(digest=result["digest"], losses=result["losses"],
                           action=(result.get("report") or {}).get("action"))
            with open(FLAGS.results, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    _define_flags()
    app.run(main)
