"""Superneurons' unified tensor pool: one question per forward tensor the
backward pass reads, "can it wait in host memory and come back in time?",
answered with a recipe or the reason it is kept."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional, Union

from sntf.analysis.memory import ACTIVATION
from sntf.graph import optable
from sntf.graph.index import on_gpu
from sntf.graph.phases import BACKWARD, FORWARD, waits_for_loss
from sntf.graph.regions import step_regions
from sntf.planner import heuristics
from sntf.planner import backward
from sntf.planner.backward import (backward_read_by_buffer, backward_read_tensors,
                                   control_flow_note, read_under_control_flow,
                                   tensor_name)
from sntf.planner import reasons as R
from sntf.planner.plan import SWAP, Decision, Plan, Swap, SwapGroup, identity_plan, keep
from sntf.planner.reasons import Reason, reason


@dataclasses.dataclass(frozen=True)
class _Setting:
    """What one call of plan_swap decides every tensor by."""

    g: object
    facts: object
    dtypes: dict
    shapes: dict
    min_bytes: int
    bandwidth: float
    protected: frozenset
    region: frozenset
    workspace_pairs: bool
    step_of: dict
    elapsed: list            # estimated compute before each step
    backward_read: dict      # buffer -> forward tensors in it the backward pass reads


def tensor_properties(index, props: dict) -> tuple[dict, dict]:
    """(node, port) -> DataType and (node, port) -> static shape, from decoded
    static properties by node name."""
    dtypes, shapes = {}, {}
    for name, outs in props.items():
        if name in index.index:
            for port, (dtype, shape) in enumerate(outs):
                dtypes[(index.node(name), port)] = dtype
                shapes[(index.node(name), port)] = shape
    return dtypes, shapes


def plan_swap(g, facts, dtypes: dict, min_bytes: Optional[int], bandwidth: float,
              protected: frozenset = frozenset(), shapes: Optional[dict] = None,
              workspace_pairs: bool = True) -> Plan:
    """Superneurons' unified tensor pool: offload, then prefetch.

    A forward tensor of at least `min_bytes` that the backward pass reads is
    copied to the host pool by a swap-out (the device copy then dies after
    its last forward reader; on a GPU, whose readers do not wait for the
    swap-out, once its copy completes too, which the analysis does not
    model: it has not run on one) and brought back by a swap-in before its first
    backward reader. The swap-in is released by a control edge from the
    backward op a prefetch distance earlier: far enough back that the
    estimated compute of the ops in between covers the transfer at
    `bandwidth`.

    Args:
      g: the graph index (sntf.graph.GraphIndex).
      facts: the analysis of g (sntf.analysis.Analysis).
      dtypes: (node, port) -> DataType enum of each tensor.
      min_bytes: smaller tensors are never swapped; None: default_min_bytes.
      bandwidth: host link bandwidth in bytes per second.
      protected: node indices that must stay as they are (fetch, preserve).
      shapes: (node, port) -> static shape, recorded for the cache ops'
        shape inference.
      workspace_pairs: whether oneDNN pairs ops with their gradients (see
        optable.WORKSPACE_PAIRS); such a pair's tensor is then not swapped.

    Returns:
      A Plan with one SWAP decision and one Swap recipe per swapped tensor,
      and a KEEP decision with its reason for every other forward tensor the
      backward pass reads.
    """
    regions = step_regions(g)
    if regions.loops:
        return identity_plan("swap", "control flow present (a loop): nothing swapped")
    region = regions.region
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth!r}")
    backward_read = backward_read_by_buffer(g, facts)
    if min_bytes is None:
        min_bytes = default_min_bytes(facts, backward_read)
    setting = _Setting(
        g=g, facts=facts, dtypes=dtypes, shapes=shapes or {}, min_bytes=min_bytes,
        bandwidth=bandwidth, protected=protected, region=region,
        workspace_pairs=workspace_pairs,
        step_of={node: s for s, node in enumerate(facts.schedule)},
        elapsed=list(itertools.accumulate(facts.step_seconds, initial=0.0)),
        backward_read=backward_read)
    # A loop's back edges make any graph cyclic to edges_acyclic.
    follow_early = not g.has_cycles
    decisions, recipes, keeps = _plan_tensors(setting, follow_early)
    early_note = ()
    if follow_early and _serves_early_readers(g, recipes) and not backward.edges_acyclic(
            g, [(g.node(grp.trigger), g.node(c)) for r in recipes for grp in r.groups
                for c, _ in grp.consumers]):
        # The swap-ins of readers that wait for no gradient are timed by
        # ops that are not their ancestors; here two such edges close a
        # cycle, so those readers are not served.
        decisions, recipes, keeps = _plan_tensors(setting, follow_early=False)
        early_note = ("swap: gradient ops that wait for no gradient not served "
                      "(their swap-ins' edges would close a cycle)",)
    notes = (f"swap: {len(recipes)} tensor(s) of at least {min_bytes} bytes",
             *early_note, *control_flow_note(regions))
    return Plan(policy="swap", decisions=tuple(decisions) + tuple(keeps), notes=notes,
                swaps=tuple(recipes))


def default_min_bytes(facts, backward_read: dict) -> int:
    """The swap threshold when the user sets none (see
    heuristics.SWAP_MIN_BYTES).

    Args:
      facts: the graph's analysis.
      backward_read: backward_read_by_buffer of the graph.

    Returns:
      heuristics.SWAP_MIN_BYTES, or less where buffers of that size hold
      less than SWAP_MIN_COVER of the bytes the backward pass reads: the
      size of the smallest buffer among the largest that hold that share,
      but at least SWAP_MIN_FLOOR_BYTES.
    """
    sizes = sorted((facts.buffer_bytes.get(buffer, 0) for buffer in backward_read),
                   reverse=True)
    wanted, held = heuristics.SWAP_MIN_COVER * sum(sizes), 0
    for size in sizes:
        held += size
        if held >= wanted:
            return min(heuristics.SWAP_MIN_BYTES,
                       max(heuristics.SWAP_MIN_FLOOR_BYTES, size))
    return heuristics.SWAP_MIN_BYTES


def threshold_at_peak(g, facts, min_bytes: int) -> Optional[int]:
    """The swap threshold that reaches the kept activations live at a
    planned graph's peak, or None where none is below min_bytes.

    Args:
      g, facts: a planned (rewritten) graph's index and analysis.
      min_bytes: the threshold its swap plan was made with.

    Returns:
      The smallest such activation's bytes, at least SWAP_MIN_FLOOR_BYTES,
      or None.
    """
    step = facts.peak_step
    sizes = [size for buffer, (start, stop) in facts.buffer_intervals.items()
             if start <= step <= stop
             and facts.buffer_class.get(buffer) == ACTIVATION
             and heuristics.SWAP_MIN_FLOOR_BYTES <= (
                 size := facts.buffer_bytes.get(buffer, 0)) < min_bytes]
    return min(sizes, default=None)


def _serves_early_readers(g, recipes) -> bool:
    """Whether a swap-in serves a reader that waits for no gradient. Only
    such a swap-in's trigger may not be an ancestor of its readers; without
    one, every trigger runs before its readers and the edges need no check
    (the pass runs on every traced function)."""
    waits = waits_for_loss(g)
    return any(g.node(grp.consumers[0][0]) not in waits
               for r in recipes for grp in r.groups)


def _plan_tensors(s: _Setting, follow_early: bool) -> tuple:
    """(SWAP decisions, Swap recipes, KEEP decisions) for every forward
    tensor the backward pass reads."""
    decisions, recipes, keeps = [], [], []
    for t in backward_read_tensors(s.g, s.facts):
        answer = _swap_one(s, t, follow_early)
        if isinstance(answer, Reason):
            keeps.append(keep(tensor_name(s.g, t), R.staged(answer, "swap")))
        else:
            recipes.append(answer[0])
            decisions.append(answer[1])
    return decisions, recipes, keeps


def _not_swappable(s: _Setting, producer: int) -> Optional[Reason]:
    """Why no output of `producer` may be swapped, or None."""
    op = s.g.ops[producer]
    if s.facts.node_phases[producer] != FORWARD:
        return reason(R.WRONG_PHASE, phase="forward")
    if producer in s.protected:
        return reason(R.PROTECTED)
    if producer in s.region:
        return reason(R.CONTROL_FLOW)
    if op in optable.ALIAS_OPS and op not in optable.VIEW_OPS:
        return reason(R.VIEW, op=op)
    if op in optable.FREE_OPS or op in optable.PERSISTENT_OPS:
        return reason(R.NO_STEP_MEMORY, op=op)
    if optable.is_update_op(op):
        return reason(R.WRITES_VARIABLE, op=op)
    return None


def _tensor_not_swappable(s: _Setting, t: tuple, buffer, size: int) -> Optional[Reason]:
    """Why tensor t may not be swapped, or None."""
    if size < max(s.min_bytes, 1):
        return reason(R.BELOW_THRESHOLD, bytes=size, min_bytes=s.min_bytes)
    if s.dtypes.get(t) not in optable.SWAP_DTYPES:
        return reason(R.NOT_FLAT, dtype=s.dtypes.get(t))
    # An op that ran in place leaves t in its input's buffer; that buffer is
    # freed by swapping t when t is the only tensor in it the backward pass
    # reads.
    if s.backward_read.get(buffer, set()) != {t}:
        return reason(R.BUFFER_SHARED)
    if read_under_control_flow(s.g, t, s.region):
        return reason(R.READ_UNDER_CONTROL_FLOW)
    if s.workspace_pairs and _workspace_paired(s.g, t):
        return reason(R.ONEDNN_PAIRED)
    return None


def _swap_one(s: _Setting, t: tuple, follow_early: bool) -> Union[Reason, tuple]:
    """(Swap, Decision) for forward tensor t, or the reason t is kept."""
    g, facts = s.g, s.facts
    producer, port = t
    why = _not_swappable(s, producer)
    if why is not None:
        return why
    buffer = facts.buffer_of(t)
    size = facts.buffer_bytes.get(buffer, 0) if buffer else 0
    why = _tensor_not_swappable(s, t, buffer, size)
    if why is not None:
        return why
    readers = sorted(((c, slot) for c, slot, p in g.consumers[producer]
                      if p == port and facts.node_phases[c] == BACKWARD
                      and g.ops[c] not in optable.METADATA_OPS),
                     key=lambda r: s.step_of[r[0]])
    transfer = size / s.bandwidth
    groups = _swap_groups(g, facts, readers, transfer, s.step_of, s.elapsed,
                          follow_early)
    if not groups:
        return reason(R.NO_SWAP_IN)
    name = tensor_name(g, t)
    forward = sorted({g.names[c] for c, _, p in g.consumers[producer]
                      if p == port and (facts.node_phases[c] != BACKWARD
                                        or g.ops[c] in optable.METADATA_OPS)})
    recipe = Swap(tensor=name, dtype=s.dtypes[t], groups=tuple(groups),
                  shape=s.shapes.get(t), forward_readers=tuple(forward))
    decision = Decision(
        tensor=name, action=SWAP,
        why=(reason(R.SWAPPED, op=g.ops[producer], bytes=size, readers=len(readers),
                    swap_ins=len(groups), transfer_seconds=transfer),),
        bytes_saved=size,
        seconds_added=_exposed_transfer(groups, transfer, g, s.step_of, s.elapsed,
                                        g.devices[producer]))
    return recipe, decision


def _workspace_paired(g, tensor: tuple) -> bool:
    """Whether the tensor's gradient op reads it where oneDNN pairs the two."""
    producer, port = tensor
    return port == 0 and any(
        optable.WORKSPACE_PAIRS.get((g.ops[producer], g.ops[c])) == slot
        for c, slot, p in g.consumers[producer] if p == port)


def _swap_groups(g, facts, readers, transfer, step_of, elapsed,
                 follow_early: bool) -> list:
    """Splits readers into swap-in windows and picks each one's prefetch trigger."""
    groups, current = [], []
    window = heuristics.SWAP_WINDOW_TRANSFERS * transfer
    for reader in readers:
        if current and (elapsed[step_of[reader[0]]]
                        - elapsed[step_of[current[0][0]]]) > window:
            groups.append(current)
            current = []
        current.append(reader)
    if current:
        groups.append(current)
    result = []
    for batch in groups:
        c, slot = batch[0]
        trigger = backward.gradient_ancestor(g, facts, step_of, c, transfer,
                                             g.devices[g.data_inputs[c][slot][0]],
                                             follow_early)
        if trigger is None:
            return []
        result.append(SwapGroup(consumers=tuple((g.names[c], slot) for c, slot in batch),
                                trigger=g.names[trigger]))
    return result


def _exposed_transfer(groups, transfer, g, step_of, elapsed, device: str) -> float:
    """Predicted extra time: on a CPU the swap-out's transfer (the tensor's
    forward readers wait for it, see Swap.forward_readers; on a GPU they do
    not), plus each swap-in's transfer not hidden behind the ops between
    its trigger and its first reader."""
    exposed = 0.0 if on_gpu(device) else transfer
    for group in groups:
        start = step_of[g.node(group.trigger)]
        end = step_of[g.node(group.consumers[0][0])]
        exposed += max(0.0, transfer - (elapsed[end] - elapsed[start]))
    return exposed
