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

from sntf.planner import reasons

KEEP, SWAP, RECOMPUTE = "keep", "swap", "recompute"
ACTIONS = (KEEP, SWAP, RECOMPUTE)
# A decision's kind: its action, but a recomputation of a backward tensor
# for its later readers (sntf.planner.rebuild) is a rebuild.
REBUILD = "rebuild"
KINDS = ACTIONS + (REBUILD,)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do with one tensor ("node:port"), and why.

    Attributes:
      tensor: the tensor.
      action: KEEP, SWAP or RECOMPUTE.
      why: the reasons (sntf.planner.reasons.Reason), each a code with its
        parameters; a kept tensor has one per stage that kept it.
      bytes_saved: the bytes the action frees, where it acts.
      seconds_added: the predicted extra time per step.
    """

    tensor: str
    action: str
    why: tuple = ()
    bytes_saved: Optional[int] = None
    seconds_added: Optional[float] = None

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; actions: {ACTIONS}")

    @property
    def kind(self) -> str:
        """One of KINDS: the action, or REBUILD."""
        if self.action == RECOMPUTE and any(r.code == reasons.REBUILT for r in self.why):
            return REBUILD
        return self.action

    @property
    def codes(self) -> tuple[str, ...]:
        """The codes of its reasons, in order."""
        return tuple(r.code for r in self.why)

    @property
    def reason(self) -> str:
        """Its reasons in prose, as a report gives them."""
        return "; ".join(r.text for r in self.why)

    @classmethod
    def from_dict(cls, data: dict) -> "Decision":
        """The decision a to_dict made (its prose and kind are derived)."""
        return cls(data["tensor"], data["action"],
                   tuple(reasons.Reason.from_dict(r) for r in data.get("why", ())),
                   data.get("bytes_saved"), data.get("seconds_added"))

    def to_dict(self) -> dict:
        return {"tensor": self.tensor, "action": self.action, "kind": self.kind,
                "reason": self.reason, "why": [r.to_dict() for r in self.why],
                "bytes_saved": self.bytes_saved, "seconds_added": self.seconds_added}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's output: decisions plus the predicted memory picture."""

    policy: str
    decisions: tuple[Decision, ...] = ()
    predicted_peak_bytes: Optional[int] = None
    planned_peak_bytes: Optional[int] = None
    lower_bound_bytes: Optional[int] = None
    notes: tuple[str, ...] = ()
    # The stage's own line on what it planned ("recompute (speed): 3
    # tensor(s)"), kept apart from its notes so that a mode can restate it
    # and code can tell it from the reasons in notes; the report shows it
    # first (lines).
    summary: str = ""
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
    def lines(self) -> tuple[str, ...]:
        """What the report says of the plan: its summary, then its notes."""
        return ((self.summary,) if self.summary else ()) + self.notes

    @property
    def changes_graph(self) -> bool:
        return any(d.action != KEEP for d in self.decisions)

    def to_dict(self) -> dict:
        """The plan as plain data, each decision with its reasons in prose
        and as codes."""
        plain = dataclasses.asdict(self)
        plain["decisions"] = [d.to_dict() for d in self.decisions]
        plain["notes"] = self.lines
        del plain["summary"]
        return plain

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


def keep(tensor: str, *why) -> Decision:
    """A KEEP decision: the tensor stays where TensorFlow puts it, for the
    reasons (sntf.planner.reasons.Reason) given."""
    return Decision(tensor=tensor, action=KEEP, why=tuple(why), bytes_saved=0,
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


# How a plan stands against its room (Fit.why).
SEARCH_FITS = "search_fits"              # the budget search's plan fits
EDGES_IN_MARGIN = "edges_in_margin"      # it fits, its order edges in the margin
REFIT_FITS = "refit_fits"                # fitted lower, the allocator model fits it
COMPOSITION_FITS = "composition_fits"    # a policy's composition fits
UNMET = "unmet"                          # no plan fits: the lowest is applied
HELD_ORDER_ONLY = "held_order_only"      # the lowest fits only in a held order
DEVICE_RUNS_OUT = "device_runs_out"      # the allocator model runs out on every plan
FITS_AS_IS = "fits_as_is"                # no budget: the graph fits the limit unchanged
LIMIT_PLANNED = "limit_planned"          # no budget: planned in the executor's order
LIMIT_HELD = "limit_held"                # no budget: held to a memory-aware order
LIMIT_SEARCHED = "limit_searched"        # no budget: fitted to the limit's room
FIT_CODES = (SEARCH_FITS, EDGES_IN_MARGIN, REFIT_FITS, COMPOSITION_FITS, UNMET,
             HELD_ORDER_ONLY, DEVICE_RUNS_OUT, FITS_AS_IS, LIMIT_PLANNED, LIMIT_HELD,
             LIMIT_SEARCHED)


@dataclasses.dataclass(frozen=True)
class Fit:
    """How a plan stands against its room, where a budget or a device limit
    binds it (policy "auto").

    Attributes:
      why: one of FIT_CODES.
      budget_fits: whether the plan fits the budget (None without one).
      target: the planned peak a budget's plan must not exceed.
      achievable: the least planned peak found, where the budget is not met.
      seconds: the plan's predicted extra seconds per step.
      device_fits: whether the allocator model fits the plan under the
        device's limit (None without one).
    """

    why: str
    budget_fits: Optional[bool] = None
    target: Optional[int] = None
    achievable: Optional[int] = None
    seconds: Optional[float] = None
    device_fits: Optional[bool] = None

    def __post_init__(self):
        if self.why not in FIT_CODES:
            raise ValueError(f"unknown fit {self.why!r}; fits: {FIT_CODES}")

    def fields(self) -> dict:
        """The report's fields for it (those known)."""
        named = {"fit": self.why, "budget_fits": self.budget_fits,
                 "budget_target_bytes": self.target, "achievable_peak_bytes": self.achievable,
                 "predicted_seconds_added": self.seconds, "device_limit_fits": self.device_fits}
        return {key: value for key, value in named.items() if value is not None}


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A policy's result on one analyzed graph.

    Attributes:
      plan: the Plan (KEEP decisions included, with their reasons).
      planned: the rewritten graph analyzed, or None when nothing changed.
      cache_headroom: with conditional swaps, the bytes of swapped tensors
        the device may keep (the rewrite writes it onto the cache ops).
      fit: how the plan stands against its room, where a budget or a
        device limit binds it; else None.
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
    fit: Optional[Fit] = None
    warnings: tuple = ()
    pinned: bool = False
    held_in_margin: Optional["Outcome"] = None


def refit(outcome: Outcome, **changes) -> Outcome:
    """The outcome with its Fit's fields changed (a Fit made where it has
    none needs its why)."""
    fit = (dataclasses.replace(outcome.fit, **changes) if outcome.fit is not None
           else Fit(**changes))
    return dataclasses.replace(outcome, fit=fit)


def noted(outcome: Outcome, note: str) -> Outcome:
    """The outcome with a note added to its plan."""
    return dataclasses.replace(outcome, plan=dataclasses.replace(
        outcome.plan, notes=outcome.plan.notes + (note,)))
