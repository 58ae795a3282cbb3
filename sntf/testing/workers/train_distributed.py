"""Trains a small Keras model under tf.distribute in a fresh process.

    python train_distributed.py --strategy mirrored --family vgg --out w.npz
                                [--sntf swap+recompute] [--swap-min-bytes 4096]
    TF_CONFIG=... python train_distributed.py --strategy multiworker ...

--strategy mirrored: MirroredStrategy over two logical CPU devices of this
    process (configured before anything initialises the devices).
--strategy multiworker: MultiWorkerMirroredStrategy; TF_CONFIG (set by the
    caller) names this worker and its peers. Every worker runs this script.

Prints one line "RESULT {json}" with the step losses, the sntf reports of
every training graph, and, for each graph sntf rewrote, the placement
checks of `check_placement` (computed here, because GraphDefs do not travel
as JSON). Writes the model weights to --out (npz). With --measure it also
records step times and get_memory_info of every logical CPU device (for
benchmarks/bench_distribute.py).

Each configuration (with or without sntf) runs in its own process: the
Grappler plugin cannot be unloaded and the CPU allocator's peak cannot be
reset (docs/tensorflow.md).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from typing import Any, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

# Op types that move data between replicas. sntf must never clone, swap or
# rewire them: a recomputed collective would join a second, unmatched
# all-reduce and hang or corrupt every replica.
COLLECTIVE_PREFIXES = ("Collective", "Nccl", "_Nccl", "_Send", "_Recv",
                       "_HostSend", "_HostRecv")

SNTF_OPS = ("SnSwapOut", "SnSwapIn", "SnCacheOut", "SnCacheIn")


def free_ports(n: int) -> list[int]:
    """Loopback ports free right now (bound together, so distinct), for the
    TF_CONFIG of local MultiWorkerMirroredStrategy workers."""
    import socket

    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def is_collective(op: str) -> bool:
    """Whether an op type is a cross-replica communication op."""
    return op.startswith(COLLECTIVE_PREFIXES)


def _parse_input(text: str) -> tuple[str, bool]:
    """(producer name, is_control) of a NodeDef input string."""
    if text.startswith("^"):
        return text[1:], True
    name, sep, port = text.rpartition(":")
    return (name if sep and port.isdigit() else text), False


def check_placement(original, rewritten) -> dict:
    """Checks that sntf's rewrite of a multi-device graph respects devices.

    Args:
      original: the GraphDef Grappler handed to sntf.
      rewritten: the GraphDef sntf handed back.

    Returns:
      A JSON-able dict:
        sntf_nodes: {device: {role: count}} of the nodes sntf added;
        served_mismatch: sntf nodes whose device differs from the device of
          the node whose tensor they serve (recompute clone -> its source,
          swap node -> the producer of the swapped tensor);
        input_crossing: data inputs of sntf nodes, or of nodes sntf rewired,
          whose producer sits on another device than the producer the
          original graph had in that slot (a new cross-device edge);
        trigger_crossing: control inputs sntf added from another device;
        collectives: number of collective nodes in the original graph;
        collectives_changed: collective nodes whose NodeDef differs (or that
          vanished) in the rewritten graph;
        collectives_generated: sntf nodes that are (clones of) collectives;
        unknown_source: sntf nodes whose served node cannot be found.
    """
    from sntf.graph import names

    check = _PlacementCheck(original, rewritten)
    for node in rewritten.node:
        check.node(node)
    collectives = [n for n in original.node if is_collective(n.op)]
    changed = [n.name for n in collectives
               if n.name not in check.after
               or check.after[n.name].SerializeToString(deterministic=True)
               != n.SerializeToString(deterministic=True)]
    return {
        "sntf_nodes": {d: dict(c) for d, c in sorted(check.per_device.items())},
        "sntf_ops": dict(collections.Counter(
            n.op for n in rewritten.node if names.role_of(n))),
        "served_mismatch": check.served_mismatch,
        "input_crossing": check.input_crossing,
        "trigger_crossing": check.trigger_crossing,
        "collectives": len(collectives),
        "collective_ops": sorted({n.op for n in collectives}),
        "collectives_changed": changed,
        "collectives_generated": check.collectives_generated,
        "unknown_source": check.unknown_source,
    }


class _PlacementCheck:
    """check_placement's findings, node by node."""

    def __init__(self, original, rewritten):
        from sntf.graph import names

        self.names = names
        self.before = {n.name: n for n in original.node}
        self.after = {n.name: n for n in rewritten.node}
        self.per_device: dict = collections.defaultdict(collections.Counter)
        self.served_mismatch, self.input_crossing, self.trigger_crossing = [], [], []
        self.unknown_source, self.collectives_generated = [], []

    def device(self, name: str) -> Optional[str]:
        node = self.after.get(name) or self.before.get(name)
        return None if node is None else node.device

    def served(self, node) -> Optional[str]:
        names = self.names
        if names.role_of(node) == names.ROLE_RECOMPUTE:
            return names.recompute_source(node.name) or None
        source = names.swap_source(node.name)
        return None if source is None else source[0]

    def original_of(self, name: str) -> str:
        """The original node a (possibly generated) name stands for."""
        return self.names.recompute_source(name) or name

    def node(self, node) -> None:
        role = self.names.role_of(node)
        if role:
            self._generated(node, role)
        # Compare each data slot with the same slot of the original node (a
        # clone's original is its source; a swap node has none: its inputs
        # must sit on its own device).
        swap = role in (self.names.ROLE_SWAP_OUT, self.names.ROLE_SWAP_IN)
        template = None if swap else self.before.get(self.original_of(node.name))
        self._data_inputs(node, role, template)
        if role or node.name in self.before:
            self._control_inputs(node, template)

    def _generated(self, node, role: str) -> None:
        self.per_device[node.device][role] += 1
        target = self.served(node)
        if target is None or self.device(target) is None:
            self.unknown_source.append(node.name)
        elif self.device(target) != node.device:
            self.served_mismatch.append([node.name, node.device, target,
                                         self.device(target)])
        if is_collective(node.op) or is_collective(
                self.before.get(self.original_of(node.name), node).op):
            self.collectives_generated.append(node.name)

    def _data_inputs(self, node, role: str, template) -> None:
        old_inputs = ([t for t in template.input if not t.startswith("^")]
                      if template is not None else None)
        data = [t for t in node.input if not t.startswith("^")]
        for slot, text in enumerate(data):
            producer, _ = _parse_input(text)
            if old_inputs is not None and slot < len(old_inputs):
                old_producer, _ = _parse_input(old_inputs[slot])
                if old_producer == producer:
                    continue
                expected = self.device(old_producer)
            elif role:
                expected = node.device
            else:
                continue
            if self.device(producer) != expected:
                self.input_crossing.append([node.name, slot, producer,
                                            self.device(producer), expected])

    def _control_inputs(self, node, template) -> None:
        old_controls = set() if template is None else {
            t for t in template.input if t.startswith("^")}
        for text in node.input:
            if text.startswith("^") and text not in old_controls:
                producer, _ = _parse_input(text)
                if self.device(producer) != node.device:
                    self.trigger_crossing.append([node.name, producer,
                                                  self.device(producer), node.device])


def _configure_devices(tf, strategy: str, replicas: int) -> None:
    """Splits the one physical CPU into `replicas` logical devices (mirrored);
    must run before anything initialises TensorFlow's devices."""
    if strategy == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(replicas)])


def _strategy(tf, name: str, replicas: int):
    if name == "mirrored":
        return tf.distribute.MirroredStrategy(
            [f"/cpu:{i}" for i in range(replicas)])
    if name == "multiworker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "none":
        return tf.distribute.get_strategy()
    raise ValueError(f"unknown strategy {name!r}")


def _custom_loop(tf, keras, strategy, model, x, y, batch: int, losses: list,
                 times: list) -> None:
    """The documented tf.distribute custom loop: strategy.run of a
    GradientTape step inside a tf.function, losses summed over replicas."""
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    options = tf.data.Options()
    # Every worker holds the same arrays: shard by element, in order.
    options.experimental_distribute.auto_shard_policy = \
        tf.data.experimental.AutoShardPolicy.DATA
    options.deterministic = True
    dist = strategy.experimental_distribute_dataset(data.with_options(options))
    optimizer = model.optimizer

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(
                yb, logits, from_logits=True)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(xb, yb):
        per_replica = strategy.run(replica_step, args=(xb, yb))
        return strategy.reduce("SUM", per_replica, axis=None)

    for xb, yb in dist:
        start = time.perf_counter()
        losses.append(float(train_step(xb, yb)))
        times.append(time.perf_counter() - start)


def _memory(tf, devices: list[str]) -> dict:
    out = {}
    for d in devices:
        try:
            out[d] = tf.config.experimental.get_memory_info(d)
        except ValueError as e:       # allocator without stats
            out[d] = {"error": str(e)}
    return out


def _report_summary(report: dict) -> dict:
    keys = ("graph", "training", "nodes", "action", "reason", "devices",
            "invocations", "swapped", "recomputed", "predicted_peak_bytes",
            "planned_peak_bytes", "per_device", "error")
    summary = {k: report.get(k) for k in keys}
    if report.get("rewritten_graph") is not None and report["action"] == "rewritten":
        summary["placement"] = check_placement(report["original_graph"],
                                               report["rewritten_graph"])
    return summary


def _arguments(argv: Optional[list[str]]):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="mirrored",
                        choices=("mirrored", "multiworker", "none"))
    parser.add_argument("--replicas", type=int, default=2,
                        help="logical CPU devices (mirrored)")
    parser.add_argument("--family", default="vgg")
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--small", action="store_true",
                        help="narrow channels (vgg/resnet) for quick tests")
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--sntf", default=None,
                        help="policy to enable; omitted: sntf is not imported")
    parser.add_argument("--swap-min-bytes", type=int, default=None)
    parser.add_argument("--recompute-mode", default=None)
    parser.add_argument("--min-gain", type=float, default=0.0,
                        help="sntf's min_gain option; 0 here, not the library's "
                             "0.05: the models are small, and what is tested is "
                             "that a rewrite trains identically, not that it "
                             "saves 5%%")
    parser.add_argument("--loop", default=None, choices=("fit", "custom"),
                        help="model.fit, or strategy.run in a tf.function "
                        "(default: fit, custom for multiworker, where Keras "
                        "3.15's fit fails before training: its symbolic build "
                        "reduces a PerReplica batch eagerly)")
    parser.add_argument("--measure", action="store_true",
                        help="record step times and per-device memory info")
    parser.add_argument("--out", required=True, help="npz file for the weights")
    return parser.parse_args(argv)


def _models(args):
    """(the sntf module or None, the model families module), sntf enabled
    as asked; without --sntf, sntf/models.py is loaded by path so that the
    baseline never imports the sntf package."""
    if args.sntf is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "_sntf_models_standalone", os.path.join(REPO, "sntf", "models.py"))
        models = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(models)
        return None, models
    import sntf

    options: dict[str, Any] = {"keep_graphs": True, "min_gain": args.min_gain}
    if args.swap_min_bytes is not None:
        options["swap_min_bytes"] = args.swap_min_bytes
    if args.recompute_mode:
        options["recompute_mode"] = args.recompute_mode
    sntf.enable(policy=args.sntf, **options)
    from sntf import models

    return sntf, models


def _fit(tf, keras, args, strategy, model, x, y) -> tuple[list, list]:
    """Trains; returns (losses, step seconds)."""
    losses, times = [], []

    class Steps(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self._t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self._t)
            losses.append(float(logs["loss"]))

    loop = args.loop or ("custom" if args.strategy == "multiworker" else "fit")
    if loop == "fit":
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[Steps()])
    else:
        _custom_loop(tf, keras, strategy, model, x, y, args.batch, losses, times)
    return losses, times


def main(argv: Optional[list[str]] = None) -> int:
    args = _arguments(argv)
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import numpy as np
    import tensorflow as tf

    _configure_devices(tf, args.strategy, args.replicas)
    sntf, models = _models(args)
    tf.config.experimental.enable_op_determinism()
    import keras

    keras.utils.set_random_seed(1234)
    strategy = _strategy(tf, args.strategy, args.replicas)
    kw = {}
    if args.small:
        kw = {"vgg": {"channels": (8, 16, 16)}, "resnet": {"channels": (8, 8, 16)},
              "mlp": {"width": 64}}.get(args.family, {})
    with strategy.scope():
        model = models.build(args.family, args.depth, **kw)
    x, y = models.make_data(args.family, args.steps * args.batch, seed=7)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    before = _memory(tf, devices) if args.measure else None
    losses, times = _fit(tf, keras, args, strategy, model, x, y)
    np.savez(args.out, **{f"w{i}": np.asarray(w)
                          for i, w in enumerate(model.get_weights())})
    result: dict = {"losses": losses, "replicas": strategy.num_replicas_in_sync,
                    # get_weights() follows model.weights; the rest (BN moving
                    # statistics) are per replica.
                    "trainable": [f"w{i}" for i, w in enumerate(model.weights)
                                  if w.trainable],
                    "devices": devices, "reports": None}
    if args.measure:
        later = sorted(times[1:]) or times
        result.update(step_seconds=times,
                      seconds_per_step=later[len(later) // 2] if later else None,
                      memory_before=before, memory=_memory(tf, devices))
    if sntf is not None:
        result["reports"] = [_report_summary(r) for r in sntf.reports()
                             if r.get("training")]
        result["stats"] = sntf.stats()["swap"]
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
