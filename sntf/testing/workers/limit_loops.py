"""Trains a pre-activation ResNet with one of Keras' or TensorFlow's
training loops, in a fresh process, and prints its losses, a digest of its
weights, the allocator's peak and sntf's training report.

    python limit_loops.py --loop fit|train_on_batch|custom [--blocks 10]
                          [--batch 32] [--steps 3] [--sntf]

fit: model.fit one batch per call; train_on_batch; custom: a tf.function
step with a GradientTape and the model's optimizer. With --sntf, plain
sntf.enable() is called before the model is built. A step that runs out of
memory ends the run with "oom" in the result. The allocator settings come
from the environment (TF_CPU_ALLOCATOR_USE_BFC, TF_CPU_BFC_MEM_LIMIT_IN_MB).
"""

import argparse
import hashlib
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _model(keras, blocks: int):
    from keras import layers

    keras.utils.set_random_seed(1234)

    def conv(t):
        return layers.Conv2D(16, 3, padding="same")(t)

    inp = keras.Input((32, 32, 3))
    x = conv(inp)
    for _ in range(blocks):
        h = conv(layers.ReLU()(layers.BatchNormalization()(x)))
        h = conv(layers.ReLU()(layers.BatchNormalization()(h)))
        x = layers.Add()([x, h])
    out = layers.Dense(10)(layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _custom_step(tf, model):
    loss_fn = model.loss

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loop", choices=("fit", "train_on_batch", "custom"),
                        required=True)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sntf", action="store_true")
    args = parser.parse_args()
    import numpy as np
    import tensorflow as tf

    if args.sntf:
        import sntf

        sntf.enable()
    import keras

    model = _model(keras, args.blocks)
    r = np.random.RandomState(6)
    xs = r.rand(args.batch, 32, 32, 3).astype("float32")
    ys = r.randint(0, 10, args.batch)
    losses, oom = [], False
    try:
        if args.loop == "fit":
            for _ in range(args.steps):
                history = model.fit(xs, ys, batch_size=args.batch, epochs=1, verbose=0,
                                    shuffle=False)
                losses.append(float(history.history["loss"][0]))
        elif args.loop == "train_on_batch":
            losses = [float(model.train_on_batch(xs, ys)) for _ in range(args.steps)]
        else:
            step = _custom_step(tf, model)
            losses = [float(step(xs, ys)) for _ in range(args.steps)]
    except tf.errors.ResourceExhaustedError:
        oom = True
    digest = hashlib.sha256(b"".join(np.asarray(w).tobytes()
                                     for w in model.get_weights())).hexdigest()
    out = {"losses": losses, "oom": oom, "digest": digest,
           "peak": tf.config.experimental.get_memory_info("CPU:0")["peak"], "report": {}}
    if args.sntf:
        import sntf

        training = [rep for rep in sntf.reports() if rep.get("training")]
        if training:
            out["report"] = {k: training[-1].get(k) for k in (
                "action", "reason", "device_limit_bytes", "device_limit_fits",
                "planned_peak_bytes", "predicted_peak_bytes", "lower_bound_bytes")}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
