"""Superneurons' cost-aware recomputation: one question per forward tensor
the backward pass reads, "can it be rebuilt cheaply just before it is
needed?", answered with a recipe or the reason it is kept."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

from sntf.graph import optable
from sntf.graph.fusions import merge_pairs
from sntf.graph.phases import BACKWARD, FORWARD
from sntf.graph.regions import step_regions
from sntf.planner import heuristics
from sntf.planner.backward import (backward_read_by_buffer, backward_read_tensors,
                                   control_flow_note, read_under_control_flow,
                                   reader_groups, tensor_name)
from sntf.planner import reasons as R
from sntf.planner.plan import (RECOMPUTE, Decision, Plan, Recompute,
                               identity_plan, keep)
from sntf.planner.reasons import Reason, reason


@dataclasses.dataclass(frozen=True)
class _Setting:
    """What one call of plan_recompute decides every tensor by."""

    g: object
    facts: object
    mode: str
    memory_tensors: frozenset
    step_of: dict            # node -> position in the order readers are sorted by
    cost_step: dict          # node -> schedule step (step_seconds' index)
    why_not: Callable[[int], Optional[Reason]]   # why a node may not be re-run
    kept: set                # nodes whose outputs chains start from
    max_chain: int
    segments: int            # segment_checkpoints
    strict_pairs: tuple      # (first, second) of the pairs merged only without control inputs

    def recomputable(self, i: int) -> bool:
        return self.why_not(i) is None


def plan_recompute(g, facts, mode: str, protected: frozenset = frozenset(),
                   memory_tensors: frozenset = frozenset(),
                   order: Optional[tuple] = None,
                   segment_checkpoints: int = 0) -> Plan:
    """Superneurons' cost-aware recomputation of cheap forward tensors.

    A cheap forward tensor (activation, normalization, pooling, dropout...)
    that the backward pass reads is not kept from forward to backward: its
    chain of cheap ops is cloned from the nearest checkpoints and re-run just
    before its first backward reader, released by a control edge from a
    backward op that reaches that reader.

    Args:
      g: the graph index (sntf.graph.GraphIndex).
      facts: the analysis of g (sntf.analysis.Analysis).
      mode: "speed" (one clone serves every backward reader) or "memory"
        (one clone per reader, freed right after it).
      protected: node indices that must not be recomputed (fetch, preserve).
      memory_tensors: "node:port" names planned memory-centric whatever the
        mode (the auto mode chooses them from a planned timeline).
      order: the node order readers are sorted by and release points picked
        on; None: facts.schedule, the predicted executor order.
      segment_checkpoints: 0 keeps every checkpoint op's output (the
        paper's rule). N > 0 also re-runs checkpoint ops (convolutions,
        matmuls) in chains of up to N of them, keeping only the inputs of
        each chain (see _segment_inputs).

    Returns:
      A Plan with one RECOMPUTE decision and one Recompute recipe per
      recomputed tensor, and a KEEP decision with its reason for every other
      forward tensor the backward pass reads.
    """
    if mode not in heuristics.RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute mode {mode!r}; modes: "
                         f"{heuristics.RECOMPUTE_MODES}")
    regions = step_regions(g)
    if regions.loops:
        return identity_plan("recompute", "control flow present (a loop): "
                             "not recomputed")
    region = regions.region
    setting = _setting(g, facts, mode, protected, region, memory_tensors, order,
                       segment_checkpoints)
    candidates, kept = [], {}
    for t in backward_read_tensors(g, facts):
        answer = _recompute_one(setting, t, region)
        if isinstance(answer, Reason):
            kept[tensor_name(g, t)] = answer
        else:
            candidates.append(answer)
    recipes, decisions, dropped = _whole_buffers(g, facts, candidates, setting.segments)
    kept.update(dropped)
    keeps = tuple(keep(t, R.staged(why, "recompute")) for t, why in kept.items())
    return Plan(policy="recompute", decisions=tuple(decisions) + keeps,
                summary=f"recompute ({mode}): {len(recipes)} tensor(s)",
                notes=control_flow_note(regions), recomputes=tuple(recipes))


def _setting(g, facts, mode, protected, region, memory_tensors, order,
             segments) -> _Setting:
    cost_step = {node: s for s, node in enumerate(facts.schedule)}
    step_of = {node: s for s, node in enumerate(order)} if order else cost_step
    phases = facts.node_phases
    classes = (optable.CHEAP, optable.CHECKPOINT) if segments else (optable.CHEAP,)

    def why_not(i: int) -> Optional[Reason]:
        return not_recomputable(g, phases, protected, region, classes, i)

    def recomputable(i: int) -> bool:
        return why_not(i) is None

    if segments:
        # Chains start from the kept segment inputs and rebuild everything
        # between them, the tensors the backward pass reads included.
        kept = segment_inputs(g, facts, recomputable, segments)
        max_chain = heuristics.MAX_SEGMENT_CHAIN
    else:
        # Tensors the backward pass reads stay alive until then anyway: a
        # chain starts from them rather than re-running what produced them.
        kept = {i for i in range(len(g.names))
                if any(phases[c] == BACKWARD for c, _, _ in g.consumers[i])}
        max_chain = heuristics.MAX_RECOMPUTE_CHAIN
    strict_pairs = tuple((p.first, p.second) for p in merge_pairs(g) if p.strict)
    return _Setting(g, facts, mode, memory_tensors, step_of, cost_step, why_not,
                    kept, max_chain, segments, strict_pairs)


def not_recomputable(g, phases, protected, region, classes, i: int,
                     phase: str = FORWARD) -> Optional[Reason]:
    """Why node i may not be re-run, or None when it may.

    Args:
      g: the graph index.
      phases: every node's phase (facts.node_phases).
      protected: nodes that must not be re-run (fetch, preserve).
      region: nodes under control flow.
      classes: the op classes that may be re-run (optable.CHEAP, CHECKPOINT).
      i: the node.
      phase: the phase a node must be in.

    Returns:
      The reason, or None.
    """
    op = g.ops[i]
    if phases[i] != phase:
        return reason(R.WRONG_PHASE, phase=phase)
    if i in protected:
        return reason(R.PROTECTED)
    if i in region:
        return reason(R.CONTROL_FLOW)
    if op in optable.NEVER_RECOMPUTE_OPS:
        return reason(R.NEVER_RERUN, op=op)
    if optable.op_class(op) not in classes:
        return reason(R.CHECKPOINT if optable.op_class(op) == optable.CHECKPOINT
                      else R.NOT_CHEAP, op=op)
    if optable.is_update_op(op):
        return reason(R.WRITES_VARIABLE, op=op)
    return None


def _recompute_one(s: _Setting, t: tuple, region) -> Union[Reason, tuple]:
    """The candidate (buffer, tensor, Recompute, Decision) that rebuilds
    forward tensor t, or the reason t is kept."""
    g, facts = s.g, s.facts
    producer, port = t
    why = s.why_not(producer)
    if why is not None:
        return why
    if g.ops[producer] in optable.ALIAS_OPS:
        return reason(R.VIEW, op=g.ops[producer])
    if s.segments and producer in s.kept:
        return reason(R.SEGMENT_INPUT)
    buffer = facts.buffer_of(t)
    # With segments, readers of the shape alone keep the original (as in
    # plan_swap): they run as soon as it exists, and a clone's release point
    # cannot be found for them, so a conv output that a Shape op reads
    # (graphs with a dynamic batch) would never be recomputed. Under the
    # paper's rule such tensors stay kept: recomputing them too planned
    # higher.
    readers = [(c, slot) for c, slot, p in g.consumers[producer]
               if p == port and facts.node_phases[c] == BACKWARD
               and not (s.segments and g.ops[c] in optable.METADATA_OPS)]
    if not readers:
        return reason(R.SHAPE_ONLY)
    if read_under_control_flow(g, t, region):
        return reason(R.READ_UNDER_CONTROL_FLOW)
    chain = chain_of(g, producer, s.recomputable, s.kept, s.max_chain)
    if chain is None:
        return reason(R.CHAIN_TOO_LONG, limit=s.max_chain)
    held = _held_strict_member(g, chain, s.strict_pairs)
    if held is not None:
        return reason(R.HOLDS_FUSED, node=g.names[held])
    chain = sorted(chain, key=s.step_of.get)
    name = tensor_name(g, t)
    groups = reader_groups(g, readers, "memory" if name in s.memory_tensors else s.mode,
                           s.step_of, facts)
    if not groups:
        return reason(R.NO_RELEASE)
    recipe = Recompute(tensor=name, chain=tuple(g.names[i] for i in chain),
                       groups=tuple(groups))
    seconds = sum(facts.step_seconds[s.cost_step[i]] for i in chain) * len(groups)
    decision = Decision(
        tensor=name, action=RECOMPUTE,
        why=(reason(R.RECOMPUTED, cheap=not s.segments, op=g.ops[producer],
                    readers=len(readers), ops=len(chain), per_reader=len(groups) > 1),),
        bytes_saved=facts.buffer_bytes.get(buffer, 0), seconds_added=seconds)
    return buffer, t, recipe, decision


def _held_strict_member(g, chain, strict_pairs: tuple) -> Optional[int]:
    """A chain node the rewrite would hold back by a control edge (its data
    inputs are all outside the chain) that belongs, with another node of
    the chain, to a pair oneDNN merges only without control inputs (a
    cloned Conv2D -> BiasAdd: sntf.graph.fusions); None if there is none."""
    members = set(chain)
    for pair in strict_pairs:
        if set(pair) <= members:
            for node in pair:
                if all(p not in members for p, _ in g.data_inputs[node]):
                    return node
    return None


def _whole_buffers(g, facts, candidates, segments: bool):
    """Keeps the candidates whose buffer is freed by the plan.

    An op that runs in place (a ReLU after a BatchNorm's add) leaves its
    output in its input's buffer, so that buffer is what the backward pass
    keeps alive. It dies early only if every tensor living in it that the
    backward pass reads is recomputed; recomputing some of them saves
    nothing, so those are dropped. Each buffer's bytes count once.

    Returns:
      (recipes, decisions, {dropped tensor: why}).
    """
    # With segments, readers of the shape alone are no candidates' readers
    # (see _recompute_one), so they keep no buffer either.
    backward_read = backward_read_by_buffer(g, facts, shape_readers=not segments)
    # A clone may still read the original of another recomputed tensor (a
    # ResNet block's output feeds the next block's join); that only moves the
    # original's death to the clone, earlier in the backward pass, which the
    # planned analysis accounts for.
    covered = {}
    for buffer, t, _, _ in candidates:
        covered.setdefault(buffer, set()).add(t)
    kept, dropped = [], {}
    for c in candidates:
        if backward_read.get(c[0], set()) - covered[c[0]]:
            dropped[c[2].tensor] = reason(R.BUFFER_KEPT)
        elif c[0] in _chain_input_buffers(g, facts, c[2]):
            dropped[c[2].tensor] = reason(R.READS_OWN_BUFFER)
        else:
            kept.append(c)
    recipes, decisions, counted = [], [], set()
    for buffer, t, recipe, decision in kept:
        if buffer in counted:
            decision = dataclasses.replace(
                decision, bytes_saved=0, why=decision.why + (reason(R.SHARES_BUFFER),))
        counted.add(buffer)
        recipes.append(recipe)
        decisions.append(decision)
    return recipes, decisions, dropped


def _chain_input_buffers(g, facts, recipe) -> set:
    """Buffers a recipe's clones read: a chain rooted in its own tensor's
    buffer (a ReLU computed in place over a kept MatMul output) frees nothing."""
    members = {g.node(name) for name in recipe.chain}
    return {facts.buffer_of((p, port)) for i in members
            for p, port in g.data_inputs[i] if p not in members}


def chain_of(g, producer: int, recomputable, kept=frozenset(),
             max_chain: int = heuristics.MAX_RECOMPUTE_CHAIN) -> Optional[list]:
    """The nodes to re-run for `producer`: it and the re-runnable ops it
    reads, short of `kept` (on its device: clones run where their originals
    did), or None if the chain is longer than max_chain."""
    chain, stack = {producer}, [producer]
    while stack:
        node = stack.pop()
        for p, _ in g.data_inputs[node]:
            if p in chain or p in kept or not _walkable(g, p, producer, recomputable):
                continue
            chain.add(p)
            if len(chain) > max_chain:
                return None
            stack.append(p)
    return list(chain)


def _walkable(g, p: int, node: int, recomputable) -> bool:
    """Whether a chain that re-runs `node` may re-run its input `p` too."""
    return (recomputable(p) and g.ops[p] not in optable.RECOMPUTE_VIEW_OPS
            and g.devices[p] == g.devices[node])


def segment_inputs(g, facts, recomputable, per_segment: int) -> set:
    """The nodes whose outputs are kept when checkpoint ops are recomputed.

    Walking the forward pass in schedule order, each recomputable node
    gets the chain that would rebuild it from kept tensors. A node whose
    chain would hold more than `per_segment` checkpoint ops (convolutions,
    matmuls) or more than MAX_SEGMENT_CHAIN nodes keeps its own inputs
    instead, which starts a new segment there: a ResNet block's input (the
    chain of a block's first convolution would otherwise run back along the
    shortcut into the blocks before), every few layers of a VGG chain. What
    no chain may re-run (variables, concatenations, pools, other devices)
    is kept anyway.

    Args:
      g, facts: the graph index and its analysis.
      recomputable: node index -> whether it may be re-run.
      per_segment: most checkpoint ops per segment.

    Returns:
      The node indices whose outputs are kept.
    """
    chains, kept = {}, set()
    for node in facts.schedule:
        if not recomputable(node):
            continue
        inputs = [p for p, _ in g.data_inputs[node]
                  if p in chains and p not in kept and _walkable(g, p, node, recomputable)]
        chain = frozenset({node}).union(*(chains[p] for p in inputs))
        checkpoints = sum(optable.op_class(g.ops[i]) == optable.CHECKPOINT
                          for i in chain)
        if checkpoints > per_segment or len(chain) > heuristics.MAX_SEGMENT_CHAIN:
            kept.update(inputs)
            chain = frozenset({node})
        chains[node] = chain
    return kept
