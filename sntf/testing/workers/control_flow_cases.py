"""Trains one "odd graph" case with and without sntf, in one fresh process.

    python control_flow_cases.py [--cases gru,ragged] [--policies recompute,swap+recompute]

Cases (what TensorFlow puts in the training graph):
  gru           Keras GRU under fit(): a While loop (Keras' RNN on CPU)
  cond_layer    a custom Keras layer calling tf.cond on its input: If ops
  cond_step     a tf.function GradientTape step whose loss goes through tf.cond
  ragged        tf.RaggedTensor ids -> embedding lookup -> mean over the
                ragged axis -> dense -> loss, in a tf.function with a ragged
                input_signature (raw variables: Keras layers take no ragged)
  two_outputs   a functional Keras model (with BatchNormalization) with two
                heads and two losses (loss weights) under fit()
  tf1_session   TF1 graph mode: placeholders, resource variables,
                GradientDescentOptimizer.minimize, tf.compat.v1.Session
  tf1_session_ref  the same with TF1 reference variables (VariableV2 and
                ApplyGradientDescent)

The process first trains every case with sntf not even imported (the
plugin is not loaded: the true baseline), then, for each policy, enables
sntf with it and trains every case again from the same seed (new models and
new graphs, so Grappler hands the new graphs to the pass), and at the end
disables sntf and trains once more (graphs built after disable() are left
alone). One process for all cases: TensorFlow's import dominates a case.
Prints

    RESULT {"runs": {case: [{"policy", "losses", "weights", "reports"}, ...]}}

where weights are sha256 digests of the final weights' bytes (bitwise
comparison) and reports are the sntf reports produced during that run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
STEPS = 3
BATCH = 8


def _digest(arrays) -> list[str]:
    import numpy as np

    return [hashlib.sha256(np.ascontiguousarray(a).tobytes()
                           + str(np.asarray(a).dtype).encode()).hexdigest()
            for a in arrays]


def _fit(model, x, y, keras, batch: int = BATCH) -> list[float]:
    losses: list[float] = []

    class StepLosses(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            losses.append(float(logs["loss"]))

    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[StepLosses()])
    return losses


def case_gru(tf, keras, np):
    model = keras.Sequential([keras.Input((12, 8)), keras.layers.GRU(16),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(7)
    x = rng.random((STEPS * BATCH, 12, 8), dtype=np.float32)
    y = rng.integers(0, 10, STEPS * BATCH)
    return _fit(model, x, y, keras), model.get_weights()


def case_cond_layer(tf, keras, np):
    class Gate(keras.layers.Layer):
        """ReLU where the batch mean is positive, else a halving: tf.cond."""

        def call(self, x):
            return tf.cond(tf.reduce_mean(x) > 0.0, lambda: tf.nn.relu(x),
                           lambda: 0.5 * x)

        def compute_output_shape(self, shape):
            return shape

    inputs = keras.Input((32,))
    h = Gate()(keras.layers.Dense(64)(inputs))
    h = Gate()(keras.layers.Dense(64)(h))
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(7)
    x = rng.standard_normal((STEPS * BATCH, 32), dtype=np.float32)
    y = rng.integers(0, 10, STEPS * BATCH)
    return _fit(model, x, y, keras), model.get_weights()


def case_cond_step(tf, keras, np):
    model = keras.Sequential([keras.Input((32,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = keras.optimizers.Adam(1e-3)
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            # A penalty only when the logits drift upwards: an If op whose
            # branches the backward pass differentiates.
            loss = tf.cond(tf.reduce_mean(logits) > 0.0,
                           lambda: ce(y, logits) + 0.01 * tf.reduce_mean(
                               tf.square(logits)),
                           lambda: ce(y, logits))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    rng = np.random.default_rng(7)
    x = rng.standard_normal((STEPS * BATCH, 32), dtype=np.float32)
    y = rng.integers(0, 10, STEPS * BATCH)
    losses = [float(step(tf.constant(x[i:i + BATCH]), tf.constant(y[i:i + BATCH])))
              for i in range(0, STEPS * BATCH, BATCH)]
    return losses, model.get_weights()


def case_ragged(tf, keras, np):
    vocab, dim = 50, 16
    table = tf.Variable(tf.random.stateless_normal([vocab, dim], seed=[1, 2]))
    w1 = tf.Variable(tf.random.stateless_normal([dim, 32], seed=[3, 4]) * 0.3)
    w2 = tf.Variable(tf.random.stateless_normal([32, 10], seed=[5, 6]) * 0.3)
    variables = [table, w1, w2]

    @tf.function(input_signature=[
        tf.RaggedTensorSpec([None, None], tf.int32, ragged_rank=1),
        tf.TensorSpec([None], tf.int32)])
    def step(ids, y):
        with tf.GradientTape() as tape:
            emb = tf.nn.embedding_lookup(table, ids)          # ragged [B, None, dim]
            pooled = tf.reduce_mean(emb, axis=1)              # dense [B, dim]
            h = tf.nn.relu(pooled @ w1)
            logits = h @ w2
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=logits))
        grads = tape.gradient(loss, variables)
        for v, g in zip(variables, grads):
            v.assign_sub(0.1 * tf.convert_to_tensor(g))
        return loss

    rng = np.random.default_rng(7)
    losses = []
    for _ in range(STEPS):
        lengths = rng.integers(1, 6, BATCH)
        values = rng.integers(0, vocab, int(lengths.sum())).astype(np.int32)
        ids = tf.RaggedTensor.from_row_lengths(values, lengths.astype(np.int64))
        y = tf.constant(rng.integers(0, 10, BATCH).astype(np.int32))
        losses.append(float(step(ids, y)))
    return losses, [v.numpy() for v in variables]


def case_two_outputs(tf, keras, np):
    layers = keras.layers
    inputs = keras.Input((32,))
    h = layers.Dense(128, activation="relu")(inputs)
    # BatchNormalization's cheap ops give recomputation something to do.
    h = layers.Activation("relu")(layers.BatchNormalization()(layers.Dense(64)(h)))
    cls = layers.Dense(10, name="cls")(h)
    reg = layers.Dense(1, name="reg")(layers.Dense(32, activation="relu")(h))
    model = keras.Model(inputs, {"cls": cls, "reg": reg})
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss={"cls": keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), "reg": keras.losses.MeanSquaredError()},
                  loss_weights={"cls": 1.0, "reg": 0.5})
    # A batch large enough for activations, not weights, to set the peak:
    # the planner keeps a plan only if the predicted peak falls.
    batch, rng = 128, np.random.default_rng(7)
    x = rng.standard_normal((STEPS * batch, 32), dtype=np.float32)
    y = {"cls": rng.integers(0, 10, STEPS * batch),
         "reg": rng.standard_normal((STEPS * batch, 1), dtype=np.float32)}
    return _fit(model, x, y, keras, batch), model.get_weights()


def _tf1(tf, np, use_resource: bool):
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        x = tf.compat.v1.placeholder(tf.float32, [None, 32], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
        h, variables = x, []
        for i, (n_in, n_out) in enumerate([(32, 64), (64, 64), (64, 10)]):
            w = tf.compat.v1.get_variable(
                f"w{i}", [n_in, n_out], use_resource=use_resource,
                initializer=tf.compat.v1.glorot_uniform_initializer(seed=i + 1))
            b = tf.compat.v1.get_variable(f"b{i}", [n_out], use_resource=use_resource,
                                          initializer=tf.compat.v1.zeros_initializer())
            variables += [w, b]
            h = tf.matmul(h, w) + b
            if i < 2:
                h = tf.nn.relu(h)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=h))
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        init = tf.compat.v1.global_variables_initializer()
    rng = np.random.default_rng(7)
    xs = rng.standard_normal((STEPS * BATCH, 32), dtype=np.float32)
    ys = rng.integers(0, 10, STEPS * BATCH).astype(np.int32)
    losses = []
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        for i in range(0, STEPS * BATCH, BATCH):
            _, value = sess.run([train, loss], {x: xs[i:i + BATCH], y: ys[i:i + BATCH]})
            losses.append(float(value))
        weights = sess.run(variables)
    return losses, weights


def case_tf1_session(tf, keras, np):
    return _tf1(tf, np, use_resource=True)


def case_tf1_session_ref(tf, keras, np):
    return _tf1(tf, np, use_resource=False)


CASES: dict[str, Callable] = {
    name[len("case_"):]: fn for name, fn in globals().items()
    if name.startswith("case_")}


def _summary(report: dict) -> dict:
    keys = ("graph", "training", "nodes", "action", "reason", "swapped",
            "recomputed", "error")
    return {k: report.get(k) for k in keys}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help="comma-separated cases (default: all)")
    parser.add_argument("--policies", default="recompute,swap+recompute")
    parser.add_argument("--min-gain", type=float, default=0.0,
                        help="sntf's min_gain option; 0 here, not the library's "
                             "0.05: the cases are small, and what is tested is "
                             "that a rewrite trains identically, not that it "
                             "saves 5%%")
    parser.add_argument("--swap-min-bytes", type=int, default=0,
                        help="0: swap even the tiny tensors of these models")
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; cases: {sorted(CASES)}")

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import numpy as np
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()
    import keras

    def train(case: str, policy: str, sntf=None) -> dict:
        keras.utils.set_random_seed(1234)
        before = len(sntf.reports()) if sntf else 0
        losses, weights = CASES[case](tf, keras, np)
        reports = sntf.reports()[before:] if sntf else []
        return {"policy": policy, "losses": losses, "weights": _digest(weights),
                "reports": [_summary(r) for r in reports]}

    # Every baseline first: sntf is not even imported (no plugin loaded).
    runs = {case: [train(case, "none")] for case in cases}
    import sntf

    for policy in args.policies.split(","):
        sntf.enable(policy=policy, swap_min_bytes=args.swap_min_bytes,
                    min_gain=args.min_gain, batch_size=BATCH)
        for case in cases:
            runs[case].append(train(case, policy, sntf))
    sntf.disable()
    for case in cases:
        runs[case].append(train(case, "disabled", sntf))
    print("RESULT " + json.dumps({"runs": runs}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
