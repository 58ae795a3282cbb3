"""Trains a deep ResNet for a few steps in a fresh process and prints its
losses, a digest of its weights and sntf's training report.

    python resnet_identity.py --blocks 30 --batch 32 --steps 3 --policy swap
                             [--arch pre|post] [--width 16] [--no-bias]

pre: BN-ReLU-conv twice, then the sum (pre-activation); post: conv-BN-ReLU,
conv-BN, the sum, then ReLU (the original ResNet block).

One process per configuration: the Grappler plugin cannot be unloaded. Op
determinism is on and the step runs on one inter-op thread, so a run
without sntf repeats bit for bit (docs/tensorflow.md).
"""

import argparse
import hashlib
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--policy", default="none")
    parser.add_argument("--arch", choices=("pre", "post"), default="pre")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--no-bias", dest="bias", action="store_false")
    args = parser.parse_args()
    import numpy as np
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if args.policy != "none":
        import sntf

        sntf.enable(policy=args.policy)
    import keras
    from keras import layers

    keras.utils.set_random_seed(1234)

    def conv(t):
        return layers.Conv2D(args.width, 3, padding="same", use_bias=args.bias)(t)

    inp = keras.Input((32, 32, 3))
    x = conv(inp)
    for _ in range(args.blocks):
        if args.arch == "pre":
            h = conv(layers.ReLU()(layers.BatchNormalization()(x)))
            h = conv(layers.ReLU()(layers.BatchNormalization()(h)))
            x = layers.Add()([x, h])
        else:
            h = layers.ReLU()(layers.BatchNormalization()(conv(x)))
            h = layers.BatchNormalization()(conv(h))
            x = layers.ReLU()(layers.Add()([x, h]))
    out = layers.Dense(10)(layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.001, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    r = np.random.RandomState(6)
    xs = r.rand(args.batch, 32, 32, 3).astype("float32")
    ys = r.randint(0, 10, args.batch)
    losses = [float(model.train_on_batch(xs, ys)) for _ in range(args.steps)]
    digest = hashlib.sha256(b"".join(np.asarray(w).tobytes()
                                     for w in model.get_weights())).hexdigest()
    report = {}
    if args.policy != "none":
        import sntf

        training = [rep for rep in sntf.reports() if rep.get("training")]
        if training:
            report = {k: training[-1].get(k) for k in (
                "action", "order_dependent_sums", "planned_peak_bytes",
                "predicted_peak_bytes", "nodes")}
    print("RESULT " + json.dumps({"losses": losses, "digest": digest, "report": report}))


if __name__ == "__main__":
    main()
