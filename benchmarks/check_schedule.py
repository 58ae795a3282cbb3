"""Checks sntf's predicted executor order against the order TensorFlow ran.

    python benchmarks/check_schedule.py --family densenet [--policy recompute]
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

from sntf.testing.schedule_check import executed_ops, order_agreement  # noqa: E402

FLAGS = flags.FLAGS


def _define_flags() -> None:
    """Command-line flags, defined when run as a script."""
    flags.DEFINE_string("family", "vgg", "model family (sntf.models.FAMILIES)")
    flags.DEFINE_integer("depth", None, "model depth (family default when unset)")
    flags.DEFINE_integer("batch", 32, "batch size")
    flags.DEFINE_string("policy", "none", "'none' (sntf not enabled) or an sntf policy")
    flags.DEFINE_string("mode", "auto", "recompute mode, for recomputing policies")


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
