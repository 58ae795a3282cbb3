"""sntf_dump: train a Keras model for a step with sntf and dump what sntf saw.

    sntf-dump --model MODEL --batch B [--policy P] [--budget BUDGET]
              [--out sntf_dump_out] [--steps 1] [--verify]
    tools/sntf_dump ...                    (the same tool, in a clone)
    python -m sntf.tools.dump ...          (the same tool)

MODEL is a saved `.keras` (or `.h5`) file, or a Python file that defines
`build_model()` or `build_model(keras)` returning a Keras model (compiled or
not: an uncompiled one is compiled with Adam and
SparseCategoricalCrossentropy(from_logits=True)). The file may also define
`make_data(n)` returning (x, y) with n samples; otherwise random data is made
from the model's input shape and its loss (integer labels for sparse
categorical losses, random targets of the output shape otherwise).

The tool enables sntf with the policy ("auto" when only --budget is given,
"off" when neither is), budget and batch, trains exactly
steps * batch samples with `model.fit` in one process, and writes for every
training graph sntf saw a folder OUT/graph_<k>/ with

  original.pbtxt    the graph Grappler handed to sntf (text GraphDef)
  rewritten.pbtxt   the graph sntf handed back
  plan.json         the plan (decisions and why) and the headline numbers
  timeline.png      predicted device memory per schedule step, original and
                    planned, with the lower bound, the budget, the start of
                    the backward pass and the checkpoints (drawn with
                    matplotlib: sntf's optional extra "plot")
  timeline.json     the plotted series and lines, as numbers
  tensorboard/      both graphs for TensorBoard (runs original, rewritten):
                    tensorboard --logdir OUT/graph_<k>/tensorboard

plus OUT/summary.txt, also printed: per graph its nodes, predicted and
planned peak, lower bound, pass time and actions, and the peak TensorFlow's
device allocator measured for the whole run, set against the planned peak
of the graph that ran (the rewritten one).

With --verify, the tool then checks the rewrite on the first batch with
sntf.verify (the same policy, budget and batch): one training step of the
original and of the rewritten graph from the same variable values, every
tensor, clone, swapped-in tensor and variable compared bit for bit. It
prints the verifier's report, writes it to OUT/verify.txt (OUT/verify.json:
the result as data) and exits with status 3 when the graphs differ (or the
original graph does not repeat its own bits).

Measurement set-up, as everywhere in sntf: TF_ENABLE_ONEDNN_OPTS=0 and
TF_CPU_ALLOCATOR_USE_BFC=true unless already set (so the CPU allocator counts
every allocation) and one inter-op thread (a repeatable executor order).
Errors in the input (a missing file, no build_model, a bad flag, a policy
that is not implemented yet) print one line and exit with status 2.
"""

from __future__ import annotations

import os
import sys

# Before anything imports TensorFlow: the allocator and oneDNN settings are
# read when TensorFlow initializes its devices.
MEASURE_ENV = {"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPU_ALLOCATOR_USE_BFC": "true"}


def prepare_environment(environ=os.environ) -> None:
    """Sets the measurement environment, keeping values the user already set."""
    for name, value in MEASURE_ENV.items():
        environ.setdefault(name, value)
    environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


_TF_IMPORTED_EARLY = "tensorflow" in sys.modules
prepare_environment()

import ast  # noqa: E402
import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
from typing import Optional  # noqa: E402

from absl import flags  # noqa: E402

from sntf import config  # noqa: E402  (plain Python: no TensorFlow import)
from sntf.runtime import environment  # noqa: E402  (likewise)
from sntf.tools.dump_data import DumpError, first_batch, make_data  # noqa: E402
from sntf.tools.dump_output import (NO_PLOT_NOTE, dump_graph, one_line,  # noqa: E402
                                    plot_library_missing, summary_lines,
                                    write_verify)

PROG = "sntf_dump"
MODEL_SUFFIXES = (".keras", ".h5", ".hdf5", ".py")
DEFAULT_OPTIMIZER = "Adam"
DEFAULT_LOSS = "SparseCategoricalCrossentropy(from_logits=True)"

# A private flag registry: importing this module never clashes with the flags
# of the program that imports it.
FLAGS = flags.FlagValues()
flags.DEFINE_string("model", None,
                    "a saved .keras/.h5 model, or a Python file defining "
                    "build_model() or build_model(keras) (and optionally "
                    "make_data(n) -> (x, y))", flag_values=FLAGS)
flags.DEFINE_integer("batch", None, "batch size (required, > 0)", flag_values=FLAGS)
flags.DEFINE_string("policy", None,
                    "sntf policy: " + ", ".join(config.POLICIES) + " (default: "
                    "auto with --budget, off without)", flag_values=FLAGS)
flags.DEFINE_string("budget", None,
                    "device-memory budget passed to sntf: bytes, a size such "
                    "as 12GB or 512MiB, or a fraction of device memory such "
                    "as 0.5 or 50%, or auto", flag_values=FLAGS)
flags.DEFINE_string("out", "sntf_dump_out", "output folder", flag_values=FLAGS)
flags.DEFINE_integer("steps", 1, "training steps (steps * batch samples)",
                     flag_values=FLAGS)
flags.DEFINE_bool("verify", False,
                  "after the dump, check the rewrite on the first batch with "
                  "sntf.verify: exit status 0 when identical or identical up to "
                  "the order of sums TensorFlow adds as their terms arrive, 3 when "
                  "an op computes other bits, 4 when the original graph does not "
                  "repeat itself",
                  flag_values=FLAGS)
flags.DEFINE_string("verify_chunk_bytes", "256MiB",
                    "with --verify: the most bytes of tensors one verification "
                    "run fetches from one graph (bytes or a size such as 256MiB)",
                    flag_values=FLAGS)

# Exit status when --verify finds an op of the rewritten graph computing
# other bits from identical inputs, and when the original graph does not
# repeat its own bits (nothing can be checked). "identical" and "identical
# up to the order of sums" exit 0.
VERIFY_DIFFERS = 3
VERIFY_NONDETERMINISTIC = 4

HELP_ARGS = ("-h", "-?", "-help", "--help", "--helpshort", "--helpfull")

@dataclasses.dataclass
class Settings:
    model_path: str
    batch: int
    policy: str
    budget: Optional[config.Budget]
    budget_text: Optional[str]
    out: str
    steps: int
    verify: bool = False
    verify_chunk_bytes: int = 256 << 20


# ---------------------------------------------------------------- flags
def help_text() -> str:
    return (__doc__.rstrip() + "\n\nflags:\n"
            + FLAGS.get_help(prefix="  ", include_special_flags=False) + "\n")


def parse_flags(argv: list) -> Settings:
    """Parses and validates the command line (no TensorFlow import)."""
    FLAGS.unparse_flags()
    try:
        rest = FLAGS(argv)
    except flags.Error as e:
        raise DumpError(one_line(str(e)) + " (see --help)") from None
    if len(rest) > 1:
        raise DumpError(f"unexpected argument(s): {' '.join(rest[1:])} (see --help)")
    if not FLAGS.model:
        raise DumpError("--model is required: a .keras file or a Python file "
                        "defining build_model() (see --help)")
    if FLAGS.batch is None:
        raise DumpError("--batch is required: a positive batch size (see --help)")
    if FLAGS.batch <= 0:
        raise DumpError(f"--batch must be a positive integer, got {FLAGS.batch}")
    if FLAGS.steps is None or FLAGS.steps <= 0:
        raise DumpError(f"--steps must be a positive integer, got {FLAGS.steps}")
    if not FLAGS.out:
        raise DumpError("--out must name a folder")
    budget_text = FLAGS.budget if FLAGS.budget not in (None, "", "none", "None") else None
    # A budget alone asks for a plan that fits it: policy "auto" plans one,
    # "off" only reports.
    policy_text = FLAGS.policy if FLAGS.policy is not None else (
        "auto" if budget_text is not None else "off")
    try:
        policy = config.parse_policy(policy_text)
    except ValueError as e:
        raise DumpError(f"--policy: {e}") from None
    try:
        budget = config.parse_budget(budget_text, environment.device_memory_bytes())
    except ValueError as e:
        raise DumpError(f"--budget: {e}") from None
    try:
        chunk_bytes = config.parse_size(FLAGS.verify_chunk_bytes, "--verify_chunk_bytes")
    except ValueError as e:
        raise DumpError(str(e)) from None
    model_path = check_model_path(FLAGS.model)
    return Settings(model_path=model_path, batch=FLAGS.batch, policy=policy,
                    budget=budget, budget_text=budget_text, out=FLAGS.out,
                    steps=FLAGS.steps, verify=FLAGS.verify,
                    verify_chunk_bytes=chunk_bytes)


# ---------------------------------------------------------------- model input
def check_model_path(path: str) -> str:
    """Checks the --model path before TensorFlow is imported."""
    if not os.path.exists(path):
        raise DumpError(f"--model {path}: no such file")
    if os.path.isdir(path):
        raise DumpError(f"--model {path}: is a folder; give a .keras file or a "
                        "Python file defining build_model()")
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in MODEL_SUFFIXES:
        raise DumpError(f"--model {path}: unsupported file type {suffix or '(none)'!r};"
                        " give a .keras (or .h5) model or a .py file defining "
                        "build_model()")
    if suffix == ".py":
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=path)
        except SyntaxError as e:
            raise DumpError(f"--model {path}: syntax error at line {e.lineno}: "
                            f"{e.msg}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise DumpError(f"--model {path}: cannot read it: {e}") from None
        if not _may_define(tree, "build_model"):
            raise DumpError(f"--model {path}: defines no build_model(); the file "
                            "must define build_model() or build_model(keras) "
                            "returning a Keras model")
    return os.path.abspath(path)


def _may_define(tree: ast.AST, name: str) -> bool:
    """Whether a module could bind `name` (False only when it surely does not)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                return True
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            if node.id == name:
                return True
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*" or (alias.asname or alias.name.split(".")[-1]) == name:
                    return True
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            func = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if func in ("setattr", "exec", "globals"):
                return True
    return False


def load_user_module(path: str):
    """Imports a model file as a module of its own."""
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location("sntf_dump_user_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's code; reported as input error
        raise DumpError(f"--model {path}: importing it failed: "
                        f"{type(e).__name__}: {one_line(e)}") from None
    if not callable(getattr(module, "build_model", None)):
        raise DumpError(f"--model {path}: defines no build_model(); the file must "
                        "define build_model() or build_model(keras) returning a "
                        "Keras model")
    return module


def _wants_keras(fn) -> bool:
    """Whether build_model takes a parameter (then it is given the keras module)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    return bool(positional)


def build_model(settings: Settings, keras):
    """Returns (model, module or None, notes)."""
    notes = []
    module = None
    path = settings.model_path
    if path.lower().endswith(".py"):
        module = load_user_module(path)
        fn = module.build_model
        try:
            model = fn(keras) if _wants_keras(fn) else fn()
        except Exception as e:  # noqa: BLE001 - the user's code
            raise DumpError(f"--model {path}: build_model() raised "
                            f"{type(e).__name__}: {one_line(e)}") from None
    else:
        try:
            model = keras.models.load_model(path)
        except Exception as e:  # noqa: BLE001 - a broken or foreign file
            raise DumpError(f"--model {path}: cannot load it as a Keras model: "
                            f"{type(e).__name__}: {one_line(e)}") from None
    if not isinstance(model, keras.Model):
        raise DumpError(f"--model {path}: build_model() returned "
                        f"{type(model).__name__}, not a Keras model")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        model.compile(optimizer=keras.optimizers.Adam(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        notes.append(f"the model was not compiled: compiled with {DEFAULT_OPTIMIZER} "
                     f"and {DEFAULT_LOSS}")
    return model, module, notes


# ---------------------------------------------------------------- summary
MIB = float(1 << 20)
PREDICTED_VS_MEASURED = "predicted/measured "


def ran_peak(report: dict) -> Optional[int]:
    """The predicted peak of the graph that ran: the planned peak of the
    rewritten graph, or the original's prediction when sntf handed it back
    unchanged."""
    if report.get("action") == "rewritten" and report.get("planned_peak_bytes"):
        return report["planned_peak_bytes"]
    return report.get("predicted_peak_bytes")


def same_graph_comparison(lines: list, graphs: list, measured: Optional[int]) -> list:
    """Sets each graph's prediction against the measured peak of the graph
    that ran, not the original graph's when the rewritten one ran.

    The shared summary (sntf.tools.dump_output) compares the original
    graph's predicted peak with the measurement; here that figure becomes
    the rewritten graph's planned peak over the measurement, labelled so.

    Args:
      lines: summary_lines' output.
      graphs: the (report, dumped) pairs it was made from.
      measured: the measured peak of the run, or None.

    Returns:
      The lines, with each graph's comparison made on the graph that ran.
    """
    out = list(lines)
    for k, (report, _) in enumerate(graphs):
        ran = ran_peak(report)
        ratio = "n/a" if not ran or not measured else f"{ran / measured:.2f}"
        what = ("planned (rewritten graph, which ran)"
                if report.get("action") == "rewritten" else "predicted (graph ran unchanged)")
        head = next((i for i, line in enumerate(out) if line.startswith(f"graph_{k}: ")), None)
        if head is None:
            continue
        for i in range(head + 1, len(out)):
            if PREDICTED_VS_MEASURED in out[i]:
                out[i] = (out[i][:out[i].index(PREDICTED_VS_MEASURED)]
                          + f"{what}/measured {ratio}")
                break
            if out[i].startswith("graph_"):
                break
    return out


# ---------------------------------------------------------------- main
def run(settings: Settings) -> int:
    """Trains, dumps and summarizes; returns the exit status."""
    import tensorflow as tf

    # One inter-op thread: the executor's order, and with it the peak, repeats.
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras

    import sntf

    try:
        sntf.enable(policy=settings.policy,
                    budget=None if settings.budget is None else settings.budget.to_user(),
                    batch_size=settings.batch, keep_graphs=True)
    except (ValueError, TypeError) as e:
        raise DumpError(one_line(e)) from None

    notes = []
    if _TF_IMPORTED_EARLY:
        notes.append("TensorFlow was imported before sntf_dump set "
                     "TF_ENABLE_ONEDNN_OPTS/TF_CPU_ALLOCATOR_USE_BFC; the "
                     "measured peak may miss small allocations")
    keras.utils.set_random_seed(0)
    model, module, build_notes = build_model(settings, keras)
    notes += build_notes
    n = settings.steps * settings.batch
    x, y, source = make_data(model, module, n)
    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    try:
        model.fit(x, y, batch_size=settings.batch, epochs=1, shuffle=False, verbose=0)
    except Exception as e:  # noqa: BLE001 - the user's model or data
        raise DumpError(f"model.fit failed: {type(e).__name__}: {one_line(e)}") from None
    try:
        measured = int(tf.config.experimental.get_memory_info(device)["peak"])
    except (ValueError, RuntimeError) as e:
        measured = None
        notes.append(f"no measured peak: {type(e).__name__}: {one_line(e, 160)}")
    all_reports = sntf.reports()
    sntf.disable()  # the dump's own TensorFlow work is not part of the picture
    training = [r for r in all_reports if r.get("training")]

    budget_bytes = None
    if settings.budget is not None:
        budget_bytes = settings.budget.resolve(environment.device_memory_bytes())
    label = f"{model.name} ({os.path.basename(settings.model_path)})"
    os.makedirs(settings.out, exist_ok=True)
    graphs = []
    for k, report in enumerate(training):
        title = (f"{label}: batch {settings.batch}, policy '{settings.policy}'"
                 + (f", budget {settings.budget_text}" if settings.budget else "")
                 + f" — training graph {k}")
        folder = os.path.join(settings.out, f"graph_{k}")
        graphs.append((report, dump_graph(tf, report, folder, title, budget_bytes)))
    stale = sorted(d for d in os.listdir(settings.out)
                   if d.startswith("graph_") and d[6:].isdigit()
                   and int(d[6:]) >= len(training))
    if stale:
        notes.append("left over from an earlier run (not rewritten): "
                     + ", ".join(os.path.join(settings.out, d) for d in stale))
    if not training:
        notes.append("no training graph reached sntf (see the reasons with "
                     "sntf.reports()); nothing to dump")
    info = {"settings": settings, "model_label": label, "device": device,
            "measured_peak_bytes": measured, "reports_total": len(all_reports),
            "budget_bytes": budget_bytes, "data_source": (
                f"make_data({n}) from the model file" if source == "make_data"
                else f"{n} random samples shaped like the model's inputs"),
            "notes": notes}
    lines = same_graph_comparison(summary_lines(info, graphs), graphs, measured)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(settings.out, "summary.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    sys.stdout.write(text)
    sys.stdout.flush()
    if not training:
        return 1
    if settings.verify:
        return verify_step(settings, model, x, y)
    return 0


def verify_step(settings: Settings, model, x, y) -> int:
    """Runs sntf.verify on the first batch; prints and writes its report.

    Returns:
      0 when the verdict is "identical" or "identical_up_to_sum_order",
      VERIFY_NONDETERMINISTIC when it is "nondeterministic", else
      VERIFY_DIFFERS.
    """
    import sntf

    try:
        result = sntf.verify(
            model, first_batch(x, settings.batch), first_batch(y, settings.batch),
            policy=settings.policy,
            budget=None if settings.budget is None else settings.budget.to_user(),
            max_chunk_bytes=settings.verify_chunk_bytes, batch_size=settings.batch)
    except (ValueError, RuntimeError) as e:
        raise DumpError(f"--verify: {one_line(e)}") from None
    text = write_verify(result, settings.out)
    sys.stdout.write(text)
    sys.stdout.flush()
    if result.ok:
        return 0
    from sntf.verify import NONDETERMINISTIC

    return VERIFY_NONDETERMINISTIC if result.verdict == NONDETERMINISTIC else VERIFY_DIFFERS


def main(argv: Optional[list] = None) -> int:
    """Runs the tool: the `sntf-dump` command, tools/sntf_dump and
    `python -m sntf.tools.dump`.

    Args:
      argv: the command line, program name first; None reads sys.argv.

    Returns:
      The exit status: 0 on success, 1 when no training graph reached sntf,
      2 for input errors, 3 when --verify finds the graphs differ, 4 when
      the original graph does not repeat its own bits.
    """
    argv = list(sys.argv if argv is None else argv)
    if any(a in HELP_ARGS for a in argv[1:]):
        sys.stdout.write(help_text())
        return 0
    try:
        settings = parse_flags(argv)
        if plot_library_missing():
            sys.stderr.write(f"{PROG}: note: {NO_PLOT_NOTE}\n")
        return run(settings)
    except DumpError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
