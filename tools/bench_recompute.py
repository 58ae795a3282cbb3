"""Benchmarks recomputation against the user's alternatives, side by side.

    python tools/bench_recompute.py [--models vgg,resnet,densenet,resnet:6]
                                    [--batch 32] [--steps 4] [--repeats 1]
                                    [--out BENCHMARKS_recompute.md]

For every model (family, or family:depth) it trains `steps` steps in fresh
processes (tests/workers/measure_peak.py), one per configuration:

  TensorFlow                 the unchanged model, sntf not imported
  RematScope(mode="full")    the model built inside keras.RematScope (a
                             model-code change)
  tf.recompute_grad / block  each block wrapped in tf.recompute_grad (a
                             model-code change)
  sntf speed / memory / auto policy "recompute" with that mode, unchanged model

and tabulates the CPU:0 device peak and the median step time (steps after
the first), each with its ratio to TensorFlow's, plus sntf's planned peak
and planned / measured. A configuration that fails to train is listed with
the error's last line. Progress lines go to stdout; the table and the exact
command line are printed and written to --out.
"""

import os
import shlex
import sys
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "workers"))
sys.path.insert(0, REPO)

import measure_peak  # noqa: E402  (tests/workers, added to sys.path above)

FLAGS = flags.FLAGS
flags.DEFINE_string("models", "vgg,resnet,densenet,resnet:6",
                    "comma-separated family or family:depth")
flags.DEFINE_integer("batch", 32, "batch size")
flags.DEFINE_integer("steps", 6, "training steps per run (step time: median after the first)")
flags.DEFINE_integer("repeats", 1, "fresh processes per configuration (median peak)")
flags.DEFINE_string("out", "BENCHMARKS_recompute.md", "markdown file for the table")

MIB = float(1 << 20)
CONFIGS = (
    ("TensorFlow", dict(policy="none")),
    ('RematScope(mode="full")', dict(policy="none", remat="remat_scope")),
    ("tf.recompute_grad / block", dict(policy="none", remat="recompute_grad")),
    ("sntf speed", dict(policy="recompute", recompute_mode="speed")),
    ("sntf memory", dict(policy="recompute", recompute_mode="memory")),
    ("sntf auto", dict(policy="recompute", recompute_mode="auto")),
)


def _error_line(text: str) -> str:
    """The exception's type and its message's first non-empty line."""
    import re

    lines = [re.sub(r"\x1b\[[0-9;]*m", "", l).strip() for l in text.splitlines()]
    last = max((i for i, l in enumerate(lines) if re.match(r"^\w+(Error|Exception)\b", l)),
               default=None)
    if last is None:
        return lines[0][:200]
    message = next((l for l in lines[last + 1:] if l), "")
    return f"{lines[last]} {message}".replace("|", "/")[:240]


def _model(spec: str):
    family, _, depth = spec.partition(":")
    return family, (int(depth) if depth else None)


def _row(spec, label, result, base):
    if isinstance(result, str):
        return f"| {spec} | {label} | fails: {result} | | | | | |"
    peak, step = result["measured_peak_bytes"], result["seconds_per_step"]
    planned = result.get("planned_peak_bytes")
    cells = [spec, label, f"{peak / MIB:.1f}", f"{peak / base['measured_peak_bytes']:.3f}",
             f"{step * 1000:.0f}", f"{step / base['seconds_per_step']:.2f}",
             "" if planned is None else f"{planned / MIB:.1f}",
             "" if planned is None else f"{planned / peak:.3f}"]
    return "| " + " | ".join(cells) + " |"


def main(argv):
    del argv
    start = time.perf_counter()
    lines = ["| model | configuration | device peak (MiB) | peak / TF | step (ms) | "
             "step / TF | planned peak (MiB) | planned / measured |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for spec in FLAGS.models.split(","):
        family, depth = _model(spec)
        base = None
        for label, options in CONFIGS:
            try:
                result = measure_peak.measure(family, FLAGS.batch, steps=FLAGS.steps,
                                              depth=depth, repeats=FLAGS.repeats,
                                              **options)
            except RuntimeError as e:
                if base is None:
                    raise
                result = _error_line(str(e))
            if base is None:
                base = result
            lines.append(_row(f"{family} (depth {depth or 'default'})", label, result, base))
            print(lines[-1], flush=True)
    command = "python tools/bench_recompute.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:])
    text = "\n".join(lines) + (f"\n\nProduced by `{command}` "
                               f"({time.perf_counter() - start:.0f} s).\n")
    print(text)
    with open(FLAGS.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    app.run(main)
