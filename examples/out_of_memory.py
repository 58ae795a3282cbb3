"""A model that runs out of memory under a hard limit, and trains with sntf.

    python examples/out_of_memory.py [--model wide_preact] [--fraction 0.6]
                                     [--steps 4]

A GPU's memory is a hard limit: TensorFlow's allocator packs into it and
fails with ResourceExhaustedError when a step needs more. TensorFlow's CPU
allocator takes the same kind of limit (TF_CPU_ALLOCATOR_USE_BFC=true
TF_CPU_BFC_MEM_LIMIT_IN_MB=N), which is how this example shows the story on
any machine. Each run is a fresh process:

  1. TensorFlow alone, no limit: its peak P and its losses;
  2. TensorFlow alone under a limit of fraction x P: out of memory;
  3. the same script with `sntf.enable()` added, under the same limit: it
     trains, with the same losses as run 1.

oneDNN is off in every run: with it on, TensorFlow's oneDNN convolution
aborts the process on a refused allocation instead of raising
ResourceExhaustedError. The model is one of sntf.testing.zoo's
architectures (default: a wide pre-activation ResNet, batch 32), ordinary
Keras code compiled with SGD and momentum.
"""

import json
import os
import subprocess
import sys
import time

ENV = {"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPU_ALLOCATOR_USE_BFC": "true",
       "TF_CPP_MIN_LOG_LEVEL": "2"}


def train(with_sntf: bool, name: str, steps: int) -> None:
    """Runs in the child process: trains and prints one JSON line; a step
    that runs out of memory prints that instead."""
    import tensorflow as tf
    import keras

    from sntf.testing import zoo

    if with_sntf:
        import sntf

        sntf.enable()
    tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(0)
    model = zoo.build(name)
    batch = zoo.default_batch(name)
    x, y = zoo.make_data(name, batch * steps)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    times = []

    class StepTimes(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)

    try:
        history = model.fit(data, epochs=1, verbose=0, shuffle=False,
                            callbacks=[StepTimes()])
    except tf.errors.ResourceExhaustedError as e:
        print("RESULT " + json.dumps({"out_of_memory": str(e).splitlines()[0][:200],
                                      "plan": _plan(with_sntf)}))
        return
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    # The first step traces and rewrites the graph: the median of the others.
    later = sorted(times[1:]) or times
    print("RESULT " + json.dumps({"peak_bytes": peak, "loss": history.history["loss"],
                                  "seconds_per_step": later[len(later) // 2],
                                  "weights": [w.numpy().tobytes().hex()[:64]
                                              for w in model.weights],
                                  "plan": _plan(with_sntf)}))


def _plan(with_sntf: bool) -> dict:
    """What sntf planned for the training step: its planned peak, and
    whether its model of the allocator fits that plan under the limit."""
    if not with_sntf:
        return {}
    import sntf

    training = [r for r in sntf.reports() if r.get("training")]
    if not training:
        return {}
    return {k: training[-1].get(k) for k in ("planned_peak_bytes", "device_limit_fits",
                                             "lower_bound_bytes")}


def run(child: str, name: str, steps: int, limit_mib=None, timeout: float = 1800.0) -> dict:
    """One fresh process; its RESULT, or how it failed.

    Under a hard limit TensorFlow's allocator can retry an allocation for
    ever instead of raising ResourceExhaustedError: a run under a limit that
    outlasts `timeout` seconds is killed and counted as out of memory."""
    env = dict(os.environ, **ENV)
    if limit_mib is not None:
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(limit_mib)
    command = [sys.executable, __file__, "--child", child, "--model", name,
               "--steps", str(steps)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        if limit_mib is None:
            return {"failed": f"no result in {timeout:g} s", "stderr": ""}
        return {"out_of_memory": f"no result in {timeout:g} s under the limit "
                                 "(the allocator retrying)", "plan": {}}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"failed": f"exit code {proc.returncode}", "stderr": proc.stderr[-2000:]}


def _describe(result: dict) -> str:
    if "out_of_memory" in result:
        return "out of memory (ResourceExhaustedError)"
    if "failed" in result:
        return f"failed: {result['failed']}"
    return f"trains, device peak {result['peak_bytes'] / 2**20:.1f} MiB"


def main(argv) -> int:
    from absl import flags

    args = flags.FLAGS
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {' '.join(argv[1:])}")
    if args.child is not None:
        train(args.child == "sntf", args.model, args.steps)
        return 0
    print(f"Training {args.model!r} ({args.steps} steps) in fresh processes ...")
    base = run("tensorflow", args.model, args.steps)
    if "peak_bytes" not in base:
        raise SystemExit(f"TensorFlow alone did not train without a limit: {base}")
    limit = max(1, int(args.fraction * base["peak_bytes"] / 2**20))
    alone = run("tensorflow", args.model, args.steps, limit)
    with_sntf = run("sntf", args.model, args.steps, limit)
    print(f"  TensorFlow alone, no limit      : device peak "
          f"{base['peak_bytes'] / 2**20:.1f} MiB")
    print(f"  TensorFlow alone, limit {limit} MiB : {_describe(alone)}")
    print(f"  with sntf.enable(), same limit  : {_describe(with_sntf)}")
    if "loss" in with_sntf:
        same = (with_sntf["loss"] == base["loss"]
                and with_sntf["weights"] == base["weights"])
        print(f"  identical losses and weights    : {same}")
    if "stderr" in with_sntf:
        sys.stderr.write(with_sntf["stderr"])
    return 0


def _define_flags(flags) -> None:
    flags.DEFINE_float("fraction", 0.6, "the limit as a fraction of TensorFlow's peak",
                       lower_bound=0.05, upper_bound=1.0)
    flags.DEFINE_string("model", "wide_preact", "an architecture of sntf.testing.zoo")
    flags.DEFINE_integer("steps", 4, "training steps", lower_bound=1)
    flags.DEFINE_enum("child", None, ["tensorflow", "sntf"],
                      "(internal) train one configuration")


if __name__ == "__main__":
    from absl import app, flags

    _define_flags(flags)
    app.run(main)
