"""The Plan: plain data saying, per tensor, keep, swap or recompute, and why.

A Plan holds one Decision per tensor the backward pass keeps from the forward
pass (keep, swap or recompute), each with its reason and its predicted
effect, so a user can ask why a tensor was swapped or kept; the recipes that
tell the rewrite how; and the order edges it adds.
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
    recomputes: tuple = ()           # Recompute recipes, one per recomputed tensor
    swaps: tuple = ()                # Swap recipes, one per swapped tensor
    # Swaps are conditional under this device budget: at run time a swapped
    # tensor stays on the device while the device's bytes in use leave room
    # for it, and is copied only under pressure. None: every swap copies.
    cache_budget: Optional[int] = None
    orders: tuple = ()               # Order edges (sntf.planner.order)

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


def subset(plan: Plan, tensors: frozenset) -> Plan:
    """The part of a plan that decides `tensors`."""
    return dataclasses.replace(
        plan, decisions=tuple(d for d in plan.decisions if d.tensor in tensors),
        recomputes=tuple(r for r in plan.recomputes if r.tensor in tensors),
        swaps=tuple(s for s in plan.swaps if s.tensor in tensors))


def keep(tensor: str, reason: str) -> Decision:
    """A KEEP decision: the tensor stays where TensorFlow puts it."""
    return Decision(tensor=tensor, action=KEEP, reason=reason, bytes_saved=0,
                    seconds_added=0.0)


def acting(decisions) -> tuple:
    """The decisions that change the graph (KEEP ones left out)."""
    return tuple(d for d in decisions if d.action != KEEP)


@dataclasses.dataclass(frozen=True)
class RecomputeGroup:
    """Backward readers served by one clone of a chain, and what releases it."""

    consumers: tuple[tuple[str, int], ...]   # (node name, data input slot)
    trigger: str                             # clones wait for this node


@dataclasses.dataclass(frozen=True)
class Recompute:
    """How to rebuild one tensor in the backward pass."""

    tensor: str                      # "node:port" of the forward tensor
    chain: tuple[str, ...]           # nodes to clone, inputs before users
    groups: tuple[RecomputeGroup, ...]


@dataclasses.dataclass(frozen=True)
class SwapGroup:
    """Backward readers served by one SnSwapIn, and the node that starts it."""

    consumers: tuple[tuple[str, int], ...]   # (node name, data input slot)
    trigger: str                             # the swap-in waits for this node


@dataclasses.dataclass(frozen=True)
class Swap:
    """How to park one forward tensor in the host pool until the backward pass."""

    tensor: str                      # "node:port"
    dtype: int                       # DataType enum (the ops' T attr)
    groups: tuple[SwapGroup, ...]
    shape: Optional[tuple] = None    # static shape (-1: unknown dim; None: unknown rank)
    # Forward readers of the tensor: on a CPU they wait for the swap-out, so
    # the copy is made while they hold the tensor anyway and the device
    # buffer dies with its last forward reader (left alone, the executor may
    # run the swap-out late and keep the buffer alive meanwhile). On a GPU
    # they do not: the copy would sit on the compute path (rewrite.apply).
    forward_readers: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Order:
    """A control edge: node `after` waits for node `before` (names)."""

    before: str
    after: str


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A policy's result on one analyzed graph.

    Attributes:
      plan: the Plan (KEEP decisions included, with their reasons).
      planned: the rewritten graph analyzed, or None when nothing changed.
      cache_headroom: with conditional swaps, the bytes of swapped tensors
        the device may keep (the rewrite writes it onto the cache ops).
      fields: report fields the policy fills (budget_fits, ...).
      warnings: messages to log once.
      pinned: whether order edges hold the planned order, the executor's
        or a memory-aware one (sntf.planner.finish).
      held_in_margin: where order edges were dropped only because they
        would take a plan that fits its budget over its target, the outcome
        with them (its peak still under the budget); else None.
    """

    plan: Plan
    planned: Optional[object] = None
    cache_headroom: Optional[int] = None
    fields: dict = dataclasses.field(default_factory=dict)
    warnings: tuple = ()
    pinned: bool = False
    held_in_margin: Optional["Outcome"] = None


def noted(outcome: Outcome, note: str) -> Outcome:
    """The outcome with a note added to its plan."""
    return dataclasses.replace(outcome, plan=dataclasses.replace(
        outcome.plan, notes=outcome.plan.notes + (note,)))
