"""python -m sntf: run a training script with sntf, without changing it.

    python -m sntf [--policy P] [--budget B] [--option NAME=VALUE ...]
                   [--nosummary] script.py [args ...]
    python -m sntf [flags] -m package.module [args ...]

The script runs as `python script.py args` would run it (as __main__, with
sys.argv = [script.py, args...] and its folder first on sys.path), with
sntf enabled: the policy and budget come from the flags, else from
SNTF_POLICY / SNTF_BUDGET, else policy "auto" without a budget. The flags
are also exported as SNTF_POLICY / SNTF_BUDGET, so that Python
subprocesses the script starts are switched on by sntf's startup hook too.
As with the environment variables, the op library and the graph plugin load
when the script imports TensorFlow. When the script ends, sntf.summary()
is printed to stderr (--nosummary: not).

Errors in the flags print one line and exit with status 2; the script's
own exit status is the runner's.
"""

from __future__ import annotations

import ast
import os
import runpy
import sys
from typing import Optional, Sequence

from absl import flags

import sntf
from sntf import config

PROG = "python -m sntf"

# A private registry: never clashes with the flags of the script it runs.
FLAGS = flags.FlagValues()
flags.DEFINE_string("policy", None, "sntf policy: " + ", ".join(config.POLICIES)
                    + " (default: SNTF_POLICY, else auto)", flag_values=FLAGS)
flags.DEFINE_string("budget", None, "device-memory budget: bytes, a size such as "
                    "12GB or 512MiB, a fraction such as 0.5 or 50%, or auto "
                    "(default: SNTF_BUDGET, else none)", flag_values=FLAGS)
flags.DEFINE_multi_string("option", [], "an option of sntf.enable, as NAME=VALUE "
                          "(a Python literal, or else a string), e.g. "
                          "batch_size=64 or host_pool_limit=8GB; repeatable",
                          flag_values=FLAGS)
flags.DEFINE_boolean("summary", True, "print sntf.summary() to stderr when the "
                     "script ends", flag_values=FLAGS)

HELP_ARGS = ("-h", "-?", "-help", "--help", "--helpshort", "--helpfull")
# The runner's flags that take a value in the next argument ("--policy auto").
VALUE_FLAGS = ("policy", "budget", "option")


class UsageError(Exception):
    """A command-line problem: one line, exit status 2."""


def split_argv(argv: Sequence[str]) -> tuple[list, Optional[str], Optional[str], list]:
    """Splits the command line at the script (or -m module).

    Args:
      argv: sys.argv of the runner.

    Returns:
      (the runner's own arguments, with argv[0]; the script path or None;
      the module name or None; the script's arguments).
    """
    own = [argv[0]]
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if arg in ("-m", "--m"):
            if i + 1 >= len(argv):
                raise UsageError("-m needs a module name")
            return own, None, argv[i + 1], list(argv[i + 2:])
        if not arg.startswith("-") or arg == "-":
            break
        own.append(arg)
        name = arg.lstrip("-").split("=", 1)[0]
        if "=" not in arg and name in VALUE_FLAGS and i + 1 < len(argv):
            own.append(argv[i + 1])
            i += 1
        i += 1
    if i >= len(argv):
        raise UsageError("no script to run: give script.py [args ...] or -m module")
    return own, argv[i], None, list(argv[i + 1:])


def parse_option(text: str) -> tuple[str, object]:
    """'batch_size=64' -> ("batch_size", 64); a value that is no Python
    literal stays a string ('host_pool_limit=8GB' -> "8GB")."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise UsageError(f"--option {text!r}: expected NAME=VALUE, e.g. batch_size=64")
    try:
        parsed = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        parsed = value.strip()
    return name.strip(), parsed


def settings(own: list) -> tuple[str, Optional[str], dict, bool]:
    """(policy, budget text, options, summary) from the runner's flags and
    the environment, validated with sntf's own rules.

    Raises:
      UsageError: a bad flag or value, in one line.
    """
    FLAGS.unparse_flags()
    try:
        rest = FLAGS(own)
    except flags.Error as e:
        raise UsageError(f"{e} (see --help)") from None
    if len(rest) > 1:
        raise UsageError(f"unexpected argument(s): {' '.join(rest[1:])}")
    policy = FLAGS.policy or os.environ.get(config.ENV_POLICY, "").strip() or "auto"
    budget = FLAGS.budget
    if budget is None:
        budget = os.environ.get(config.ENV_BUDGET, "").strip() or None
    options = dict(parse_option(text) for text in FLAGS.option)
    from sntf.runtime import environment

    try:
        config.parse_policy(policy)
        config.parse_budget(budget, environment.device_memory_bytes())
        config.parse_options(options)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    return policy, budget, options, FLAGS.summary


def run(argv: Sequence[str]) -> int:
    """Runs the script or module under sntf; returns its exit status."""
    own, script, module, args = split_argv(argv)
    policy, budget, options, summary = settings(own)
    if script is not None and not os.path.isfile(script):
        raise UsageError(f"{script}: no such file")
    os.environ[config.ENV_POLICY] = policy
    if budget is not None:
        os.environ[config.ENV_BUDGET] = budget
    else:
        os.environ.pop(config.ENV_BUDGET, None)
    try:
        sntf._enable_when_tensorflow_loads(policy, budget, options)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    try:
        if module is not None:
            sys.argv = [module] + args
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script] + args
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        sys.stderr.write(f"{code}\n")
        return 1
    finally:
        if summary:
            sys.stderr.write(sntf.summary() + "\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit status (2 for a command-line error)."""
    argv = list(sys.argv if argv is None else argv)
    argv[0] = PROG
    if len(argv) < 2 or argv[1] in HELP_ARGS:
        sys.stdout.write(__doc__ + "\nflags:\n"
                         + FLAGS.get_help(prefix="  ", include_special_flags=False)
                         + "\n")
        return 0 if len(argv) > 1 else 2
    try:
        return run(argv)
    except UsageError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
