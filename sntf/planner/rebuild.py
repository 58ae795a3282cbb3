"""Rebuilding a cheap backward tensor for its later readers.

Recomputation (sntf.planner.recompute) decides the forward tensors the
backward pass reads. A tensor the backward pass itself makes can hold a
peak up the same way: it lives from its first reader to its last, and
whatever the backward ops in between allocate lands on top of it.
TensorFlow's swish gradient is the case in point: it recomputes
sigmoid(x) (once dy exists), reads it for 1 - sigmoid(x), computes
x * (1 - sigmoid(x)) and 1 + that, and only then reads sigmoid(x) again,
so the incoming gradient, sigmoid(x), 1 - sigmoid(x) and x are live at
once. Re-running sigmoid(x) from x just before its last reader frees the
first one after 1 - sigmoid(x) reads it (which then takes its buffer
over), and the step holds three such tensors where it held four.

Only chains of cheap backward ops rooted in tensors that are not the
backward pass's own qualify: forward tensors, which the swap stage then
serves for the clone like any other backward reader, and constants. A
chain that read another backward tensor would keep that one alive until
the clone instead. The stage runs after recomputation, on the graph it
left: where the swish's input is itself recomputed (a normalization's
output), sigmoid(x) reads that clone, a cheap backward op the chain
re-runs too.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from sntf.graph import optable
from sntf.graph.phases import BACKWARD
from sntf.graph.regions import step_regions
from sntf.planner import heuristics
from sntf.planner.backward import control_flow_note, reader_groups, tensor_name
from sntf.planner import reasons as R
from sntf.planner.plan import REBUILD, RECOMPUTE, Decision, Plan, Recompute, identity_plan
from sntf.planner.reasons import Reason, reason
from sntf.planner.recompute import chain_of, not_recomputable


@dataclasses.dataclass(frozen=True)
class _Setting:
    """What one call of plan_rebuilds decides every tensor by."""

    g: object
    facts: object
    mode: str
    step_of: dict            # node -> schedule step (facts.schedule, step_seconds' index)
    why_not: Callable[[int], Optional[Reason]]   # why a backward node may not be re-run


def plan_rebuilds(g, facts, mode: str, protected: frozenset = frozenset()) -> Plan:
    """Re-runs cheap backward tensors for their readers after the first.

    Args:
      g: the graph index (sntf.graph.GraphIndex).
      facts: the analysis of g (sntf.analysis.Analysis).
      mode: "speed" (one clone serves every later reader) or "memory" (one
        clone per later reader).
      protected: node indices that must not be re-run (fetch, preserve).

    Returns:
      A Plan with one RECOMPUTE decision and one Recompute recipe per
      rebuilt tensor, in schedule order, each recipe's groups serving every
      reader after the first.
    """
    regions = step_regions(g)
    if regions.loops:
        return identity_plan("recompute", "control flow present (a loop): not rebuilt")
    phases, region = facts.node_phases, regions.region

    def why_not(i: int) -> Optional[Reason]:
        return not_recomputable(g, phases, protected, region, (optable.CHEAP,), i,
                                BACKWARD)

    s = _Setting(g, facts, mode, {node: k for k, node in enumerate(facts.schedule)},
                 why_not)
    least = heuristics.REBUILD_PEAK_SHARE * facts.predicted_peak_bytes
    recipes, decisions = [], []
    for producer in facts.schedule:
        if why_not(producer) is not None or g.ops[producer] in optable.ALIAS_OPS:
            continue
        for port in sorted({p for _, _, p in g.consumers[producer]}):
            buffer = facts.buffer_of((producer, port))
            if buffer is None or facts.buffer_bytes.get(buffer, 0) < least:
                continue
            found = _rebuild_one(s, (producer, port), buffer)
            if found is not None:
                recipes.append(found[0])
                decisions.append(found[1])
    notes = (f"rebuild: {len(recipes)} backward tensor(s) re-run for their later "
             "readers", *control_flow_note(regions))
    return Plan(policy="recompute", decisions=tuple(decisions), notes=notes,
                recomputes=tuple(recipes))


def _rebuild_one(s: _Setting, t: tuple, buffer) -> Optional[tuple]:
    """(Recompute, Decision) for backward tensor t, or None where rebuilding
    it cannot free its buffer before its last reader."""
    g, facts = s.g, s.facts
    producer, port = t
    readers = sorted(((c, slot) for c, slot, p in g.consumers[producer]
                      if p == port and g.ops[c] not in optable.METADATA_OPS),
                     key=lambda r: s.step_of[r[0]])
    if len(readers) < 2 or any(facts.node_phases[c] != BACKWARD for c, _ in readers):
        return None
    chain = chain_of(g, producer, lambda i: s.why_not(i) is None)
    if chain is None:
        return None
    chain = set(chain)
    roots = {(p, q) for i in chain for p, q in g.data_inputs[i] if p not in chain}
    if any(facts.node_phases[p] == BACKWARD for p, _ in roots):
        return None
    # A chain that reads the buffer its own output lives in (an op computed
    # in place) would keep that buffer alive until the clone: nothing freed.
    if any(facts.buffer_of(r) == buffer for r in roots):
        return None
    groups = reader_groups(g, readers[1:], s.mode, s.step_of, facts)
    # The clone must wait past the first reader, or it runs alongside the
    # original and the buffer lives as long as before.
    if not groups or s.step_of[g.node(groups[0].trigger)] <= s.step_of[readers[0][0]]:
        return None
    chain = sorted(chain, key=s.step_of.get)
    recipe = Recompute(tensor=tensor_name(g, t), chain=tuple(g.names[i] for i in chain),
                       groups=tuple(groups))
    seconds = sum(facts.step_seconds[s.step_of[i]] for i in chain) * len(groups)
    decision = Decision(
        tensor=recipe.tensor, action=RECOMPUTE,
        why=(reason(R.REBUILT, op=g.ops[producer], readers=len(readers), ops=len(chain),
                    per_reader=len(groups) > 1),),
        bytes_saved=facts.buffer_bytes.get(buffer, 0), seconds_added=seconds)
    return recipe, decision


def is_rebuild(decision) -> bool:
    """Whether a plan decision (a Decision or its dict) rebuilds a backward
    tensor rather than recomputing a forward one: its kind."""
    kind = decision.get("kind") if isinstance(decision, dict) else decision.kind
    return kind == REBUILD
