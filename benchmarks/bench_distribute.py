"""Peak memory and step time of data-parallel training, with and without sntf.

    python benchmarks/bench_distribute.py [--family vgg] [--depth 2] [--batch 64]
                                     [--steps 4] [--policies recompute,swap+recompute]
                                     [--nomultiworker] [--out FILE.md]

Each configuration trains in fresh processes (sntf/testing/workers/train_distributed.py
--measure), with TF_ENABLE_ONEDNN_OPTS=0 and TF_CPU_ALLOCATOR_USE_BFC=true so
that TensorFlow's CPU allocator keeps statistics (docs/tensorflow.md, "Memory on a CPU-only machine"):

  MirroredStrategy, 2 replicas: two logical CPU devices in one process,
      model.fit. The logical CPU devices share ONE allocator
      (ProcessState's CPU allocator): get_memory_info("CPU:0") and
      ("CPU:1") return the same numbers, the peak of both replicas together.
      The table gives that shared peak and half of it as "per replica"
      (derived, not measured separately).
  MultiWorkerMirroredStrategy, 2 workers: one replica per process on
      loopback ports (a custom strategy.run loop: Keras 3.15's fit fails under
      this strategy before training), so each replica's peak is measured by
      its own allocator; the table gives each worker's.

Step time: the median of the steps after the first (the first traces and
optimizes the graph); for the workers, the slower worker's median. The
markdown table and the exact command line are printed (and written to --out).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Optional

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
WORKER = os.path.join(REPO, "sntf", "testing", "workers", "train_distributed.py")

from sntf.testing.workers import train_distributed  # noqa: E402  (no TensorFlow at import)

FLAGS = flags.FLAGS
flags.DEFINE_string("family", "vgg", "model family of sntf.models")
flags.DEFINE_integer("depth", 2, "the family's depth")
flags.DEFINE_integer("batch", 64, "global batch size")
flags.DEFINE_integer("steps", 4, "training steps")
flags.DEFINE_string("policies", "recompute,swap+recompute", "sntf policies to run")
flags.DEFINE_integer("swap_min_bytes", None, "swap_min_bytes option")
flags.DEFINE_bool("multiworker", True, "also run MultiWorkerMirroredStrategy")
flags.DEFINE_float("timeout", 1800, "seconds per worker process")
flags.DEFINE_string("out", None, "markdown file for the table")

MEASURE_ENV = {"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPU_ALLOCATOR_USE_BFC": "true",
               "TF_CPP_MIN_LOG_LEVEL": "2"}
MIB = float(1 << 20)


def _env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env.update(MEASURE_ENV)
    for name in ("SNTF_POLICY", "SNTF_BUDGET"):    # the worker decides
        env.pop(name, None)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def _result(text: str) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError("no RESULT line:\n" + text[-3000:])


def _model_args(args) -> list[str]:
    return ["--family", args.family, "--depth", str(args.depth), "--batch",
            str(args.batch), "--steps", str(args.steps), "--measure"]


def _policy_args(policy: str, args) -> list[str]:
    if policy == "none":
        return []
    flags = ["--sntf", policy]
    if args.swap_min_bytes is not None:
        flags += ["--swap-min-bytes", str(args.swap_min_bytes)]
    return flags


def run_mirrored(policy: str, args, workdir: str) -> dict:
    """One MirroredStrategy process (two logical CPUs)."""
    out = os.path.join(workdir, f"mirrored-{policy}.npz")
    proc = subprocess.run([sys.executable, WORKER, "--strategy", "mirrored",
                           *_model_args(args), *_policy_args(policy, args),
                           "--out", out], capture_output=True, text=True,
                          env=_env(), cwd=REPO, timeout=args.timeout)
    if proc.returncode:
        raise RuntimeError(f"mirrored {policy} failed (rc={proc.returncode}):\n"
                           + proc.stderr[-3000:])
    return _result(proc.stdout)


def run_workers(policy: str, args, workdir: str, workers: int = 2) -> list[dict]:
    """MultiWorkerMirroredStrategy: `workers` processes, one replica each."""
    cluster = {"worker": [f"127.0.0.1:{p}" for p in train_distributed.free_ports(workers)]}
    procs = []
    try:
        for i in range(workers):
            tf_config = json.dumps({"cluster": cluster,
                                    "task": {"type": "worker", "index": i}})
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, "--strategy", "multiworker",
                 *_model_args(args), *_policy_args(policy, args),
                 "--out", os.path.join(workdir, f"worker{i}-{policy}.npz")],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=_env({"TF_CONFIG": tf_config}), cwd=REPO))
        outputs = [p.communicate(timeout=args.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, (_, err)) in enumerate(zip(procs, outputs)):
        if p.returncode:
            raise RuntimeError(f"worker {i} ({policy}) failed (rc={p.returncode}):\n"
                               + err[-3000:])
    return [_result(out) for out, _ in outputs]


def _peaks(result: dict) -> list[int]:
    return [int(info["peak"]) for info in result["memory"].values() if "peak" in info]


def _planned(result: dict) -> Optional[int]:
    """sntf's planned peak of the training graph that ran (None without sntf)."""
    reports = [r for r in (result.get("reports") or [])
               if r.get("planned_peak_bytes") is not None]
    return reports[-1]["planned_peak_bytes"] if reports else None


def _planned_per_device(result: dict) -> str:
    """Each device's predicted -> planned peak, from the report's per_device."""
    reports = [r for r in (result.get("reports") or []) if r.get("per_device")]
    if not reports:
        return ""
    per_device = reports[-1]["per_device"]
    return "; per device " + ", ".join(
        f"{d.rsplit('/', 1)[-1].replace('device:', '')} "
        f"{f['predicted_peak_bytes'] / MIB:.1f} -> {f['planned_peak_bytes'] / MIB:.1f}"
        for d, f in sorted(per_device.items()))


def _rewritten(result: dict) -> str:
    reports = [r for r in (result.get("reports") or []) if r["training"]]
    if not reports:
        return "-"
    actions = sorted({r["action"] for r in reports})
    swapped = sum(len(r.get("swapped") or ()) for r in reports)
    recomputed = sum(len(r.get("recomputed") or ()) for r in reports)
    return f"{'/'.join(actions)}: {swapped} swapped, {recomputed} recomputed"


def table(mirrored: dict, workers: dict) -> str:
    """The markdown table."""
    lines = ["| strategy | configuration | per-replica peak (MiB) | peak vs TF | "
             "step time (s) | time vs TF | sntf planned peak (MiB) | sntf |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    base = mirrored.get("none")
    for policy, result in mirrored.items():
        shared = max(_peaks(result))
        per = shared / 2
        step = result["seconds_per_step"]
        planned = _planned(result)
        lines.append(
            f"| Mirrored, 2 logical CPUs | {_label(policy)} | {per / MIB:.1f} "
            f"(both: {shared / MIB:.1f}, shared allocator) | "
            f"{_ratio(shared, base and max(_peaks(base)))} | {step:.3f} | "
            f"{_ratio(step, base and base['seconds_per_step'])} | "
            f"{'-' if planned is None else f'{planned / MIB:.1f} (both)'}"
            f"{_planned_per_device(result)} | "
            f"{_rewritten(result)} |")
    base = workers.get("none")
    for policy, results in workers.items():
        peaks = [max(_peaks(r)) for r in results]
        step = max(r["seconds_per_step"] for r in results)
        base_peak = base and max(max(_peaks(r)) for r in base)
        base_step = base and max(r["seconds_per_step"] for r in base)
        planned = _planned(results[0])
        lines.append(
            f"| MultiWorker, 2 processes | {_label(policy)} | "
            f"{' / '.join(f'{p / MIB:.1f}' for p in peaks)} | "
            f"{_ratio(max(peaks), base_peak)} | {step:.3f} | {_ratio(step, base_step)} | "
            f"{'-' if planned is None else f'{planned / MIB:.1f}'} | "
            f"{_rewritten(results[0])} |")
    return "\n".join(lines)


def _label(policy: str) -> str:
    return "TensorFlow (sntf not imported)" if policy == "none" else f"sntf {policy}"


def _ratio(value, base) -> str:
    return f"{value / base:.2f}x" if base else "-"


def main(argv: list) -> int:
    """absl entry point: runs every configuration, prints the table."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    args = FLAGS
    policies = ["none"] + [p for p in args.policies.split(",") if p]
    mirrored, workers = {}, {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        for policy in policies:
            print(f"[mirrored {policy}]", flush=True)
            mirrored[policy] = run_mirrored(policy, args, workdir)
        if args.multiworker:
            for policy in policies:
                print(f"[multiworker {policy}]", flush=True)
                workers[policy] = run_workers(policy, args, workdir)
    for name, results in [("mirrored", mirrored)] + [
            (f"worker {i}", {p: r[i] for p, r in workers.items()}) for i in range(2)
            if workers]:
        losses = {p: r["losses"] for p, r in results.items()}
        same = all(v == losses["none"] for v in losses.values())
        print(f"{name}: losses identical to TensorFlow's: {same}")
    command = "python " + " ".join(shlex.quote(a) for a in
                                   ["benchmarks/bench_distribute.py", *sys.argv[1:]])
    text = (f"{table(mirrored, workers)}\n\n{args.family} depth {args.depth}, global "
            f"batch {args.batch}, {args.steps} steps, CPU (TF_ENABLE_ONEDNN_OPTS=0, "
            f"BFC allocator); {time.perf_counter() - start:.0f} s.\n"
            f"Command: `{command}`\n")
    print()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    app.run(main)
