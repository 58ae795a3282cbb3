"""sntf_dump: train a Keras model for a step with sntf and dump what sntf saw.

    tools/sntf_dump --model MODEL --batch B [--policy off] [--budget BUDGET]
                    [--out sntf_dump_out] [--steps 1]
    python -m sntf.tools.dump ...          (the same tool)

MODEL is a saved `.keras` (or `.h5`) file, or a Python file that defines
`build_model()` or `build_model(keras)` returning a Keras model (compiled or
not: an uncompiled one is compiled with Adam and
SparseCategoricalCrossentropy(from_logits=True)). The file may also define
`make_data(n)` returning (x, y) with n samples; otherwise random data is made
from the model's input shape and its loss (integer labels for sparse
categorical losses, random targets of the output shape otherwise).

The tool enables sntf with the policy, budget and batch, trains exactly
steps * batch samples with `model.fit` in one process, and writes for every
training graph sntf saw a folder OUT/graph_<k>/ with

  original.pbtxt    the graph Grappler handed to sntf (text GraphDef)
  rewritten.pbtxt   the graph sntf handed back
  plan.json         the plan (decisions and why) and the headline numbers
  timeline.png      predicted device memory per schedule step, original and
                    planned, with the lower bound, the budget, the start of
                    the backward pass and the checkpoints
  timeline.json     the plotted series and lines, as numbers
  tensorboard/      both graphs for TensorBoard (runs original, rewritten):
                    tensorboard --logdir OUT/graph_<k>/tensorboard

plus OUT/summary.txt, also printed: per graph its nodes, predicted and
planned peak, lower bound, pass time and actions, and the peak TensorFlow's
device allocator measured for the whole run.

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
import json  # noqa: E402
import shutil  # noqa: E402
from typing import Optional  # noqa: E402

from absl import flags  # noqa: E402

from sntf import config  # noqa: E402  (plain Python: no TensorFlow import)

PROG = "sntf_dump"
MIB = float(1 << 20)
GRAPH_FILES = ("original.pbtxt", "rewritten.pbtxt", "plan.json", "timeline.png",
               "timeline.json", "tensorboard/")
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
flags.DEFINE_string("policy", "off",
                    "sntf policy: " + ", ".join(config.POLICIES),
                    flag_values=FLAGS)
flags.DEFINE_string("budget", None,
                    "device-memory budget passed to sntf: bytes, a size such "
                    "as 12GB or 512MiB, or a fraction of device memory such "
                    "as 0.5 or 50%, or auto", flag_values=FLAGS)
flags.DEFINE_string("out", "sntf_dump_out", "output folder", flag_values=FLAGS)
flags.DEFINE_integer("steps", 1, "training steps (steps * batch samples)",
                     flag_values=FLAGS)

HELP_ARGS = ("-h", "-?", "-help", "--help", "--helpshort", "--helpfull")


class DumpError(Exception):
    """An input problem: reported as one line, exit status 2."""


@dataclasses.dataclass
class Settings:
    model_path: str
    batch: int
    policy: str
    budget: Optional[config.Budget]
    budget_text: Optional[str]
    out: str
    steps: int


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
        raise DumpError(_one_line(str(e)) + " (see --help)") from None
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
    try:
        policy = config.parse_policy(FLAGS.policy)
    except ValueError as e:
        raise DumpError(f"--policy: {e}") from None
    budget_text = FLAGS.budget if FLAGS.budget not in (None, "", "none", "None") else None
    try:
        budget = config.parse_budget(budget_text)
    except ValueError as e:
        raise DumpError(f"--budget: {e}") from None
    model_path = check_model_path(FLAGS.model)
    return Settings(model_path=model_path, batch=FLAGS.batch, policy=policy,
                    budget=budget, budget_text=budget_text, out=FLAGS.out,
                    steps=FLAGS.steps)


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


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
                        f"{type(e).__name__}: {_one_line(e)}") from None
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
                            f"{type(e).__name__}: {_one_line(e)}") from None
    else:
        try:
            model = keras.models.load_model(path)
        except Exception as e:  # noqa: BLE001 - a broken or foreign file
            raise DumpError(f"--model {path}: cannot load it as a Keras model: "
                            f"{type(e).__name__}: {_one_line(e)}") from None
    if not isinstance(model, keras.Model):
        raise DumpError(f"--model {path}: build_model() returned "
                        f"{type(model).__name__}, not a Keras model")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        model.compile(optimizer=keras.optimizers.Adam(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        notes.append(f"the model was not compiled: compiled with {DEFAULT_OPTIMIZER} "
                     f"and {DEFAULT_LOSS}")
    return model, module, notes


def _shapes(shape) -> list:
    """A Keras input/output shape as a list of tuples (one per tensor)."""
    if isinstance(shape, dict):
        return [tuple(s) for s in shape.values()]
    if isinstance(shape, (list, tuple)) and shape and isinstance(shape[0], (list, tuple)):
        return [tuple(s) for s in shape]
    return [tuple(shape)]


def _loss_name(loss, index: int) -> str:
    if isinstance(loss, (list, tuple)):
        loss = loss[index] if index < len(loss) else None
    elif isinstance(loss, dict):
        values = list(loss.values())
        loss = values[index] if index < len(values) else None
    if loss is None:
        return ""
    if isinstance(loss, str):
        return loss.lower()
    name = getattr(loss, "name", None) or getattr(loss, "__name__", None) or ""
    return f"{type(loss).__name__} {name}".lower()


def _concrete(shape: tuple, n: int, what: str) -> tuple:
    dims = (n,) + tuple(shape[1:])
    if any(d is None for d in dims):
        raise DumpError(f"the model's {what} shape {shape} has unknown dimensions "
                        "besides the batch; define make_data(n) in the model file")
    return dims


def synthesize_data(model, n: int):
    """Random inputs and targets for n samples, from the model's shapes and loss."""
    import numpy as np

    rng = np.random.default_rng(0)
    inputs = []
    dtypes = [getattr(t, "dtype", "float32") for t in (getattr(model, "inputs", None) or [])]
    for i, shape in enumerate(_shapes(model.input_shape)):
        dims = _concrete(shape, n, "input")
        dtype = np.dtype(str(dtypes[i]) if i < len(dtypes) else "float32")
        if np.issubdtype(dtype, np.integer):
            inputs.append(rng.integers(0, 2, dims).astype(dtype))
        else:
            inputs.append(rng.random(dims, dtype=np.float32).astype(dtype))
    targets = []
    for i, shape in enumerate(_shapes(model.output_shape)):
        dims = _concrete(shape, n, "output")
        loss = _loss_name(getattr(model, "loss", None), i)
        classes = dims[-1] if len(dims) > 1 else 1
        if "sparse" in loss:
            targets.append(rng.integers(0, max(classes, 1), dims[:-1]).astype(np.int64))
        elif "categorical" in loss:
            labels = rng.integers(0, max(classes, 1), dims[:-1])
            targets.append(np.eye(classes, dtype=np.float32)[labels])
        else:
            targets.append(rng.random(dims, dtype=np.float32))
    x = inputs[0] if len(inputs) == 1 else inputs
    y = targets[0] if len(targets) == 1 else targets
    return x, y


def make_data(model, module, n: int):
    """(x, y, where from): the model file's make_data(n), or synthesized."""
    fn = getattr(module, "make_data", None) if module is not None else None
    if callable(fn):
        try:
            data = fn(n)
            x, y = data
        except Exception as e:  # noqa: BLE001 - the user's code
            raise DumpError(f"make_data({n}) failed: {type(e).__name__}: "
                            f"{_one_line(e)}") from None
        return x, y, "make_data"
    x, y = synthesize_data(model, n)
    return x, y, "synthesized"


# ---------------------------------------------------------------- per graph
def planned_analysis(report: dict):
    """(Analysis of the graph as planned, its source key).

    Once the pass reports an Analysis of the rewritten graph
    ("planned_analysis_result"), that is the planned curve; until then the
    rewritten graph is the original one (policy "off"), so the planned curve
    is the original analysis.
    """
    planned = report.get("planned_analysis_result")
    if planned is not None:
        return planned, "planned_analysis_result"
    return report.get("analysis_result"), "analysis_result"


def headline(report: dict) -> dict:
    """The report's headline numbers, as plain data."""
    facts = report.get("analysis_result")
    keys = ("graph", "policy", "action", "reason", "batch", "nodes", "invocations",
            "pass_seconds", "predicted_peak_bytes", "planned_peak_bytes",
            "lower_bound_bytes", "swapped", "recomputed", "analysis_error")
    out = {k: report.get(k) for k in keys}
    out["persistent_bytes"] = getattr(facts, "persistent_bytes", None)
    out["peak_step"] = getattr(facts, "peak_step", None)
    out["schedule_steps"] = len(facts.schedule) if facts is not None else None
    out["analysis"] = report.get("analysis")
    ratio = None
    if out["planned_peak_bytes"] and out["lower_bound_bytes"]:
        ratio = out["planned_peak_bytes"] / out["lower_bound_bytes"]
    out["planned_over_lower_bound"] = ratio
    return out


def plan_document(report: dict, budget_bytes: Optional[int]) -> dict:
    """plan.json: the plan dict, then the report's headline numbers."""
    doc = dict(report.get("plan") or {"policy": report.get("policy"), "decisions": [],
                                       "notes": ["the report carries no plan"]})
    doc.update(headline(report))
    doc["budget_bytes"] = budget_bytes
    return doc


def backward_start(facts) -> Optional[int]:
    """The step where the backward pass starts, for the plot.

    The analysis' timeline.backward_start is the first op it labels backward.
    Ops that update state from forward activations (BatchNormalization's
    moving averages) carry that label too and can run before the forward pass
    ends, so when forward checkpoints (conv/matmul outputs) run after it, the
    plot marks the first backward op after the last forward checkpoint.
    """
    first = facts.timeline.backward_start
    checkpoints = facts.timeline.checkpoint_steps
    if first is None or not checkpoints or max(checkpoints) < first:
        return first
    last = max(checkpoints)
    for step in range(last + 1, len(facts.schedule)):
        if facts.phases[facts.schedule[step]] == "backward":
            return step
    return first


def timeline_data(report: dict, title: str, budget_bytes: Optional[int]) -> Optional[dict]:
    """The series and lines timeline.png shows, as plain numbers (bytes)."""
    original = report.get("analysis_result")
    if original is None:
        return None
    planned, source = planned_analysis(report)
    planned_peak = report.get("planned_peak_bytes")
    if source != "analysis_result" or planned_peak is None:
        planned_peak = planned.predicted_peak_bytes
    return {
        "title": title,
        "x": "schedule step",
        "y": "bytes (MiB in the plot)",
        "series": {
            "original": [int(v) for v in original.timeline.device_bytes],
            "planned": [int(v) for v in planned.timeline.device_bytes],
        },
        "planned_source": source,
        "planned_equals_original": planned is original,
        "predicted_peak_bytes": int(original.predicted_peak_bytes),
        "planned_peak_bytes": int(planned_peak),
        "peak_step": original.peak_step,
        "lower_bound_bytes": int(original.lower_bound_bytes),
        "lower_bound_step": original.lower_bound_step,
        "budget_bytes": budget_bytes,
        "backward_start": backward_start(original),
        "analysis_backward_start": original.timeline.backward_start,
        "checkpoint_steps": list(original.timeline.checkpoint_steps),
        "planned_checkpoint_steps": list(planned.timeline.checkpoint_steps),
        "planned_backward_start": backward_start(planned),
        "policy": report.get("policy"),
    }


def plot_timeline(data: dict, path: str) -> None:
    """Draws timeline.png from timeline_data (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    orig = [v / MIB for v in data["series"]["original"]]
    plan = [v / MIB for v in data["series"]["planned"]]
    lower = data["lower_bound_bytes"] / MIB
    budget = data["budget_bytes"] / MIB if data["budget_bytes"] else None
    top = max(max(orig or [0]), max(plan or [0]), lower) * 1.18 or 1.0

    fig, ax = plt.subplots(figsize=(11, 5.6), dpi=110)
    back = data["backward_start"]
    if back is not None:
        ax.axvspan(back, max(len(orig) - 1, back), color="0.5", alpha=0.07, lw=0)
    ax.plot(range(len(orig)), orig, color="tab:blue", lw=1.8,
            label=f"original graph: predicted peak {data['predicted_peak_bytes'] / MIB:.1f} MiB")
    same = data["planned_equals_original"]
    ax.plot(range(len(plan)), plan, color="tab:orange", lw=1.3, ls=(0, (5, 3)),
            label=(f"planned ({data['policy']}): peak {data['planned_peak_bytes'] / MIB:.1f} MiB"
                   + ("  (same graph: nothing planned)" if same else "")))
    if orig:
        p = data["peak_step"]
        ax.plot([p], [orig[p]], "o", color="tab:blue", ms=5)
        ax.annotate(f"peak {orig[p]:.1f} MiB", (p, orig[p]), xytext=(6, 4),
                    textcoords="offset points", fontsize=8, color="tab:blue")
    cps = [s for s in data["checkpoint_steps"] if s < len(orig)]
    if cps:
        ax.plot(cps, [orig[s] for s in cps], "v", color="tab:purple", ms=4.5,
                label=f"checkpoints: conv/matmul outputs in the forward pass ({len(cps)})")
    ax.axhline(lower, color="tab:green", ls=":", lw=1.6,
               label=f"lower bound (largest single-op working set): {lower:.1f} MiB")
    if budget is not None:
        if budget <= top:
            ax.axhline(budget, color="tab:red", ls="-.", lw=1.4,
                       label=f"budget: {budget:.1f} MiB")
        else:
            ax.text(0.99, 0.985, f"budget {budget:,.0f} MiB (far above this scale)",
                    transform=ax.transAxes, ha="right", va="top", fontsize=8,
                    color="tab:red")
    if back is not None:
        ax.axvline(back, color="0.35", ls="--", lw=1.0,
                   label=f"backward pass starts (step {back})")
    ax.set_xlim(0, max(len(orig), len(plan), 2) - 1)
    ax.set_ylim(0, top)
    ax.set_xlabel("schedule step (ops in the executor's order, one inter-op thread)")
    ax.set_ylabel("device memory in use (MiB)")
    ax.set_title(data["title"], fontsize=11)
    ax.grid(alpha=0.25)
    ax.legend(loc="upper left", fontsize=8, framealpha=0.92)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_pbtxt(graph_def, path: str) -> None:
    from google.protobuf import text_format

    with open(path, "w", encoding="utf-8") as f:
        f.write(text_format.MessageToString(graph_def))


def write_tensorboard(tf, graph_def, logdir: str) -> Optional[str]:
    """Writes one graph to a TensorBoard run; returns a note when it had to
    write the GraphDef as is (it could not be imported into a tf.Graph)."""
    note = None
    data = graph_def
    try:
        g = tf.Graph()
        with g.as_default():
            tf.compat.v1.import_graph_def(graph_def, name="")
        data = g
    except Exception as e:  # noqa: BLE001 - fall back to the raw GraphDef
        note = (f"{os.path.basename(logdir)}: written as a GraphDef (import into "
                f"a tf.Graph failed: {type(e).__name__}: {_one_line(e, 160)})")
    writer = tf.summary.create_file_writer(logdir)
    with writer.as_default():
        tf.summary.graph(data)
    writer.flush()
    writer.close()
    return note


def dump_graph(tf, report: dict, folder: str, title: str,
               budget_bytes: Optional[int]) -> dict:
    """Writes one training report's folder; returns what was written and notes."""
    os.makedirs(folder, exist_ok=True)
    written, notes = [], []
    original = report.get("original_graph")
    rewritten = report.get("rewritten_graph")
    if original is None:
        notes.append("the report kept no graphs (" + (report.get("reason") or "no reason")
                     + ")")
    else:
        if rewritten is None:
            rewritten = original
        write_pbtxt(original, os.path.join(folder, "original.pbtxt"))
        write_pbtxt(rewritten, os.path.join(folder, "rewritten.pbtxt"))
        written += ["original.pbtxt", "rewritten.pbtxt"]
        board = os.path.join(folder, "tensorboard")
        shutil.rmtree(board, ignore_errors=True)  # ours: no stale event files
        for run, graph_def in (("original", original), ("rewritten", rewritten)):
            note = write_tensorboard(tf, graph_def, os.path.join(board, run))
            if note:
                notes.append(note)
        written.append("tensorboard/")
    with open(os.path.join(folder, "plan.json"), "w", encoding="utf-8") as f:
        json.dump(plan_document(report, budget_bytes), f, indent=2, default=str)
        f.write("\n")
    written.append("plan.json")
    data = timeline_data(report, title, budget_bytes)
    if data is None:
        notes.append("no memory analysis, so no timeline: "
                     + (report.get("analysis_error") or "the report carries none"))
    else:
        with open(os.path.join(folder, "timeline.json"), "w", encoding="utf-8") as f:
            json.dump(data, f)
            f.write("\n")
        try:
            plot_timeline(data, os.path.join(folder, "timeline.png"))
            written.append("timeline.png")
        except ImportError:
            notes.append("matplotlib is not installed: timeline.png not drawn "
                         "(timeline.json has the numbers)")
        written.append("timeline.json")
    order = {name: k for k, name in enumerate(GRAPH_FILES)}
    written.sort(key=lambda name: order.get(name, len(order)))
    return {"folder": folder, "written": written, "notes": notes}


# ---------------------------------------------------------------- summary
def _mib(value) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f} MiB"


def _ratio(a, b) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}"


def summary_lines(run: dict, graphs: list) -> list:
    """The one-screen text summary."""
    s = run["settings"]
    budget = "none" if s.budget is None else (
        f"{s.budget_text} = {run['budget_bytes'] / MIB:.1f} MiB")
    lines = [
        f"sntf_dump: {run['model_label']}, batch {s.batch}, {s.steps} step(s), "
        f"policy '{s.policy}', budget {budget}",
        f"data: {run['data_source']}; measured {run['device']} peak of the run: "
        f"{_mib(run['measured_peak_bytes'])} (TensorFlow's allocator, whole process)",
        f"training graphs: {len(graphs)} of {run['reports_total']} graphs sntf saw",
    ]
    for note in run["notes"]:
        lines.append(f"note: {note}")
    for k, (report, dumped) in enumerate(graphs):
        h = headline(report)
        budget_bytes = run["budget_bytes"]
        if budget_bytes is not None and h["lower_bound_bytes"] and \
                budget_bytes < h["lower_bound_bytes"]:
            dumped["notes"].append(
                f"the budget ({_mib(budget_bytes)}) is below the lower bound "
                f"({_mib(h['lower_bound_bytes'])}): no plan can meet it")
        swapped = len(report.get("swapped") or [])
        recomputed = len(report.get("recomputed") or [])
        lines += [
            f"graph_{k}: {h['graph']!s}: {h['nodes']} nodes, action {h['action']}",
            f"  predicted peak {_mib(h['predicted_peak_bytes']):>12}   "
            f"predicted/measured {_ratio(h['predicted_peak_bytes'], run['measured_peak_bytes'])}",
            f"  planned peak   {_mib(h['planned_peak_bytes']):>12}   "
            f"planned/lower bound {_ratio(h['planned_peak_bytes'], h['lower_bound_bytes'])}",
            f"  lower bound    {_mib(h['lower_bound_bytes']):>12}   "
            "(largest single-op working set + persistent)",
            f"  pass {h['pass_seconds'] or 0.0:.3f} s over {h['invocations']} "
            f"invocation(s); swapped {swapped}, recomputed {recomputed}",
            f"  files: {dumped['folder']}/ " + " ".join(dumped["written"]),
        ]
        lines += [f"  note: {n}" for n in dumped["notes"]]
    if graphs:
        lines.append(f"graphs in TensorBoard: tensorboard --logdir "
                     f"{os.path.join(s.out, 'graph_0', 'tensorboard')}")
    lines.append(f"this summary: {os.path.join(s.out, 'summary.txt')}")
    return lines


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
        raise DumpError(_one_line(e)) from None

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
        raise DumpError(f"model.fit failed: {type(e).__name__}: {_one_line(e)}") from None
    try:
        measured = int(tf.config.experimental.get_memory_info(device)["peak"])
    except (ValueError, RuntimeError) as e:
        measured = None
        notes.append(f"no measured peak: {type(e).__name__}: {_one_line(e, 160)}")
    all_reports = sntf.reports()
    sntf.disable()  # the dump's own TensorFlow work is not part of the picture
    training = [r for r in all_reports if r.get("training")]

    budget_bytes = None
    if settings.budget is not None:
        budget_bytes = settings.budget.resolve(config.device_memory_bytes())
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
    lines = summary_lines(info, graphs)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(settings.out, "summary.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0 if training else 1


def main(argv: Optional[list] = None) -> int:
    """Entry point: returns the exit status (2 for input errors)."""
    argv = list(sys.argv if argv is None else argv)
    if any(a in HELP_ARGS for a in argv[1:]):
        sys.stdout.write(help_text())
        return 0
    try:
        settings = parse_flags(argv)
        return run(settings)
    except DumpError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
