"""The fit loop (sntf.planner.fit) and the room it fits (sntf.planner.room):
one place computes the bytes a step may use, and one loop takes the plan
the room holds from every plan sntf can make of the graph."""

import dataclasses

import pytest

from graphs import analyzed, context, mlp_step, properties_fn
from sntf import config, passes, planner
from sntf.planner import fit, policies
from sntf.planner.plan import COMPOSITION_FITS, HELD_ORDER_ONLY, UNMET
from sntf.planner.room import Room, allocator_slack

MIB = 1 << 20


class _Facts:
    """What the room reads of an analysis: the buffers and the planned peak."""

    def __init__(self, peak: int, largest: int):
        self.budget_peak_bytes = peak
        self.buffer_bytes = {(0, 0): 8 * MIB, (1, 0): largest, (2, 0): largest // 2}
        self.persistent_buffers = frozenset({(0, 0)})
        self.device_timelines = ()


def test_the_room_holds_back_margin_outside_bytes_and_slack_once():
    facts = _Facts(peak=6 * MIB, largest=2 * MIB)
    room = Room.of(facts, budget=20 * MIB, margin=0.1, outside=MIB)
    assert room.slack == allocator_slack(facts) == 2 * MIB
    assert room.target == 18 * MIB - MIB - 2 * MIB
    assert room.headroom(facts) == room.target - 6 * MIB
    assert room.binds and room.usable is None and not room.runs_out(facts)
    limited = Room.of(facts, limit=40 * MIB, margin=0.25)
    assert limited.binds and limited.target is None and limited.usable == 30 * MIB
    assert limited.headroom(facts) is None
    assert not Room().binds


def test_the_device_is_asked_what_it_holds_once_per_graph():
    """What the device holds outside the graph is read once, and the budget's
    target and the allocator model both hold it back."""
    g, props = mlp_step()
    asked = []

    def in_use(device):
        asked.append(device)
        return 3 * MIB

    state = config.State(enabled=True, policy="auto", budget=config.Budget(bytes=64 * MIB),
                         options=config.parse_options({}))
    env = passes.Environment(allocator_limit=lambda d: 64 * MIB, in_use=in_use)
    report = passes.run_pass(g.SerializeToString(), ["ret"], [], state,
                             properties_fn(props), env=env).report
    assert asked == ["CPU:0"], asked
    outside = report["outside_bytes"]
    assert 0 < outside <= 3 * MIB
    assert f"{outside} bytes held outside the graph" in report["reason"]
    assert report["device_limit_bytes"] == 64 * MIB


def _seconds(outcome) -> float:
    return sum(d.seconds_added or 0.0 for d in planner.acting(outcome.plan.decisions))


def _searchless(monkeypatch):
    """Policy "auto" whose search has no options: it fits no budget below
    the graph's own peak, and the fit loop must find the compositions'."""
    empty = (lambda base, ctx: planner.Plan("auto"),) * 2
    auto = policies.POLICIES["auto"]
    monkeypatch.setitem(policies.POLICIES, "auto", dataclasses.replace(auto, sources=empty))
    return auto


def test_where_the_search_fits_nothing_the_cheapest_composition_that_fits_is_taken(
        monkeypatch):
    """A budget the search cannot meet but a composition can is met: the
    composition of least predicted time among those that fit, said to fit."""
    g, props = mlp_step()
    base = analyzed(g, ["ret"], props)
    auto = _searchless(monkeypatch)
    plain = context(memory_order=False)
    plans = {c.label: policies.finished("auto", c, base, plain, {})
             for c in auto.compositions}
    peaks = {label: o.planned.peak for label, o in plans.items()}
    # A budget every composition fits (its target above each plan's peak).
    slack = allocator_slack(base.facts)
    budget = int((max(peaks.values()) + slack + 1) / 0.9) + 1
    assert budget < base.facts.budget_peak_bytes / 0.9, "the unplanned graph would fit"
    ctx = context(memory_order=False, room=Room.of(base.facts, budget))
    outcome = planner.plan("auto", base, ctx)
    assert outcome.fit.budget_fits is True, outcome.plan.lines
    assert outcome.fit.why == COMPOSITION_FITS
    assert outcome.fit.achievable is None and outcome.fit.target == ctx.room.target
    assert outcome.planned.peak <= ctx.room.target
    cheapest = min(plans.values(), key=_seconds)
    assert outcome.fit.seconds == pytest.approx(_seconds(cheapest))


def test_where_nothing_fits_the_lowest_plan_tried_is_taken_and_never_said_to_fit(
        monkeypatch):
    g, props = mlp_step()
    base = analyzed(g, ["ret"], props)
    auto = _searchless(monkeypatch)
    ctx = context(room=Room.of(base.facts, base.facts.lower_bound_bytes // 2))
    outcome = planner.plan("auto", base, ctx)
    assert outcome.fit.budget_fits is False
    assert outcome.fit.why in (UNMET, HELD_ORDER_ONLY)
    tried = [policies.finished("auto", c, base, c_ctx, {}) for c in auto.compositions
             for c_ctx in (ctx, ctx.searching(memory_order=True, pin_order=True))]
    lowest = min(o.planned.peak for o in tried if o is not None and o.planned is not None)
    assert outcome.planned.peak == lowest
    assert outcome.fit.achievable == lowest
    assert outcome.warnings and "cannot be met" in outcome.warnings[0]


def test_every_policy_but_auto_plans_its_composition_whatever_binds():
    """The fit loop is policy "auto"'s: a budget leaves the others' plans
    as they are, their swaps conditional under it."""
    g, props = mlp_step()
    base = analyzed(g, ["ret"], props)
    free = planner.plan("swap+recompute", base, context())
    bound = planner.plan("swap+recompute", base, context(
        room=Room.of(base.facts, base.facts.budget_peak_bytes // 2)))
    assert [d.tensor for d in planner.acting(bound.plan.decisions)] == \
        [d.tensor for d in planner.acting(free.plan.decisions)]
    assert bound.fit is None
    assert fit.plan("off", base, context()).planned is None
