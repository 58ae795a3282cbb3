"""Planner: turns a graph (and its analysis) plus a policy into a Plan.

A Plan is plain data: one Decision per tensor sntf acts on (keep, swap or
recompute), each with the reason and its predicted effect, so a user can ask
why a tensor was swapped. Policies answer one question per tensor and know
nothing about how the rewrite is done.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

KEEP, SWAP, RECOMPUTE = "keep", "swap", "recompute"
ACTIONS = (KEEP, SWAP, RECOMPUTE)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do with one tensor ("node:port"), and why."""

    tensor: str
    action: str
    reason: str
    bytes_saved: Optional[int] = None
    seconds_added: Optional[float] = None

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; actions: {ACTIONS}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's output: decisions plus the predicted memory picture."""

    policy: str
    decisions: tuple[Decision, ...] = ()
    predicted_peak_bytes: Optional[int] = None
    planned_peak_bytes: Optional[int] = None
    lower_bound_bytes: Optional[int] = None
    notes: tuple[str, ...] = ()

    def tensors(self, action: str) -> list[str]:
        """Tensors given `action`, in decision order."""
        return [d.tensor for d in self.decisions if d.action == action]

    @property
    def changes_graph(self) -> bool:
        return any(d.action != KEEP for d in self.decisions)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def identity_plan(policy: str, note: str = "") -> Plan:
    """The no-change plan: every tensor stays where TensorFlow puts it."""
    return Plan(policy=policy, notes=(note,) if note else ())


def make_plan(policy: str) -> Plan:
    """Plans a training graph under `policy`.

    Args:
      policy: a validated policy name. Only "off" is implemented so far;
        sntf.enable refuses the others, so reaching them here is a bug.

    Returns:
      The Plan.
    """
    if policy == "off":
        return identity_plan(policy, "policy 'off': graph left as TensorFlow built it")
    raise NotImplementedError(f"policy {policy!r} has no planner yet")
