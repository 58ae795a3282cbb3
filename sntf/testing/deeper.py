"""Finds, by measurement, how much deeper a model trains within a memory budget
with sntf than with TensorFlow alone (benchmarks/deeper.py runs it).

For a model family of sntf.models (default "resnet", whose depth knob n is
residual blocks per stage: the CIFAR ResNet-(6n+2), 10 + 21*n Keras layers)
it runs two searches over the depth:

  TensorFlow  the deepest depth whose measured CPU:0 peak <= budget, sntf
              never imported (sntf/testing/workers/measure_peak.py --policy none)
  sntf        the deepest depth whose measured peak <= budget and whose
              training did not fail (--policy <policy> --budget <budget>)

Each search grows the depth exponentially (1, 2, 4, 8, ...) until a depth
does not fit or --max_depth is reached (max_depth itself is tried last), then
bisects between the last depth that fit and the first that did not. Every
trial is a fresh process (docs/tensorflow.md: one plugin per process, the
allocator's peak cannot be reset). A trial "does not fit" when its peak is
over the budget, the worker fails, it times out (--timeout), or a loss is not
finite; the reason is recorded.

With --hard_limit the budget is a hard limit on the CPU allocator
(TF_CPU_BFC_MEM_LIMIT_IN_MB), as a GPU's memory is: a depth fits when it
trains, not when a step raises ResourceExhaustedError. sntf gets no budget:
it reads the device's limit, as a plain `sntf.enable()` does. oneDNN is off
(with it, a refused allocation aborts inside a oneDNN convolution).

The search assumes the peak grows with the depth. Identical runs differ by a
few percent now and then (see measure_peak.py), so a depth whose peak lies
within that noise of the budget may land on either side; --repeats N takes
the median of N runs per trial.

Output: result_table and trials_table (markdown) and the command line on
stdout, progress on stderr; --out writes every trial's result as JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import subprocess
import sys
import time
from typing import Any, Callable, Optional, TextIO

from sntf.testing.deeper_tables import MIB, result_table, trials_table  # noqa: F401
from sntf.testing.workers import measure_peak

# What a worker prints when a step needs more than the hard limit: the
# error's class, or, where the error's text is all that is left of a long
# traceback, TensorFlow's message.
OUT_OF_MEMORY = ("ResourceExhaustedError", "OOM when allocating tensor")

@dataclasses.dataclass
class Trial:
    """One depth tried by a search."""

    depth: int
    fits: bool
    info: Any  # whatever fits() returned with the verdict


@dataclasses.dataclass
class SearchResult:
    """The outcome of search_deepest."""

    deepest: Optional[int]  # None: not even depth 1 fits
    capped: bool            # max_depth fits, so the true answer may be deeper
    trials: list            # [Trial], in the order they ran

    def trial(self, depth: int) -> Optional[Trial]:
        """The trial at `depth`, or None if the search did not try it."""
        return next((t for t in self.trials if t.depth == depth), None)


def _ceil_log2(n: int) -> int:
    return (n - 1).bit_length() if n > 0 else 0


def remaining_trials(good: int, bad: Optional[int], max_depth: int) -> int:
    """An upper bound on the trials search_deepest still runs.

    Args:
      good: the deepest depth known to fit (0 if none yet).
      bad: the shallowest depth known not to fit (None if none yet).
      max_depth: the search's cap.

    Returns:
      The most trials left, over every outcome of the remaining trials.
    """
    if bad is not None:
        # Bisection over the bad - good - 1 untried depths in between.
        return _ceil_log2(bad - good)
    worst, count, prev = 0, 0, good
    while prev < max_depth:
        nxt = min(2 * prev, max_depth) if prev else 1
        count += 1
        # If nxt fails, bisection between prev and nxt follows.
        worst = max(worst, count + _ceil_log2(nxt - prev))
        prev = nxt
    return max(worst, count)


def search_deepest(fits: Callable[[int], tuple], max_depth: int,
                   on_trial: Optional[Callable[[Trial, int], None]] = None
                   ) -> SearchResult:
    """Finds the deepest depth in [1, max_depth] for which fits(depth) holds.

    Assumes fits is monotone (true up to some depth, false beyond). Tries
    1, 2, 4, ... (and max_depth when the next power of two would pass it)
    until a depth does not fit, then bisects between the last depth that fit
    and the first that did not. Each depth is tried at most once.

    Args:
      fits: depth -> (fits: bool, info); info is kept in the Trial.
      max_depth: the deepest depth tried (>= 1).
      on_trial: called after each trial with the trial and an upper bound on
        the trials still to run (for a progress bar).

    Returns:
      A SearchResult.

    Raises:
      ValueError: max_depth < 1.
    """
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    trials: list = []
    good, bad = 0, None

    def probe(depth: int) -> bool:
        nonlocal good, bad
        ok, info = fits(depth)
        ok = bool(ok)
        if ok:
            good = depth
        else:
            bad = depth
        trials.append(Trial(depth, ok, info))
        if on_trial is not None:
            on_trial(trials[-1], remaining_trials(good, bad, max_depth))
        return ok

    depth = 1
    while probe(depth) and depth < max_depth:
        depth = min(2 * depth, max_depth)
    while bad is not None and bad - good > 1:
        probe((good + bad) // 2)
    return SearchResult(deepest=good or None, capped=good == max_depth, trials=trials)


# --------------------------------------------------------------------------
# Trials: one measure_peak worker process per depth.


def _error_line(text: str) -> str:
    """The last exception line of a worker's output and the line after it."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", l).strip() for l in text.splitlines()]
    last = max((i for i, l in enumerate(lines)
                if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", l)), default=None)
    if last is None:
        first = next((l for l in lines if l), "")
        return first[:240]
    message = next((l for l in lines[last + 1:] if l), "")
    return f"{lines[last]} {message}".strip()[:240]


def make_fits(family: str, batch: int, steps: int, budget_bytes: int,
              policy: str, *, repeats: int = 1, timeout: float = 900,
              measure: Callable[..., dict] = measure_peak.measure,
              hard_limit: bool = False) -> Callable[[int], tuple]:
    """A fits(depth) callable that measures one configuration per call.

    Args:
      family, batch, steps: the model and training run (sntf.models, or
        "zoo:<name>" for an architecture of sntf.testing.zoo with blocks).
      budget_bytes: the budget the measured peak must not exceed.
      policy: "none" (TensorFlow, sntf never imported) or an sntf policy,
        which the worker enables with budget=budget_bytes.
      repeats: fresh processes per trial (measure_peak's median run).
      timeout: seconds per process.
      measure: measure_peak.measure or a stand-in with its signature.
      hard_limit: the budget is a hard limit on the CPU allocator: a depth
        fits when it trains under it, and sntf gets no budget (module doc).

    Returns:
      depth -> (fits, record): record is a JSON-able dict with depth, fits,
      reason, seconds (wall time of the trial), error (worker failure text,
      or None) and result (the worker's result dict, or None).
    """
    sntf_on = policy != "none"

    def fits(depth: int) -> tuple:
        start = time.perf_counter()
        record = {"depth": depth, "fits": False, "reason": "", "error": None,
                  "result": None}
        limit = {"limit_mib": int(budget_bytes // MIB)} if hard_limit else {}
        try:
            result = measure(family, batch, steps=steps, policy=policy, depth=depth,
                             repeats=repeats, timeout=timeout,
                             budget=budget_bytes if sntf_on and not hard_limit else None,
                             **limit)
        except subprocess.TimeoutExpired:
            record["reason"] = f"timed out after {timeout:g} s"
        except RuntimeError as e:
            record["error"] = str(e)
            ran_out = hard_limit and any(m in str(e) for m in OUT_OF_MEMORY)
            record["reason"] = ("out of memory" if ran_out
                                else "failed: " + _error_line(str(e)))
        else:
            record["result"] = result
            peak = result["measured_peak_bytes"]
            losses = result.get("losses") or []
            if not all(math.isfinite(l) for l in losses):
                record["reason"] = f"non-finite loss {losses}"
            elif hard_limit:
                record["fits"] = True
                record["reason"] = (f"trains under {budget_bytes / MIB:.0f} MiB, "
                                    f"peak {peak / MIB:.1f} MiB")
            elif peak > budget_bytes:
                record["reason"] = (f"peak {peak / MIB:.1f} MiB > budget "
                                    f"{budget_bytes / MIB:.1f} MiB")
            else:
                record["fits"] = True
                record["reason"] = (f"peak {peak / MIB:.1f} MiB <= budget "
                                    f"{budget_bytes / MIB:.1f} MiB")
        record["seconds"] = time.perf_counter() - start
        return record["fits"], record

    return fits


# --------------------------------------------------------------------------
# Progress bar (stderr).


class ProgressBar:
    """A one-line text progress bar.

    On a terminal it redraws one line in place; otherwise (a log file, CI)
    it writes one line per finished trial, so the log stays readable.
    """

    def __init__(self, stream: TextIO = sys.stderr, width: int = 24):
        self.stream = stream
        self.width = width
        self.start = time.perf_counter()
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self._drawn = False

    def update(self, done: int, total: int, label: str, final: bool = True) -> None:
        """Shows `done` of at most `total` trials and a label.

        Args:
          done: trials finished.
          total: an upper bound on all trials (finished and to come).
          label: what is happening now.
          final: False for a "trial started" update, shown on terminals only.
        """
        if not final and not self.tty:
            return
        total = max(total, done, 1)
        filled = int(round(self.width * done / total))
        elapsed = int(time.perf_counter() - self.start)
        line = (f"[{'#' * filled}{'-' * (self.width - filled)}] {done}/<={total} "
                f"{elapsed // 60}m{elapsed % 60:02d}s  {label}")
        if self.tty:
            columns = 160
            self.stream.write("\r\x1b[K" + line[:columns])
            self._drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Ends the bar's line on a terminal."""
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


# --------------------------------------------------------------------------
# The whole run.


def _summary(search: SearchResult) -> dict:
    best = search.trial(search.deepest) if search.deepest else None
    result = best.info["result"] if best else None
    return {
        "deepest_depth": search.deepest,
        "capped": search.capped,
        "layers": result["layers"] if result else None,
        "peak_bytes": result["measured_peak_bytes"] if result else None,
        "seconds_per_step": result["seconds_per_step"] if result else None,
        # Why the first depth that does not fit does not (None when capped).
        "limit": next((f"depth {t.depth}: {t.info['reason']}"
                       for t in sorted(search.trials, key=lambda t: t.depth)
                       if not t.fits), None),
        "trials": [t.info for t in search.trials],
    }


def run(family: str, batch: int, budget_bytes: int, policy: str, steps: int = 2,
        repeats: int = 1, max_depth: int = 128, timeout: float = 900,
        time_ratio: bool = True, measure: Callable[..., dict] = measure_peak.measure,
        progress: Optional[ProgressBar] = None, hard_limit: bool = False) -> dict:
    """Runs both searches (TensorFlow, then sntf) and the step-time trial.

    Args:
      family, batch, steps: the model and training run.
      budget_bytes: the device-memory budget.
      policy: the sntf policy of the second search.
      repeats: fresh processes per trial.
      max_depth: the deepest depth tried.
      timeout: seconds per trial process.
      time_ratio: run one more sntf trial at TensorFlow's deepest depth if
        the sntf search did not measure it.
      measure: measure_peak.measure or a stand-in (tests).
      progress: a ProgressBar, or None for no progress output.
      hard_limit: a depth fits when it trains under the budget (make_fits).

    Returns:
      A JSON-able dict: settings, "tf" and "sntf" summaries (deepest_depth,
      capped, layers, peak_bytes, seconds_per_step, limit, trials),
      "time_ratio" (sntf / TF step time at TF's deepest depth, with the
      depth and where the sntf figure came from) and "deeper" (sntf layers /
      TF layers, or None).
    """
    start = time.perf_counter()
    out: dict = {"family": family, "batch": batch, "budget_bytes": budget_bytes,
                 "policy": policy, "steps": steps, "repeats": repeats,
                 "max_depth": max_depth, "timeout": timeout, "hard_limit": hard_limit}
    trials = [0]     # trials run so far
    fits_of = functools.partial(make_fits, family, batch, steps, budget_bytes,
                                repeats=repeats, timeout=timeout, measure=measure,
                                hard_limit=hard_limit)
    _search_both(out, fits_of, policy, max_depth, time_ratio, progress, trials)
    out["time_ratio"] = _time_ratio(out, fits_of, policy, steps, time_ratio, progress,
                                    trials)
    tf_layers, sntf_layers = out["tf"]["layers"], out["sntf"]["layers"]
    out["deeper"] = sntf_layers / tf_layers if tf_layers and sntf_layers else None
    out["wall_seconds"] = time.perf_counter() - start
    if progress:
        progress.close()
    return out


def _search_both(out: dict, fits_of, policy: str, max_depth: int, time_ratio: bool,
                 progress: Optional[ProgressBar], trials: list) -> None:
    """Runs the TensorFlow search, then the sntf search, into out["tf"] and
    out["sntf"]."""
    searches = (("tf", "TF", "none"), ("sntf", "sntf", policy))
    pending_bound = remaining_trials(0, None, max_depth)
    for index, (key, label, worker_policy) in enumerate(searches):
        # Trials still possible in the searches after this one, plus the
        # optional step-time trial.
        later = pending_bound * (len(searches) - 1 - index) + int(time_ratio)
        base_fits = fits_of(worker_policy)
        bound = [pending_bound]

        def fits(depth, base_fits=base_fits, label=label, bound=bound, later=later):
            if progress:
                progress.update(trials[0], trials[0] + bound[0] + later,
                                f"{label} depth {depth}: running", final=False)
            return base_fits(depth)

        def on_trial(trial, remaining, label=label, bound=bound, later=later):
            trials[0] += 1
            bound[0] = remaining
            if progress:
                verdict = "fits" if trial.fits else "does not fit"
                progress.update(trials[0], trials[0] + remaining + later,
                                f"{label} depth {trial.depth}: {verdict} "
                                f"({trial.info['reason']})")

        out[key] = _summary(search_deepest(fits, max_depth, on_trial))


def _time_ratio(out: dict, fits_of, policy: str, steps: int, time_ratio: bool,
                progress: Optional[ProgressBar], trials: list) -> dict:
    """sntf's step time over TensorFlow's at TensorFlow's deepest depth (one
    more sntf trial there if its search did not measure it)."""
    tf_depth = out["tf"]["deepest_depth"]
    ratio = {"depth": tf_depth, "value": None, "source": None, "note": None}
    if tf_depth is None:
        ratio["note"] = "TensorFlow fits no depth"
        return ratio
    sntf_trial = next((t for t in out["sntf"]["trials"] if t["depth"] == tf_depth),
                      None)
    source = "sntf search"
    if sntf_trial is None and time_ratio:
        if progress:
            progress.update(trials[0], trials[0] + 1, f"sntf depth {tf_depth}: running "
                            "(step time at TF's deepest depth)", final=False)
        _, sntf_trial = fits_of(policy)(tf_depth)
        trials[0] += 1
        out["sntf"]["time_trial"] = sntf_trial
        source = "extra trial"
        if progress:
            progress.update(trials[0], trials[0],
                            f"sntf depth {tf_depth}: {sntf_trial['reason']}")
    tf_step = out["tf"]["seconds_per_step"]
    if sntf_trial is None:
        ratio["note"] = "not measured (--notime_ratio)"
    elif not sntf_trial["fits"]:
        ratio["note"] = f"sntf does not fit there: {sntf_trial['reason']}"
    elif tf_step and sntf_trial["result"]["seconds_per_step"]:
        ratio["value"] = sntf_trial["result"]["seconds_per_step"] / tf_step
        ratio["source"] = source
    if steps < 3 and ratio["value"] is not None:
        ratio["note"] = (f"one timed step per run (--steps {steps}): "
                         "step time is the median of the steps after the first")
    return ratio


# --------------------------------------------------------------------------
# Tables.
