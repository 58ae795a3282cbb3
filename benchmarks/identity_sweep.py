"""The identity sweep: do ResNets train bit for bit alike with and without sntf?

    python benchmarks/identity_sweep.py [--archs pre,post] [--blocks 10,30,50,100]
                                        [--widths 16,64] [--batches 8,64]
                                        [--bias true,false] [--onednn 1,0]
                                        [--policies swap,recompute,swap+recompute]
                                        [--steps 3] [--out identity_sweep.md]

For every combination it trains `steps` steps of the ResNet of
sntf/testing/workers/resnet_identity.py (pre- or post-activation blocks;
op determinism on, one inter-op thread) in fresh processes: once without
sntf, then once per policy, and compares the losses and a digest of every
weight. A row per policy run: identical or DIFFERENT, what the pass did
with the graph (rewritten, or left unchanged because TensorFlow sums some
of its gradients in an order it decides as it runs), the order-dependent
sums it found, and its planned and predicted peaks. Progress goes to
stdout; the table and the command go to --out.
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
WORKER = os.path.join(REPO, "sntf", "testing", "workers", "resnet_identity.py")
MIB = float(1 << 20)

FLAGS = flags.FLAGS


def _define_flags() -> None:
    flags.DEFINE_list("archs", ["pre", "post"], "block kinds: pre, post")
    flags.DEFINE_list("blocks", ["10", "30", "50", "100"], "residual blocks")
    flags.DEFINE_list("widths", ["16", "64"], "channels")
    flags.DEFINE_list("batches", ["8", "64"], "batch sizes")
    flags.DEFINE_list("bias", ["true", "false"], "convolutions with biases")
    flags.DEFINE_list("onednn", ["1", "0"], "TF_ENABLE_ONEDNN_OPTS values")
    flags.DEFINE_list("policies", ["swap", "recompute", "swap+recompute"], "sntf policies")
    flags.DEFINE_integer("steps", 3, "training steps per run")
    flags.DEFINE_string("out", "identity_sweep.md", "markdown table to write")


def _train(arch: str, blocks: str, width: str, batch: str, bias: str, onednn: str,
           policy: str, steps: int) -> dict:
    """One configuration in a fresh process: its RESULT line, or an error."""
    args = [sys.executable, WORKER, "--arch", arch, "--blocks", blocks, "--width", width,
            "--batch", batch, "--steps", str(steps), "--policy", policy]
    if bias == "false":
        args.append("--no-bias")
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:120]}


def _row(config: tuple, policy: str, base: dict, run: dict) -> str:
    arch, blocks, width, batch, bias, onednn = config
    cells = [arch, blocks, width, batch, bias, "on" if onednn == "1" else "off", policy]
    if "error" in run or "error" in base:
        return "| " + " | ".join(cells + [f"error: {run.get('error') or base.get('error')}",
                                          "", "", "", ""]) + " |"
    same = (run["losses"], run["digest"]) == (base["losses"], base["digest"])
    report = run["report"] or {}
    sums = report.get("order_dependent_sums") or {}
    peaks = (f"{report['predicted_peak_bytes'] / MIB:.1f} -> "
             f"{report['planned_peak_bytes'] / MIB:.1f}"
             if report.get("predicted_peak_bytes") and report.get("planned_peak_bytes")
             else "")
    return "| " + " | ".join(cells + [
        "identical" if same else "**DIFFERENT**", str(report.get("action")),
        str(report.get("nodes")),
        f"{sums.get('accumulations', 0)} / {sums.get('pins', 0)}", peaks]) + " |"


def main(argv) -> int:
    del argv
    started = time.perf_counter()
    header = ("| block | blocks | width | batch | bias | oneDNN | policy | verdict | "
              "graph | nodes | accumulator edges / sum edges | predicted -> planned MiB |\n"
              "| --- | ---: | ---: | ---: | --- | --- | --- | --- | --- | ---: | ---: | ---: |")
    rows, different = [], 0
    for config in itertools.product(FLAGS.archs, FLAGS.blocks, FLAGS.widths,
                                    FLAGS.batches, FLAGS.bias, FLAGS.onednn):
        base = _train(*config, "none", FLAGS.steps)
        for policy in FLAGS.policies:
            run = _train(*config, policy, FLAGS.steps)
            row = _row(config, policy, base, run)
            different += "DIFFERENT" in row or "error" in row
            rows.append(row)
            print(row, flush=True)
    command = "python benchmarks/identity_sweep.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:])
    text = (f"`{command}` ({time.perf_counter() - started:.0f} s; one inter-op thread, "
            f"op determinism on)\n\n{header}\n" + "\n".join(rows) + "\n\n"
            f"{len(rows)} runs, {different} different or failed.\n")
    with open(FLAGS.out, "w") as f:
        f.write(text)
    print(text)
    return 1 if different else 0


if __name__ == "__main__":
    _define_flags()
    app.run(main)
