"""Out of memory under a hard limit: TensorFlow alone against sntf.enable().

    .venv/bin/python benchmarks/bench_oom.py [--models a,b] [--fractions 0.75,0.6]
                                             [--steps 4] [--out table.md]

For each architecture of sntf.testing.zoo: TensorFlow alone without a limit
gives its peak P and its losses; then, for each fraction x, TensorFlow alone
and the same script with `sntf.enable()` (no other change) run under a hard
limit of x P (TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB), each
in a fresh process. A run either trains or raises ResourceExhaustedError; a
run of sntf that trains is compared with the unlimited run, losses and
weights. The runs are examples/out_of_memory.py's (oneDNN off, for the reason
its docstring gives), so the table is that example over more models and
limits.
"""

import importlib.util
import os
import sys
import time

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

MIB = 2**20
DEFAULT_MODELS = ["wide_preact", "preact_resnet", "mobilenet_v2", "densenet_bc",
                  "unet_transpose", "gpt"]

flags.DEFINE_list("models", DEFAULT_MODELS, "sntf.testing.zoo architectures")
flags.DEFINE_list("fractions", ["0.75", "0.6", "0.5"], "limits, as fractions of TensorFlow's peak")
flags.DEFINE_integer("steps", 4, "training steps per run", lower_bound=1)
flags.DEFINE_string("out", None, "markdown file for the table")


def _example():
    """examples/out_of_memory.py as a module: its runs are the ones measured."""
    path = os.path.join(REPO, "examples", "out_of_memory.py")
    spec = importlib.util.spec_from_file_location("out_of_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(result: dict) -> str:
    """'trains, 81.2 MiB', 'OOM' or 'failed (...)' for one run (a failure's
    output goes to stderr)."""
    if "out_of_memory" in result:
        return "OOM"
    if "failed" in result:
        sys.stderr.write(result.get("stderr", "") + "\n")
        return f"failed ({result['failed']})"
    return f"trains, {result['peak_bytes'] / MIB:.1f} MiB"


def _identical(base: dict, result: dict) -> str:
    if "loss" not in result:
        return ""
    same = result["loss"] == base["loss"] and result["weights"] == base["weights"]
    return "yes" if same else "NO"


def _ratios(base: dict, result: dict) -> str:
    """sntf's peak and step time over TensorFlow's, unlimited,
    for a run that trained."""
    if "peak_bytes" not in result:
        return " | "
    return (f"{result['peak_bytes'] / base['peak_bytes']:.2f} | "
            f"{result['seconds_per_step'] / base['seconds_per_step']:.2f}")


def _planned(result: dict) -> str:
    """sntf's planned peak and whether its allocator model fits the plan
    under the limit (the report's device_limit_fits)."""
    plan = result.get("plan") or {}
    if plan.get("planned_peak_bytes") is None:
        return " | "
    return f"{plan['planned_peak_bytes'] / MIB:.1f} | {plan.get('device_limit_fits')}"


def rows(example, name: str, fractions: list, steps: int) -> list:
    """Table rows for one architecture: the unlimited run, then one row per
    fraction with TensorFlow's and sntf's outcome under that limit."""
    base = example.run("tensorflow", name, steps)
    out = [f"| {name} | no limit | {_cell(base)} | | | | | | |"]
    if "peak_bytes" not in base:
        return out
    for fraction in fractions:
        limit = max(1, int(fraction * base["peak_bytes"] / MIB))
        alone = example.run("tensorflow", name, steps, limit)
        with_sntf = example.run("sntf", name, steps, limit)
        out.append(f"| {name} | {fraction:g} × = {limit} MiB | {_cell(alone)} | "
                   f"{_cell(with_sntf)} | {_ratios(base, with_sntf)} | "
                   f"{_identical(base, with_sntf)} | {_planned(with_sntf)} |")
        print(out[-1], flush=True)
    return out


def main(argv) -> int:
    if len(argv) > 1:
        raise SystemExit(f"unexpected arguments: {' '.join(argv[1:])}")
    args = flags.FLAGS
    fractions = [float(f) for f in args.fractions]
    example = _example()
    start = time.time()
    lines = ["| model | limit | TensorFlow alone | sntf.enable() | peak / TF peak "
             "| step time / TF | identical | planned MiB | fits (model) |",
             "| --- | --- | --- | --- | ---: | ---: | --- | ---: | --- |"]
    for name in args.models:
        lines += rows(example, name, fractions, args.steps)
    table = "\n".join(lines) + f"\n\n{time.time() - start:.0f} s in all.\n"
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    app.run(main)
