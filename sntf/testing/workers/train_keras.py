"""Trains a small Keras model for a few steps in a fresh process.

Used by the end-to-end tests: each configuration (with or without sntf) runs
in its own process, because the Grappler plugin cannot be unloaded and the
CPU allocator's peak cannot be reset (docs/tensorflow.md).

    python train_keras.py --model cnn --steps 5 --out result.npz [--sntf off]

Prints one JSON line with the losses, the measured CPU:0 peak, and the sntf
reports (when enabled).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def build_model(name, keras):
    layers = keras.layers
    if name == "cnn":
        return keras.Sequential([
            keras.Input((16, 16, 3)),
            layers.Conv2D(8, 3, padding="same", activation="relu"),
            layers.BatchNormalization(),
            layers.MaxPooling2D(),
            layers.Conv2D(16, 3, padding="same", activation="relu"),
            layers.BatchNormalization(),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dropout(0.3),
            layers.Dense(10),
        ])
    if name == "mlp":
        return keras.Sequential([keras.Input((32,)), layers.Dense(64, activation="relu"),
                                 layers.Dense(10)])
    if name == "lstm":
        # A while loop in the training graph (control flow).
        return keras.Sequential([keras.Input((12, 8)), layers.LSTM(16),
                                 layers.Dense(10)])
    raise ValueError(f"unknown model {name!r}")


def input_shape(name):
    return {"cnn": (16, 16, 3), "mlp": (32,), "lstm": (12, 8)}[name]


def fit_custom_loop(model, x, y, batch, losses, tf, keras):
    """A user's own training loop: tf.GradientTape inside a tf.function."""
    optimizer = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for i in range(0, len(x), batch):
        losses.append(float(step(tf.constant(x[i:i + batch]),
                                 tf.constant(y[i:i + batch]))))


def _arguments():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sntf", default=None,
                        help="policy to enable; omitted: sntf is not imported")
    parser.add_argument("--identity-rewrite", action="store_true")
    parser.add_argument("--recompute-mode", default=None,
                        help="recompute_mode option (with --sntf recompute)")
    parser.add_argument("--swap-min-bytes", type=int, default=None,
                        help="swap_min_bytes option (with --sntf swap...)")
    parser.add_argument("--family", default=None,
                        help="a model family of sntf.models instead of --model")
    parser.add_argument("--evaluate", action="store_true",
                        help="also run evaluate() and predict()")
    parser.add_argument("--mixed-precision", default=None,
                        help="a Keras dtype policy, e.g. mixed_bfloat16")
    parser.add_argument("--custom-loop", action="store_true",
                        help="train with a tf.function GradientTape loop, not fit()")
    parser.add_argument("--budget", type=int, default=None,
                        help="budget in bytes (with --sntf auto)")
    parser.add_argument("--no-batch-option", action="store_true",
                        help="enable sntf without batch_size: the batch comes "
                             "from the input fit() feeds")
    parser.add_argument("--extra-samples", type=int, default=0,
                        help="samples beyond steps*batch: a last partial batch")
    parser.add_argument("--pin-order", default="on", choices=("on", "off"),
                        help="sntf's pin_order option")
    parser.add_argument("--min-gain", type=float, default=0.0,
                        help="sntf's min_gain option; 0 here, not the library's "
                             "0.05: the models are small, and what is tested is "
                             "that a rewrite trains identically, not that it "
                             "saves 5%%")
    parser.add_argument("--steps-per-execution", type=int, default=1,
                        help="Keras' steps_per_execution: fit() runs this many "
                             "steps in a while loop per call (one loss logged "
                             "per call)")
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def _enable(args) -> None:
    import sntf

    options = {"identity_rewrite": args.identity_rewrite,
               "pin_order": args.pin_order == "on", "min_gain": args.min_gain}
    if args.recompute_mode:
        options["recompute_mode"] = args.recompute_mode
    if args.swap_min_bytes is not None:
        options["swap_min_bytes"] = args.swap_min_bytes
    if not args.no_batch_option:
        options["batch_size"] = args.batch
    sntf.enable(policy=args.sntf, budget=args.budget, **options)


def _model_and_data(args, keras, np):
    n = args.steps * args.batch + args.extra_samples
    if args.family:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.dirname(os.path.abspath(__file__))))))
        from sntf import models

        return models.build(args.family), *models.make_data(args.family, n, seed=7)
    model = build_model(args.model, keras)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    rng = np.random.default_rng(7)
    x = rng.random((n,) + input_shape(args.model), dtype=np.float32)
    return model, x, rng.integers(0, 10, n)


def _train(args, tf, keras, model, x, y) -> tuple[list, dict]:
    """Trains (and evaluates); returns the losses and, per phase, how many
    reports sntf had made by its end."""
    losses, phases = [], {}

    class StepLosses(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            losses.append(float(logs["loss"]))

    def mark(phase):
        if args.sntf is not None:
            import sntf

            phases[phase] = len(sntf.reports())

    if args.custom_loop:
        fit_custom_loop(model, x, y, args.batch, losses, tf, keras)
    else:
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[StepLosses()])
    mark("fit")
    if args.evaluate:
        model.evaluate(x, y, batch_size=args.batch, verbose=0)
        mark("evaluate")
        model.predict(x, batch_size=args.batch, verbose=0)
        mark("predict")
    return losses, phases


def main():
    args = _arguments()
    import numpy as np
    import tensorflow as tf
    import keras

    if args.sntf is not None:
        _enable(args)
    tf.config.experimental.enable_op_determinism()
    if args.mixed_precision:
        keras.mixed_precision.set_global_policy(args.mixed_precision)
    keras.utils.set_random_seed(1234)
    model, x, y = _model_and_data(args, keras, np)
    # Read when fit() first builds its train function, after compile().
    model.steps_per_execution = args.steps_per_execution
    losses, phases = _train(args, tf, keras, model, x, y)
    weights = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    np.savez(args.out, **weights)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    result = {"losses": losses, "peak_bytes": peak, "reports": None,
              "phases": phases}
    if args.sntf is not None:
        import sntf

        result["reports"] = [
            {k: r[k] for k in ("graph", "training", "nodes", "action", "reason",
                               "invocations", "swapped", "recomputed", "batch",
                               "batch_source", "budget_bytes", "budget_fits",
                               "planned_peak_bytes", "predicted_peak_bytes")}
            for r in sntf.reports()]
        result["stats"] = sntf.stats()
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
