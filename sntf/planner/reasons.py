"""Why a tensor is kept, swapped or recomputed: reasons as codes.

A Reason is a code, the stage that gave it and its parameters. Code that
decides on a reason reads its code; its prose is made only when a report
is written (Reason.text, from TEXTS), and nothing parses it back.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Union

# Why a stage keeps a tensor.
WRONG_PHASE = "wrong_phase"
PROTECTED = "protected"
CONTROL_FLOW = "control_flow"
READ_UNDER_CONTROL_FLOW = "read_under_control_flow"
NEVER_RERUN = "never_rerun"
CHECKPOINT = "checkpoint"
NOT_CHEAP = "not_cheap"
WRITES_VARIABLE = "writes_variable"
VIEW = "view"
SEGMENT_INPUT = "segment_input"
SHAPE_ONLY = "shape_only"
CHAIN_TOO_LONG = "chain_too_long"
HOLDS_FUSED = "holds_fused"
NO_RELEASE = "no_release"
BUFFER_KEPT = "buffer_kept"
READS_OWN_BUFFER = "reads_own_buffer"
NO_STEP_MEMORY = "no_step_memory"
BELOW_THRESHOLD = "below_threshold"
NOT_FLAT = "not_flat"
BUFFER_SHARED = "buffer_shared"
ONEDNN_PAIRED = "onednn_paired"
NO_SWAP_IN = "no_swap_in"
# Why a composition or the budget did not apply a stage's answer.
NOT_LOWERED = "not_lowered"
BELOW_MIN_GAIN = "below_min_gain"
MET_WITHOUT = "met_without"
NOT_APPLIED = "not_applied"
UNTOUCHED = "untouched"
# Why a tensor is moved.
RECOMPUTED = "recomputed"
SHARES_BUFFER = "shares_buffer"
REBUILT = "rebuilt"
SWAPPED = "swapped"


def _recomputed(p: dict) -> str:
    return (f"{'cheap ' if p['cheap'] else ''}{p['op']} output read by {p['readers']} "
            f"backward op(s); {p['ops']} op(s) re-run "
            f"{'per reader' if p['per_reader'] else 'once'}")


def _rebuilt(p: dict) -> str:
    return (f"cheap backward {p['op']} output read by {p['readers']} ops; {p['ops']} "
            f"op(s) re-run for the {p['readers'] - 1} after the first"
            f"{' per reader' if p['per_reader'] else ''}")


def _swapped(p: dict) -> str:
    return (f"{p['op']} output of {p['bytes']} bytes read by {p['readers']} backward "
            f"op(s); {p['swap_ins']} swap-in(s), prefetched "
            f"{p['transfer_seconds'] * 1e3:.3f} ms of transfer ahead")


# code -> a format string over its parameters, or a function of them.
TEXTS: dict[str, Union[str, Callable[[dict], str]]] = {
    WRONG_PHASE: "not a {phase} op",
    PROTECTED: "a fetched or preserved node",
    CONTROL_FLOW: "under control flow",
    READ_UNDER_CONTROL_FLOW: "read under control flow",
    NEVER_RERUN: "{op} is never re-run",
    CHECKPOINT: "{op} is a checkpoint",
    NOT_CHEAP: "{op} is not known to be cheap",
    WRITES_VARIABLE: "{op} writes a variable",
    VIEW: "{op} is a view of its input",
    SEGMENT_INPUT: "a segment input, kept",
    SHAPE_ONLY: "read by the backward pass for its shape only",
    CHAIN_TOO_LONG: "its recompute chain is longer than {limit} ops",
    HOLDS_FUSED: ("its recompute chain would hold back {node}, which oneDNN merges "
                  "into one kernel only without control inputs"),
    NO_RELEASE: "no backward op can release its recomputation",
    BUFFER_KEPT: "its buffer holds another tensor that is kept",
    READS_OWN_BUFFER: "its recomputation would read its own buffer",
    NO_STEP_MEMORY: "{op} holds no step memory",
    BELOW_THRESHOLD: "{bytes} bytes, below swap_min_bytes ({min_bytes})",
    NOT_FLAT: "DataType {dtype} is not a flat buffer",
    BUFFER_SHARED: "its buffer holds other tensors the backward pass reads",
    ONEDNN_PAIRED: "paired with its gradient by oneDNN",
    NO_SWAP_IN: "no backward op can start its swap-in",
    NOT_LOWERED: ("{count} tensor(s) planned but not applied: the predicted peak "
                  "would not fall ({before} -> {after} bytes)"),
    BELOW_MIN_GAIN: ("policy {policy!r}: not applied: the planned peak would not fall "
                     "by {percent:g}% ({before} -> {after} bytes), within the "
                     "analysis' error (option min_gain)"),
    MET_WITHOUT: "met without it",
    NOT_APPLIED: "not applied",
    UNTOUCHED: "kept: {by}",
    RECOMPUTED: _recomputed,
    SHARES_BUFFER: "shares its buffer with another recomputed tensor",
    REBUILT: _rebuilt,
    SWAPPED: _swapped,
}


@dataclasses.dataclass(frozen=True)
class Reason:
    """One reason: its code, the stage that gave it ("recompute", "swap",
    "budget", or "" for none) and its parameters ((name, value) pairs)."""

    code: str
    stage: str = ""
    params: tuple = ()

    def __post_init__(self):
        if self.code not in TEXTS:
            raise ValueError(f"unknown reason code {self.code!r}; codes: {sorted(TEXTS)}")

    def param(self, name: str):
        """The value of one parameter (KeyError where it has none)."""
        return dict(self.params)[name]

    @property
    def text(self) -> str:
        """The reason in prose, "stage: ..." where a stage gave it."""
        text = TEXTS[self.code]
        params = dict(self.params)
        body = text(params) if callable(text) else text.format(**params)
        return f"{self.stage}: {body}" if self.stage else body

    def to_dict(self) -> dict:
        return {"code": self.code, "stage": self.stage, "params": dict(self.params)}

    @classmethod
    def from_dict(cls, data: dict) -> "Reason":
        """The reason a to_dict made."""
        return cls(data["code"], data.get("stage", ""),
                   tuple((data.get("params") or {}).items()))


def reason(code: str, stage: str = "", **params) -> Reason:
    """A Reason with its parameters by name (kept in the order given)."""
    return Reason(code, stage, tuple(params.items()))


def staged(why: Reason, stage: str) -> Reason:
    """The reason as given by `stage` (a stage's reasons carry its name)."""
    return dataclasses.replace(why, stage=stage)
