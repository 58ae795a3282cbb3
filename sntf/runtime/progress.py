"""What a slow graph pass is doing, shown on stderr while it runs.

A graph of many thousands of nodes can take a while to plan, before its
first step; the user sees why. Once a pass has run DELAY_SECONDS, a line
names the graph, its nodes, the stage the pass is in and the time so far,
rewritten in place (on a terminal, every PERIOD_SECONDS; elsewhere a new
line every LOG_PERIOD_SECONDS, so that logs stay readable). When the pass
ends, one line says what it took: nodes, seconds, and the planned peak
against the predicted one. A pass that ends sooner shows nothing.

The pass fills its report as it goes: the stage is the last key of its
stage_seconds (a stage is entered there when it starts).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional, TextIO

DELAY_SECONDS = 3.0
PERIOD_SECONDS = 0.5
LOG_PERIOD_SECONDS = 10.0
MIB = float(1 << 20)


class Progress:
    """One pass's progress line.

    Args:
      name: report -> the graph's name to show.
      stream: where to write (stderr).
      delay: seconds before anything is shown.
      period: seconds between updates (by default PERIOD_SECONDS on a
        terminal, else LOG_PERIOD_SECONDS).
    """

    def __init__(self, name: Callable[[dict], str], stream: Optional[TextIO] = None,
                 delay: Optional[float] = None, period: Optional[float] = None):
        self._name = name
        self._stream = stream or sys.stderr
        self._delay = DELAY_SECONDS if delay is None else delay
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._period = period if period is not None else (
            PERIOD_SECONDS if self._tty else LOG_PERIOD_SECONDS)
        self._report: Optional[dict] = None
        self._start = time.perf_counter()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self.shown = False

    def watch(self, report: dict) -> None:
        """Follows the report of the pass that just started."""
        self._report, self._start = report, time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="sntf-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._done.wait(self._delay):
            return
        while True:
            self._write(self._line(), final=False)
            if self._done.wait(self._period):
                return

    def _line(self) -> str:
        report = self._report or {}
        stages = list(report.get("stage_seconds") or ())
        stage = stages[-1] if stages else "starting"
        nodes = report.get("nodes") or 0
        return (f"sntf: planning {self._name(report)} ({nodes:,} nodes): {stage}, "
                f"{time.perf_counter() - self._start:.0f} s")

    def _write(self, line: str, final: bool) -> None:
        with self._lock:
            try:
                if self._tty:
                    # Rewrite the line in place, padded over a longer one.
                    self._stream.write("\r" + line.ljust(getattr(self, "_width", 0))
                                       + ("\n" if final else ""))
                    self._width = len(line)
                else:
                    self._stream.write(line + "\n")
                self._stream.flush()
                self.shown = True
            except (OSError, ValueError):   # a closed or broken stream: nothing shown
                pass

    def finish(self, report: Optional[dict]) -> None:
        """Stops the line; where it was shown, ends it with what the pass took."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if not self.shown or report is None:
            return
        seconds = time.perf_counter() - self._start
        line = (f"sntf: planned {self._name(report)}: {report.get('nodes') or 0:,} nodes "
                f"in {seconds:.1f} s")
        predicted, planned = report.get("predicted_peak_bytes"), report.get("planned_peak_bytes")
        if predicted and planned:
            line += f", planned peak {planned / MIB:.1f} MiB of {predicted / MIB:.1f} predicted"
        self._write(line, final=True)
