"""Planner: turns an analyzed graph, a policy and its settings into a Plan.

    plan       the Plan and its Decisions (keep, swap, recompute), recipes, orders
    policies   per-tensor questions and the combinators that compose them
    recompute  which forward tensors can be rebuilt cheaply, and how
    swap       which forward tensors can wait in host memory, and how
    order      control edges that change when ops run
    modes      speed-, memory-centric and auto recomputation
    budget     planning under a budget: options and their search
    search     the search itself (pure, over planned-peak callables)
    heuristics every tunable, named
    context    the settings a policy plans under: options, device, room, search
    room       the bytes a step may use: budget, device limit, margin, what
               the device holds outside the graph
    fit        the fit loop: policy "auto" wherever a budget or limit binds
    device_limit  a device allocator's limit: the plan left unchanged, the
               tensor cache cut, the plan checked

Policies know nothing about how the rewrite is done; plans are tried with
the Context's evaluate callable, which the pass supplies.
"""

from sntf.planner import context
from sntf.planner.context import Context, protected
from sntf.planner.fit import plan
from sntf.planner.order import plan_gradient_order, plan_update_order
from sntf.planner.plan import (ACTIONS, KEEP, RECOMPUTE, SWAP, Decision, Order, Plan,
                               Recompute, RecomputeGroup, Swap, SwapGroup, acting,
                               identity_plan, keep, subset)
from sntf.planner.policies import POLICIES, Outcome
from sntf.planner.room import Room
from sntf.planner.recompute import plan_recompute, segment_inputs
from sntf.planner.swap import plan_swap

__all__ = [
    "ACTIONS", "Context", "Decision", "KEEP", "Order", "Outcome", "POLICIES", "Plan",
    "RECOMPUTE", "Recompute", "RecomputeGroup", "Room", "SWAP", "Swap", "SwapGroup",
    "acting", "identity_plan", "keep", "plan", "plan_gradient_order",
    "plan_recompute", "plan_swap", "plan_update_order", "protected",
    "segment_inputs", "subset",
]
