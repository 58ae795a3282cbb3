"""What the tensor cache keeps on the device, as the allocator sees it.

A plan's analysis assumes every swapped tensor leaves the device: SnCacheOut
frees its input, and each SnCacheIn allocates a fresh output. At run time
the cache keeps a swapped tensor on the device while the tensors it keeps
fit its headroom (tf_ops/cache_core.h): SnCacheIn then hands on that same
tensor, and nothing is allocated. A kept tensor fills its chunk until its
last swap-in's readers are done, or until a later swap-out evicts it (the
least recently used first) to make room under the headroom.

Under a hard limit those chunks matter: the allocator's regions may have
room for the planned step and none once the cache fills the gaps. The
model here rewrites the analysis' buffer lifetimes the way the cache would
change them, for the allocator model (analysis.bfc) to judge. It assumes
the cache keeps every tensor the headroom allows (its other test, live
bytes within the budget, is left out: the model errs towards pressure).
Pure Python, no TensorFlow.
"""

from __future__ import annotations

import collections

from sntf.analysis import memory
from sntf.graph import names
from sntf.graph.index import GraphIndex


def cached_lifetimes(g: GraphIndex, facts, headroom: int) -> tuple[dict, dict]:
    """Buffer sizes and lifetimes with the tensor cache keeping what fits.

    Args:
      g: the rewritten graph's index.
      facts: its analysis (sntf.analysis.Analysis).
      headroom: the cache's cap on the bytes it keeps on the device (the
        SnCacheOut attribute; 0 or less keeps nothing).

    Returns:
      (buffer -> bytes, buffer -> (first step, step after which it is
      freed)), for analysis.memory.device_series.
    """
    sizes = dict(facts.buffer_bytes)
    intervals = dict(facts.buffer_intervals)
    if headroom <= 0:
        return sizes, intervals
    step_of = {node: s for s, node in enumerate(facts.schedule)}
    ins_of = collections.defaultdict(list)      # cache-out -> its swap-ins
    for i, op in enumerate(g.ops):
        if op == names.CACHE_IN_OP and g.data_inputs[i]:
            ins_of[g.data_inputs[i][0][0]].append(i)
    events = []                                 # (step, 0 = a swap-in, 1 = a swap-out, node)
    for out, ins in ins_of.items():
        if out in step_of and g.data_inputs[out]:
            events.append((step_of[out], 1, out))
            events.extend((step_of[i], 0, i) for i in ins if i in step_of)
    kept = collections.OrderedDict()            # cache-out -> its buffer, LRU first
    left = {out: len(ins) for out, ins in ins_of.items()}   # the kernel's `uses`
    cached = 0
    for step, kind, node in sorted(events):
        if kind == 1:
            buffer = facts.buffers.get(g.data_inputs[node][0])
            nbytes = sizes.get(buffer, 0)
            # As ChooseVictimsLocked: least recently used first, until the
            # tensor fits the cap (all of them for one larger than the cap).
            while kept and cached + nbytes > headroom:
                _, victim = kept.popitem(last=False)
                cached -= sizes[victim]
                _hold(intervals, victim, step)  # evicted: copied out, then freed
            if buffer is not None and nbytes <= headroom:
                kept[node] = buffer
                cached += nbytes
            continue
        out = g.data_inputs[node][0][0]
        if out not in kept:
            continue                            # a miss: its output is allocated
        kept.move_to_end(out)                   # a hit: the last to be evicted
        buffer, y = kept[out], facts.buffers.get((node, 0))
        if y is not None and y != buffer and y in intervals:
            _hold(intervals, buffer, intervals.pop(y)[1])  # it hands the tensor on
        left[out] -= 1
        if left[out] == 0:
            kept.pop(out)
            cached -= sizes[buffer]
    return sizes, intervals


def cached_peak(g: GraphIndex, facts, headroom: int) -> int:
    """The device peak the allocator model predicts with the tensor cache
    keeping what its headroom allows (the planned peak assumes every swap
    copies; a plan that leaves headroom under its budget measures higher).

    Args:
      g: the rewritten graph's index.
      facts: its analysis (a single-device graph's).
      headroom: the cache's cap on the bytes it keeps on the device.

    Returns:
      Bytes.
    """
    sizes, intervals = cached_lifetimes(g, facts, headroom)
    series = memory.device_series(sizes, facts.persistent_buffers, intervals,
                                  len(facts.schedule), facts.handover, facts.outside_bytes)
    return max(series, default=facts.persistent_bytes)


def _hold(intervals: dict, buffer, until: int) -> None:
    """Keeps a buffer allocated at least until a step (a buffer a hit
    already handed on lives in its reader's interval)."""
    if buffer in intervals:
        start, stop = intervals[buffer]
        intervals[buffer] = (start, max(stop, until))
