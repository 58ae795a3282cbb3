"""Measures the device-memory peak of a few training steps in a fresh process.

    python measure_peak.py --family resnet --batch 64 [--steps 2] [--depth N]
                           [--policy off|none] [--executor default|single]
                           [--settings lab|user] [--out result.json]

Trains one model of `sntf.models` (or, as --family zoo:NAME, of
sntf.testing.zoo) for `steps` steps with `model.fit` on
exactly steps*batch samples (one trace, no partial batch) and prints one line

    RESULT {"family": ..., "measured_peak_bytes": ..., ...}

(also written to --out when given). Each configuration must run in its own
process: the Grappler plugin cannot be unloaded and the CPU allocator's peak
cannot be reset (docs/tensorflow.md). From Python, `measure(...)` runs this
script in a subprocess and returns the dict.

Measurement set-up, made before TensorFlow is imported (--settings lab):
  TF_ENABLE_ONEDNN_OPTS=0, TF_CPU_ALLOCATOR_USE_BFC=true  (the default oneDNN
      CPU allocator does not count small allocations; the BFC one counts all)
  TF_CPP_MIN_LOG_LEVEL=2
and then one inter-op thread and op determinism. --settings user measures as
users run: oneDNN on (TensorFlow's default on CPUs with AVX-512 VNNI, BF16 or
AMX) and TensorFlow's default inter-op thread pool, still with the BFC
allocator, whose statistics count every allocation. One inter-op thread makes
the peak repeatable only approximately: the graphs are identical from run to
run, but the executor still runs ops on the calling thread and the pool thread,
and Keras' tf.data pipeline allocates from other threads, so identical runs
now and then differ by a few percent (ResNet, with its parallel branches,
the most). `measure(..., repeats=3)` reports the median run. --executor single
runs the train function on TensorFlow's SINGLE_THREADED_EXECUTOR (one fixed
topological order; not what users run, and not free of outliers either).

Result keys:
  family, depth, batch, steps, policy, executor, device, layers (len(model.layers)),
  params, param_bytes (all model weights, trainable or not),
  measured_peak_bytes   the process peak: get_memory_info(device)["peak"]
                        before fit, after each step and after fit (the
                        stats are reset after each step)
  bytes_before_fit      get_memory_info(device)["current"] right before fit:
                        model weights and the training data (converted to
                        tensors before fit; the optimizer's slots are
                        created inside fit)
  bytes_after_fit       get_memory_info(device)["current"] after fit
  seconds_per_step      median time of the steps after the first (the first
                        also traces and optimizes the graph); the first
                        step's time when steps == 1
  first_step_seconds, fit_seconds, losses
  weights_sha256        a digest of every weight's bytes after fit (identical
                        training gives the identical digest)
  settings              "lab" or "user"
  step_peaks_bytes      the process peak after each step (a running max)
  own_step_peaks_bytes  each step's own peak; the first step's includes
                        what fit set up before it (iterator, tracing)
  training_reports      one dict per sntf training report: graph, nodes,
                        predicted_peak_bytes, lower_bound_bytes,
                        pass_seconds, invocations, action, budget_bytes,
                        budget_fits, achievable_peak_bytes,
                        predicted_seconds_added, reason, and the counts
                        swapped and recomputed                  (sntf enabled)
  nodes                 list: nodes of each training report
  predicted_peak_bytes  the last training report that has one (the graph that ran)
  lower_bound_bytes     the last training report that has one
  planned_peak_bytes    the prediction for the graph as rewritten (the last
                        training report that has one)
  cached_peak_bytes     the same with the tensor cache keeping what its
                        headroom allows (a budget plan with swaps), or None
  pass_seconds          pass time of the largest training report
  reports_total         number of sntf reports (all graphs)
  sntf_stats            sntf.stats() after fit: host pool and swap counters
With policy "none" the sntf keys are None and sntf is never imported.
`measure()` adds wall_seconds (the subprocess's wall time).
"""

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))

MEASURE_ENV = {"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPU_ALLOCATOR_USE_BFC": "true",
               "TF_CPP_MIN_LOG_LEVEL": "2"}
# --settings: "lab" (oneDNN off, one inter-op thread) or "user" (oneDNN on,
# the default inter-op pool).
SETTINGS = {"lab": MEASURE_ENV,
            "user": dict(MEASURE_ENV, TF_ENABLE_ONEDNN_OPTS="1")}


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--policy", default="off",
                        help='sntf policy to enable; "none": sntf is not imported')
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--executor", default="default", choices=("default", "single"),
                        help='"single": run the train function on TensorFlow\'s '
                        'SINGLE_THREADED_EXECUTOR (one fixed topological order)')
    parser.add_argument("--input", default="dataset", choices=("dataset", "arrays"),
                        help="dataset: a batched tf.data pipeline without "
                        "prefetching (repeatable peaks); arrays: model.fit(x, y)")
    parser.add_argument("--recompute-mode", default=None,
                        choices=("auto", "speed", "memory"))
    parser.add_argument("--budget", default=None,
                        help="sntf budget (bytes or a size string such as 64MiB)")
    parser.add_argument("--remat", default=None, choices=("remat_scope", "recompute_grad"),
                        help="the user's alternative (changes the model code): "
                        "keras.RematScope(mode='full') or tf.recompute_grad per block")
    parser.add_argument("--settings", default="lab", choices=tuple(SETTINGS),
                        help="lab: oneDNN off, one inter-op thread; user: oneDNN "
                        "on, TensorFlow's default inter-op pool")
    parser.add_argument("--pin-order", default="on", choices=("on", "off"),
                        help="sntf's pin_order option: chain the memory-heavy "
                        "ops of a rewritten graph in the planned order")
    parser.add_argument("--one-region", default="on", choices=("on", "off"),
                        help="sntf's one_region option: under a CPU limit, the "
                        "allocator takes the rest of it as one region")
    parser.add_argument("--eager", action="store_true",
                        help="compile(run_eagerly=True): no graph, so no sntf pass")
    parser.add_argument("--out", default=None)
    return parser


def _models_without_sntf(zoo: bool = False):
    """sntf/models.py (or sntf/testing/zoo.py) loaded by path, so that the
    baseline never imports the sntf package (whose import would honour
    SNTF_POLICY)."""
    import importlib.util

    path = (os.path.join(REPO, "sntf", "testing", "zoo.py") if zoo
            else os.path.join(REPO, "sntf", "models.py"))
    spec = importlib.util.spec_from_file_location(
        f"_sntf_{'zoo' if zoo else 'models'}_standalone", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Zoo:
    """sntf.testing.zoo behind the interface of sntf.models."""

    def __init__(self, module, name: str):
        self.module, self.name = module, name

    def build(self, family, depth=None, remat=None, run_eagerly=False):
        # --depth sets the number of blocks where the architecture has them.
        if depth is not None and self.name not in self.module.DEEPENS:
            raise ValueError(f"--depth: zoo architecture {self.name!r} has no blocks option")
        return self.module.build(self.name, **({"blocks": depth} if depth else {}))

    def make_data(self, family, n, seed=0):
        return self.module.make_data(self.name, n, seed=seed)

    def default_depth(self, family):
        return None


def _model_source(args, with_sntf: bool):
    """The module that builds args.family (sntf.models or a zoo entry)."""
    zoo = args.family.startswith("zoo:")
    if not with_sntf:
        module = _models_without_sntf(zoo)
    elif zoo:
        from sntf.testing import zoo as module
    else:
        from sntf import models as module
    return _Zoo(module, args.family[len("zoo:"):]) if zoo else module


def _weights_digest(model, np) -> str:
    import hashlib

    digest = hashlib.sha256()
    for w in model.get_weights():
        digest.update(np.ascontiguousarray(w).tobytes())
    return digest.hexdigest()


def _run(args):
    """The child's work; TensorFlow is imported here, after the environment is set."""
    os.environ.update(SETTINGS[args.settings])
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import numpy as np
    import tensorflow as tf

    if args.settings == "lab":
        tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.experimental.enable_op_determinism()
    import keras

    sntf = None
    if args.policy != "none":
        import sntf

        options = {"recompute_mode": args.recompute_mode} if args.recompute_mode else {}
        options["pin_order"] = args.pin_order == "on"
        options["one_region"] = args.one_region == "on"
        budget = int(args.budget) if args.budget and args.budget.isdigit() else args.budget
        sntf.enable(policy=args.policy, budget=budget, batch_size=args.batch, **options)
    models = _model_source(args, sntf is not None)
    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    keras.utils.set_random_seed(args.seed)
    model = models.build(args.family, args.depth, remat=args.remat,
                         run_eagerly=args.eager)
    x, y = models.make_data(args.family, args.steps * args.batch, seed=args.seed)
    try:
        fitted = _fit(tf, keras, args, device, model, x, y)
    except tf.errors.ResourceExhaustedError:
        # What the plan claimed is read from the reports, which exist by
        # now: a plan that said it fits and ran out of memory is the case
        # the caller most needs to see.
        print("SNTF_REPORTS " + json.dumps(_sntf_fields(sntf), default=str), flush=True)
        raise
    info = tf.config.experimental.get_memory_info(device)
    times = fitted["times"]
    later = sorted(times[1:]) or times
    result = {
        "family": args.family,
        "depth": args.depth if args.depth is not None else models.default_depth(args.family),
        "batch": args.batch, "steps": args.steps, "policy": args.policy,
        "recompute_mode": args.recompute_mode, "budget": args.budget,
        "eager": args.eager, "remat": args.remat, "executor": args.executor,
        "device": device, "layers": len(model.layers),
        "params": int(model.count_params()),
        "param_bytes": int(sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize
                               for w in model.weights)),
        "measured_peak_bytes": max([int(info["peak"])] + fitted["step_peaks"]),
        "bytes_before_fit": int(fitted["before"]),
        "bytes_after_fit": int(info["current"]),
        "seconds_per_step": later[len(later) // 2] if later else None,
        "first_step_seconds": times[0] if times else None,
        "fit_seconds": fitted["seconds"], "losses": fitted["losses"],
        "step_peaks_bytes": fitted["step_peaks"],
        "own_step_peaks_bytes": fitted["own_step_peaks"], "settings": args.settings,
        "weights_sha256": _weights_digest(model, np),
    }
    result.update(_sntf_fields(sntf))
    return result


def _fit(tf, keras, args, device: str, model, x, y) -> dict:
    """Trains; returns step times, losses, per-step peaks, the bytes in use
    before fit and the seconds fit took."""
    # Place the data on the device before fit, so that bytes_before_fit holds
    # weights and data; Keras slices these tensors without copying them again.
    # DeepCopy: converting a suitably aligned numpy array may alias its buffer
    # (not counted by the allocator), an unaligned one is copied (counted).
    if args.input == "arrays":
        x = tf.raw_ops.DeepCopy(x=tf.constant(x))
        y = tf.raw_ops.DeepCopy(x=tf.constant(y))
    times, losses, own_step_peaks = [], [], []

    class StepTimes(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self._t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self._t)
            losses.append(float(logs["loss"]))
            own_step_peaks.append(int(tf.config.experimental.get_memory_info(device)["peak"]))
            # Each step's own peak: the allocator's layout is untouched,
            # only its counters restart (at the bytes now in use).
            tf.config.experimental.reset_memory_stats(device)

    before_fit = tf.config.experimental.get_memory_info(device)
    before = before_fit["current"]
    executor = (tf.experimental.function_executor_type("SINGLE_THREADED_EXECUTOR")
                if args.executor == "single" else contextlib.nullcontext())
    if args.input == "dataset":
        # A plain batched dataset, no prefetching thread: Keras' own adapter
        # prefetches the next batch from another thread while a step runs,
        # which reorders allocations and moves the peak between identical runs.
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch)
        options = tf.data.Options()
        options.threading.private_threadpool_size = 1
        options.autotune.enabled = False
        fit_args = dict(x=data.with_options(options))
    else:
        fit_args = dict(x=x, y=y, batch_size=args.batch, shuffle=False)
    t0 = time.perf_counter()
    with executor:
        model.fit(**fit_args, epochs=1, verbose=0, callbacks=[StepTimes()])
    step_peaks = list(itertools.accumulate([int(before_fit["peak"])] + own_step_peaks,
                                           max))[1:]
    return {"times": times, "losses": losses, "step_peaks": step_peaks,
            "own_step_peaks": own_step_peaks,
            "before": before, "seconds": time.perf_counter() - t0}


def _sntf_fields(sntf) -> dict:
    """The result's sntf keys: the training graphs' reports in brief, the
    last figures the pass gave, and sntf's statistics (None without sntf)."""
    fields = dict.fromkeys(("training_reports", "nodes", "predicted_peak_bytes",
                            "planned_peak_bytes", "cached_peak_bytes", "lower_bound_bytes",
                            "outside_bytes", "pass_seconds",
                            "reports_total", "sntf_stats"))
    if sntf is None:
        return fields
    reports = sntf.reports()
    training = [r for r in reports if r.get("training")]
    keys = ("graph", "nodes", "predicted_peak_bytes", "planned_peak_bytes",
            "cached_peak_bytes", "lower_bound_bytes", "pass_seconds", "invocations", "action",
            "budget_bytes", "budget_fits", "achievable_peak_bytes",
            "predicted_seconds_added", "outside_bytes", "reason", "fit",
            "budget_target_bytes")
    fields["training_reports"] = [
        dict({k: r.get(k) for k in keys}, swapped=len(r.get("swapped") or ()),
             recomputed=len(r.get("recomputed") or ()))
        for r in training]
    fields["nodes"] = [r.get("nodes") for r in training]
    fields["reports_total"] = len(reports)
    fields["sntf_stats"] = sntf.stats()

    def last_known(key):
        # Grappler hands the train graph over twice; the graph that runs is
        # the last one handed over.
        values = [r.get(key) for r in training if r.get(key) is not None]
        return values[-1] if values else None

    for key in ("predicted_peak_bytes", "lower_bound_bytes", "planned_peak_bytes",
                "cached_peak_bytes", "outside_bytes"):
        fields[key] = last_known(key)
    if training:
        largest = max(training, key=lambda r: r.get("nodes") or 0)
        fields["pass_seconds"] = largest.get("pass_seconds")
    return fields


def main(argv=None):
    args = _parser().parse_args(argv)
    result = _run(args)
    line = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print("RESULT " + line, flush=True)
    return 0


def _median_run(runs: list) -> dict:
    """Of identical runs' results, the run with the median measured peak,
    with every run's peaks, wall seconds and step seconds added, its peak
    spread (max/min - 1) and the median step seconds (measure's repeats)."""
    peaks = [r["measured_peak_bytes"] for r in runs]
    chosen = dict(sorted(runs, key=lambda r: r["measured_peak_bytes"])[len(runs) // 2])
    chosen["measured_peaks_bytes"] = peaks
    chosen["peak_spread"] = max(peaks) / min(peaks) - 1.0 if min(peaks) else None
    chosen["wall_seconds_all"] = [r["wall_seconds"] for r in runs]
    times = sorted(r["seconds_per_step"] for r in runs
                   if r["seconds_per_step"] is not None)
    chosen["seconds_per_step_all"] = [r["seconds_per_step"] for r in runs]
    if times:
        chosen["seconds_per_step"] = times[len(times) // 2]
    return chosen


def measure(family, batch, steps=2, policy="off", depth=None, seed=1234,
            timeout=900, repeats=1, executor="default", input="dataset",
            recompute_mode=None, remat=None, budget=None, eager=False,
            settings="lab", limit_mib=None, pin_order=True, one_region=True):
    """Runs this worker in a fresh Python process (sys.executable) and returns
    its result dict, with wall_seconds added.

    With repeats > 1 it runs that many identical fresh processes and returns
    the run with the median measured peak, adding measured_peaks_bytes (all
    runs, in order), peak_spread (max/min - 1), wall_seconds_all and
    seconds_per_step_all; its seconds_per_step is the median over the runs
    (one run's swung by a third between identical runs on a shared 2-core
    machine, the baseline's included). One
    inter-op thread makes the peak repeatable only approximately: identical
    runs differ by up to a few percent now and then (thread timing in the
    executor and in Keras' tf.data input pipeline; the graphs are identical).

    limit_mib, when given, is a hard limit on the CPU allocator
    (TF_CPU_BFC_MEM_LIMIT_IN_MB): a step that needs more raises
    ResourceExhaustedError and the worker fails (RuntimeError here);
    one_region=False leaves the allocator growing by regions under it
    (sntf's one_region option).

    Raises:
      RuntimeError: the worker failed or printed no RESULT line (the message
        holds the end of its output).
    """
    if repeats > 1:
        runs = [measure(family, batch, steps, policy, depth, seed, timeout,
                        executor=executor, input=input,
                        recompute_mode=recompute_mode, remat=remat, budget=budget,
                        eager=eager, settings=settings, limit_mib=limit_mib,
                        pin_order=pin_order, one_region=one_region)
                for _ in range(repeats)]
        return _median_run(runs)
    command = [sys.executable, os.path.abspath(__file__), "--family", family,
               "--batch", str(batch), "--steps", str(steps), "--policy", policy,
               "--seed", str(seed), "--executor", executor, "--input", input,
               "--settings", settings, "--pin-order", "on" if pin_order else "off",
               "--one-region", "on" if one_region else "off"]
    if depth is not None:
        command += ["--depth", str(depth)]
    if recompute_mode is not None:
        command += ["--recompute-mode", recompute_mode]
    if remat is not None:
        command += ["--remat", remat]
    if budget is not None:
        command += ["--budget", str(budget)]
    if eager:
        command += ["--eager"]
    env = dict(os.environ)
    env.update(SETTINGS[settings])
    for name in ("SNTF_POLICY", "SNTF_BUDGET"):  # the worker decides the policy
        env.pop(name, None)
    env.pop("TF_CPU_BFC_MEM_LIMIT_IN_MB", None)
    if limit_mib is not None:
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(int(limit_mib))
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)
    wall = time.perf_counter() - t0
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            result["wall_seconds"] = wall
            return result
    reports = [line for line in proc.stdout.splitlines() if line.startswith("SNTF_REPORTS ")]
    raise RuntimeError(f"measure_peak {family} batch {batch} policy {policy} "
                       f"failed (rc={proc.returncode})\n{''.join(reports[-1:])}"
                       f"\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-3000:]}")


if __name__ == "__main__":
    # Before anything can import TensorFlow (_run sets --settings' values).
    os.environ.update(MEASURE_ENV)
    for _name in ("SNTF_POLICY", "SNTF_BUDGET"):  # the worker decides the policy
        os.environ.pop(_name, None)
    sys.exit(main())
