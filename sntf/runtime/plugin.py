"""Python side of the Grappler plugin shim.

The compiled shim (sntf/_plugin*.so) calls `_optimize` for every graph
Grappler optimizes on the CPU device type. `_optimize` reads the switch state,
runs the pass, records one report per graph, and returns new GraphDef bytes
or None ("leave the graph unchanged"). It raises nothing but a
KeyboardInterrupt or SystemExit during the pass, which the shim raises again
in the main thread.

Registering a second CPU graph optimizer aborts TensorFlow (a CHECK failure),
so the library is registered at most once per process: `ensure_loaded` checks
the process-wide marker that the shim's TF_InitGraph sets, and the shim
registers any second copy for a device type that never exists, where it never
runs (an error status from TF_InitGraph would abort TensorFlow too).
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import importlib
import logging
import os
import site
import sys
import threading
from typing import Optional, Sequence

from sntf import config, passes
from sntf import report as report_schema
from sntf.runtime import environment, noops, progress

logger = logging.getLogger("sntf")

_load_lock = threading.Lock()
_loaded_from: Optional[str] = None
_reports_lock = threading.Lock()
_reports: collections.deque = collections.deque(maxlen=config.Options.max_reports)
# Per thread: (graph key, report) of the last graph handled, so that the
# meta-optimizer's second iteration over a graph merges into its report.
_thread_state = threading.local()
_logged_failures: set = set()
MAX_LOGGED_FAILURES = 1000   # distinct messages remembered for "log once"
_generation = 0              # bumped by clear_reports()


def _shim():
    return importlib.import_module("sntf._plugin")


def _plugin_dirs() -> list[str]:
    """site-packages/tensorflow-plugins folders TensorFlow auto-loads from."""
    roots = [p for p in sys.path if "site-packages" in p]
    try:
        roots += site.getsitepackages()
    except AttributeError:  # virtualenv's old site module
        pass
    dirs = {os.path.join(r, "tensorflow-plugins") for r in roots}
    return sorted(d for d in dirs if os.path.isdir(d))


def foreign_graph_plugins() -> list[str]:
    """Auto-loaded libraries that register a graph optimizer and are not sntf's.

    Their presence means a CPU graph optimizer may already be registered, and a
    second one aborts TensorFlow; the file contents are searched rather than
    loaded, so nothing runs.
    """
    found = []
    for folder in _plugin_dirs():
        for entry in sorted(os.listdir(folder)):
            path = os.path.join(folder, entry)
            if not entry.endswith(".so") or not os.path.isfile(path):
                continue
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if b"TF_InitGraph" in data and b"SNTF_PLUGIN_REGISTERED" not in data:
                found.append(path)
    return found


def registered_path() -> str:
    """Path of the sntf plugin registered in this process, or ''."""
    return _shim().registered_path()


def ensure_loaded() -> str:
    """Registers the Grappler plugin once per process.

    Returns:
      The path of the registered library (possibly a copy TensorFlow
      auto-loaded before sntf was imported).

    Raises:
      RuntimeError: another graph plugin is present, or registration failed.
    """
    global _loaded_from
    with _load_lock:
        if _loaded_from is not None:
            return _loaded_from
        from sntf.runtime import native

        path = native.plugin_library_path()
        shim = _shim()
        owner = shim.registered_path()
        if owner:
            _loaded_from = owner
            logger.info("graph plugin already registered by %s", owner)
            return owner
        foreign = foreign_graph_plugins()
        if foreign:
            raise RuntimeError(
                "sntf: another TensorFlow graph plugin is installed ("
                + ", ".join(foreign) + "); TensorFlow aborts the process when "
                "two graph optimizers register for the same device type, so "
                "sntf did not register its own. Remove that plugin to use sntf.")
        from tensorflow.python.framework import load_library

        try:
            load_library.load_pluggable_device_library(path)
        except Exception as e:  # noqa: BLE001 - re-raised with context below
            owner = shim.registered_path()
            if not owner:
                raise RuntimeError(f"sntf: could not register the graph plugin "
                                   f"{path}: {e}") from e
        _loaded_from = shim.registered_path() or path
        return _loaded_from


def _log_once(key: str, message: str) -> None:
    """Logs a warning once per key. The logger's name already says sntf, so a
    message the pass worded as "sntf: ..." loses that prefix."""
    key = key[:200]
    if message.startswith("sntf: "):
        message = message[len("sntf: "):]
    with _reports_lock:
        if key in _logged_failures or len(_logged_failures) >= MAX_LOGGED_FAILURES:
            return
        _logged_failures.add(key)
    logger.warning("%s", message)


def _name_graph(report: dict, graph_bytes: bytes) -> None:
    """Names a training graph after the Keras model whose fit() built it
    ("train step of 'wrn16_4'"); the pass's hint from name scopes (such as
    "StatefulPartitionedCall,ConstantFolding") stays as report["scopes"].

    The graph counts as the model's when the model's name appears in it:
    Keras scopes every layer's ops under the model's name.
    """
    model = environment.fit_model()
    if not report.get("training") or not model:
        return
    if model.encode("utf-8", "replace") not in graph_bytes:
        return
    report["scopes"] = report.get("graph")
    report["graph"] = f"train step of {model!r}"


def _renamed(message: str, report: dict) -> str:
    """A pass message with the graph's scope hint replaced by its readable
    name (see _name_graph)."""
    scopes = report.get("scopes")
    if scopes and report.get("graph") != scopes:
        return message.replace(f"graph {scopes}", f"graph {report['graph']}")
    return message


def _record(report: dict, key: Optional[bytes], max_reports: int) -> None:
    """Appends a report, or merges it into this thread's previous report of
    the same graph (Grappler's second iteration over it)."""
    global _reports
    with _reports_lock:
        if _reports.maxlen != max_reports:
            _reports = collections.deque(_reports, maxlen=max_reports)
        previous = getattr(_thread_state, "last", None)
        if (key is not None and previous is not None
                and previous[:2] == (_generation, key)):
            _merge(previous[2], report)
            return
        _reports.append(report)
        _thread_state.last = (_generation, key, report)


def _complete(deferred: dict, report: dict, key: Optional[bytes]) -> None:
    """Replaces a deferred report by the report of the call that ran the
    pass (counting both calls), and makes it this thread's last report."""
    with _reports_lock:
        invocations = deferred["invocations"] + report["invocations"]
        seconds = deferred["pass_seconds"] + report["pass_seconds"]
        deferred.clear()
        deferred.update(report)
        deferred["invocations"] = invocations
        deferred["pass_seconds"] = seconds
        _thread_state.last = (_generation, key, deferred)


def _merge(first: dict, again: dict) -> None:
    first["invocations"] += 1
    first["pass_seconds"] += again["pass_seconds"]
    if again["action"] == report_schema.ERROR and first["action"] != report_schema.ERROR:
        for k in ("action", "reason", "error"):
            first[k] = again[k]


def _optimize(graph_bytes: bytes, fetch: Sequence[str], preserve: Sequence[str],
              properties=None) -> Optional[bytes]:
    """Entry point called by the compiled shim for every graph.

    A training graph sntf would change is rewritten the second time
    Grappler hands it over (its last iteration, see passes.run_pass); the first
    time it goes back unchanged, with a report that the second call
    completes.

    Args:
      graph_bytes: serialized GraphDef.
      fetch: fetch node names.
      preserve: nodes-to-preserve names.
      properties: callable giving static output properties (valid only during
        this call).

    Returns:
      The rewritten serialized GraphDef, or None to keep the input graph.
    """
    try:
        state = config.current()
        # The meta-optimizer runs both iterations over one graph in a row on
        # one thread: a graph deferred by this thread's previous call, with
        # the same fetch nodes, is being handed over for the last time.
        pending = getattr(_thread_state, "pending", None)
        _thread_state.pending = None
        if not state.enabled:
            return None
        later = (pending is not None and pending[0] == _generation
                 and pending[1] == tuple(fetch))
        result = _run_without_gc(graph_bytes, fetch, preserve, state, properties,
                                 defer=not later)
        report = result.report
        _name_graph(report, graph_bytes)
        for warning in result.warnings:
            _log_once(warning, _renamed(warning, report))
        if result.deferred:
            _record(report, None, state.options.max_reports)
            _thread_state.pending = (_generation, tuple(fetch), report)
            return None
        out = None
        if result.graph_def is not None:
            out = result.graph_def.SerializeToString()
        if report["action"] == report_schema.ERROR:
            _log_once(report["reason"],
                      f"graph pass failed, graph {report['graph']!r} left "
                      f"unchanged: {report['reason']}")
        if later:
            _complete(pending[2], report, result.key)
        else:
            _record(report, result.key, state.options.max_reports)
        noops.check_report(report)
        noops.check_pool_fallbacks()
        return out
    except (KeyboardInterrupt, SystemExit) as e:
        # Ctrl-C (or a signal handler's sys.exit) while the pass ran: not a
        # failure of the pass. It goes on to the compiled shim, which hands
        # the graph back unchanged (no exception may cross a Grappler
        # callback) and raises it again in the main thread, where fit()
        # runs, once TensorFlow returns there (tf_ops/plugin.cc). Raising it
        # again from here would fire inside this very call.
        logger.warning("%s while the graph pass ran: graph left unchanged, "
                       "the interrupt passed on", type(e).__name__)
        raise
    except Exception as e:  # noqa: BLE001 - a failed pass leaves the graph unchanged
        _record_failure(e)
        return None


def _run_without_gc(graph_bytes: bytes, fetch, preserve, state, properties, defer: bool):
    """passes.run_pass with Python's cyclic GC off.

    The pass allocates hundreds of thousands of small objects on large
    graphs; the cyclic GC then rescans the whole heap again and again.
    Nothing the pass builds needs the cycle collector while it runs."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    env, shown = environment.current(), None
    if state.options.progress and logger.isEnabledFor(logging.WARNING):
        shown = progress.Progress(lambda report: _shown_name(report, graph_bytes))
        env = dataclasses.replace(env, watch=shown.watch)
    result = None
    try:
        result = passes.run_pass(graph_bytes, fetch, preserve, state, properties,
                                 env, defer=defer)
        return result
    finally:
        if shown is not None:
            shown.finish(result.report if result is not None else None)
        if gc_was_enabled:
            gc.enable()


def _shown_name(report: dict, graph_bytes: bytes) -> str:
    """The graph's name as its report will give it (_name_graph)."""
    named = {k: report.get(k) for k in ("graph", "training")}
    named["training"] = True
    _name_graph(named, graph_bytes)
    return named.get("graph") or "a graph"


def _record_failure(error: Exception) -> None:
    """An error report for a call that failed outside the pass, logged once."""
    try:
        report = report_schema.new_report()
        report["action"] = report_schema.ERROR
        report["reason"] = f"{type(error).__name__}: {error}"
        _log_once(report["reason"], "graph pass failed, graph left "
                  f"unchanged: {report['reason']}")
        _record(report, None, config.current().options.max_reports)
    except Exception:  # noqa: BLE001 - nothing may escape into TensorFlow
        pass


def _exit_class(error: SystemExit) -> tuple[int, type]:
    """What the shim needs to raise `error` again in the main thread.

    The interpreter raises an asynchronous exception by calling its class
    without arguments; this subclass of SystemExit supplies the code.

    Args:
      error: the SystemExit the pass raised.

    Returns:
      (the main thread's ident, a SystemExit subclass carrying error.code).
    """
    code = error.code

    class _Exit(SystemExit):
        """SystemExit(code), raised by the interpreter without arguments."""

        def __init__(self, *args) -> None:
            super().__init__(*(args or (code,)))

    _Exit.__name__ = _Exit.__qualname__ = "SystemExit"
    return threading.main_thread().ident, _Exit


def reports() -> list[dict]:
    """Copies of the reports, oldest first."""
    with _reports_lock:
        return [dict(r) for r in _reports]


def clear_reports() -> None:
    """Forgets all reports (the next call to a known graph is reported anew)."""
    global _generation
    with _reports_lock:
        _reports.clear()
        _generation += 1


# ---------------------------------------------------------------- summary
MIB = float(1 << 20)
REASON_CHARACTERS = 110   # a summary line's reason, at most


def _mib(value: Optional[int]) -> str:
    return "?" if value is None else f"{value / MIB:.1f}"


def _clip(text: str, limit: int = REASON_CHARACTERS) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 3].rstrip(" ,;:") + "..."


def short_reason(report: dict) -> str:
    """The gist of a report's reason, on one line.

    Args:
      report: a report from reports().

    Returns:
      At most REASON_CHARACTERS characters.
    """
    action = report.get("action")
    reason = report.get("reason") or ""
    if action == report_schema.ERROR:
        return _clip("pass failed, graph unchanged: " + reason)
    if report.get("deferred"):
        return "deferred: Grappler never handed the graph over a second time"
    if report.get("budget_bytes") is not None and report.get("budget_fits") is not None:
        # The plan must fit a target below the budget: less the margin, what
        # the device holds outside the graph and the allocator's slack.
        target = report.get("budget_target_bytes")
        target = f"the {_mib(target)} MiB target" if target is not None else "the target"
        if report["budget_fits"]:
            return f"fits {target} (the budget less margin and allocator slack)"
        least = report.get("achievable_peak_bytes")
        return _clip(f"no plan reaches {target} (the budget less margin and allocator "
                     "slack)" + (f"; least planned {_mib(least)} MiB" if least else ""))
    if report.get("training_reason") is not None:
        # What the plan did, without why the graph is a training one.
        reason = "; ".join(report.get("notes") or ())
    if not reason:
        return "no reason given"
    # Whole notes while they fit on the line, else the first one clipped.
    notes = report.get("notes") or [reason]
    text = notes[0]
    for note in notes[1:]:
        if len(text) + 2 + len(note) > REASON_CHARACTERS:
            break
        text += "; " + note
    return _clip(text)


def summary_line(report: dict) -> str:
    """One graph's summary line: name, action, peaks and budget in MiB, the
    tensors swapped and recomputed, and the reason's gist.

    Args:
      report: a report from reports().

    Returns:
      One line of text.
    """
    parts = [f"{report.get('graph') or 'graph'}: {report.get('action')}"]
    predicted = report.get("predicted_peak_bytes")
    planned = report.get("planned_peak_bytes")
    if predicted is not None:
        peak = f"peak {_mib(predicted)}"
        if planned is not None:
            peak += f" -> {_mib(planned)}"
        parts.append(peak + " MiB")
    if report.get("budget_bytes") is not None:
        parts.append(f"budget {_mib(report['budget_bytes'])} MiB")
    if report.get("swapped") is not None or report.get("recomputed") is not None:
        parts.append(f"swapped {len(report.get('swapped') or ())}, "
                     f"recomputed {len(report.get('recomputed') or ())}")
    return ", ".join(parts) + "; " + short_reason(report)


def summary(all_graphs: bool = False) -> str:
    """The text sntf.summary() returns: a header, then one line per training
    graph (per graph with all_graphs=True).

    Args:
      all_graphs: list every graph, not only training steps.

    Returns:
      Lines of text joined by newlines.
    """
    state = config.current()
    every = reports()
    shown = [r for r in every if all_graphs or r.get("training")]
    if state.enabled:
        budget = "no budget" if state.budget is None else f"budget {state.budget.describe()}"
        header = f"sntf: policy {state.policy!r}, {budget}"
    else:
        header = "sntf: disabled"
    header += (f"; {sum(1 for r in every if r.get('training'))} training graph(s) "
               f"of {len(every)} graph(s) seen")
    lines = [header] + ["  " + summary_line(r) for r in shown]
    if not any(r.get("training") for r in every):
        causes = sorted(noops.warned())
        lines.append("  no training graph reached sntf"
                     + (f" (see the warnings logged: {', '.join(causes)})" if causes
                        else "; docs/troubleshooting.md lists why that happens"))
    return "\n".join(lines)
