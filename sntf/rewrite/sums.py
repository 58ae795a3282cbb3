"""Holds a rewritten graph's order-dependent sums to the original's order.

TensorFlow decides the order of some gradient sums at run time
(sntf.graph.accumulations). A rewrite moves the ops around them, and with
them the order, and so the bits of the gradient. This step adds the control
edges that make every such sum of the rewritten graph add in the order the
original graph does when the executor runs it as the analysis emulates.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from sntf.analysis.schedule import schedule
from sntf.graph import accumulations
from sntf.graph.fusions import merged_kernels
from sntf.graph.index import GraphError, GraphIndex
from sntf.graph.updates import updated_index
from sntf.rewrite.fusions import kept_merges
from sntf.rewrite.validate import validate


@dataclasses.dataclass(frozen=True)
class PinnedSums:
    """A rewritten graph with its sums held in order.

    Attributes:
      graph_def: the new GraphDef (the input's when `pins` is empty).
      index: its index.
      pins: the control edges added.
      lost: reordering sums no edge can hold to the original's choice.
    """

    graph_def: object
    index: GraphIndex
    pins: tuple
    lost: tuple


def pin_sums(graph_def, index: GraphIndex, original: GraphIndex, order,
             onednn: bool = False) -> PinnedSums:
    """Adds the edges that hold a rewritten graph's sums in the original's order.

    Args:
      graph_def: the rewritten GraphDef (left untouched).
      index: its index.
      original: the original graph's index.
      order: the original graph's node indices in the order the executor
        runs them (the analysis' emulation).
      onednn: whether TensorFlow's oneDNN graph pass runs: an edge to one
        node of a pair it merges (a filter gradient and its bias gradient)
        is given to the other too, or the pair would run unmerged and round
        differently (sntf.rewrite.fusions).

    Returns:
      A PinnedSums; its graph is validated (a cycle, or a pair that cannot
      stay merged, raises GraphError).
    """
    names = [original.names[i] for i in order]
    mine = [index.index[n] for n in names if n in index.index]
    pins = accumulations.accumulation_pins(index, mine)
    held, lost = accumulations.sum_pins(original, order, index)
    pins += held
    if not pins:
        return PinnedSums(graph_def, index, (), tuple(lost))
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    added = []
    for pin in pins:
        after = out.node[index.index[pin.after]]
        control = "^" + pin.before
        producers = {text.split(":")[0] for text in after.input}
        if control in after.input or pin.before in producers:
            continue
        after.input.append(control)
        added.append(pin)
    # The index of the graph with the edges: index's, where they were added.
    pinned = updated_index(index, out, {pin.after for pin in added})
    if onednn and added:
        kept, gave = kept_merges(out, original, index=pinned)
        if kept is not out:
            out, pinned = kept, updated_index(pinned, kept, gave)
    pinned = validate(out, original, pinned)
    return PinnedSums(out, pinned, tuple(added), tuple(lost))


# Why a graph goes back unchanged: its sums cannot be held in order.
UNPINNABLE = "order_dependent_sum"
# What stands in the way, for the report's prose.
ACCUMULATOR, FAILED, LOST = "accumulator", "failed", "lost"


@dataclasses.dataclass(frozen=True)
class SumsOutcome:
    """What holding a graph's sums in order did.

    Attributes:
      graph_def, index: the graph with its sums held (the input graph where
        nothing was added, or where `code` is set).
      accumulations: edges an accumulator's additions need to run in order.
      pins: edges added.
      lost: reordering sums no edge can hold to the original's choice.
      code: UNPINNABLE where the graph must go back unchanged, else None.
      cause: ACCUMULATOR, FAILED or LOST where `code` is set.
      detail: the accumulator, the failure or the sum `cause` names.
    """

    graph_def: object
    index: GraphIndex
    accumulations: int = 0
    pins: int = 0
    lost: tuple = ()
    code: Optional[str] = None
    cause: Optional[str] = None
    detail: str = ""

    def fields(self) -> dict:
        """The report's `order_dependent_sums`."""
        return {"accumulations": self.accumulations, "pins": self.pins,
                "lost": list(self.lost), "code": self.code}

    def note(self, outcome: str = "graph left unchanged") -> Optional[str]:
        """The report's words for why the plan was not applied.

        Args:
          outcome: what became of the graph instead.

        Returns:
          The note, or None where `code` is not set.
        """
        if self.cause == ACCUMULATOR:
            return (f"{outcome} (exact_sums=True): the additions of Grappler "
                    f"accumulator {self.detail!r} run in an order TensorFlow's executor "
                    "picks at run time, which a rewrite moves, so TensorFlow's bits "
                    "cannot be promised")
        if self.cause == FAILED:
            return f"{outcome}: holding its sums in order failed: {self.detail}"
        if self.cause == LOST:
            return (f"{outcome}: the rewrite lets AddN {self.detail!r} sum "
                    "its inputs in another order")
        return None


def hold_before_planning(graph_def, index: GraphIndex, onednn: bool,
                         determinism: bool, exact: bool = False) -> SumsOutcome:
    """The graph with its order-dependent sums held, by control edges, to
    the order the executor runs them in as the analysis emulates it, before
    anything is planned on it: the planner's own order edges then respect
    them.

    TensorFlow orders a Grappler accumulator's additions by when its inputs
    arrive, and no emulation of its executor is exact: the edges add the
    same terms in one fixed order, so the rewritten graph's sums repeat
    under any thread pool (TensorFlow's own do not). Where the user asked
    for TensorFlow's exact bits (exact_sums=True) under op determinism,
    such a graph goes back unchanged instead.

    Args:
      graph_def: the graph Grappler handed over (left untouched).
      index: its index.
      onednn: whether TensorFlow's oneDNN graph pass runs.
      determinism: whether op determinism is on.
      exact: the exact_sums option.

    Returns:
      A SumsOutcome.
    """
    if not (accumulations.accumulation_groups(index) or accumulations.reordering_sums(index)):
        return SumsOutcome(graph_def, index)
    order = schedule(index, merged=merged_kernels(index) if onednn else None)
    unordered = accumulations.accumulation_pins(index, order)
    if unordered and determinism and exact:
        return SumsOutcome(graph_def, index, len(unordered), code=UNPINNABLE,
                           cause=ACCUMULATOR, detail=unordered[0].sum_node)
    try:
        held = pin_sums(graph_def, index, index, order, onednn)
    except GraphError as e:
        return SumsOutcome(graph_def, index, len(unordered), code=UNPINNABLE,
                           cause=FAILED, detail=str(e))
    return SumsOutcome(held.graph_def, held.index, len(unordered), len(held.pins))


def hold_after_planning(rewritten, index: GraphIndex, planned_on: GraphIndex, order,
                        onednn: bool, before: SumsOutcome) -> SumsOutcome:
    """The rewritten graph with the sums its new nodes could reorder held to
    the order of the graph it was planned on.

    Args:
      rewritten: the rewritten GraphDef (left untouched).
      index: its index.
      planned_on: the index of the graph it was planned on (sums held).
      order: that graph's node indices in the emulated executor order.
      onednn: whether TensorFlow's oneDNN graph pass runs.
      before: what hold_before_planning did.

    Returns:
      A SumsOutcome counting both steps' edges; its code is set where no
      edge can hold a sum.
    """
    try:
        held = pin_sums(rewritten, index, planned_on, order, onednn)
    except GraphError as e:
        return dataclasses.replace(before, code=UNPINNABLE, cause=FAILED, detail=str(e))
    outcome = dataclasses.replace(before, graph_def=held.graph_def, index=held.index,
                                  pins=before.pins + len(held.pins), lost=held.lost)
    if held.lost:
        return dataclasses.replace(outcome, code=UNPINNABLE, cause=LOST,
                                   detail=held.lost[0])
    return outcome
