"""What the allocator held at a training step's measured peak.

    python benchmarks/measured_peak.py --model transformer --policy swap+recompute
                                       [--warm-steps 2] [--settings user|lab]
                                       [--budget 28MiB]

One configuration per process (the Grappler plugin cannot be unloaded). It
builds a sntf.testing.zoo model (or a sntf.models family, --model
family:NAME), trains --warm-steps steps, then one more under TensorFlow's
profiler, and replays the BFC allocator's events of that step
(sntf.testing.allocator_trace). It prints the chunks live at the step's
peak, largest first, with the op that asked for each, and one line:

    RESULT {"peak_bytes": ..., "op": ..., "chunks": [...], "waste_bytes": ...}

waste_bytes is what the live chunks hold beyond their requests: BFC splits
a free chunk only when it is at least twice the request. --warm-steps 0
profiles the first step, whose allocator is still growing its regions.
--settings user is oneDNN on and the default inter-op pool; lab is oneDNN
off and one inter-op thread (measure_peak's settings).
"""

import glob
import json
import os
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
MIB = 1 << 20
# Chunks smaller than this are summed, not listed.
LISTED_BYTES = 256 << 10


def _define_flags() -> None:
    """Command-line flags, defined when run as a script."""
    flags.DEFINE_string("model", "transformer",
                        "a sntf.testing.zoo architecture, or family:NAME")
    flags.DEFINE_string("policy", "swap+recompute", "'none' or an sntf policy")
    flags.DEFINE_integer("warm_steps", 2, "steps trained before the profiled one")
    flags.DEFINE_integer("batch", None, "batch size (the model's default when unset)")
    flags.DEFINE_enum("settings", "user", ["user", "lab"], "measurement settings")
    flags.DEFINE_string("budget", None, "sntf budget (bytes or a size string such as "
                        "28MiB), for the policy 'auto'")


def _build(name: str, batch):
    """(model, dataset of warm_steps + 1 batches)."""
    import tensorflow as tf

    if name.startswith("family:"):
        from sntf import models

        family = name.split(":", 1)[1]
        batch = batch or 32
        model = models.build(family)
        x, y = models.make_data(family, (FLAGS.warm_steps + 1) * batch, seed=1234)
    else:
        from sntf.testing import zoo

        batch = batch or zoo.default_batch(name)
        model = zoo.build(name)
        x, y = zoo.make_data(name, (FLAGS.warm_steps + 1) * batch, seed=1234)
    return model, tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def main(argv):
    del argv
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    from sntf.testing import allocator_trace

    if FLAGS.settings == "lab":
        tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.experimental.enable_op_determinism()
    if FLAGS.policy != "none":
        import sntf

        sntf.enable(policy=FLAGS.policy, budget=FLAGS.budget)
    import keras

    keras.utils.set_random_seed(1234)
    model, data = _build(FLAGS.model, FLAGS.batch)
    if FLAGS.warm_steps:
        model.fit(data.take(FLAGS.warm_steps), epochs=1, verbose=0)
    logdir = tempfile.mkdtemp(prefix="sntf_peak_")
    try:
        tf.profiler.experimental.start(
            logdir, options=tf.profiler.experimental.ProfilerOptions(host_tracer_level=2))
        model.fit(data.skip(FLAGS.warm_steps).take(1), epochs=1, verbose=0)
        tf.profiler.experimental.stop()
        traces = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
        if not traces:
            raise RuntimeError(f"the profiler wrote no trace under {logdir}")
        space = xplane_pb2.XSpace()
        with open(traces[0], "rb") as f:
            space.ParseFromString(f.read())
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    found = allocator_trace.live_at_peak(allocator_trace.allocator_events(space))
    chunks = found["chunks"]
    listed = [c for c in chunks if c["bytes"] >= LISTED_BYTES]
    print(f"peak {found['peak_bytes'] / MIB:.2f} MiB at {found['op']}")
    for c in listed:
        print(f"  {c['bytes'] / MIB:7.2f} MiB chunk, {c['requested'] / MIB:7.2f} requested"
              f"  {c['op']} {c['shape']}")
    rest = sum(c["bytes"] for c in chunks if c["bytes"] < LISTED_BYTES)
    print(f"  {rest / MIB:7.2f} MiB in {len(chunks) - len(listed)} smaller chunks")
    result = {"model": FLAGS.model, "policy": FLAGS.policy, "warm_steps": FLAGS.warm_steps,
              "settings": FLAGS.settings, "peak_bytes": found["peak_bytes"],
              "op": found["op"], "chunks": listed,
              "waste_bytes": sum(c["bytes"] - c["requested"] for c in chunks)}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    _define_flags()
    FLAGS(sys.argv)
    # measure_peak's settings, which hold only when set before TensorFlow
    # is imported (the module imports no TensorFlow).
    from sntf.testing.workers import measure_peak

    os.environ.update(measure_peak.SETTINGS[FLAGS.settings])
    app.run(main)
