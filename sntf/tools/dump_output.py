"""sntf_dump's output: per training graph, its files, and the summary.

Plain functions over the reports sntf keeps with keep_graphs=True.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
from typing import Optional

MIB = float(1 << 20)
GRAPH_FILES = ("original.pbtxt", "rewritten.pbtxt", "plan.json", "timeline.png",
               "timeline.json", "tensorboard/")


# Said once before a run when matplotlib, sntf's optional extra "plot", is
# missing: the dump then writes timeline.json but no timeline.png.
NO_PLOT_NOTE = ("matplotlib is not installed, so no timeline.png (timeline.json "
                "has its numbers); to draw it install sntf's extra: pip install "
                "'sntf[plot]' (from a clone: pip install --no-build-isolation "
                "'.[plot]')")


def plot_library_missing() -> bool:
    """Whether matplotlib, which draws timeline.png, cannot be found.

    Returns:
      True when `import matplotlib` would fail (the extra "plot" is not
      installed); the module is not imported.
    """
    try:
        return importlib.util.find_spec("matplotlib") is None
    except (ImportError, ValueError):
        return True


def one_line(text, limit: int = 400) -> str:
    """Text on one line, at most `limit` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


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
        if facts.node_phases[facts.schedule[step]] == "backward":
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
                f"a tf.Graph failed: {type(e).__name__}: {one_line(e, 160)})")
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
# The pass's stages in the order they run (sntf.passes.run_pass).
STAGE_ORDER = ("parse", "index", "detect", "shapes", "analysis", "plan_recompute",
               "plan_rebuild", "plan_swap", "plan_auto", "rewrite")


def breakdown_line(found: dict) -> str:
    """The planned peak's breakdown on one line (sntf.analysis.breakdown)."""
    from sntf.analysis.breakdown import describe

    return "planned " + describe(found)


def stage_line(stage_seconds: dict) -> str:
    """The wall time of each stage of the pass, in the order they ran."""
    known = [s for s in STAGE_ORDER if s in stage_seconds]
    known += sorted(s for s in stage_seconds if s not in STAGE_ORDER)
    if not known:
        return "none timed"
    return " -> ".join(f"{s} {stage_seconds[s]:.3f} s" for s in known)


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
            "  stages: " + stage_line(report.get("stage_seconds") or {}),
            "  " + (breakdown_line(report["peak_breakdown"])
                    if report.get("peak_breakdown") else "peak breakdown: n/a"),
            f"  files: {dumped['folder']}/ " + " ".join(dumped["written"]),
        ]
        lines += [f"  note: {n}" for n in dumped["notes"]]
    if graphs:
        lines.append(f"graphs in TensorBoard: tensorboard --logdir "
                     f"{os.path.join(s.out, 'graph_0', 'tensorboard')}")
    lines.append(f"this summary: {os.path.join(s.out, 'summary.txt')}")
    return lines


# ---------------------------------------------------------------- --verify
def write_verify(result, out: str) -> str:
    """Writes sntf.verify's report to OUT/verify.txt and the result as data to
    OUT/verify.json; returns the text (with a trailing newline).

    Args:
      result: a sntf.verify VerifyResult.
      out: the output folder.

    Returns:
      The report text, as written to verify.txt.
    """
    os.makedirs(out, exist_ok=True)
    text = str(result) + "\n"
    with open(os.path.join(out, "verify.txt"), "w", encoding="utf-8") as f:
        f.write(text)
    document = dataclasses.asdict(result)
    document["identical"] = result.identical
    document["ok"] = result.ok
    with open(os.path.join(out, "verify.json"), "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2, default=str)
        f.write("\n")
    return text
