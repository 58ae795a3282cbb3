"""Every training loop under a hard limit: plain sntf.enable(), fit,
train_on_batch and a custom tf.function step with a GradientTape.

    python benchmarks/limit_loops.py [--blocks 50] [--batch 32] [--steps 3]
                                     [--limits 0.6,0.3] [--loops fit,train_on_batch,custom]
                                     [--results benchmarks/results/limit_loops.jsonl]
    python benchmarks/limit_loops.py --table [--results ...]

Each run is a fresh process of sntf/testing/workers/limit_loops.py (the
pre-activation ResNet, oneDNN off, TF_CPU_ALLOCATOR_USE_BFC=true, the
default inter-op pool). First TensorFlow alone without a limit, whose peak
sets the limits (each share of it, in MiB, as TF_CPU_BFC_MEM_LIMIT_IN_MB);
then, per loop, sntf without a limit and under each limit. One JSON row
per run goes to the results file: losses, weight digest, whether it ran
out of memory, the allocator's peak, and the report's limit fields.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from sntf.testing import results  # noqa: E402
WORKER = os.path.join(REPO, "sntf", "testing", "workers", "limit_loops.py")
RESULTS = os.path.join(REPO, "benchmarks", "results", "limit_loops.jsonl")
MIB = float(1 << 20)

FLAGS = flags.FLAGS


def _define_flags() -> None:
    flags.DEFINE_integer("blocks", 50, "residual blocks")
    flags.DEFINE_integer("batch", 32, "batch")
    flags.DEFINE_integer("steps", 3, "training steps")
    flags.DEFINE_list("limits", ["0.6", "0.3"], "limits as shares of TensorFlow's peak")
    flags.DEFINE_list("loops", ["fit", "train_on_batch", "custom"], "training loops")
    flags.DEFINE_string("results", RESULTS, "JSON-lines results file (appended)")
    flags.DEFINE_bool("table", False, "print the table from the results file and exit")


def _run(loop: str, use_sntf: bool, limit_mib) -> dict:
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPU_ALLOCATOR_USE_BFC="true",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    env.pop("TF_CPU_BFC_MEM_LIMIT_IN_MB", None)
    if limit_mib is not None:
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(limit_mib)
    args = [sys.executable, WORKER, "--loop", loop, "--blocks", str(FLAGS.blocks),
            "--batch", str(FLAGS.batch), "--steps", str(FLAGS.steps)]
    if use_sntf:
        args.append("--sntf")
    try:
        proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=900)
    except subprocess.TimeoutExpired:
        return {"oom": True, "hang": True}     # a hang under a limit counts as OOM
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}


def table(rows: list) -> str:
    """The markdown table of the results file's rows."""
    lines = ["| run | loop | limit MiB | trained | peak MiB | planned MiB | limit read | "
             "fits (model) | losses | weight digest |",
             "| --- | --- | ---: | --- | ---: | ---: | --- | --- | --- | --- |"]
    for r in rows:
        rep = r.get("report") or {}
        who = "sntf" if r["sntf"] else "TensorFlow"
        limit = r["limit_mib"] if r["limit_mib"] is not None else "none"
        if "error" in r or r.get("hang"):
            lines.append(f"| {who} | {r['loop']} | {limit} | "
                         f"{r.get('error', 'no (hang)')} | | | | | | |")
            continue
        planned = rep.get("planned_peak_bytes")
        read = ("yes" if rep.get("device_limit_bytes") else "no") if r["sntf"] else ""
        losses = ", ".join(f"{v:.7g}" for v in r["losses"] if isinstance(v, float))
        lines.append(
            f"| {who} | {r['loop']} | {limit} | {'no (OOM)' if r['oom'] else 'yes'} | "
            f"{r['peak'] / MIB:.1f} | {planned / MIB:.1f} | " if planned else
            f"| {who} | {r['loop']} | {limit} | {'no (OOM)' if r['oom'] else 'yes'} | "
            f"{r['peak'] / MIB:.1f} | | ")
        lines[-1] += (f"{read} | {rep.get('device_limit_fits', '')} | {losses} | "
                      f"{r['digest'][:16]} |")
    return "\n".join(lines)


def main(argv) -> int:
    del argv
    if FLAGS.table:
        print(table(results.load(FLAGS.results)))
        return 0
    os.makedirs(os.path.dirname(FLAGS.results), exist_ok=True)

    def record(loop, use_sntf, limit_mib):
        row = dict(_run(loop, use_sntf, limit_mib), loop=loop, sntf=use_sntf,
                   limit_mib=limit_mib, blocks=FLAGS.blocks, batch=FLAGS.batch,
                   steps=FLAGS.steps)
        with open(FLAGS.results, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: row.get(k) for k in ("loop", "sntf", "limit_mib", "oom",
                                                   "peak", "digest")}), flush=True)
        return row

    base = record(FLAGS.loops[0], False, None)
    limits = [int(float(share) * base["peak"] / MIB) for share in FLAGS.limits]
    record(FLAGS.loops[0], False, limits[-1])
    for loop in FLAGS.loops:
        record(loop, True, None)
        for limit in limits:
            record(loop, True, limit)
    return 0


if __name__ == "__main__":
    _define_flags()
    app.run(main)
