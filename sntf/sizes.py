"""Sizes and memory budgets as users write them: bytes, size strings with
units, fractions of device memory, percentages and "auto".

The same rules hold on every path a value arrives by (an argument, an
environment variable, a setter, a tool's flag); a refused value raises a
ValueError naming it, why, and the accepted forms.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from typing import Any, Optional, Union

_DECIMAL_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                  "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)"
                      r"\s*([a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")

# Byte counts travel to TensorFlow and the host pool as int64.
MAX_BYTES = 2**63 - 1
# A training step needs more than this; a smaller budget is almost always a
# fraction or a unit gone missing.
MIN_BUDGET_BYTES = 1 << 20
# Each report is kept in memory (with its graphs under keep_graphs=True).
MAX_REPORTS = 1_000_000

BUDGET_FORMS = ("a number of bytes of at least 1 MiB (an int such as 12000000000, "
                "or a float above 1 such as 8e9), "
                "a size string such as '12GB', '512MiB' or '1.5GiB', "
                "a fraction of device memory in (0, 1] (a float such as 0.5, or '50%'), "
                "'auto' (what the device's allocator may hand out: the GPU's memory, or "
                "the CPU's under TF_CPU_BFC_MEM_LIMIT_IN_MB; else no budget on CPU), "
                "or None for no budget")
SIZE_UNITS = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"


@dataclasses.dataclass(frozen=True)
class Budget:
    """A memory budget: absolute bytes, a fraction of device memory, or
    "auto" (all that the device's TensorFlow allocator may hand out; for a
    graph on the CPU only under a BFC allocator limit, else no budget: the
    CPU's memory is the host's RAM, and the policy's own default applies)."""

    bytes: Optional[int] = None
    fraction: Optional[float] = None
    auto: bool = False

    def resolve(self, device_memory_bytes: int) -> int:
        """Returns the budget in bytes for a device with the given memory.

        Args:
          device_memory_bytes: what the allocator of the graph's device may
            hand out (its bytes_limit where read, else the device's total).

        Returns:
          The budget in bytes.
        """
        if self.bytes is not None:
            return self.bytes
        if self.auto:
            return device_memory_bytes
        return int(round(self.fraction * device_memory_bytes))

    def describe(self) -> str:
        """The budget in words, e.g. "67108864 bytes (64.0 MiB)"."""
        if self.bytes is not None:
            return f"{self.bytes} bytes ({self.bytes / 2**20:.1f} MiB)"
        if self.auto:
            return "auto (all the device's allocator may hand out)"
        return f"{self.fraction:g} of device memory"

    def to_user(self) -> Union[int, float, str]:
        """The value to hand back to sntf.enable(budget=...)."""
        if self.bytes is not None:
            return self.bytes
        return "auto" if self.auto else self.fraction


class _Invalid(Exception):
    """Why a value is not accepted; the caller names the argument."""


def _is_bool(value: Any) -> bool:
    """A Python or numpy bool (numpy names its type bool_ or bool)."""
    return isinstance(value, bool) or type(value).__name__ in ("bool", "bool_")


def _number(value: Any) -> Union[int, float, None]:
    """A Python or numpy number as an int (integral types) or a float (other
    real types); None for anything else, bools included."""
    if _is_bool(value):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _split_size(text: str) -> tuple[Union[int, float], bool]:
    """("12GB" -> 12 * 10**9, True), ("0.5" -> 0.5, False): the number of
    bytes a size string gives (unscaled when it has no unit) and whether it
    had a unit. Integers stay exact; a float too large to represent is inf.

    Raises:
      _Invalid: the text is not a number with an optional unit.
    """
    match = _SIZE_RE.match(text)
    if not match:
        raise _Invalid("not a number with an optional unit")
    number, unit = match.group(1), match.group(2).lower()
    scale = 1
    if unit:
        scale = _DECIMAL_UNITS.get(unit) or _BINARY_UNITS.get(unit)
        if scale is None:
            raise _Invalid(f"unknown unit {match.group(2)!r} (units: {SIZE_UNITS})")
    if re.fullmatch(r"[+-]?[0-9]+", number):
        return int(number) * scale, bool(unit)
    try:
        return float(number) * scale, bool(unit)
    except OverflowError:
        return math.inf, bool(unit)


def _byte_count(number: Union[int, float], allow_zero: bool) -> int:
    """A whole number of bytes from an int or a float (rounded).

    Raises:
      _Invalid: not finite, negative, zero (unless allowed), rounding to
        zero, or beyond int64.
    """
    if isinstance(number, float):
        if math.isnan(number):
            raise _Invalid("not a number")
        if number >= 2**63:
            raise _Invalid(f"too large: at most 2**63-1 ({MAX_BYTES}) bytes")
        if number < 0:
            raise _Invalid("it must be zero or more" if allow_zero else
                           "it must be positive")
        rounded = int(round(number))
        if rounded == 0 and number > 0 and not allow_zero:
            raise _Invalid("it rounds to zero bytes")
        number = rounded
    if number < 0 or (number == 0 and not allow_zero):
        raise _Invalid("it must be zero or more" if allow_zero else "it must be positive")
    if number > MAX_BYTES:
        raise _Invalid(f"too large: at most 2**63-1 ({MAX_BYTES}) bytes")
    return number


def parse_size(value: Any, what: str = "size", allow_zero: bool = False) -> int:
    """Parses a byte count: a number or a string with an optional unit.

    Args:
      value: e.g. 1048576, 4e9, numpy.int64(4096), "1048576", "12GB",
        "512MiB". A float is rounded to whole bytes.
      what: the argument's name, used in error messages.
      allow_zero: accept 0 (for thresholds).

    Returns:
      The number of bytes, a positive int (or 0 when allowed), below 2**63.

    Raises:
      ValueError: naming `what`, the value and the accepted forms.
    """
    if isinstance(value, str):
        try:
            number, _ = _split_size(value)
        except _Invalid as e:
            raise ValueError(f"sntf: invalid {what} {value!r}: {e}; expected a "
                             f"number of bytes with an optional unit ({SIZE_UNITS}), "
                             "e.g. '12GB' or '512MiB'") from None
    else:
        number = _number(value)
        if number is None:
            raise ValueError(f"sntf: invalid {what} {value!r}: expected a number "
                             "of bytes or a string such as '12GB' or '512MiB'")
    try:
        return _byte_count(number, allow_zero)
    except _Invalid as e:
        raise ValueError(f"sntf: invalid {what} {value!r}: {e}") from None


def _budget_error(value: Any, why: str) -> ValueError:
    return ValueError(
        f"sntf: invalid budget {value!r} ({why}); accepted forms: {BUDGET_FORMS}")


def _fraction_budget(fraction: float, device_memory: Optional[int]) -> Budget:
    if device_memory is not None:
        resolved = Budget(fraction=fraction).resolve(device_memory)
        if resolved < MIN_BUDGET_BYTES:
            raise _Invalid(f"{fraction:g} of this device's {device_memory} bytes is "
                           f"{resolved} bytes, below the smallest budget, 1 MiB")
    return Budget(fraction=fraction)


def _bytes_budget(number: Union[int, float]) -> Budget:
    n = _byte_count(number, allow_zero=False)
    if n < MIN_BUDGET_BYTES:
        raise _Invalid(f"{n} byte{'' if n == 1 else 's'} is below the smallest budget, 1 MiB "
                       f"({MIN_BUDGET_BYTES} bytes); did you mean a fraction of "
                       "device memory, such as 0.5 or '50%'?")
    return Budget(bytes=n)


def _numeric_budget(number: Union[int, float],
                    device_memory: Optional[int]) -> Budget:
    """An int is bytes; a float in (0, 1] a fraction, above 1 bytes."""
    if isinstance(number, float):
        if not math.isfinite(number):
            raise _Invalid("not a finite number")
        if number <= 0:
            raise _Invalid("it must be positive")
        if number <= 1.0:
            return _fraction_budget(number, device_memory)
    return _bytes_budget(number)


def parse_budget(value: Any, device_memory: Optional[int] = None) -> Optional[Budget]:
    """Parses a user budget; the same rules hold for every way one is given
    (enable()'s argument, SNTF_BUDGET, the set_memory_budget() setter, the
    tools' --budget flag).

    Args:
      value: None; a number of bytes of at least 1 MiB (an int, a numpy
        integer, or a float above 1, rounded); a fraction of device memory
        in (0, 1] (a float, numpy floats included); a string holding any of
        these, a size with a unit ("12GB", "512MiB") or a percentage
        ("50%"); or "auto".
      device_memory: the device's memory in bytes, when known: a fraction
        must then come to at least 1 MiB of it.

    Returns:
      A Budget, or None for "no budget".

    Raises:
      ValueError: naming the value, why it is refused and the accepted forms.
    """
    if value is None:
        return None
    try:
        if isinstance(value, str):
            return _parse_budget_text(value.strip(), device_memory)
        if _is_bool(value):
            raise _Invalid("a bool is not a budget")
        number = _number(value)
        if number is None:
            raise _Invalid(f"unsupported type {type(value).__name__}")
        return _numeric_budget(number, device_memory)
    except _Invalid as e:
        raise _budget_error(value, str(e)) from None


def _parse_budget_text(text: str, device_memory: Optional[int]) -> Budget:
    if not text:
        raise _Invalid("an empty string; pass None for no budget")
    if text.lower() == "auto":
        return Budget(auto=True)
    percent = _PERCENT_RE.match(text)
    if percent:
        fraction = float(percent.group(1)) / 100.0
        if not 0.0 < fraction <= 1.0:
            raise _Invalid("a percentage must lie in (0, 100]")
        return _fraction_budget(fraction, device_memory)
    try:
        number, has_unit = _split_size(text)
    except _Invalid as e:
        raise _Invalid(f"not a size, fraction or percentage: {e}") from None
    if number == math.inf:
        raise _Invalid(f"too large: at most 2**63-1 ({MAX_BYTES}) bytes")
    if has_unit:
        return _bytes_budget(number)
    return _numeric_budget(number, device_memory)
