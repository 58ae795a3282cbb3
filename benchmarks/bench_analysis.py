"""Benchmarks sntf's memory analysis: predicted vs measured peak, and pass time.

    python benchmarks/bench_analysis.py [--families mlp,vgg,...] [--batches 32,64]
                                   [--steps 2] [--out BENCHMARKS_analysis.md]
    python benchmarks/bench_analysis.py --analysis_speed [--speed_depths 12,24,48]

Default mode: for every family x batch, trains `steps` steps in a fresh
process with policy "off" (sntf/testing/workers/measure_peak.py) and tabulates the
analysis' predicted peak against the peak TensorFlow's device allocator
measured, with the lower bound and the pass time of the training graph.

--analysis_speed: builds the ResNet family at three depths (about 250, 500
and 1000+ Keras layers), runs one training step in a fresh process per depth
and tabulates the pass time of the largest training graph per 1k graph
nodes.

Both modes print progress lines, then the table and the exact command line,
and write both to --out.
"""

import os
import shlex
import sys
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from sntf.testing.workers import measure_peak  # noqa: E402

from sntf import models  # noqa: E402  (cheap: keras is imported lazily)

FLAGS = flags.FLAGS
flags.DEFINE_string("families", ",".join(models.FAMILIES),
                    "comma-separated model families (sntf.models.FAMILIES)")
flags.DEFINE_string("batches", "32,64", "comma-separated batch sizes")
flags.DEFINE_integer("steps", 2, "training steps per run")
flags.DEFINE_string("out", "BENCHMARKS_analysis.md",
                    "markdown file the table is written to")
flags.DEFINE_bool("analysis_speed", False,
                  "measure the pass time on ResNets of ~250, ~500 and 1000+ layers")
flags.DEFINE_string("speed_depths", "12,24,48",
                    "ResNet blocks per stage for --analysis_speed "
                    "(layers = 10 + 21 * depth)")
flags.DEFINE_integer("speed_batch", 8, "batch size for --analysis_speed")
flags.DEFINE_integer("repeats", 1,
                     "fresh processes per configuration; the run with the median "
                     "measured peak is reported (identical runs can differ by a few "
                     "percent)")
flags.DEFINE_integer("timeout", 1800, "seconds allowed per fresh-process run")

MIB = float(1 << 20)


def _mib(value):
    return "n/a" if value is None else f"{value / MIB:.1f}"


def _secs(value, digits=3):
    return "n/a" if value is None else f"{value:.{digits}f}"


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _csv(text, cast=str):
    return [cast(part.strip()) for part in text.split(",") if part.strip()]


def _command_line():
    return "python " + " ".join(shlex.quote(a) for a in
                                [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:])


def peaks():
    families = _csv(FLAGS.families)
    for family in families:
        if family not in models.FAMILIES:
            raise app.UsageError(f"unknown family {family!r}; expected one of "
                                 f"{', '.join(models.FAMILIES)}")
    batches = _csv(FLAGS.batches, int)
    rows = []
    total = len(families) * len(batches)
    for i, (family, batch) in enumerate(
            [(f, b) for f in families for b in batches], start=1):
        print(f"[{i}/{total}] {family} batch {batch}: training {FLAGS.steps} steps "
              "in a fresh process (policy off) ...", flush=True)
        r = measure_peak.measure(family, batch, FLAGS.steps, "off",
                                 timeout=FLAGS.timeout, repeats=FLAGS.repeats)
        predicted, measured = r["predicted_peak_bytes"], r["measured_peak_bytes"]
        if predicted is not None:
            # The device reports what it held outside the graph too.
            predicted += r.get("outside_bytes") or 0
        ratio = "n/a" if predicted is None or not measured else f"{predicted / measured:.3f}"
        print(f"    measured {_mib(measured)} MiB, predicted {_mib(predicted)} MiB, "
              f"lower bound {_mib(r['lower_bound_bytes'])} MiB, "
              f"pass {_secs(r['pass_seconds'])} s, training graphs {len(r['nodes'] or [])}, "
              f"{_secs(r['seconds_per_step'])} s/step, {r['wall_seconds']:.1f} s wall",
              flush=True)
        if FLAGS.repeats > 1:
            print("    measured peaks (MiB): "
                  + ", ".join(_mib(p) for p in r["measured_peaks_bytes"])
                  + f"; spread {100 * r['peak_spread']:.1f}%", flush=True)
        rows.append([f"{family} ({r['layers']} layers)", batch, _mib(predicted),
                     _mib(measured), ratio, _mib(r["lower_bound_bytes"]),
                     _secs(r["pass_seconds"])])
    header = ["model", "batch", "predicted peak (MiB)", "measured peak (MiB)",
              "predicted / measured", "lower bound (MiB)", "pass seconds"]
    return ("Predicted vs measured peak of the training step (policy off; "
            f"{FLAGS.steps} steps; CPU:0 BFC allocator, one inter-op thread; "
            + (f"median of {FLAGS.repeats} fresh processes)" if FLAGS.repeats > 1
               else "one fresh process each)"),
            _table(header, rows))


def analysis_speed():
    depths = _csv(FLAGS.speed_depths, int)
    rows = []
    for i, depth in enumerate(depths, start=1):
        print(f"[{i}/{len(depths)}] resnet depth {depth} "
              f"({10 + 21 * depth} layers expected): one training step at batch "
              f"{FLAGS.speed_batch} in a fresh process (policy off) ...", flush=True)
        r = measure_peak.measure("resnet", FLAGS.speed_batch, 1, "off", depth=depth,
                                 timeout=FLAGS.timeout)
        nodes = max(r["nodes"]) if r["nodes"] else None
        seconds = r["pass_seconds"]
        per_k = (None if nodes is None or seconds is None
                 else seconds / (nodes / 1000.0))
        print(f"    {r['layers']} layers, {nodes} graph nodes, pass {_secs(seconds, 4)} s, "
              f"{_secs(per_k, 4)} s per 1k nodes, {r['wall_seconds']:.1f} s wall",
              flush=True)
        rows.append([r["layers"], nodes, _secs(seconds, 4), _secs(per_k, 4)])
    header = ["layers", "graph nodes", "pass seconds", "seconds per 1k nodes"]
    return ("Analysis speed: sntf pass time on the largest training graph of "
            f"ResNets (policy off, batch {FLAGS.speed_batch}, one step)",
            _table(header, rows))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    t0 = time.perf_counter()
    title, table = analysis_speed() if FLAGS.analysis_speed else peaks()
    command = _command_line()
    text = (f"### {title}\n\n{table}\n\nProduced by `{command}` "
            f"({time.perf_counter() - t0:.0f} s).\n")
    print()
    print(text)
    out = FLAGS.out if os.path.isabs(FLAGS.out) else os.path.join(os.getcwd(), FLAGS.out)
    with open(out, "w") as f:
        f.write(text)
    print(f"written to {out}")


if __name__ == "__main__":
    app.run(main)
