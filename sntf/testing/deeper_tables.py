"""The markdown tables of a deeper search's result (sntf.testing.deeper):
the deepest depths side by side, and every trial."""

from __future__ import annotations

from typing import Optional

MIB = float(1 << 20)


def _mib(n: Optional[int]) -> str:
    return "" if n is None else f"{n / MIB:.1f}"


def _depth_cell(summary: dict) -> str:
    if summary["deepest_depth"] is None:
        return f"none ({summary['limit']})"
    if summary["capped"]:
        return f">= {summary['deepest_depth']} (max_depth)"
    return str(summary["deepest_depth"])


def _budget_text(budget_bytes: int) -> str:
    if budget_bytes % (1 << 20) == 0:
        return f"{budget_bytes >> 20} MiB"
    return f"{budget_bytes / MIB:.1f} MiB ({budget_bytes} B)"


def result_table(out: dict) -> str:
    """The summary table (markdown) of a run() result.

    Args:
      out: what run() returned.

    Returns:
      A markdown table with a header and one row.
    """
    tf, sn, ratio = out["tf"], out["sntf"], out["time_ratio"]
    header = ["family", "batch", "budget", "TF deepest depth", "TF layers",
              "TF peak (MiB)", "sntf policy", "sntf deepest depth", "sntf layers",
              "sntf peak (MiB)",
              f"sntf / TF step time at depth {ratio['depth'] or '-'}",
              "deeper (sntf / TF layers)"]
    if ratio["value"] is not None:
        ratio_cell = f"{ratio['value']:.2f}"
        if out["steps"] < 3:
            # Say so in the table itself: one timed step is a noisy figure.
            ratio_cell += f" ({max(out['steps'] - 1, 1)} timed step)"
    else:
        ratio_cell = f"n/a: {ratio['note']}"
    if out["deeper"] is not None:
        deeper = f"{'>= ' if sn['capped'] else ''}{out['deeper']:.2f}x"
    elif sn["layers"] and not tf["layers"]:
        deeper = "TF fits no depth"
    else:
        deeper = "n/a"
    budget = _budget_text(out["budget_bytes"])
    if out.get("hard_limit"):
        budget += " (hard limit)"
    cells = [out["family"], str(out["batch"]), budget,
             _depth_cell(tf), str(tf["layers"] or ""),
             _mib(tf["peak_bytes"]), out["policy"], _depth_cell(sn),
             str(sn["layers"] or ""), _mib(sn["peak_bytes"]), ratio_cell, deeper]
    cells = [c.replace("|", "/") for c in cells]
    return ("| " + " | ".join(header) + " |\n|" + " --- |" * len(header) + "\n| "
            + " | ".join(cells) + " |")


def trials_table(out: dict) -> str:
    """Every trial of a run() result as a markdown table, in the order run.

    Args:
      out: what run() returned.

    Returns:
      A markdown table.
    """
    lines = ["| search | depth | layers | peak (MiB) | step (ms) | wall (s) | fits | why |",
             "|" + " --- |" * 8]
    rows = [("TF", t) for t in out["tf"]["trials"]]
    rows += [(f"sntf {out['policy']}", t) for t in out["sntf"]["trials"]]
    if out["sntf"].get("time_trial"):
        rows.append((f"sntf {out['policy']} (step time)", out["sntf"]["time_trial"]))
    for label, t in rows:
        r = t["result"] or {}
        step = r.get("seconds_per_step")
        cells = [label, str(t["depth"]), str(r.get("layers", "")),
                 _mib(r.get("measured_peak_bytes")),
                 "" if step is None else f"{step * 1000:.0f}", f"{t['seconds']:.1f}",
                 "yes" if t["fits"] else "no", t["reason"]]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)
