"""User-facing configuration: policies, budgets, options, and the on/off switch.

Everything here validates user input and raises ValueError/TypeError naming
the argument, the value received and the accepted forms. Nothing here touches
TensorFlow's runtime.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import threading
from typing import Any, Mapping, Optional, Union

POLICIES = ("off", "recompute", "swap", "swap+recompute", "auto")

ENV_POLICY = "SNTF_POLICY"
ENV_BUDGET = "SNTF_BUDGET"
ENV_HOST_POOL_LIMIT = "SNTF_HOST_POOL_LIMIT"

_DECIMAL_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                  "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")

BUDGET_FORMS = ("a positive number of bytes (int, e.g. 12000000000), "
                "a size string such as '12GB', '512MiB' or '1.5GiB', "
                "a fraction of device memory in (0, 1] (float, e.g. 0.5, or '50%'), "
                "'auto' (the GPU's memory on a GPU; no budget on CPU), "
                "or None for no budget")


@dataclasses.dataclass(frozen=True)
class Budget:
    """A memory budget: absolute bytes, a fraction of device memory, or
    "auto" (all of a GPU's memory; no budget for a graph on the CPU, where
    device memory is the host's RAM and the policy's own default applies)."""

    bytes: Optional[int] = None
    fraction: Optional[float] = None
    auto: bool = False

    def resolve(self, device_memory_bytes: int) -> int:
        """Returns the budget in bytes for a device with the given memory.

        Args:
          device_memory_bytes: total memory of the device the graph runs on.

        Returns:
          The budget in bytes.
        """
        if self.bytes is not None:
            return self.bytes
        if self.auto:
            return device_memory_bytes
        return int(round(self.fraction * device_memory_bytes))

    def describe(self) -> str:
        if self.bytes is not None:
            return f"{self.bytes} bytes"
        if self.auto:
            return "auto (the GPU's memory; none on CPU)"
        return f"{self.fraction:g} of device memory"

    def to_user(self):
        """The value to hand back to sntf.enable(budget=...)."""
        if self.bytes is not None:
            return self.bytes
        return "auto" if self.auto else self.fraction


def _budget_error(value: Any, why: str) -> ValueError:
    return ValueError(
        f"sntf: invalid budget {value!r} ({why}); accepted forms: {BUDGET_FORMS}")


def parse_size(value: Any, what: str = "size", allow_zero: bool = False) -> int:
    """Parses a byte count given as an int or a string with an optional unit.

    Args:
      value: e.g. 1048576, "1048576", "12GB", "512MiB".
      what: the argument's name, used in error messages.
      allow_zero: accept 0 (for thresholds).

    Returns:
      The number of bytes, a positive int (or 0 when allowed).
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"sntf: invalid {what} {value!r}: expected a positive "
                         "number of bytes or a string such as '12GB' or '512MiB'")
    if isinstance(value, int):
        n = value
    else:
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        scale = _DECIMAL_UNITS.get(unit) or _BINARY_UNITS.get(unit) if unit else 1
        if not match or scale is None:
            raise ValueError(f"sntf: invalid {what} {value!r}: expected a number "
                             "of bytes with an optional unit (B, KB, MB, GB, TB, "
                             "KiB, MiB, GiB, TiB), e.g. '12GB' or '512MiB'")
        number = float(match.group(1)) * scale
        if not math.isfinite(number):
            raise ValueError(f"sntf: invalid {what} {value!r}: the number is too "
                             "large to be a byte count")
        n = int(number)
    if n < 0 or (n == 0 and not allow_zero):
        raise ValueError(f"sntf: invalid {what} {value!r}: it must be "
                         f"{'zero or more' if allow_zero else 'positive'}")
    if n >= 2**63:
        raise ValueError(f"sntf: invalid {what} {value!r}: at most 2**63-1 bytes")
    return n


def parse_budget(value: Any) -> Optional[Budget]:
    """Parses a user budget.

    Args:
      value: None, bytes (int), a size string ("12GB", "512MiB"), a fraction of
        device memory in (0, 1] (float or numeric string), a percentage
        string ("50%"), or "auto".

    Returns:
      A Budget, or None for "no budget".

    Raises:
      ValueError: naming the value and the accepted forms.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise _budget_error(value, "a bool is not a budget")
    if isinstance(value, float):
        if not math.isfinite(value) or not 0.0 < value <= 1.0:
            raise _budget_error(value, "a float budget is a fraction of device "
                                "memory and must lie in (0, 1]")
        return Budget(fraction=float(value))
    if isinstance(value, int):
        if value <= 0:
            raise _budget_error(value, "it must be positive")
        return Budget(bytes=value)
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "auto":
            return Budget(auto=True)
        percent = _PERCENT_RE.match(text)
        if percent:
            fraction = float(percent.group(1)) / 100.0
            if not 0.0 < fraction <= 1.0:
                raise _budget_error(value, "a percentage must lie in (0, 100]")
            return Budget(fraction=fraction)
        if re.fullmatch(r"[0-9]*\.[0-9]+", text):
            fraction = float(text)
            if not 0.0 < fraction <= 1.0:
                raise _budget_error(value, "a fractional budget is a fraction of "
                                    "device memory and must lie in (0, 1]")
            return Budget(fraction=fraction)
        try:
            size = parse_size(text, "budget", allow_zero=True)
        except ValueError:
            raise _budget_error(value, "not a size, fraction or percentage") from None
        if size == 0:
            raise _budget_error(value, "it must be positive")
        return Budget(bytes=size)
    raise _budget_error(value, f"unsupported type {type(value).__name__}")


def parse_policy(value: Any) -> str:
    """Validates a policy name (case-insensitive, surrounding space ignored).

    Args:
      value: one of POLICIES.

    Returns:
      The canonical policy name.
    """
    if not isinstance(value, str) or value.strip().lower() not in POLICIES:
        raise ValueError(f"sntf: unknown policy {value!r}; accepted policies: "
                         + ", ".join(repr(p) for p in POLICIES))
    return value.strip().lower()


@dataclasses.dataclass(frozen=True)
class Options:
    """Options accepted by sntf.enable(**options)."""

    # Run the full pipeline (analysis, empty plan, rewrite, serialization) and
    # hand the re-serialized graph back even when the plan changes nothing.
    identity_rewrite: bool = False
    # Batch size to assume where the batch dimension is unknown.
    batch_size: Optional[int] = None
    # Byte limit of the host tensor pool (also SNTF_HOST_POOL_LIMIT).
    host_pool_limit: Optional[int] = None
    # Most reports kept; the oldest are dropped first.
    max_reports: int = 1000
    # Keep each training graph's GraphDefs and Analysis in its report (for
    # tools/sntf_dump); costs memory, off by default.
    keep_graphs: bool = False
    # Recomputation: "speed" (re-run a segment once before its first backward
    # reader), "memory" (once per reader; may also re-run convolutions and
    # matmuls, keeping only segment inputs, where that plans lower) or
    # "auto" (speed unless that would raise the predicted peak).
    recompute_mode: str = "auto"
    # Swapping: tensors smaller than this stay on the device (the transfer's
    # fixed cost outweighs the bytes).
    swap_min_bytes: int = 1 << 20
    # Host link bandwidth (bytes/s) that sets the prefetch distance: None
    # means PCIe 4 x16 (25 GB/s sustained) on a GPU and the cost model's
    # memory bandwidth on CPU.
    link_bandwidth: Optional[float] = None
    # Policy "auto", when no plan fits the budget: "best_effort" applies the
    # plan of least planned peak, "unchanged" leaves the graph as it is.
    # Either way the report and a warning (logged once) give that peak.
    budget_behaviour: str = "best_effort"
    # Policy "auto": the share of the budget held back for the analysis'
    # error (BENCHMARKS.md gives planned against measured peaks): the
    # planner fits the plan under budget * (1 - budget_margin).
    budget_margin: float = 0.10


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(Options))


def parse_options(options: Mapping[str, Any]) -> Options:
    """Validates enable()'s keyword options.

    Args:
      options: keyword arguments given to sntf.enable beyond policy and budget.

    Returns:
      An Options value.
    """
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"sntf.enable() got unknown option(s) {unknown}; "
                        f"accepted options: {', '.join(OPTION_NAMES)}")
    values = dict(options)
    for flag in ("identity_rewrite", "keep_graphs"):
        if flag in values and not isinstance(values[flag], bool):
            raise ValueError(f"sntf: {flag} must be True or False, got "
                             f"{values[flag]!r}")
    batch = values.get("batch_size")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int)
                              or batch <= 0):
        raise ValueError(f"sntf: batch_size must be a positive int, got {batch!r}")
    if values.get("host_pool_limit") is not None:
        values["host_pool_limit"] = parse_size(values["host_pool_limit"],
                                               "host_pool_limit")
    mode = values.get("recompute_mode", Options.recompute_mode)
    if mode not in ("auto", "speed", "memory"):
        raise ValueError(f"sntf: recompute_mode must be 'auto', 'speed' or "
                         f"'memory', got {mode!r}")
    if "swap_min_bytes" in values:
        values["swap_min_bytes"] = parse_size(values["swap_min_bytes"], "swap_min_bytes",
                                              allow_zero=True)
    bandwidth = values.get("link_bandwidth")
    if bandwidth is not None and (isinstance(bandwidth, bool)
                                  or not isinstance(bandwidth, (int, float))
                                  or not math.isfinite(bandwidth) or bandwidth <= 0):
        raise ValueError(f"sntf: link_bandwidth must be a positive number of "
                         f"bytes per second (e.g. 25e9) or None, got {bandwidth!r}")
    margin = values.get("budget_margin", Options.budget_margin)
    if (isinstance(margin, bool) or not isinstance(margin, (int, float))
            or not math.isfinite(margin) or not 0 <= margin < 0.5):
        raise ValueError(f"sntf: budget_margin must be a number in [0, 0.5), "
                         f"got {margin!r}")
    behaviour = values.get("budget_behaviour", Options.budget_behaviour)
    if behaviour not in ("best_effort", "unchanged"):
        raise ValueError(f"sntf: budget_behaviour must be 'best_effort' or "
                         f"'unchanged', got {behaviour!r}")
    reports = values.get("max_reports", Options.max_reports)
    if isinstance(reports, bool) or not isinstance(reports, int) or reports <= 0:
        raise ValueError(f"sntf: max_reports must be a positive int, got {reports!r}")
    return Options(**values)


@dataclasses.dataclass(frozen=True)
class State:
    """What the graph pass reads on every call: one immutable snapshot."""

    enabled: bool = False
    policy: str = "off"
    budget: Optional[Budget] = None
    options: Options = Options()


_lock = threading.Lock()
_state = State()


def current() -> State:
    """Returns the current switch state (an immutable snapshot)."""
    return _state


def set_state(state: State) -> None:
    """Replaces the switch state atomically."""
    global _state
    with _lock:
        _state = state


def from_environment(environ: Mapping[str, str] = os.environ
                     ) -> Optional[tuple[str, Optional[Budget]]]:
    """Reads SNTF_POLICY and SNTF_BUDGET.

    Args:
      environ: the environment to read.

    Returns:
      (policy, budget) when either variable is set and non-empty, else None.

    Raises:
      ValueError: for malformed values, naming the variable.
    """
    policy_text = environ.get(ENV_POLICY, "").strip()
    budget_text = environ.get(ENV_BUDGET, "").strip()
    if not policy_text and not budget_text:
        return None
    try:
        policy = parse_policy(policy_text) if policy_text else "auto"
    except ValueError as e:
        raise ValueError(f"{ENV_POLICY}={policy_text!r}: {e}") from None
    try:
        budget = parse_budget(budget_text) if budget_text else None
    except (ValueError, OverflowError) as e:
        raise ValueError(f"{ENV_BUDGET}={budget_text!r}: {e}") from None
    return policy, budget


Budgetish = Union[None, int, float, str]
