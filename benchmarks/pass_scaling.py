"""How the pass's time and memory grow with the graph.

    python benchmarks/pass_scaling.py [--preact 50,100,200,400,1000]
                                      [--gpt 6,12,24,48] [--batch 8]
                                      [--policy swap+recompute] [--max_minutes 20]
                                      [--results benchmarks/results/pass_scaling.jsonl]
    python benchmarks/pass_scaling.py --table [--results ...]

For each network (the pre-activation ResNet of sntf.testing.deep at each
depth in blocks, the zoo's GPT-style decoder at each depth in blocks), two
fresh processes with one inter-op thread (sntf/testing/workers/
pass_scaling.py) time the first training step: TensorFlow alone, and with
sntf under --policy. The sntf run gives the training graph's nodes, the
pass's seconds per stage and the growth of the process's resident memory
while the pass ran. One JSON row per process goes to the results file; a
run resumes where the file stops, and no process starts after
--max_minutes, so the sweep goes in shards (smallest networks first).

--table prints per network: nodes, pass seconds, per 1,000 nodes, the
stages that took longest, the pass's resident growth, and the first step
with sntf over TensorFlow's own; and per architecture the exponent of pass
seconds in nodes, fitted by least squares on logarithms.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from sntf.testing import results  # noqa: E402
RESULTS = os.path.join(REPO, "benchmarks", "results", "pass_scaling.jsonl")
MIB = float(1 << 20)

FLAGS = flags.FLAGS


def _define_flags() -> None:
    flags.DEFINE_list("preact", ["50", "100", "200", "400", "1000"],
                      "pre-activation ResNet depths (blocks)")
    flags.DEFINE_list("gpt", ["6", "12", "24", "48"], "GPT-style decoder depths (blocks)")
    flags.DEFINE_integer("batch", 8, "batch size")
    flags.DEFINE_string("policy", "swap+recompute", "sntf policy")
    flags.DEFINE_integer("timeout", 3600, "seconds per process")
    flags.DEFINE_float("max_minutes", 20.0, "start no process after this long")
    flags.DEFINE_string("results", RESULTS, "JSON-lines results file (appended)")
    flags.DEFINE_bool("table", False, "print the table from the results file and exit")


def _run(arch: str, size: int, policy: str) -> dict:
    """One fresh process: the worker's RESULT, or an error row."""
    cmd = [sys.executable, "-m", "sntf.testing.workers.pass_scaling", "--arch", arch,
           "--size", str(size), "--batch", str(FLAGS.batch), "--policy", policy]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    row = {"arch": arch, "size": size, "batch": FLAGS.batch, "policy": policy}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=FLAGS.timeout)
    except subprocess.TimeoutExpired:
        return dict(row, error=f"timed out after {FLAGS.timeout} s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(row, error=tail[:300])
    return dict(row, **json.loads(lines[-1][len("RESULT "):]))


def sweep() -> int:
    start = time.time()
    os.makedirs(os.path.dirname(FLAGS.results), exist_ok=True)
    done = {(r["arch"], r["size"], r["batch"], r["policy"])
            for r in results.load(FLAGS.results) if "error" not in r}
    nets = sorted([("preact", int(s)) for s in FLAGS.preact] +
                  [("gpt", int(s)) for s in FLAGS.gpt], key=lambda n: (n[1], n[0]))
    for arch, size in nets:
        for policy in ("none", FLAGS.policy):
            if (arch, size, FLAGS.batch, policy) in done:
                continue
            if time.time() - start > FLAGS.max_minutes * 60:
                print("max_minutes reached; resume to go on", flush=True)
                return 0
            row = _run(arch, size, policy)
            with open(FLAGS.results, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{arch} {size} {policy}: " + (
                row.get("error") or f"first step {row['first_step_seconds']:.1f} s"
                + (f", pass {row['pass_seconds']:.1f} s over {row['nodes']} nodes"
                   if row.get("pass_seconds") else "")), flush=True)
    return 0


def exponent(points: list) -> float:
    """The slope of log(seconds) on log(nodes), least squares."""
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(s) for _, s in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
            / sum((x - mx) ** 2 for x in xs))


def table(rows: list) -> str:
    """The markdown table and fitted exponents of the results file's rows."""
    ok = [r for r in rows if "error" not in r]
    base = {(r["arch"], r["size"], r["batch"]): r for r in ok if r["policy"] == "none"}
    lines = ["| network | nodes | pass s | s per 1,000 nodes | longest stages | "
             "pass RSS growth MiB | first step s (TensorFlow, sntf) | ratio |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
    points: dict = {}
    for r in sorted((r for r in ok if r["policy"] != "none"),
                    key=lambda r: (r["arch"], r["size"])):
        tf = base.get((r["arch"], r["size"], r["batch"]))
        stages = sorted((r.get("stage_seconds") or {}).items(), key=lambda kv: -kv[1])[:3]
        first = (f"{tf['first_step_seconds']:.1f}, {r['first_step_seconds']:.1f}"
                 if tf else f"?, {r['first_step_seconds']:.1f}")
        ratio = f"{r['first_step_seconds'] / tf['first_step_seconds']:.2f}" if tf else ""
        growth = r.get("pass_rss_growth_bytes")
        lines.append(
            f"| {r['arch']} {r['size']} | {r['nodes']} | {r['pass_seconds']:.1f} | "
            f"{1000 * r['pass_seconds'] / r['nodes']:.2f} | "
            + ", ".join(f"{k} {v:.1f}" for k, v in stages)
            + f" | {'' if growth is None else f'{growth / MIB:.0f}'} | {first} | {ratio} |")
        points.setdefault(r["arch"], []).append((r["nodes"], r["pass_seconds"]))
    lines.append("")
    for arch, pts in points.items():
        if len({n for n, _ in pts}) >= 2:     # repeats of one size fit nothing
            lines.append(f"{arch}: pass seconds grow as nodes^{exponent(pts):.2f} "
                         f"({len(pts)} sizes)")
    failed = [r for r in rows if "error" in r]
    if failed:
        lines.append(f"{len(failed)} process(es) failed: " + "; ".join(
            f"{r['arch']} {r['size']} {r['policy']}: {r['error']}" for r in failed))
    return "\n".join(lines)


def main(argv) -> int:
    del argv
    return results.table_or_sweep(FLAGS.table, FLAGS.results, table, sweep)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
