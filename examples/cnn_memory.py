"""Train a Keras CNN with model.fit, without and with sntf, and compare memory.

    python examples/cnn_memory.py [--fraction 0.75] [--policy auto] [--batch 64]
                                  [--steps 10]

It trains the model once with TensorFlow alone, then once more with
`sntf.enable(budget=...)`, the budget being `fraction` of the first run's
measured peak. Each configuration runs in a fresh process: the Grappler
plugin cannot be unloaded, and TensorFlow's allocator peak cannot be reset.
The model code is the same in both; the only difference is the enable call.

The "device peak" is the peak of TensorFlow's CPU:0 device allocator
(tf.config.experimental.get_memory_info), measured with the BFC CPU allocator
so that every allocation is counted, and with one inter-op thread so that the
executor's order (and so the peak) repeats from run to run. Tensors parked in sntf's host pool are
not device memory, just as pinned host memory does not count against a GPU.
"""

import json
import os
import subprocess
import sys

MEASURE_ENV = {"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPU_ALLOCATOR_USE_BFC": "true",
               "TF_CPP_MIN_LOG_LEVEL": "2"}


def build_model(keras):
    """A VGG-style CNN for 32x32 RGB images; ordinary Keras, nothing sntf-specific."""
    layers = keras.layers
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.BatchNormalization(),
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(),
        layers.Conv2D(64, 3, padding="same", activation="relu"),
        layers.BatchNormalization(),
        layers.Conv2D(64, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(),
        layers.Flatten(),
        layers.Dropout(0.3),
        layers.Dense(128, activation="relu"),
        layers.Dense(10),
    ])


def train(policy, batch, steps, budget):
    """Runs in the child process: trains and prints one JSON line."""
    import numpy as np
    import tensorflow as tf
    import keras

    # One inter-op thread: the executor then runs ops in a repeatable order,
    # so the peak is a property of the graph rather than of thread timing.
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if policy != "none":
        import sntf

        # No batch_size needed: sntf takes the batch from what fit() feeds.
        sntf.enable(policy=policy, budget=budget)
    keras.utils.set_random_seed(0)
    model = build_model(keras)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.random((batch * steps, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, batch * steps)
    # A plain tf.data pipeline: Keras' own adapter for numpy arrays keeps
    # shuffled copies and prefetched batches on the device (about 35 MiB
    # here), memory outside the training graph that no plan can move.
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    history = model.fit(data, epochs=1, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    result = {"policy": policy, "peak_bytes": peak,
              "loss": float(history.history["loss"][-1])}
    if policy != "none":
        import sntf

        trained = [r for r in sntf.reports() if r["training"]]
        result["training_graphs"] = len(trained)
        result["actions"] = sorted({r["action"] for r in trained})
        result["pool_peak_bytes"] = sntf.stats()["pool"]["peak_bytes_in_use"]
        budgeted = [r for r in trained if r["budget_bytes"] is not None]
        if budgeted:
            result["plan_fits"] = all(r["budget_fits"] for r in budgeted)
            result["planned_peak_bytes"] = budgeted[-1]["planned_peak_bytes"]
        # One line per training graph: its peaks, and why its plan fits the
        # budget's target or why none does.
        result["summary"] = sntf.summary()
    print("RESULT " + json.dumps(result))


def run_child(policy, batch, steps, budget=None):
    env = dict(os.environ, **MEASURE_ENV)
    command = [sys.executable, __file__, "--child", policy, "--batch", str(batch),
               "--steps", str(steps)]
    if budget is not None:
        command += ["--budget", str(budget)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    sys.stderr.write(proc.stderr[-4000:])
    raise SystemExit(f"the {policy!r} run failed (exit code {proc.returncode})")


def _define_flags(flags) -> None:
    """The example's flags (absl, like every sntf tool). Defined only when the
    example runs as a script: tools/sntf_dump imports it for build_model."""
    flags.DEFINE_string("policy", "auto", "sntf policy")
    flags.DEFINE_float("fraction", 0.75,
                       "budget as a fraction of TensorFlow's measured peak, in (0, 1]",
                       lower_bound=0.0, upper_bound=1.0)
    flags.DEFINE_integer("batch", 64, "batch size", lower_bound=1)
    flags.DEFINE_integer("steps", 10, "training steps", lower_bound=1)
    # Internal: the fresh child processes the example starts.
    flags.DEFINE_string("child", None, "(internal) train one configuration")
    flags.DEFINE_integer("budget", None, "(internal) the child's budget in bytes")


def main(argv):
    from absl import flags

    args = flags.FLAGS
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {' '.join(argv[1:])}")
    if args.child is not None:
        train(args.child, args.batch, args.steps, args.budget)
        return
    if args.fraction == 0:
        raise SystemExit(f"--fraction must lie in (0, 1], got {args.fraction}")
    print(f"Training the same Keras CNN twice (batch {args.batch}, {args.steps} "
          "steps), each in a fresh process ...")
    base = run_child("none", args.batch, args.steps)
    budget = int(args.fraction * base["peak_bytes"])
    with_sntf = run_child(args.policy, args.batch, args.steps, budget)
    mib = 2**20
    peak = with_sntf["peak_bytes"]
    print(f"  TensorFlow alone : device peak {base['peak_bytes'] / mib:7.1f} MiB"
          f"   final loss {base['loss']:.6f}")
    print(f"  with sntf        : device peak {peak / mib:7.1f} MiB"
          f"   final loss {with_sntf['loss']:.6f}   (policy {args.policy!r}, budget "
          f"{budget / mib:.1f} MiB = {args.fraction:g} x TensorFlow's peak)")
    print(f"  peak / budget    : {peak / budget:.3f}   host pool peak "
          f"{with_sntf['pool_peak_bytes'] / mib:.1f} MiB   plan fits the budget: "
          f"{'yes' if with_sntf.get('plan_fits') else 'no (best effort)'}")
    print(f"  identical loss   : {with_sntf['loss'] == base['loss']}   (training "
          f"graphs seen by sntf: {with_sntf['training_graphs']}, actions: "
          f"{', '.join(with_sntf['actions'])})")
    if not with_sntf.get("plan_fits", True):
        # The plan must fit a target below the budget: it holds back a
        # margin for the analysis' error, what the device holds outside the
        # graph, and the step's largest request for the allocator's
        # rounding. sntf then applies the lowest plan it found.
        print("  sntf.summary()   : " + with_sntf["summary"].replace("\n", "\n" + " " * 21))


if __name__ == "__main__":
    from absl import app, flags

    _define_flags(flags)
    app.run(main)
