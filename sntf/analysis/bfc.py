"""A model of TensorFlow's BFC allocator, to predict what the device reports.

TensorFlow's CPU BFC allocator (and every GPU allocator) counts whole chunks
as in use: a request is rounded to 256 bytes, served from the best-fitting
free chunk, and that chunk is split only when it is at least twice the
request. Regions grow by doubling. A 20 MiB im2col buffer taken from a fresh
32 MiB region therefore shows as 32 MiB in use, which a sum of tensor sizes
misses.

Under a memory limit (a GPU's, or the CPU's TF_CPU_BFC_MEM_LIMIT_IN_MB) a
new region takes what the doubling asks for or what is left, whichever is
less, and a request that no free chunk and no new region can hold fails
(BFCAllocator::Extend). A chunk never spans two regions, so a step whose
peak is well under the limit can still run out of memory: the last region
is too small for a large request and the large regions are split. The
model raises OutOfMemory there. Pure Python, no TensorFlow.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import threading
from typing import Callable, Optional

try:  # the native model (tf_ops/bfc_model.cc), where sntf is built
    from sntf import _bfc_model as _native
except ImportError:  # pragma: no cover - a source checkout not yet built
    _native = None

MIN_ALLOCATION_BITS = 8
MIN_ALLOCATION = 1 << MIN_ALLOCATION_BITS          # 256 bytes
NUM_BINS = 21
INITIAL_REGION_BYTES = 2 << 20                     # allow_growth starts at 2 MiB
MAX_INTERNAL_FRAGMENTATION = 128 << 20


def rounded_bytes(n: int) -> int:
    """The size BFC reserves for a request of n bytes."""
    return max(MIN_ALLOCATION, -(-n // MIN_ALLOCATION) * MIN_ALLOCATION)


def bin_for_size(n: int) -> int:
    """BFC's bin index: floor(log2(n >> 8)), capped."""
    v = max(n, 1) >> MIN_ALLOCATION_BITS
    return min(NUM_BINS - 1, v.bit_length() - 1) if v else 0


# bin_for_size of a chunk's size, memoized: a step's buffers come in few sizes.
_bin_of = functools.lru_cache(maxsize=1 << 16)(bin_for_size)


class OutOfMemory(Exception):
    """A request the allocator cannot serve under its limit; step: the
    schedule step that made it (-1: before the step), set by simulate."""

    step: int = -1


@dataclasses.dataclass(slots=True)
class _Chunk:
    addr: int
    size: int
    region: int
    in_use: bool = False
    prev: Optional[int] = None   # address of the previous chunk in the region
    next: Optional[int] = None


class BfcModel:
    """Best-fit with coalescing, bins and region doubling, as TensorFlow does it.

    Args:
      initial_region_bytes: the first region's size (allow_growth's 2 MiB).
      limit: the allocator's memory limit in bytes, or None for none.
    """

    def __init__(self, initial_region_bytes: int = INITIAL_REGION_BYTES,
                 limit: Optional[int] = None):
        self._limit = limit
        self._region_bytes = rounded_bytes(initial_region_bytes)
        self._next_addr = 0
        self._chunks: dict = {}
        self._bins = [[] for _ in range(NUM_BINS)]   # sorted (size, addr)
        self.in_use = 0
        self.peak = 0
        self.reserved = 0

    # -- bins
    def _bin_insert(self, c: _Chunk) -> None:
        bisect.insort(self._bins[_bin_of(c.size)], (c.size, c.addr))

    def _bin_remove(self, c: _Chunk) -> None:
        entries = self._bins[_bin_of(c.size)]
        entries.pop(bisect.bisect_left(entries, (c.size, c.addr)))

    def _find(self, size: int) -> Optional[_Chunk]:
        key = (size, -1)
        bins = self._bins
        for b in range(_bin_of(size), NUM_BINS):
            entries = bins[b]
            if entries:
                k = bisect.bisect_left(entries, key)
                if k < len(entries):
                    return self._chunks[entries[k][1]]
        return None

    # -- regions
    def _extend(self, size: int) -> None:
        available = None
        if self._limit is not None:
            available = (self._limit - self.reserved) // MIN_ALLOCATION * MIN_ALLOCATION
            if size > available:
                raise OutOfMemory(f"{size} bytes with {self.reserved} of "
                                  f"{self._limit} reserved")
        grew = False
        while size > self._region_bytes:
            self._region_bytes *= 2
            grew = True
        region_size = (self._region_bytes if available is None
                       else min(self._region_bytes, available))
        addr = self._next_addr
        self._next_addr += region_size + MIN_ALLOCATION  # regions never touch
        c = _Chunk(addr=addr, size=region_size, region=addr)
        self._chunks[addr] = c
        self._bin_insert(c)
        self.reserved += region_size
        if not grew:
            self._region_bytes *= 2

    def copy(self) -> "BfcModel":
        """An independent copy of the allocator in its present state."""
        other = BfcModel.__new__(BfcModel)
        other.__dict__.update(self.__dict__)
        other._chunks = {a: _Chunk(c.addr, c.size, c.region, c.in_use, c.prev, c.next)
                         for a, c in self._chunks.items()}
        other._bins = [list(entries) for entries in self._bins]
        return other

    # -- public
    @property
    def next_region_bytes(self) -> int:
        """The size of the region the allocator would add next (unless a
        larger request makes it double further)."""
        return self._region_bytes

    def allocate(self, nbytes: int) -> int:
        """Allocates; returns the chunk address (a handle for free()).

        Raises:
          OutOfMemory: under a limit, no free chunk or new region holds it.
        """
        size = rounded_bytes(nbytes)
        c = self._find(size)
        if c is None:
            self._extend(size)
            c = self._find(size)
        self._bin_remove(c)
        if c.size >= 2 * size or c.size - size >= MAX_INTERNAL_FRAGMENTATION:
            rest = _Chunk(addr=c.addr + size, size=c.size - size, region=c.region,
                          prev=c.addr, next=c.next)
            if c.next is not None:
                self._chunks[c.next].prev = rest.addr
            c.next = rest.addr
            c.size = size
            self._chunks[rest.addr] = rest
            self._bin_insert(rest)
        c.in_use = True
        self.in_use += c.size
        self.peak = max(self.peak, self.in_use)
        return c.addr

    def free(self, addr: int) -> None:
        """Frees a chunk and merges it with free neighbours.

        Every free chunk but the one being freed is in its bin."""
        chunks = self._chunks
        c = chunks[addr]
        c.in_use = False
        self.in_use -= c.size
        if c.next is not None:
            right = chunks[c.next]
            if not right.in_use:
                self._bin_remove(right)
                self._absorb(c, right)
        if c.prev is not None:
            left = chunks[c.prev]
            if not left.in_use:
                self._bin_remove(left)
                self._absorb(left, c)
                c = left
        self._bin_insert(c)

    def _absorb(self, left: _Chunk, right: _Chunk) -> None:
        """Merges `right` into `left`, its neighbour before it; neither is
        in a bin."""
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            self._chunks[right.next].prev = left.addr
        del self._chunks[right.addr]


def hold_outside(sim: BfcModel, nbytes: int) -> None:
    """Allocates what a device holds outside the graph before its step: as
    the requests that made it grew the regions, a piece of each region in
    turn, from the first, until nbytes are held (1.8 MiB takes the first
    2 MiB region whole, which BFC does not split for it; 6 MiB fills the
    2 and 4 MiB regions rather than one 8 MiB region)."""
    rest = nbytes
    while rest > 0:
        piece = min(rest, sim.next_region_bytes)
        sim.allocate(piece)
        rest -= piece


def held_bytes(nbytes: int) -> int:
    """What a fresh allocator reports in use after hold_outside(nbytes)."""
    if nbytes <= 0:
        return 0
    sim = BfcModel()
    hold_outside(sim, nbytes)
    return sim.in_use


def simulate(buffer_bytes: dict, persistent, intervals: dict, end: int,
             is_scratch: Callable[[tuple], bool], limit: Optional[int] = None,
             outside: int = 0, grows: bool = True,
             handover: Optional[dict] = None) -> tuple[int, ...]:
    """Bytes the allocator reports in use at each step of a schedule.

    What the device holds outside the graph (`outside` bytes), then the
    persistent buffers, are allocated first (they exist before the step);
    within a step, outputs are allocated, then scratch, then scratch and
    dead inputs are freed.

    With `handover`, the step runs twice, as training runs it: a variable
    update that takes its new value's buffer (an AssignVariableOp whose
    value no one else reads) frees the variable's old buffer instead, so
    the variables move to where the first step's updates were allocated,
    and the second step's large buffers are served from what that leaves.
    Each step's figure is the larger of the two runs'.

    Args:
      buffer_bytes: buffer -> bytes.
      persistent: the buffers that exist before the step.
      intervals: buffer -> (first step, step after which it is freed).
      end: the number of steps.
      is_scratch: whether a buffer is an op's scratch memory.
      limit: the allocator's limit, or None.
      outside: bytes held outside the graph.
      grows: the allocator grows by regions from 2 MiB (allow_growth, the
        CPU's); else its first region is the whole limit (a GPU's default).
      handover: buffer -> the persistent buffer it becomes when it dies
        (None or empty: one step).

    Returns:
      Bytes in use at every step.

    Raises:
      OutOfMemory: under the limit; its step says where.
    """
    first = INITIAL_REGION_BYTES if grows or limit is None else limit
    kept = sorted(persistent)
    allocs = collections.defaultdict(list)
    frees = collections.defaultdict(list)
    for b, (start, stop) in intervals.items():
        # Scratch last in, first out; outputs by node and port.
        allocs[start].append((is_scratch(b), b))
        if stop < end:
            frees[stop].append((not is_scratch(b), b))
    for lists in (allocs, frees):
        for step_list in lists.values():
            step_list.sort()
    handover = handover or {}
    if _native is not None:
        return _natively(first, limit, outside, kept, buffer_bytes, intervals, allocs, frees,
                         end, handover)
    sim, chunks = _before_step(first, limit, outside, tuple(buffer_bytes[b] for b in kept))
    held = dict(zip(kept, chunks))
    series = _run_step(sim, buffer_bytes, allocs, frees, end, held, handover)
    if handover:
        series = tuple(max(a, b) for a, b in zip(
            series, _run_step(sim, buffer_bytes, allocs, frees, end, held, handover)))
    return series


def _natively(first: int, limit: Optional[int], outside: int, kept: list, buffer_bytes: dict,
              intervals: dict, allocs: dict, frees: dict, end: int,
              handover: dict) -> tuple[int, ...]:
    """simulate's step on the native model (tf_ops/bfc_model.cc), which
    follows BfcModel rule for rule: the events as arrays of buffer ids."""
    ids = {b: k for k, b in enumerate(intervals)}
    sizes = [buffer_bytes[b] for b in intervals]
    steps = sorted(k for k in set(allocs) | set(frees) if 0 <= k < end)
    alloc_start, alloc_ids, free_start, free_ids = [0], [], [0], []
    none: list = []
    for step in steps:
        alloc_ids += [ids[b] for _, b in allocs.get(step, none)]
        alloc_start.append(len(alloc_ids))
        free_ids += [ids[b] for _, b in frees.get(step, none)]
        free_start.append(len(free_ids))
    slot = {b: k for k, b in enumerate(kept)}
    handed = [-1] * len(sizes)
    for b, target in handover.items():
        if b in ids and target in slot:
            handed[ids[b]] = slot[target]
    # What is live at the step's end is freed (free chunks coalesce alike
    # in any order).
    last = [ids[b] for b, (start, stop) in intervals.items() if stop >= end and 0 <= start < end]
    series, failed = _native.simulate(
        first, -1 if limit is None else limit, outside, [buffer_bytes[b] for b in kept],
        sizes, steps, alloc_start, alloc_ids, free_start, free_ids, handed, last, end,
        bool(handover))
    if failed is not None:
        step, size, reserved, at_most = failed
        e = OutOfMemory(f"{size} bytes with {reserved} of {at_most} reserved")
        e.step = step
        raise e
    return tuple(series)


# The allocator with what exists before a step allocated, for the last few
# settings asked about: the plans tried on one graph share their variables.
_BEFORE_SIZE = 4
_before: collections.OrderedDict = collections.OrderedDict()
_before_lock = threading.Lock()


def _before_step(first: int, limit: Optional[int], outside: int, sizes: tuple) -> tuple:
    """(a fresh allocator holding `outside` bytes, then the persistent
    buffers of `sizes` in turn, their chunks): a copy of one made before
    with the same settings. Raises OutOfMemory (step -1) where they do not
    fit."""
    key = (first, limit, outside, sizes)
    with _before_lock:
        made = _before.get(key)
        if made is not None:
            _before.move_to_end(key)
    if made is None:
        sim = BfcModel(initial_region_bytes=first, limit=limit)
        hold_outside(sim, outside)
        made = (sim, [sim.allocate(n) for n in sizes])
        with _before_lock:
            _before[key] = made
            while len(_before) > _BEFORE_SIZE:
                _before.popitem(last=False)
    return made[0].copy(), made[1]


def _run_step(sim: BfcModel, buffer_bytes: dict, allocs: dict, frees: dict, end: int,
              held: dict, handover: dict) -> tuple[int, ...]:
    """Runs one step's allocations and frees on `sim`; frees what is live at
    its end but persistent. held: persistent buffer -> its chunk, updated
    where a dying buffer is handed over to a persistent one."""
    where = {}
    series = []
    step = -1
    # Only the steps that allocate or free change what is in use: the steps
    # between them repeat the figure.
    busy = sorted(k for k in set(allocs) | set(frees) if 0 <= k < end)
    try:
        for step in busy:
            if len(series) < step:
                series.extend([sim.in_use] * (step - len(series)))
            for _, b in allocs.get(step, ()):
                where[b] = sim.allocate(buffer_bytes[b])
            series.append(sim.in_use)
            for _, b in frees.get(step, ()):
                target = handover.get(b)
                if target in held:
                    sim.free(held[target])
                    held[target] = where.pop(b)
                else:
                    sim.free(where.pop(b))
    except OutOfMemory as e:
        e.step = step
        raise
    series.extend([sim.in_use] * (end - len(series)))
    for b in sorted(where):
        sim.free(where[b])
    return tuple(series)
