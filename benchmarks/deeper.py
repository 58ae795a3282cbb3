"""Finds, by measurement, how much deeper a model trains within a memory
budget with sntf than with TensorFlow alone; see sntf/testing/deeper.py.

    python benchmarks/deeper.py --budget 64MiB [--family resnet] [--batch 32]
                                [--policy auto] [--steps 2] [--repeats 1]
                                [--max_depth 128] [--timeout 900] [--hard_limit]
                                [--out deeper.json]
"""

from __future__ import annotations

import json
import os
import shlex
import sys

# The driver only starts workers, which choose their own policy: an sntf
# switch in the environment must not enable sntf here or in the baseline.
for _name in ("SNTF_POLICY", "SNTF_BUDGET"):
    os.environ.pop(_name, None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from sntf import config, models  # noqa: E402
from sntf.testing import deeper, zoo  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("family", "resnet",
                  list(models.FAMILIES) + [f"zoo:{name}" for name in zoo.DEEPENS],
                  "model family of sntf.models, or zoo:<name> for an architecture "
                  "of sntf.testing.zoo whose depth is its blocks")
flags.DEFINE_integer("batch", 32, "batch size", lower_bound=1)
flags.DEFINE_string("budget", None, "device-memory budget: bytes or a size string "
                    "such as 64MiB or 0.5GB")
flags.DEFINE_string("policy", "auto", "sntf policy of the sntf search")
flags.DEFINE_integer("steps", 2, "training steps per trial", lower_bound=1)
flags.DEFINE_integer("repeats", 1, "fresh processes per trial (median peak)",
                     lower_bound=1)
flags.DEFINE_integer("max_depth", 128, "deepest depth tried", lower_bound=1)
flags.DEFINE_integer("timeout", 900, "seconds per trial process; a trial that "
                     "runs longer does not fit", lower_bound=1)
flags.DEFINE_bool("time_ratio", True, "if the sntf search did not measure "
                  "TensorFlow's deepest depth, run one more sntf trial there "
                  "for the step-time ratio")
flags.DEFINE_bool("hard_limit", False, "the budget is a hard limit on the CPU "
                  "allocator: a depth fits when it trains under it, not when its "
                  "peak is below it")
flags.DEFINE_string("out", None, "JSON file for the tables, settings and all trials")


def command_line(argv: list) -> str:
    """The command that reproduces this run, relative to the repository root."""
    return "python benchmarks/deeper.py " + " ".join(shlex.quote(a) for a in argv[1:])


def main(argv: list) -> int:
    """absl entry point: validates flags, runs the searches, prints tables."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.budget is None:
        raise app.UsageError("--budget is required (bytes or e.g. 64MiB)")
    try:
        budget_bytes = config.parse_size(FLAGS.budget.strip(), "budget")
        policy = config.parse_policy(FLAGS.policy)
    except ValueError as e:
        raise app.UsageError(str(e))
    command = command_line(sys.argv)
    out = deeper.run(FLAGS.family, FLAGS.batch, budget_bytes, policy, steps=FLAGS.steps,
              repeats=FLAGS.repeats, max_depth=FLAGS.max_depth, timeout=FLAGS.timeout,
              time_ratio=FLAGS.time_ratio, progress=deeper.ProgressBar(),
              hard_limit=FLAGS.hard_limit)
    out["command"] = command
    out["table"] = deeper.result_table(out)
    out["trials_table"] = deeper.trials_table(out)
    print(out["table"])
    print()
    print(out["trials_table"])
    print()
    print(f"Produced by `{command}` ({out['wall_seconds']:.0f} s).")
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    app.run(main)
