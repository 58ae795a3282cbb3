"""Trains a deep ResNet for a few steps in a fresh process and prints its
losses, a digest of its weights and sntf's training report.

    python resnet_identity.py --blocks 30 --batch 32 --steps 3 --policy swap
                             [--arch pre|post] [--width 16] [--no-bias]
                             [--pool] [--verify] [--exact-sums]

pre: BN-ReLU-conv twice, then the sum (pre-activation); post: conv-BN-ReLU,
conv-BN, the sum, then ReLU (the original ResNet block).

One process per configuration: the Grappler plugin cannot be unloaded. Op
determinism is on and the step runs on one inter-op thread, so a run
without sntf repeats bit for bit (docs/tensorflow.md); --pool leaves
TensorFlow's default inter-op pool. --verify then checks the policy's
rewrite of the step with sntf.verify on the same batch (its verdict and
the sums it names go into the result); --exact-sums enables sntf with
exact_sums=True.
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
    parser.add_argument("--pool", action="store_true")
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--exact-sums", dest="exact_sums", action="store_true")
    args = parser.parse_args()
    import numpy as np
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()
    if not args.pool:
        tf.config.threading.set_inter_op_parallelism_threads(1)
    if args.policy != "none":
        import sntf

        sntf.enable(policy=args.policy, **({"exact_sums": True} if args.exact_sums else {}))
    import keras

    keras.utils.set_random_seed(1234)
    from sntf.testing.deep import preact_resnet

    model = preact_resnet(args.blocks, args.width, args.bias, args.arch)
    r = np.random.RandomState(6)
    xs = r.rand(args.batch, 32, 32, 3).astype("float32")
    ys = r.randint(0, 10, args.batch)
    losses = [float(model.train_on_batch(xs, ys)) for _ in range(args.steps)]
    digest = hashlib.sha256(b"".join(np.asarray(w).tobytes()
                                     for w in model.get_weights())).hexdigest()
    try:
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    except ValueError:   # TensorFlow's default CPU allocator keeps no statistics
        peak = None
    out = {"losses": losses, "digest": digest, "peak": peak, "report": {}}
    if args.policy != "none":
        import sntf

        training = [rep for rep in sntf.reports() if rep.get("training")]
        if training:
            out["report"] = {k: training[-1].get(k) for k in (
                "action", "reason", "order_dependent_sums", "planned_peak_bytes",
                "predicted_peak_bytes", "nodes")}
            out["report"]["swapped"] = len(training[-1].get("swapped") or ())
            out["report"]["recomputed"] = len(training[-1].get("recomputed") or ())
        if args.verify:
            result = sntf.verify(model, xs, ys, policy=args.policy)
            out["verify"] = {"verdict": result.verdict, "ok": result.ok,
                             "ordered_sums": list(result.ordered_sums),
                             "text": str(result)}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
