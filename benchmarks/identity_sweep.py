"""The identity sweep: does sntf keep TensorFlow's results on deep ResNets?

    python benchmarks/identity_sweep.py [--archs pre,post] [--blocks 10,30,50,100]
                                        [--widths 16,64] [--batches 8,64]
                                        [--bias true,false] [--onednn 1,0]
                                        [--policies swap,recompute,swap+recompute]
                                        [--steps 4] [--max_minutes 20]
                                        [--results benchmarks/results/identity_sweep.jsonl]
    python benchmarks/identity_sweep.py --table [--results ...]

For every combination it trains `steps` steps of the ResNet of
sntf/testing/workers/resnet_identity.py (pre- or post-activation blocks; op
determinism on, one inter-op thread) in fresh processes: once without sntf,
then once per policy, each followed by sntf.verify of that policy's rewrite
on the same batch. It appends one JSON row per policy run to the results
file: the verifier's verdict (identical, identical up to the order of N
sums, different), whether the losses and weights equal TensorFlow's bit for
bit, the largest relative loss difference, what the pass did with the
graph, its order-dependent sums, and its predicted and planned peaks and
the measured one against TensorFlow's.

A run resumes: a configuration already in the results file is skipped, and
the run stops starting configurations after --max_minutes, so a sweep of
hours goes in shards of one session each. --table prints the markdown table
and the totals BENCHMARKS.md shows, generated from the results file.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import subprocess
import sys
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from sntf.testing import results  # noqa: E402
WORKER = os.path.join(REPO, "sntf", "testing", "workers", "resnet_identity.py")
RESULTS = os.path.join(REPO, "benchmarks", "results", "identity_sweep.jsonl")
MIB = float(1 << 20)
SAME = ("identical", "identical_up_to_sum_order")

FLAGS = flags.FLAGS


def _define_flags() -> None:
    flags.DEFINE_list("archs", ["pre", "post"], "block kinds: pre, post")
    flags.DEFINE_list("blocks", ["10", "30", "50", "100"], "residual blocks")
    flags.DEFINE_list("widths", ["16", "64"], "channels")
    flags.DEFINE_list("batches", ["8", "64"], "batch sizes")
    flags.DEFINE_list("bias", ["true", "false"], "convolutions with biases")
    flags.DEFINE_list("onednn", ["1", "0"], "TF_ENABLE_ONEDNN_OPTS values")
    flags.DEFINE_list("policies", ["swap", "recompute", "swap+recompute"], "sntf policies")
    flags.DEFINE_integer("steps", 4, "training steps per run")
    flags.DEFINE_float("max_minutes", 20.0, "start no configuration after this long")
    flags.DEFINE_string("results", RESULTS, "JSON-lines results file (appended)")
    flags.DEFINE_bool("table", False, "print the table from the results file and exit")


def _train(config: dict, policy: str, steps: int) -> dict:
    """One configuration in a fresh process: its RESULT line, or an error."""
    args = [sys.executable, WORKER, "--arch", config["arch"], "--blocks",
            str(config["blocks"]), "--width", str(config["width"]), "--batch",
            str(config["batch"]), "--steps", str(steps), "--policy", policy]
    if not config["bias"]:
        args.append("--no-bias")
    if policy != "none":
        args.append("--verify")
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1" if config["onednn"] else "0",
               TF_CPP_MIN_LOG_LEVEL="2")
    if not config["onednn"]:
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"      # the allocator keeps statistics
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]}


def _row(config: dict, policy: str, steps: int, base: dict, run: dict) -> dict:
    """The results file's row of one policy run."""
    row = dict(config, policy=policy, steps=steps)
    if "error" in run or "error" in base:
        row["error"] = run.get("error") or base.get("error")
        return row
    report = run.get("report") or {}
    verified = run.get("verify") or {}
    worst = max((abs(a - b) / max(abs(b), 1e-30)
                 for a, b in zip(run["losses"], base["losses"])), default=0.0)
    row.update(
        verdict=verified.get("verdict"), ordered_sums=verified.get("ordered_sums", []),
        bitwise=(run["losses"], run["digest"]) == (base["losses"], base["digest"]),
        loss_rel_diff=worst, action=report.get("action"), nodes=report.get("nodes"),
        swapped=report.get("swapped"), recomputed=report.get("recomputed"),
        sums=report.get("order_dependent_sums"),
        predicted_peak=report.get("predicted_peak_bytes"),
        planned_peak=report.get("planned_peak_bytes"),
        measured_peak=run.get("peak"), tensorflow_peak=base.get("peak"))
    if verified.get("verdict") not in SAME:
        row["verify_text"] = verified.get("text")
    return row


def _key(row: dict) -> tuple:
    return tuple(row[k] for k in ("arch", "blocks", "width", "batch", "bias", "onednn",
                                  "policy", "steps"))


def table(rows: list) -> str:
    """The markdown table of the results and its totals."""
    head = ("| block | blocks | width | batch | bias | oneDNN | policy | verdict | "
            "bitwise | loss rel. diff | graph | swapped / recomputed | "
            "predicted -> planned MiB | measured / TensorFlow's peak |\n"
            "| --- | ---: | ---: | ---: | --- | --- | --- | --- | --- | ---: | --- | ---: "
            "| ---: | ---: |")
    lines, counts = [], {"rows": len(rows), "identical": 0, "up to sum order": 0,
                         "different": 0, "error": 0, "rewritten": 0}
    for r in rows:
        cells = [r["arch"], str(r["blocks"]), str(r["width"]), str(r["batch"]),
                 "yes" if r["bias"] else "no", "on" if r["onednn"] else "off", r["policy"]]
        if "error" in r:
            counts["error"] += 1
            lines.append("| " + " | ".join(cells + [f"error: {r['error']}"] + [""] * 6) + " |")
            continue
        verdict = r["verdict"]
        if verdict == "identical":
            counts["identical"] += 1
        elif verdict == "identical_up_to_sum_order":
            counts["up to sum order"] += 1
            verdict = f"up to the order of {len(r['ordered_sums'])} sum(s)"
        else:
            counts["different"] += 1
            verdict = f"**{verdict}**"
        counts["rewritten"] += r["action"] == "rewritten"
        peaks = (f"{r['predicted_peak'] / MIB:.1f} -> {r['planned_peak'] / MIB:.1f}"
                 if r.get("predicted_peak") and r.get("planned_peak") else "")
        measured = (f"{r['measured_peak'] / r['tensorflow_peak']:.3f}"
                    if r.get("measured_peak") and r.get("tensorflow_peak") else "")
        lines.append("| " + " | ".join(cells + [
            verdict, "yes" if r["bitwise"] else "no", f"{r['loss_rel_diff']:.1e}",
            str(r["action"]), f"{r['swapped']} / {r['recomputed']}", peaks, measured]) + " |")
    total = (f"{counts['rows']} runs: {counts['identical']} identical, "
             f"{counts['up to sum order']} identical up to the order of sums, "
             f"{counts['different']} different, {counts['error']} failed; "
             f"{counts['rewritten']} rewritten.")
    return head + "\n" + "\n".join(lines) + "\n\n" + total + "\n"


def main(argv) -> int:
    del argv
    if FLAGS.table:
        print(table(results.load(FLAGS.results)))
        return 0
    started = time.perf_counter()
    done = {_key(r) for r in results.load(FLAGS.results)}
    os.makedirs(os.path.dirname(FLAGS.results), exist_ok=True)
    command = "python benchmarks/identity_sweep.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:])
    print(command, flush=True)
    different = 0
    for arch, blocks, width, batch, bias, onednn in itertools.product(
            FLAGS.archs, FLAGS.blocks, FLAGS.widths, FLAGS.batches, FLAGS.bias,
            FLAGS.onednn):
        config = {"arch": arch, "blocks": int(blocks), "width": int(width),
                  "batch": int(batch), "bias": bias == "true", "onednn": onednn == "1"}
        todo = [p for p in FLAGS.policies
                if _key(dict(config, policy=p, steps=FLAGS.steps)) not in done]
        if not todo:
            continue
        if time.perf_counter() - started > FLAGS.max_minutes * 60:
            print("stopping: --max_minutes reached; run again to resume", flush=True)
            break
        base = _train(config, "none", FLAGS.steps)
        for policy in todo:
            row = _row(config, policy, FLAGS.steps, base, _train(config, policy, FLAGS.steps))
            different += row.get("verdict") not in SAME
            with open(FLAGS.results, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps({k: v for k, v in row.items() if k != "verify_text"}),
                  flush=True)
    return 1 if different else 0


if __name__ == "__main__":
    _define_flags()
    app.run(main)
