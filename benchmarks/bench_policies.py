"""Benchmarks sntf's policies against TensorFlow and the user's alternatives.

    python benchmarks/bench_policies.py --suite recompute|swap|budget
                                   [--models vgg,resnet,densenet,resnet:8]
                                   [--batch 32] [--steps 6] [--repeats 1]
                                   [--out BENCHMARKS_<suite>.md]

For every model (family, or family:depth) it trains `steps` steps in fresh
processes (sntf/testing/workers/measure_peak.py), one per configuration.

--suite recompute:
  TensorFlow                 the unchanged model, sntf not imported
  RematScope(mode="full")    the model built inside keras.RematScope (a
                             model-code change); in graph mode Keras 3.15's
                             TensorFlow backend rejects it, so it also runs
                             with compile(run_eagerly=True)
  tf.recompute_grad / block  each block wrapped in tf.recompute_grad (a
                             model-code change)
  sntf speed / memory / auto policy "recompute" with that mode, unchanged model
--suite swap:
  TensorFlow, sntf recompute (auto), sntf swap, sntf swap+recompute, and
  swap+recompute with a budget of half TensorFlow's measured peak (the
  run-time tensor cache keeps what fits and copies the rest)
--suite budget:
  TensorFlow, sntf auto without a budget, and sntf auto with budgets of
  0.7, 0.5 and 0.35 of TensorFlow's measured peak; with the budget, the
  measured peak / budget, whether the plan fits (the budget less its
  margin), the least planned peak where it does not, and how many buffers
  the plan swaps and recomputes

It tabulates the CPU:0 device peak and the median step time (steps after
the first; with --repeats, the median over the runs), each with its ratio
to TensorFlow's, sntf's planned peak and planned / measured, and for the
swap suite the host pool's peak and the bytes moved per step each way. A
configuration that fails to train is listed with its error. Progress lines
go to stdout; the table and the exact command line are printed and written
to --out.
"""

import os
import shlex
import sys
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from sntf.testing.workers import measure_peak  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("suite", "recompute", ["recompute", "swap", "budget"],
                  "which configurations")
flags.DEFINE_string("models", "vgg,resnet,densenet,resnet:8",
                    "comma-separated family or family:depth")
flags.DEFINE_integer("batch", 32, "batch size")
flags.DEFINE_integer("steps", 6, "training steps per run (step time: median after the first)")
flags.DEFINE_integer("repeats", 1, "fresh processes per configuration (median peak "
                     "and median step time)")
flags.DEFINE_string("out", None, "markdown file for the table "
                    "(default BENCHMARKS_<suite>.md)")

MIB = float(1 << 20)
SUITES = {"recompute": (
    ("TensorFlow", dict(policy="none")),
    ('RematScope(mode="full")', dict(policy="none", remat="remat_scope")),
    ('RematScope(mode="full"), run eagerly', dict(policy="none", remat="remat_scope",
                                                  eager=True)),
    ("tf.recompute_grad / block", dict(policy="none", remat="recompute_grad")),
    ("sntf speed", dict(policy="recompute", recompute_mode="speed")),
    ("sntf memory", dict(policy="recompute", recompute_mode="memory")),
    ("sntf auto", dict(policy="recompute", recompute_mode="auto")),
), "swap": (
    ("TensorFlow", dict(policy="none")),
    ("sntf recompute", dict(policy="recompute", recompute_mode="auto")),
    ("sntf swap", dict(policy="swap")),
    ("sntf swap+recompute", dict(policy="swap+recompute")),
    ("sntf swap+recompute, budget 0.5x TF", dict(policy="swap+recompute", budget=0.5)),
), "budget": (
    ("TensorFlow", dict(policy="none")),
    ("sntf auto, no budget", dict(policy="auto")),
    ("sntf auto, budget 0.7x TF", dict(policy="auto", budget=0.7)),
    ("sntf auto, budget 0.5x TF", dict(policy="auto", budget=0.5)),
    ("sntf auto, budget 0.35x TF", dict(policy="auto", budget=0.35)),
)}


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


HEADER = ["model", "configuration", "device peak (MiB)", "peak / TF", "step (ms)",
          "step / TF", "planned peak (MiB)", "planned / measured"]
SWAP_HEADER = ["host pool peak (MiB)", "to host / step (MiB)", "to device / step (MiB)",
               "cache hit rate"]
BUDGET_HEADER = ["budget (MiB)", "peak / budget", "plan fits", "least planned (MiB)",
                 "swapped / recomputed"]
EXTRA = {"recompute": [], "swap": SWAP_HEADER, "budget": BUDGET_HEADER}


def _budget_cells(result) -> list:
    """The budget columns, from the last training report that had a budget."""
    reports = [r for r in result.get("training_reports") or ()
               if r.get("budget_bytes") is not None]
    if not reports:
        return [""] * len(BUDGET_HEADER)
    r = reports[-1]
    least = r.get("achievable_peak_bytes")
    return [f"{r['budget_bytes'] / MIB:.1f}",
            f"{result['measured_peak_bytes'] / r['budget_bytes']:.3f}",
            "yes" if r.get("budget_fits") else "no",
            "" if least is None else f"{least / MIB:.1f}",
            f"{r.get('swapped', 0)} / {r.get('recomputed', 0)}"]


def _row(spec, label, result, base, suite):
    width = len(HEADER) + len(EXTRA[suite])
    if isinstance(result, str):
        return f"| {spec} | {label} | fails: {result} |" + " |" * (width - 3)
    peak, step = result["measured_peak_bytes"], result["seconds_per_step"]
    planned = result.get("planned_peak_bytes")
    cells = [spec, label, f"{peak / MIB:.1f}", f"{peak / base['measured_peak_bytes']:.3f}",
             f"{step * 1000:.0f}", f"{step / base['seconds_per_step']:.2f}",
             "" if planned is None else f"{planned / MIB:.1f}",
             "" if planned is None else f"{planned / peak:.3f}"]
    if suite == "budget":
        cells += _budget_cells(result)
    if suite == "swap":
        stats = result.get("sntf_stats") or {}
        pool, swap = stats.get("pool", {}), stats.get("swap", {})
        steps = result["steps"]
        lookups = swap.get("cache_hits", 0) + swap.get("cache_misses", 0)
        cells += [f"{pool.get('peak_bytes_in_use', 0) / MIB:.1f}",
                  f"{swap.get('bytes_to_host', 0) / steps / MIB:.1f}",
                  f"{swap.get('bytes_to_device', 0) / steps / MIB:.1f}",
                  f"{swap['cache_hits'] / lookups:.2f}" if lookups else "no cache"]
    return "| " + " | ".join(cells) + " |"


def main(argv):
    del argv
    start = time.perf_counter()
    header = HEADER + EXTRA[FLAGS.suite]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for spec in FLAGS.models.split(","):
        family, depth = _model(spec)
        base = None
        for label, options in SUITES[FLAGS.suite]:
            options = dict(options)
            if isinstance(options.get("budget"), float):
                # A fraction of TensorFlow's measured peak, in bytes.
                options["budget"] = int(options["budget"] * base["measured_peak_bytes"])
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
            lines.append(_row(f"{family} (depth {depth or 'default'})", label, result,
                              base, FLAGS.suite))
            print(lines[-1], flush=True)
    command = "python benchmarks/bench_policies.py " + " ".join(
        shlex.quote(a) for a in sys.argv[1:])
    text = "\n".join(lines) + (f"\n\nProduced by `{command}` "
                               f"({time.perf_counter() - start:.0f} s).\n")
    print(text)
    with open(FLAGS.out or f"BENCHMARKS_{FLAGS.suite}.md", "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    app.run(main)
