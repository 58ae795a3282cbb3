"""User-facing configuration: policies, budgets, options, and the on/off switch.

Everything here validates user input and raises ValueError/TypeError naming
the argument, the value received and the accepted forms. Nothing here touches
TensorFlow's runtime.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import threading
from typing import Any, Mapping, Optional, Sequence, Union

# Re-exported: sizes and budgets are part of the configuration's API.
from sntf.sizes import (BUDGET_FORMS, MAX_REPORTS, Budget, _number,  # noqa: F401
                        parse_budget, parse_size)

POLICIES = ("off", "recompute", "swap", "swap+recompute", "auto")

ENV_POLICY = "SNTF_POLICY"
ENV_BUDGET = "SNTF_BUDGET"
ENV_HOST_POOL_LIMIT = "SNTF_HOST_POOL_LIMIT"


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
    # fixed cost outweighs the bytes). None: 1 MiB, or less in a network
    # whose tensors are all small (planner.swap.default_min_bytes).
    swap_min_bytes: Optional[int] = None
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
    # Without a budget, a rewritten graph is applied only where it plans at
    # least this share below the original graph: a smaller saving is within
    # the analysis' error (a GPT's `recompute` plan 4% lower measured 1.01
    # times TensorFlow's lowest peak) and costs step time for nothing
    # certain. Under a budget every byte counts toward it.
    min_gain: float = 0.05
    # Chain the memory-heavy ops of a rewritten graph in the order its plan
    # was made for (control edges), so that the executor's thread pool
    # cannot reorder the allocations the planned peak depends on. False
    # leaves the executor free to run them side by side.
    pin_order: bool = True
    # With op determinism on, a graph with sums TensorFlow adds in the order
    # their terms arrive (Grappler's accumulators) is rewritten with each
    # such sum held to one order: the same terms, bit for bit, in a fixed
    # order, so runs repeat under any thread pool. True leaves such graphs
    # unchanged instead (TensorFlow's one-thread bits, no memory saved).
    exact_sums: bool = False
    # A pass that plans one graph for more than a few seconds shows on
    # stderr what it is doing, and then what it took (False: nothing; so
    # does a level above WARNING on the "sntf" logger).
    progress: bool = True
    # Under a CPU limit the user set (TF_CPU_BFC_MEM_LIMIT_IN_MB), have the
    # allocator take the rest of it as one region when sntf reads the limit,
    # as a GPU's does without memory growth. False leaves it growing by
    # regions, where a request can find none large enough under the limit.
    one_region: bool = True


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(Options))


def _share(values: Mapping[str, Any], name: str, upper: float) -> float:
    """Option `name` (or its default) as a float in [0, upper); a ValueError
    that names it otherwise."""
    value = values.get(name, getattr(Options, name))
    number = _number(value)
    if number is None or not math.isfinite(number) or not 0 <= number < upper:
        raise ValueError(f"sntf: {name} must be a number in [0, {upper:g}), "
                         f"got {value!r}")
    return float(number)


def parse_options(options: Mapping[str, Any], caller: str = "sntf.enable()"
                  ) -> Options:
    """Validates enable()'s keyword options.

    Args:
      options: keyword arguments given to sntf.enable beyond policy and budget.
      caller: the function the user called, named in the error message.

    Returns:
      An Options value.

    Raises:
      TypeError: an unknown option name.
      ValueError: a malformed option value.
    """
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"{caller} got unknown option(s) {unknown}; "
                        f"accepted options: {', '.join(OPTION_NAMES)}")
    values = dict(options)
    for flag in ("identity_rewrite", "keep_graphs", "pin_order", "exact_sums", "progress",
                 "one_region"):
        if flag in values and not isinstance(values[flag], bool):
            raise ValueError(f"sntf: {flag} must be True or False, got "
                             f"{values[flag]!r}")
    batch = values.get("batch_size")
    if batch is not None:
        number = _number(batch)
        if not isinstance(number, int) or number <= 0:
            raise ValueError(f"sntf: batch_size must be a positive int, got {batch!r}")
        values["batch_size"] = number
    if values.get("host_pool_limit") is not None:
        values["host_pool_limit"] = parse_size(values["host_pool_limit"],
                                               "host_pool_limit")
    mode = values.get("recompute_mode", Options.recompute_mode)
    if mode not in ("auto", "speed", "memory"):
        raise ValueError(f"sntf: recompute_mode must be 'auto', 'speed' or "
                         f"'memory', got {mode!r}")
    if values.get("swap_min_bytes") is not None:
        values["swap_min_bytes"] = parse_size(values["swap_min_bytes"], "swap_min_bytes",
                                              allow_zero=True)
    bandwidth = values.get("link_bandwidth")
    if bandwidth is not None:
        number = _number(bandwidth)
        if number is None or not math.isfinite(number) or number <= 0:
            raise ValueError(f"sntf: link_bandwidth must be a positive number of "
                             f"bytes per second (e.g. 25e9) or None, got {bandwidth!r}")
        values["link_bandwidth"] = float(number)
    values["budget_margin"] = _share(values, "budget_margin", 0.5)
    values["min_gain"] = _share(values, "min_gain", 1)
    behaviour = values.get("budget_behaviour", Options.budget_behaviour)
    if behaviour not in ("best_effort", "unchanged"):
        raise ValueError(f"sntf: budget_behaviour must be 'best_effort' or "
                         f"'unchanged', got {behaviour!r}")
    reports = values.get("max_reports", Options.max_reports)
    number = _number(reports)
    if not isinstance(number, int) or not 0 < number <= MAX_REPORTS:
        raise ValueError(f"sntf: max_reports must be an int from 1 to {MAX_REPORTS}, "
                         f"got {reports!r}")
    values["max_reports"] = number
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
    """Replaces the switch state atomically.

    The host pool's limit follows the options of every enabled state
    (host_pool_limit None: SNTF_HOST_POOL_LIMIT, else physical memory), so
    that a limit set once does not outlive the options that set it. A
    disabled state leaves the limit alone: graphs already rewritten keep
    swapping under the limit they were enabled with.
    """
    global _state
    with _lock:
        _state = state
        if state.enabled:
            _sync_host_pool_limit(state.options.host_pool_limit)


def _sync_host_pool_limit(limit: Optional[int]) -> None:
    """Applies a host_pool_limit option to the pool, once the op library is
    loaded (before that, enable() applies it when it loads the library;
    nothing here imports TensorFlow)."""
    import sys

    native = sys.modules.get("sntf.runtime.native")
    if native is not None and native.ops_loaded():
        native.apply_host_pool_limit(limit)


# The runner's flags that take a value in the next argument (sntf/__main__.py).
_RUNNER_VALUE_FLAGS = ("policy", "budget", "option")
# Interpreter options that take a value in the next argument.
_PYTHON_VALUE_OPTIONS = ("-X", "-W")


def runner_flags(argv: Optional[Sequence[str]] = None) -> dict:
    """The --policy and --budget flags of `python -m sntf`, when this
    process is that runner.

    The runner's flags override SNTF_POLICY and SNTF_BUDGET, but sntf reads
    those when the package is imported, before the runner parses its flags:
    importing sntf must then skip the variables the flags replace, or a
    malformed one would stop the runner the flag was meant to correct.

    Args:
      argv: the interpreter's full command line (default: sys.orig_argv).

    Returns:
      {"policy": text, "budget": text} for the flags given (the last of
      each), or {} when this process is not `python -m sntf`.
    """
    import sys

    argv = list(getattr(sys, "orig_argv", ()) if argv is None else argv)
    i, rest = 1, None
    while i < len(argv):
        arg = argv[i]
        if arg == "-m" or (arg.startswith("-m") and not arg.startswith("--")):
            module = argv[i + 1] if arg == "-m" and i + 1 < len(argv) else arg[2:]
            start = i + 2 if arg == "-m" else i + 1
            rest = argv[start:] if module == "sntf" else None
            break
        if arg in _PYTHON_VALUE_OPTIONS:
            i += 2
            continue
        if not arg.startswith("-") or arg == "-" or arg.startswith("-c"):
            break   # a script, stdin or -c: not the runner
        i += 1
    if rest is None:
        return {}
    found: dict = {}
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            break   # the script and its own arguments
        name, sep, value = arg.lstrip("-").partition("=")
        if not sep and name in _RUNNER_VALUE_FLAGS:
            value = rest[i + 1] if i + 1 < len(rest) else ""
            i += 1
        if name in ("policy", "budget"):
            found[name] = value
        i += 1
    return found


def from_environment(environ: Mapping[str, str] = os.environ,
                     device_memory: Optional[int] = None,
                     argv: Optional[Sequence[str]] = None,
                     ) -> Optional[tuple[str, Optional[Budget]]]:
    """Reads SNTF_POLICY and SNTF_BUDGET.

    In the `python -m sntf` runner, a variable its flag overrides is not
    read (runner_flags).

    Args:
      environ: the environment to read.
      device_memory: the device's memory in bytes, when known (a fraction
        budget must come to at least 1 MiB of it).
      argv: the interpreter's command line, for runner_flags (default:
        sys.orig_argv).

    Returns:
      (policy, budget) when either variable is set and non-empty, else None.

    Raises:
      ValueError: for malformed values, naming the variable.
    """
    overridden = runner_flags(argv)
    policy_text = "" if "policy" in overridden else environ.get(ENV_POLICY, "").strip()
    budget_text = "" if "budget" in overridden else environ.get(ENV_BUDGET, "").strip()
    if not policy_text and not budget_text:
        return None
    try:
        policy = parse_policy(policy_text) if policy_text else "auto"
    except ValueError as e:
        raise ValueError(f"{ENV_POLICY}={policy_text!r}: {e}") from None
    try:
        budget = parse_budget(budget_text, device_memory) if budget_text else None
    except ValueError as e:
        raise ValueError(f"{ENV_BUDGET}={budget_text!r}: {e}") from None
    return policy, budget


def host_pool_limit_from_environment(environ: Mapping[str, str] = os.environ
                                     ) -> Optional[int]:
    """Reads SNTF_HOST_POOL_LIMIT with the rules of the host_pool_limit option.

    Args:
      environ: the environment to read.

    Returns:
      The limit in bytes, or None when the variable is unset or empty.

    Raises:
      ValueError: for a malformed or zero limit, naming the variable.
    """
    text = environ.get(ENV_HOST_POOL_LIMIT, "").strip()
    if not text:
        return None
    try:
        return parse_size(text, "host_pool_limit")
    except ValueError as e:
        raise ValueError(f"{ENV_HOST_POOL_LIMIT}={text!r}: {e}") from None


Budgetish = Union[None, int, float, str, numbers.Real]


# ---------------------------------------------------------------- tf.config style
# Set/get pairs named as tf.config names its switches
# (tf.config.optimizer.set_experimental_options / get_experimental_options,
# tf.config.experimental.set_memory_growth / get_memory_growth). A setter
# changes one part of the switch, keeps the others, and enables sntf (policy
# "auto" when it was off); sntf.disable() turns it off.

def _enable(policy: str, budget: Budgetish, options: Mapping[str, Any]) -> None:
    import sntf  # the package imports this module first: no cycle at import time

    sntf.enable(policy=policy, budget=budget, **options)


def _current_parts() -> tuple[str, Budgetish, dict]:
    state = current()
    if not state.enabled:
        return "auto", None, {}
    budget = None if state.budget is None else state.budget.to_user()
    return state.policy, budget, dataclasses.asdict(state.options)


def set_policy(policy: str) -> None:
    """Sets the policy for graphs built from now on, keeping the budget and
    options; enables sntf if it was off.

    Args:
      policy: one of POLICIES ("off", "recompute", "swap", "swap+recompute",
        "auto"), case-insensitive.

    Raises:
      ValueError: an unknown policy, listing the accepted ones.
    """
    name = parse_policy(policy)
    _, budget, options = _current_parts()
    _enable(name, budget, options)


def get_policy() -> Optional[str]:
    """The policy in force, or None while sntf is disabled.

    Returns:
      One of POLICIES, or None.
    """
    state = current()
    return state.policy if state.enabled else None


def set_memory_budget(budget: Budgetish) -> None:
    """Sets the device-memory budget for graphs built from now on, keeping
    the policy and options; enables sntf (policy "auto") if it was off.

    Args:
      budget: as sntf.enable(budget=...): bytes, a size string ("6GB"), a
        fraction of device memory in (0, 1] or "50%", "auto", or None to
        drop the budget.

    Raises:
      ValueError: a malformed budget, naming it and the accepted forms.
    """
    parse_budget(budget)
    policy, _, options = _current_parts()
    _enable(policy, budget, options)


def get_memory_budget() -> Budgetish:
    """The budget in force, as set_memory_budget() accepts it back.

    Returns:
      Bytes (int), a fraction (float), "auto", or None (no budget, or sntf
      disabled).
    """
    state = current()
    if not state.enabled or state.budget is None:
        return None
    return state.budget.to_user()


def set_options(options: Mapping[str, Any]) -> None:
    """Changes options for graphs built from now on; options not named keep
    their values. Enables sntf (policy "auto") if it was off.

    Args:
      options: option name -> value, names from OPTION_NAMES (see Options).

    Raises:
      TypeError: `options` is not a mapping, or names an unknown option.
      ValueError: a malformed option value.
    """
    if not isinstance(options, Mapping):
        raise TypeError(f"sntf.config.set_options() takes a dict of options, got "
                        f"{type(options).__name__} {options!r}; accepted options: "
                        f"{', '.join(OPTION_NAMES)}")
    policy, budget, current_options = _current_parts()
    merged = dict(current_options)
    merged.update(options)
    parse_options(merged, caller="sntf.config.set_options()")
    _enable(policy, budget, merged)


def get_options() -> dict:
    """The options in force (the defaults while sntf is disabled).

    Returns:
      A dict, option name -> value.
    """
    return dataclasses.asdict(current().options)
