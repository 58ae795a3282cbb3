"""Checks sntf's predicted executor order against the order TensorFlow ran.

    python tools/check_schedule.py --family densenet [--policy recompute]
                                   [--mode speed] [--batch 32]

One configuration per process (the Grappler plugin cannot be unloaded). It
trains one step with run metadata on, which hands back the graph the
executor ran (after every Grappler pass, sntf's included), then one more
step under TensorFlow's profiler, whose host trace lists the ops in the
order they ran. It prints one line:

    RESULT {"ops": N, "in_order": 0.82, "in_order_no_reads": 0.99, ...}

in_order is the share of consecutive executed ops that the predicted
schedule (sntf.analysis.schedule) also runs one after the other;
in_order_no_reads counts only pairs without a ReadVariableOp (those
allocate nothing, and the executor runs them wherever they become ready).
The measurement set-up is measure_peak's: oneDNN rewrites off, the BFC CPU
allocator, one inter-op thread, op determinism.
"""

import glob
import json
import os
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# Allowed only when these are set before TensorFlow is imported.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def _define_flags() -> None:
    """Command-line flags, defined only when run as a script: the tests
    import order_agreement next to other tools' flags of the same names."""
    flags.DEFINE_string("family", "vgg", "model family (sntf.models.FAMILIES)")
    flags.DEFINE_integer("depth", None, "model depth (family default when unset)")
    flags.DEFINE_integer("batch", 32, "batch size")
    flags.DEFINE_string("policy", "none", "'none' (sntf not enabled) or an sntf policy")
    flags.DEFINE_string("mode", "auto", "recompute mode, for recomputing policies")


# Ops that allocate nothing and run wherever they become ready.
_READS = frozenset({"ReadVariableOp"})


def order_agreement(graph_def, executed: list) -> dict:
    """How closely sntf's predicted schedule follows an executed op order.

    Args:
      graph_def: the graph the executor ran.
      executed: node names in the order they ran (names not in the graph,
        such as the profiler's own events, are ignored).

    Returns:
      {"ops": executed ops found in the graph, "in_order": share of
      consecutive pairs the prediction also runs back to back,
      "in_order_no_reads": the same over pairs without a ReadVariableOp}.
    """
    from sntf import analysis
    from sntf import graph as graph_model

    g = graph_model.build_index(graph_def)
    ran = [n for n in executed if n in g.index]
    seen = set(ran)
    predicted = [g.names[i] for i in analysis.schedule(g) if g.names[i] in seen]
    position = {name: k for k, name in enumerate(predicted)}
    pairs = list(zip(ran, ran[1:]))
    adjacent = [position[b] == position[a] + 1 for a, b in pairs]
    plain = [ok for (a, b), ok in zip(pairs, adjacent)
             if g.ops[g.node(a)] not in _READS and g.ops[g.node(b)] not in _READS]
    return {"ops": len(ran),
            "in_order": round(sum(adjacent) / max(len(adjacent), 1), 4),
            "in_order_no_reads": round(sum(plain) / max(len(plain), 1), 4)}


def executed_ops(xspace_path: str) -> list:
    """Op names in the order the executor's threads started them."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(xspace_path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for e in line.events:
                # Op events are "node_name:OpType"; the executor's own are
                # "ExecutorState::Process" and the like.
                name = names[e.metadata_id]
                if ":" in name and " " not in name and "::" not in name:
                    events.append((line.timestamp_ns * 1000 + e.offset_ps,
                                   name.rsplit(":", 1)[0]))
    return [name for _, name in sorted(events)]


def main(argv):
    del argv
    import tensorflow as tf
    from tensorflow.python.eager import context

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.experimental.enable_op_determinism()
    from sntf import models

    if FLAGS.policy != "none":
        import sntf

        kwargs = {"recompute_mode": FLAGS.mode} if "recompute" in FLAGS.policy else {}
        sntf.enable(policy=FLAGS.policy, **kwargs)
    model = models.build(FLAGS.family, FLAGS.depth)
    x, y = models.make_data(FLAGS.family, 2 * FLAGS.batch, seed=7)
    first = slice(0, FLAGS.batch)
    second = slice(FLAGS.batch, 2 * FLAGS.batch)
    context.context().enable_run_metadata()
    model.fit(x[first], y[first], batch_size=FLAGS.batch, epochs=1, shuffle=False,
              verbose=0)
    metadata = context.context().export_run_metadata()
    context.context().disable_run_metadata()
    # The train step is by far the largest partition the first step ran.
    graph_def = max(metadata.partition_graphs, key=lambda g: len(g.node))
    logdir = tempfile.mkdtemp(prefix="sntf_schedule_")
    try:
        tf.profiler.experimental.start(
            logdir, options=tf.profiler.experimental.ProfilerOptions(host_tracer_level=3))
        model.fit(x[second], y[second], batch_size=FLAGS.batch, epochs=1,
                  shuffle=False, verbose=0)
        tf.profiler.experimental.stop()
        traces = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
        if not traces:
            raise RuntimeError(f"the profiler wrote no trace under {logdir}")
        result = order_agreement(graph_def, executed_ops(traces[0]))
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    result.update(family=FLAGS.family, depth=FLAGS.depth, batch=FLAGS.batch,
                  policy=FLAGS.policy,
                  mode=FLAGS.mode if "recompute" in FLAGS.policy else None,
                  graph_nodes=len(graph_def.node))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
