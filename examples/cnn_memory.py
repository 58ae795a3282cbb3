"""Train a Keras CNN with model.fit, without and with sntf, and compare memory.

    python examples/cnn_memory.py [--policy off] [--batch 64] [--steps 10]

Each configuration runs in a fresh process: the Grappler plugin cannot be
unloaded, and TensorFlow's allocator peak cannot be reset. The model code is
the same in both; the only difference is `sntf.enable(...)`.

The "device peak" is the peak of TensorFlow's CPU:0 device allocator
(tf.config.experimental.get_memory_info), measured with the BFC CPU allocator
so that every allocation is counted, and with one inter-op thread so that the
executor's order (and so the peak) repeats from run to run. Tensors parked in sntf's host pool are
not device memory, just as pinned host memory does not count against a GPU.
"""

import argparse
import json
import os
import subprocess
import sys

# The most capable policy this version implements comes first.
POLICY_PREFERENCE = ("auto", "swap+recompute", "recompute", "swap", "off")
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


def train(policy, batch, steps):
    """Runs in the child process: trains and prints one JSON line."""
    import numpy as np
    import tensorflow as tf
    import keras

    # One inter-op thread: the executor then runs ops in a repeatable order,
    # so the peak is a property of the graph rather than of thread timing.
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if policy != "none":
        import sntf

        # Keras traces the step with an unknown batch dimension; batch_size
        # gives the planner byte sizes (swap thresholds are in bytes).
        sntf.enable(policy=policy, batch_size=batch)
    keras.utils.set_random_seed(0)
    model = build_model(keras)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.random((batch * steps, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, batch * steps)
    history = model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    result = {"policy": policy, "peak_bytes": peak,
              "loss": float(history.history["loss"][-1])}
    if policy != "none":
        import sntf

        trained = [r for r in sntf.reports() if r["training"]]
        result["training_graphs"] = len(trained)
        result["actions"] = sorted({r["action"] for r in trained})
        result["pool_peak_bytes"] = sntf.stats()["pool"]["peak_bytes_in_use"]
    print("RESULT " + json.dumps(result))


def run_child(policy, batch, steps):
    env = dict(os.environ, **MEASURE_ENV)
    proc = subprocess.run([sys.executable, __file__, "--child", policy, "--batch",
                           str(batch), "--steps", str(steps)],
                          capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    sys.stderr.write(proc.stderr[-4000:])
    raise SystemExit(f"the {policy!r} run failed (exit code {proc.returncode})")


def best_policy():
    from sntf import config

    return next(p for p in POLICY_PREFERENCE if p in config.IMPLEMENTED_POLICIES)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default=None,
                        help="sntf policy (default: the most capable one implemented)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        train(args.child, args.batch, args.steps)
        return
    policy = args.policy or best_policy()
    print(f"Training the same Keras CNN twice (batch {args.batch}, {args.steps} "
          "steps), each in a fresh process ...")
    base = run_child("none", args.batch, args.steps)
    with_sntf = run_child(policy, args.batch, args.steps)
    mib = 2**20
    ratio = with_sntf["peak_bytes"] / base["peak_bytes"]
    print(f"  TensorFlow alone       : device peak {base['peak_bytes'] / mib:9.1f} MiB"
          f"   final loss {base['loss']:.6f}")
    print(f"  with sntf ({policy:>13}): device peak "
          f"{with_sntf['peak_bytes'] / mib:9.1f} MiB   final loss "
          f"{with_sntf['loss']:.6f}   host pool peak "
          f"{with_sntf['pool_peak_bytes'] / mib:.1f} MiB")
    print(f"  ratio sntf / TensorFlow: {ratio:.3f}   (training graphs seen by "
          f"sntf: {with_sntf['training_graphs']}, actions: "
          f"{', '.join(with_sntf['actions'])})")
    if policy == "off":
        print("  Policy 'off' loads sntf and inspects every graph but changes "
              "none, so the ratio is 1.0 by design; swapping and recomputation "
              "arrive with their policies.")


if __name__ == "__main__":
    main()
