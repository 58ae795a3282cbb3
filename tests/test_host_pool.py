"""Tests for the BFC host memory pool (tf_ops/host_pool*.cc) through its C API.

The pool's C API is exported by the shipped op library (sntf/_sntf_ops*.so);
SNTF_POOL_LIB may name another build of it. A library that does not load is a
test failure, never a reason to test something else.
"""

import bisect
import ctypes
import json
import os
import pathlib
import random
import subprocess
import sys
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
STUB_CUDART_SOURCE = ROOT / "tf_ops" / "testing" / "stub_cudart.cc"

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
ALIGN = 256
ERR_LEN = 1024

STAT_NAMES = (
    "bytes_in_use",
    "peak_bytes_in_use",
    "bytes_reserved",
    "peak_bytes_reserved",
    "limit_bytes",
    "num_allocs",
    "num_frees",
    "active_allocs",
    "num_failed_allocs",
    "largest_free_block",
    "free_bytes",
    "num_regions",
    "pinned_regions",
    "pinned_bytes",
    "pin_failures",
    "pin_limit_bytes",
    "pin_over_limit",
)

_vp, _u64 = ctypes.c_void_p, ctypes.c_uint64
SIGNATURES = {
    "sntf_pool_new": ([_u64, _u64], _vp),
    "sntf_pool_delete": ([_vp], None),
    "sntf_pool_global": ([], _vp),
    "sntf_pool_alloc": ([_vp, _u64, ctypes.c_char_p, _u64], _vp),
    "sntf_pool_free": ([_vp, _vp], ctypes.c_int),
    "sntf_pool_allocated_size": ([_vp, _vp], _u64),
    "sntf_pool_set_limit": ([_vp, _u64], None),
    "sntf_pool_trim": ([_vp], _u64),
    "sntf_pool_reset_peak": ([_vp], None),
    "sntf_pool_stats": ([_vp, ctypes.POINTER(_u64), ctypes.c_int], ctypes.c_int),
    "sntf_pool_fragmentation": ([_vp], ctypes.c_double),
    "sntf_pool_set_pin_hooks": ([_vp, ctypes.c_void_p, ctypes.c_void_p], None),
    "sntf_pool_set_pin_limit": ([_vp, _u64], None),
    "sntf_pool_block_pinned": ([_vp, _vp], ctypes.c_int),
    "sntf_pool_pin_with_cuda_runtime": ([_vp, ctypes.c_char_p, _u64], ctypes.c_int),
}
PIN_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64)
UNPIN_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def round_up(n):
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


def _packaged_library_path():
    """The shipped op library, loaded by TensorFlow first: it only sees the
    ops that register during its own load, not in an earlier plain dlopen."""
    from sntf.runtime import native as _native

    _native.load_ops()
    return _native.ops_library_path()


def _load(path):
    lib = ctypes.CDLL(path)
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    return lib


@pytest.fixture(scope="module")
def lib_path():
    return os.environ.get("SNTF_POOL_LIB") or _packaged_library_path()


@pytest.fixture(scope="module")
def lib(lib_path):
    return _load(lib_path)


class Pool:
    """Thin wrapper over one pool handle of the C API."""

    def __init__(self, lib, handle):
        assert handle, "pool handle is null"
        self.lib = lib
        self.h = handle

    def alloc(self, n):
        err = ctypes.create_string_buffer(ERR_LEN)
        p = self.lib.sntf_pool_alloc(self.h, n, err, ERR_LEN)
        return p, err.value.decode()

    def free(self, p):
        return self.lib.sntf_pool_free(self.h, p)

    def size(self, p):
        return self.lib.sntf_pool_allocated_size(self.h, p)

    def trim(self):
        return self.lib.sntf_pool_trim(self.h)

    def set_limit(self, n):
        self.lib.sntf_pool_set_limit(self.h, n)

    def reset_peak(self):
        self.lib.sntf_pool_reset_peak(self.h)

    def set_pin_limit(self, n):
        self.lib.sntf_pool_set_pin_limit(self.h, n)

    def pinned(self, p):
        return self.lib.sntf_pool_block_pinned(self.h, p) == 1

    def fragmentation(self):
        return self.lib.sntf_pool_fragmentation(self.h)

    def stats(self):
        out = (_u64 * len(STAT_NAMES))()
        written = self.lib.sntf_pool_stats(self.h, out, len(STAT_NAMES))
        assert written == len(STAT_NAMES), f"sntf_pool_stats wrote {written} values"
        return dict(zip(STAT_NAMES, out))


@pytest.fixture
def make_pool(lib):
    pools = []

    def make(limit, initial=1 * MiB):
        pool = Pool(lib, lib.sntf_pool_new(limit, initial))
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        lib.sntf_pool_delete(pool.h)


def fill(p, size, byte):
    ctypes.memset(p, byte, size)


def intact(p, size, byte):
    return ctypes.string_at(p, size).count(bytes([byte])) == size


def expected_fragmentation(s):
    return 0.0 if s["free_bytes"] == 0 else 1.0 - s["largest_free_block"] / s["free_bytes"]


def assert_failure_message(msg, n, limit):
    assert f"requested {n} bytes" in msg, f"failure message lacks the request size {n}: {msg!r}"
    assert f"pool limit {limit} bytes" in msg, f"failure message lacks the limit {limit}: {msg!r}"


# --------------------------------------------------------------------------
# Randomized model check
# --------------------------------------------------------------------------


class Model:
    """Reference bookkeeping the pool's observable state must match."""

    def __init__(self, pool, limit):
        self.pool = pool
        self.limit = limit
        self.live = {}  # ptr -> (size, byte)
        self.ptrs = []  # for O(1) random choice
        self.starts = []  # sorted, for overlap checks
        self.in_use = self.peak = 0
        self.allocs = self.frees = self.failures = 0
        self.regions = []  # sizes, in creation order
        self.tag = 0

    def check_no_overlap(self, p, size):
        i = bisect.bisect_left(self.starts, p)
        if i > 0:
            q = self.starts[i - 1]
            assert q + self.live[q][0] <= p, f"block {p:#x} overlaps live block {q:#x}"
        if i < len(self.starts):
            q = self.starts[i]
            assert p + size <= q, f"block {p:#x}+{size} overlaps live block {q:#x}"

    def alloc(self, n):
        before = self.pool.stats()
        rounded = round_up(n)
        p, msg = self.pool.alloc(n)
        fits = rounded <= before["largest_free_block"]
        can_grow = before["bytes_reserved"] + rounded <= self.limit
        after = self.pool.stats()
        if p is None:
            assert not fits and not can_grow, (
                f"alloc({n}) failed although the pool could serve it: {before}, msg={msg!r}"
            )
            assert_failure_message(msg, n, self.limit)
            self.failures += 1
            assert after["bytes_reserved"] == before["bytes_reserved"]
            return
        assert fits or can_grow, f"alloc({n}) succeeded beyond the limit: {before}"
        assert msg == "", f"successful alloc left an error message: {msg!r}"
        assert p % ALIGN == 0, f"pointer {p:#x} is not {ALIGN}-aligned"
        size = self.pool.size(p)
        assert size == rounded, f"allocated_size({n}) = {size}, expected {rounded}"
        assert p not in self.live, f"pointer {p:#x} handed out twice"
        self.check_no_overlap(p, size)
        if after["num_regions"] == before["num_regions"] + 1:
            assert not fits, "pool grew although a free block could serve the request"
            self.regions.append(after["bytes_reserved"] - before["bytes_reserved"])
        else:
            assert after["num_regions"] == before["num_regions"]
            assert after["bytes_reserved"] == before["bytes_reserved"]
        self.tag = self.tag % 251 + 1
        fill(p, size, self.tag)
        self.live[p] = (size, self.tag)
        self.ptrs.append(p)
        bisect.insort(self.starts, p)
        self.in_use += size
        self.peak = max(self.peak, self.in_use)
        self.allocs += 1

    def free_random(self, rng):
        i = rng.randrange(len(self.ptrs))
        self.ptrs[i], self.ptrs[-1] = self.ptrs[-1], self.ptrs[i]
        self.free(self.ptrs.pop())

    def free(self, p):
        size, tag = self.live.pop(p)
        assert self.pool.size(p) == size
        assert intact(p, size, tag), f"block {p:#x} ({size} bytes) was overwritten"
        assert self.pool.free(p) == 1, f"free({p:#x}) refused a live block"
        assert self.pool.size(p) == 0, "allocated_size of a freed block must be 0"
        del self.starts[bisect.bisect_left(self.starts, p)]
        self.in_use -= size
        self.frees += 1

    def check_stats(self):
        s = self.pool.stats()
        expected = {
            "bytes_in_use": self.in_use,
            "peak_bytes_in_use": self.peak,
            "bytes_reserved": sum(self.regions),
            "peak_bytes_reserved": sum(self.regions),  # never trimmed here
            "limit_bytes": self.limit,
            "num_allocs": self.allocs,
            "num_frees": self.frees,
            "active_allocs": len(self.live),
            "num_failed_allocs": self.failures,
            "free_bytes": sum(self.regions) - self.in_use,
            "num_regions": len(self.regions),
        }
        for key, want in expected.items():
            assert s[key] == want, f"{key} = {s[key]}, model says {want}; stats={s}"
        assert s["largest_free_block"] <= s["free_bytes"]
        assert self.pool.fragmentation() == pytest.approx(expected_fragmentation(s))
        return s


def random_size(rng):
    r = rng.random()
    if r < 0.01:
        return 0
    if r < 0.85:
        return int(2 ** rng.uniform(0, 16))  # 1 B .. 64 KiB
    if r < 0.97:
        return int(2 ** rng.uniform(16, 22))  # 64 KiB .. 4 MiB
    return rng.randint(8 * MiB, 40 * MiB)  # often more than a 32 MiB pool can give


@pytest.mark.parametrize(
    "seed,initial", [(1, 1 * MiB), (2, 1 * MiB), (3, 3 * MiB + 3), (4, 32 * MiB)]
)
def test_randomized_against_model(make_pool, seed, initial):
    limit = 32 * MiB
    rng = random.Random(seed)
    pool = make_pool(limit, initial)
    model = Model(pool, limit)
    for _ in range(5000):
        if model.live and rng.random() < (0.45 if model.in_use < limit // 2 else 0.7):
            model.free_random(rng)
        else:
            model.alloc(random_size(rng))
        model.check_stats()

    assert model.failures > 0, "the sequence never exhausted the pool; test is too weak"
    assert model.allocs > 1000 and model.frees > 1000
    if initial < limit:
        assert len(model.regions) >= 2, f"expected several regions, got {model.regions}"

    for p in list(model.live):
        model.free(p)
    s = model.check_stats()
    assert s["bytes_in_use"] == 0 and s["active_allocs"] == 0
    # Fully coalesced: each region is one free block.
    assert s["largest_free_block"] == max(model.regions), (s, model.regions)
    assert s["free_bytes"] == s["bytes_reserved"] == sum(model.regions)
    expected_frag = 1.0 - max(model.regions) / sum(model.regions)
    assert pool.fragmentation() == pytest.approx(expected_frag)
    if len(model.regions) == 1:
        assert pool.fragmentation() == 0.0
    # Trim only releases fully free regions, so releasing all of them proves
    # no region was left split into several free chunks.
    assert pool.trim() == sum(model.regions)
    s = pool.stats()
    assert s["bytes_reserved"] == 0 and s["num_regions"] == 0 and s["largest_free_block"] == 0


# --------------------------------------------------------------------------
# Coalescing and best fit
# --------------------------------------------------------------------------


def test_coalescing_merges_neighbours(make_pool):
    pool = make_pool(1 * MiB, 1 * MiB)
    a, _ = pool.alloc(1000)
    b, _ = pool.alloc(2048)
    c, _ = pool.alloc(4000)
    guard, _ = pool.alloc(1)
    assert None not in (a, b, c, guard)
    assert b == a + 1024 and c == b + 2048 and guard == c + 4096, "chunks are not carved in address order"

    assert pool.free(a) == 1 and pool.free(c) == 1
    s = pool.stats()
    assert s["free_bytes"] == MiB - 2048 - 256  # b and guard still live
    assert s["largest_free_block"] == MiB - 1024 - 2048 - 4096 - 256  # tail only
    assert pool.free(b) == 1
    # a+b+c is now one 7168-byte hole, smaller than the tail: best fit takes it
    # whole, which only works if the three chunks merged.
    p, _ = pool.alloc(7168)
    assert p == a, f"7168-byte request got {p:#x}, expected the coalesced hole at {a:#x}"
    assert pool.size(p) == 7168
    assert pool.free(p) == 1 and pool.free(guard) == 1
    s = pool.stats()
    assert s["largest_free_block"] == MiB and s["free_bytes"] == MiB, s
    assert pool.fragmentation() == 0.0


def test_coalescing_with_free_next_neighbour(make_pool):
    pool = make_pool(1 * MiB, 1 * MiB)
    a, _ = pool.alloc(4096)
    b, _ = pool.alloc(4096)
    assert pool.free(b) == 1  # merges into the tail
    assert pool.stats()["largest_free_block"] == MiB - 4096
    assert pool.free(a) == 1  # merges with the (free) next chunk
    assert pool.stats()["largest_free_block"] == MiB


def test_best_fit_picks_smallest_hole_lowest_address(make_pool):
    pool = make_pool(1 * MiB, 1 * MiB)
    holes = {}
    guards = []
    for name, size in [("h4096", 4096), ("h1024a", 1024), ("h2048", 2048), ("h1024b", 1024)]:
        holes[name], _ = pool.alloc(size)
        g, _ = pool.alloc(256)  # keeps the holes from merging
        guards.append(g)
    for p in holes.values():
        assert pool.free(p) == 1

    p, _ = pool.alloc(1500)  # 1536: only 2048 and 4096 fit, 2048 is smaller
    assert p == holes["h2048"], "best fit did not pick the smallest fitting hole"
    p, _ = pool.alloc(1000)  # 1024: two equal holes, lowest address wins
    assert p == holes["h1024a"], "ties must go to the lowest address"
    p, _ = pool.alloc(3000)  # 3072: only the 4096 hole fits; leaves 1024 behind
    assert p == holes["h4096"]
    p, _ = pool.alloc(1024)  # split remainder of h4096 sits below h1024b
    assert p == holes["h4096"] + 3072, "split remainder was not reused"
    p, _ = pool.alloc(600)  # 768: remainder 512 of h2048 too small, h1024b fits
    assert p == holes["h1024b"]
    p, _ = pool.alloc(512)  # exactly the h2048 remainder
    assert p == holes["h2048"] + 1536


# --------------------------------------------------------------------------
# Limits, errors, growth
# --------------------------------------------------------------------------


def test_exhaustion_returns_null_with_message(make_pool):
    limit = 1 * MiB
    pool = make_pool(limit, 256 * KiB)
    p, msg = pool.alloc(2 * MiB)
    assert p is None
    assert_failure_message(msg, 2 * MiB, limit)
    assert "exhausted" in msg

    blocks = []
    while True:
        p, msg = pool.alloc(64 * KiB)
        if p is None:
            break
        blocks.append(p)
        assert len(blocks) <= limit // (64 * KiB), "pool handed out more than its limit"
    assert len(blocks) == limit // (64 * KiB), f"limit not fully usable: {len(blocks)} blocks"
    assert_failure_message(msg, 64 * KiB, limit)
    s = pool.stats()
    assert s["bytes_reserved"] == limit and s["bytes_in_use"] == limit
    assert s["num_failed_allocs"] == 2 and s["num_allocs"] == len(blocks)
    assert s["largest_free_block"] == 0 and s["free_bytes"] == 0
    assert pool.fragmentation() == 0.0

    # Recovers once something is freed.
    assert pool.free(blocks.pop()) == 1
    p, msg = pool.alloc(1)
    assert p is not None, msg
    blocks.append(p)
    for p in blocks:
        assert pool.free(p) == 1


def test_request_too_large_for_64_bits(make_pool):
    pool = make_pool(1 * MiB)
    for n in (2**64 - 1, 2**64 - 255, 2**63):
        p, msg = pool.alloc(n)
        assert p is None
        assert_failure_message(msg, n, 1 * MiB)
    assert pool.stats()["num_failed_allocs"] == 3


def test_zero_byte_allocations_are_distinct(make_pool):
    pool = make_pool(1 * MiB)
    ptrs = [pool.alloc(0)[0] for _ in range(10)]
    assert None not in ptrs and len(set(ptrs)) == 10
    for p in ptrs:
        assert pool.size(p) == 256 and p % ALIGN == 0
        assert pool.free(p) == 1
    assert pool.stats()["num_allocs"] == 10


def test_bad_frees_are_rejected(make_pool):
    pool = make_pool(1 * MiB)
    p, _ = pool.alloc(1024)
    stack_buf = ctypes.create_string_buffer(64)
    assert pool.free(ctypes.addressof(stack_buf)) == 0, "freed a pointer the pool never owned"
    assert pool.free(None) == 0
    assert pool.free(p + 256) == 0, "freed an interior pointer"
    assert pool.size(p + 256) == 0
    assert pool.free(p) == 1
    assert pool.free(p) == 0, "double free accepted"
    assert pool.size(p) == 0
    s = pool.stats()
    assert s["num_frees"] == 1 and s["active_allocs"] == 0 and s["bytes_in_use"] == 0


def test_null_pool_is_tolerated(lib):
    err = ctypes.create_string_buffer(128)
    assert lib.sntf_pool_alloc(None, 16, err, 128) is None
    assert lib.sntf_pool_alloc(None, 16, None, 0) is None
    assert lib.sntf_pool_free(None, 1234) == 0
    assert lib.sntf_pool_allocated_size(None, 1234) == 0
    assert lib.sntf_pool_trim(None) == 0
    assert lib.sntf_pool_fragmentation(None) == 0.0
    out = (_u64 * 12)()
    assert lib.sntf_pool_stats(None, out, 12) == 0
    lib.sntf_pool_set_limit(None, 1)
    lib.sntf_pool_reset_peak(None)
    lib.sntf_pool_delete(None)


def test_stats_count_and_error_buffer_truncation(make_pool):
    pool = make_pool(1 * MiB)
    out = (_u64 * 20)()
    assert pool.lib.sntf_pool_stats(pool.h, out, 20) == len(STAT_NAMES)
    assert pool.lib.sntf_pool_stats(pool.h, out, 5) == 5
    assert pool.lib.sntf_pool_stats(pool.h, out, 0) == 0
    err = ctypes.create_string_buffer(b"\xff" * 16, 16)
    assert pool.lib.sntf_pool_alloc(pool.h, 10 * MiB, err, 16) is None
    assert err.raw[15] == 0 and len(err.value) == 15, err.raw
    assert pool.lib.sntf_pool_alloc(pool.h, 10 * MiB, None, 0) is None  # no buffer: no crash


def test_growth_policy_doubles_and_clamps_to_limit(make_pool):
    pool = make_pool(10 * MiB, 1 * MiB)
    sizes = []
    reserved = 0
    while True:
        p, msg = pool.alloc(256 * KiB)
        if p is None:
            assert_failure_message(msg, 256 * KiB, 10 * MiB)
            break
        now = pool.stats()["bytes_reserved"]
        if now != reserved:
            sizes.append(now - reserved)
            reserved = now
    assert sizes == [1 * MiB, 2 * MiB, 4 * MiB, 3 * MiB], sizes

    big = make_pool(100 * MiB, 1 * MiB)
    p, msg = big.alloc(10 * MiB + 1)
    assert p is not None, msg
    assert big.stats()["bytes_reserved"] == 10 * MiB + 256, "region must be sized by the request"


def test_set_limit_below_reserved_blocks_growth(make_pool):
    pool = make_pool(64 * MiB, 1 * MiB)
    a, _ = pool.alloc(1 * MiB)
    assert pool.stats()["bytes_reserved"] == 1 * MiB
    pool.set_limit(512 * KiB)
    s = pool.stats()
    assert s["limit_bytes"] == 512 * KiB and s["bytes_reserved"] == 1 * MiB, s
    p, msg = pool.alloc(256)
    assert p is None, "pool grew past a lowered limit"
    assert_failure_message(msg, 256, 512 * KiB)
    # Existing regions stay usable below the limit.
    assert pool.free(a) == 1
    b, msg = pool.alloc(768 * KiB)
    assert b is not None, msg
    assert pool.stats()["bytes_reserved"] == 1 * MiB
    pool.set_limit(64 * MiB)
    c, msg = pool.alloc(2 * MiB)
    assert c is not None, msg
    assert pool.stats()["num_regions"] == 2


def test_trim_releases_only_fully_free_regions(make_pool):
    pool = make_pool(64 * MiB, 1 * MiB)
    a, _ = pool.alloc(512 * KiB)  # region 1: 1 MiB
    b, _ = pool.alloc(1536 * KiB)  # region 2: 2 MiB
    c, _ = pool.alloc(3 * MiB)  # region 3: 4 MiB
    s = pool.stats()
    assert s["num_regions"] == 3 and s["bytes_reserved"] == 7 * MiB, s
    fill(a, 512 * KiB, 0xA1)
    fill(c, 3 * MiB, 0xC3)

    assert pool.trim() == 0, "trim released a region that is still in use"
    assert pool.free(b) == 1
    assert pool.trim() == 2 * MiB
    s = pool.stats()
    assert s["num_regions"] == 2 and s["bytes_reserved"] == 5 * MiB, s
    assert intact(a, 512 * KiB, 0xA1) and intact(c, 3 * MiB, 0xC3)
    assert pool.free(a) == 1 and pool.free(c) == 1
    assert pool.trim() == 5 * MiB
    s = pool.stats()
    assert s["bytes_reserved"] == 0 and s["num_regions"] == 0 and s["free_bytes"] == 0
    assert s["peak_bytes_reserved"] == 7 * MiB and s["peak_bytes_in_use"] == 5 * MiB, s
    assert pool.trim() == 0

    pool.reset_peak()
    s = pool.stats()
    assert s["peak_bytes_reserved"] == 0 and s["peak_bytes_in_use"] == 0, s
    p, _ = pool.alloc(100)
    s = pool.stats()
    assert s["bytes_reserved"] == 1 * MiB, "a fully trimmed pool should restart at the initial size"
    assert s["peak_bytes_in_use"] == 256 and s["peak_bytes_reserved"] == 1 * MiB
    assert pool.free(p) == 1
    assert pool.stats()["peak_bytes_in_use"] == 256


def test_allocation_above_4gib(make_pool):
    limit = 6 * GiB
    pool = make_pool(limit, 1 * MiB)
    n = 5 * GiB + 3
    p, msg = pool.alloc(n)
    if p is None and "mmap failed" in msg:
        pytest.skip(f"this machine will not map 5 GiB of address space: {msg}")
    assert p is not None, msg
    size = pool.size(p)
    assert size == 5 * GiB + 256, f"allocated_size = {size}: 64-bit size truncated?"
    assert p % ALIGN == 0
    s = pool.stats()
    assert s["bytes_in_use"] == size and s["bytes_reserved"] == size, s
    # mmap is lazy: touch only the two ends.
    fill(p, 4096, 0x5A)
    fill(p + size - 4096, 4096, 0xA5)
    assert intact(p, 4096, 0x5A) and intact(p + size - 4096, 4096, 0xA5)

    q, msg = pool.alloc(2 * GiB)
    assert q is None, "allocation beyond a 6 GiB limit succeeded"
    assert_failure_message(msg, 2 * GiB, limit)
    q, msg = pool.alloc(512 * MiB)
    assert q is not None, msg
    assert pool.free(q) == 1
    assert pool.free(p) == 1
    assert pool.stats()["bytes_in_use"] == 0

    # Exactly 4 GiB + 1 must not wrap to a tiny block.
    r, msg = pool.alloc(4 * GiB + 1)
    assert r is not None, msg
    assert pool.size(r) == 4 * GiB + 256
    assert pool.free(r) == 1
    assert pool.trim() == pool.stats()["peak_bytes_reserved"]


# --------------------------------------------------------------------------
# Concurrency
# --------------------------------------------------------------------------


def test_threads_share_one_pool(make_pool):
    pool = make_pool(64 * MiB, 1 * MiB)
    n_threads, n_ops = 4, 1500
    errors = []
    alloc_counts = [0] * n_threads

    def worker(tid):
        rng = random.Random(100 + tid)
        live = []
        try:
            for i in range(n_ops):
                if live and (rng.random() < 0.5 or len(live) > 40):
                    p, size, tag = live.pop(rng.randrange(len(live)))
                    if not intact(p, size, tag):
                        errors.append(f"thread {tid}: block {p:#x} overwritten")
                    if pool.free(p) != 1:
                        errors.append(f"thread {tid}: free({p:#x}) refused")
                else:
                    p, msg = pool.alloc(int(2 ** rng.uniform(0, 16)))
                    if p is None:
                        errors.append(f"thread {tid}: alloc failed: {msg}")
                        continue
                    size = pool.size(p)
                    tag = (tid * 61 + i) % 255 + 1
                    fill(p, size, tag)
                    live.append((p, size, tag))
                    alloc_counts[tid] += 1
            for p, size, tag in live:
                if not intact(p, size, tag):
                    errors.append(f"thread {tid}: block {p:#x} overwritten")
                pool.free(p)
        except Exception as e:  # surface in the main thread
            errors.append(f"thread {tid}: {e!r}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]

    total = sum(alloc_counts)
    s = pool.stats()
    assert s["num_allocs"] == total and s["num_frees"] == total, (s, total)
    assert s["active_allocs"] == 0 and s["bytes_in_use"] == 0 and s["num_failed_allocs"] == 0, s
    assert s["free_bytes"] == s["bytes_reserved"]
    assert pool.trim() == s["bytes_reserved"], "some region did not coalesce back to one block"


# Python threads rarely overlap inside the pool (the GIL is only released for
# the short ctypes call), so a missing lock can slip through the test above.
# This driver hammers the pool from native threads through the same C API
# function pointers the loaded library exports, whatever library that is.
_STRESS_DRIVER = r"""
#include <atomic>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

typedef void* (*AllocFn)(void*, uint64_t, char*, uint64_t);
typedef int (*FreeFn)(void*, void*);
typedef uint64_t (*SizeFn)(void*, void*);

extern "C" uint64_t stress(void* pool, void* alloc_fn, void* free_fn,
                           void* size_fn, int threads, int ops,
                           uint64_t* allocs_out) {
  AllocFn alloc = reinterpret_cast<AllocFn>(alloc_fn);
  FreeFn release = reinterpret_cast<FreeFn>(free_fn);
  SizeFn size_of = reinterpret_cast<SizeFn>(size_fn);
  std::atomic<uint64_t> errors{0}, allocs{0};
  struct Block { unsigned char* p; uint64_t size; unsigned char tag; };
  auto check_and_free = [&](const Block& b) {
    for (uint64_t i = 0; i < b.size; i += 61)
      if (b.p[i] != b.tag) { ++errors; break; }
    if (b.p[b.size - 1] != b.tag) ++errors;
    if (release(pool, b.p) != 1) ++errors;
  };
  auto work = [&](int tid) {
    std::mt19937_64 rng(tid + 1);
    std::vector<Block> live;
    for (int i = 0; i < ops; ++i) {
      if (!live.empty() && (rng() % 2 == 0 || live.size() > 64)) {
        size_t k = rng() % live.size();
        Block b = live[k];
        live[k] = live.back();
        live.pop_back();
        check_and_free(b);
        continue;
      }
      uint64_t n = 1 + rng() % (uint64_t{1} << (rng() % 17));
      unsigned char* p = static_cast<unsigned char*>(alloc(pool, n, nullptr, 0));
      if (p == nullptr) { ++errors; continue; }
      uint64_t size = size_of(pool, p);
      if (size < n || reinterpret_cast<uintptr_t>(p) % 256 != 0) { ++errors; continue; }
      // Disjoint tag ranges per thread expose cross-thread overlaps.
      unsigned char tag = static_cast<unsigned char>(tid * 60 + i % 60 + 1);
      std::memset(p, tag, size);
      live.push_back({p, size, tag});
      ++allocs;
    }
    for (const Block& b : live) check_and_free(b);
  };
  std::vector<std::thread> pool_threads;
  for (int t = 0; t < threads; ++t) pool_threads.emplace_back(work, t);
  for (auto& t : pool_threads) t.join();
  *allocs_out = allocs;
  return errors;
}
"""


def test_native_threads_stress(make_pool, tmp_path):
    src = tmp_path / "stress.cc"
    so = tmp_path / "libstress.so"
    src.write_text(_STRESS_DRIVER)
    res = subprocess.run(
        ["g++", "-std=c++17", "-O2", "-fPIC", "-shared", "-pthread", "-o", str(so), str(src)],
        capture_output=True, text=True,
    )
    assert res.returncode == 0, res.stderr
    driver = ctypes.CDLL(str(so))
    driver.stress.argtypes = [_vp] * 4 + [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_u64)]
    driver.stress.restype = _u64

    pool = make_pool(256 * MiB, 1 * MiB)
    lib = pool.lib
    addr = lambda fn: ctypes.cast(fn, _vp).value  # noqa: E731
    allocs = _u64(0)
    errors = driver.stress(
        pool.h, addr(lib.sntf_pool_alloc), addr(lib.sntf_pool_free),
        addr(lib.sntf_pool_allocated_size), 4, 100_000, ctypes.byref(allocs),
    )
    assert errors == 0, f"{errors} corrupted blocks / refused frees / failed allocations"
    s = pool.stats()
    assert allocs.value > 100_000
    assert s["num_allocs"] == allocs.value and s["num_frees"] == allocs.value, (s, allocs.value)
    assert s["active_allocs"] == 0 and s["bytes_in_use"] == 0, s
    assert pool.trim() == s["bytes_reserved"], "some region did not coalesce back to one block"


# --------------------------------------------------------------------------
# Global pool
# --------------------------------------------------------------------------


def test_global_pool_is_a_singleton(lib):
    g = lib.sntf_pool_global()
    assert g and g == lib.sntf_pool_global()
    pool = Pool(lib, g)
    p, msg = pool.alloc(1000)
    assert p is not None, msg
    assert pool.size(p) == 1024
    lib.sntf_pool_delete(g)  # must be ignored: the global pool is never destroyed
    assert pool.size(p) == 1024
    assert pool.free(p) == 1


_GLOBAL_PROBE = r"""
import ctypes, json, sys
try:
    lib = ctypes.CDLL(sys.argv[1])
except OSError:  # the packaged op library needs TensorFlow loaded first
    import tensorflow  # noqa: F401
    lib = ctypes.CDLL(sys.argv[1])
lib.sntf_pool_global.restype = ctypes.c_void_p
lib.sntf_pool_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
out = (ctypes.c_uint64 * 12)()
lib.sntf_pool_stats(lib.sntf_pool_global(), out, 12)
print(json.dumps({"limit": out[4]}))
"""


def _probe_global(lib_path, env_value):
    env = dict(os.environ)
    env.pop("SNTF_HOST_POOL_LIMIT", None)
    if env_value is not None:
        env["SNTF_HOST_POOL_LIMIT"] = env_value
    res = subprocess.run(
        [sys.executable, "-c", _GLOBAL_PROBE, lib_path],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])["limit"], res.stderr


def test_global_pool_limit_from_environment(lib_path):
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    limit, stderr = _probe_global(lib_path, None)
    assert limit == phys, f"default limit {limit} != physical memory {phys}"
    assert "SNTF_HOST_POOL_LIMIT" not in stderr

    limit, stderr = _probe_global(lib_path, "123456789")
    assert limit == 123456789
    assert "SNTF_HOST_POOL_LIMIT" not in stderr

    for bad in ("12GB", "-1", "1e9", "99999999999999999999999"):
        limit, stderr = _probe_global(lib_path, bad)
        assert limit == phys, f"malformed {bad!r} changed the limit to {limit}"
        warnings = [l for l in stderr.splitlines() if "SNTF_HOST_POOL_LIMIT" in l]
        assert len(warnings) == 1 and bad in warnings[0], stderr


def test_pin_hooks_pin_every_region_and_unpin_before_unmapping(make_pool, lib):
    """The page-locking logic of GPU machines (cudaHostRegister), run on CPU
    with recording hooks: every region is pinned once, also those mapped
    before the hooks were installed, and unpinned before it is unmapped."""
    pinned, unpinned = {}, []

    def pin(base, size):
        pinned[base] = size
        return 0

    def unpin(base):
        unpinned.append(base)

    pin_fn, unpin_fn = PIN_FN(pin), UNPIN_FN(unpin)
    pool = make_pool(64 * MiB, initial=1 * MiB)
    first, _ = pool.alloc(512 * KiB)                 # one region, before hooks
    lib.sntf_pool_set_pin_hooks(pool.h, ctypes.cast(pin_fn, ctypes.c_void_p),
                                ctypes.cast(unpin_fn, ctypes.c_void_p))
    assert len(pinned) == 1
    second, _ = pool.alloc(3 * MiB)                  # a new region, pinned on map
    stats = pool.stats()
    assert stats["pinned_regions"] == stats["num_regions"] == len(pinned) == 2
    assert stats["pinned_bytes"] == stats["bytes_reserved"] == sum(pinned.values())
    assert stats["pin_failures"] == 0
    pool.free(second)
    pool.free(first)
    released = pool.trim()
    assert released == sum(pinned.values())
    assert sorted(unpinned) == sorted(pinned)
    stats = pool.stats()
    assert stats["pinned_regions"] == 0 and stats["pinned_bytes"] == 0


def test_a_refused_pin_leaves_the_region_pageable(make_pool, lib):
    # A failure inside a ctypes callback cannot fail the test (ctypes prints
    # and swallows exceptions there): record the calls and assert after.
    unpinned = []
    refuse = PIN_FN(lambda base, size: 1)          # e.g. cudaErrorMemoryAllocation
    never = UNPIN_FN(lambda base: unpinned.append(base))
    pool = make_pool(64 * MiB)
    lib.sntf_pool_set_pin_hooks(pool.h, ctypes.cast(refuse, ctypes.c_void_p),
                                ctypes.cast(never, ctypes.c_void_p))
    p, err = pool.alloc(2 * MiB)
    assert p and not err
    fill(p, 2 * MiB, 7)
    assert intact(p, 2 * MiB, 7)
    stats = pool.stats()
    assert stats["pin_failures"] == 1 and stats["pinned_regions"] == 0
    assert not pool.pinned(p)
    pool.free(p)
    assert pool.trim() > 0
    assert unpinned == [], "unpinned a region that was never pinned"


# --------------------------------------------------------------------------
# Pinning: the cap, the lock, the CUDA runtime lookup
# --------------------------------------------------------------------------


def _recording_hooks():
    """Pin hooks that accept every region and record (base, size) / base."""
    pinned, unpinned = {}, []

    def pin(base, size):
        pinned[base] = size
        return 0

    return pinned, unpinned, PIN_FN(pin), UNPIN_FN(unpinned.append)


def _install(lib, pool, pin_fn, unpin_fn):
    lib.sntf_pool_set_pin_hooks(pool.h, ctypes.cast(pin_fn, ctypes.c_void_p),
                                ctypes.cast(unpin_fn, ctypes.c_void_p))


def test_pinning_stops_at_the_pin_cap(make_pool, lib):
    """Finding 1: regions beyond the pinned-bytes cap stay pageable, and each
    block says which kind of region it lies in."""
    pinned, unpinned, pin_fn, unpin_fn = _recording_hooks()
    pool = make_pool(64 * MiB, initial=1 * MiB)
    pool.set_pin_limit(3 * MiB)
    _install(lib, pool, pin_fn, unpin_fn)
    a, _ = pool.alloc(1 * MiB)          # region 1 MiB: pinned (1 of 3)
    b, _ = pool.alloc(2 * MiB)          # region 2 MiB: pinned (3 of 3)
    c, _ = pool.alloc(4 * MiB)          # region 4 MiB: over the cap
    stats = pool.stats()
    assert stats["num_regions"] == 3 and stats["pin_limit_bytes"] == 3 * MiB
    assert stats["pinned_regions"] == 2 and stats["pinned_bytes"] == 3 * MiB
    assert stats["pin_over_limit"] == 1 and stats["pin_failures"] == 0
    assert sorted(pinned.values()) == [1 * MiB, 2 * MiB]
    assert pool.pinned(a) and pool.pinned(b) and not pool.pinned(c)
    for p in (a, b, c):
        pool.free(p)
    assert pool.trim() == 7 * MiB
    assert sorted(unpinned) == sorted(pinned), "unpinned other than the pinned regions"
    assert pool.stats()["pinned_bytes"] == 0


def test_late_hooks_pin_existing_regions_within_the_cap(make_pool, lib):
    pinned, unpinned, pin_fn, unpin_fn = _recording_hooks()
    pool = make_pool(64 * MiB, initial=1 * MiB)
    pool.set_pin_limit(1536 * KiB)
    a, _ = pool.alloc(1 * MiB)
    b, _ = pool.alloc(2 * MiB)
    _install(lib, pool, pin_fn, unpin_fn)   # 1 MiB fits the cap, 2 MiB not
    stats = pool.stats()
    assert list(pinned.values()) == [1 * MiB]
    assert stats["pinned_bytes"] == 1 * MiB and stats["pin_over_limit"] == 1
    assert pool.pinned(a) and not pool.pinned(b)
    pool.free(a)
    pool.free(b)
    pool.trim()
    assert list(unpinned) == list(pinned)


def test_pinning_runs_outside_the_pool_mutex(make_pool, lib):
    """While a new region is being pinned (slow: every page is locked), other
    threads keep allocating from the regions the pool has."""
    events = []
    armed, pin_started, other_done = threading.Event(), threading.Event(), threading.Event()

    def slow_pin(base, size):
        if not armed.is_set():
            return 0
        pin_started.set()
        # If pinning held the pool's mutex, the other thread could not
        # allocate and this wait would time out.
        events.append("other allocated" if other_done.wait(20) else "timed out")
        return 0

    pin_fn, unpin_fn = PIN_FN(slow_pin), UNPIN_FN(lambda base: None)
    pool = make_pool(64 * MiB, initial=1 * MiB)
    first, _ = pool.alloc(256 * KiB)        # a region exists before the hooks
    _install(lib, pool, pin_fn, unpin_fn)   # pins it at once
    armed.set()

    def other():
        pin_started.wait(20)
        p, msg = pool.alloc(1000)           # fits in the first region
        events.append("ok" if p else msg)
        other_done.set()

    thread = threading.Thread(target=other)
    thread.start()
    grown, msg = pool.alloc(2 * MiB)        # maps and pins a new region
    thread.join(30)
    assert grown, msg
    assert "other allocated" in events and "ok" in events, events
    assert "timed out" not in events
    assert pool.stats()["pinned_regions"] == 2


_CUDART_PROBE = r"""
import ctypes, json, sys
try:
    lib = ctypes.CDLL(sys.argv[1])
except OSError:  # the op library may need TensorFlow loaded first
    import tensorflow  # noqa: F401
    lib = ctypes.CDLL(sys.argv[1])
stub = ctypes.CDLL(sys.argv[2]) if len(sys.argv) > 2 else None
vp, u64 = ctypes.c_void_p, ctypes.c_uint64
lib.sntf_pool_new.restype = vp
lib.sntf_pool_new.argtypes = [u64, u64]
lib.sntf_pool_alloc.restype = vp
lib.sntf_pool_alloc.argtypes = [vp, u64, ctypes.c_char_p, u64]
lib.sntf_pool_free.argtypes = [vp, vp]
lib.sntf_pool_trim.argtypes = [vp]
lib.sntf_pool_trim.restype = u64
lib.sntf_pool_block_pinned.argtypes = [vp, vp]
lib.sntf_pool_pin_with_cuda_runtime.argtypes = [vp, ctypes.c_char_p, u64]
pool = lib.sntf_pool_new(1 << 30, 1 << 20)
err = ctypes.create_string_buffer(512)
ok = lib.sntf_pool_pin_with_cuda_runtime(pool, err, 512)
result = {"ok": ok, "error": err.value.decode()}
def counts():
    out = (u64 * 7)()
    stub.stub_cudart_counts(out, 7)
    return dict(zip(["registers", "refusals", "unregisters", "last_error_reads",
                     "registered_bytes", "flags", "pending_error"], out))
if ok:
    small = lib.sntf_pool_alloc(pool, 1 << 20, None, 0)    # 1 MiB region
    result["after_small"] = counts()
    big = lib.sntf_pool_alloc(pool, 8 << 20, None, 0)      # refused above 4 MiB
    result["after_big"] = counts()
    result["pinned"] = [lib.sntf_pool_block_pinned(pool, small),
                        lib.sntf_pool_block_pinned(pool, big)]
    lib.sntf_pool_free(pool, small)
    lib.sntf_pool_free(pool, big)
    result["trimmed"] = lib.sntf_pool_trim(pool)
    result["after_trim"] = counts()
print("RESULT " + json.dumps(result))
"""


def _run_cudart_probe(lib_path, args, env_extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **env_extra)
    res = subprocess.run([sys.executable, "-c", _CUDART_PROBE, lib_path, *args],
                         capture_output=True, text=True, env=env, timeout=300)
    lines = [l for l in res.stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, f"rc={res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_cuda_runtime_lookup_pins_and_clears_refusals(lib_path, tmp_path):
    """Finding 7, the CUDA-runtime path, with a stub runtime found through
    SNTF_CUDART_LIBRARY: portable registration per region, a refusal leaves
    the region pageable and the runtime's last error cleared, and trimming
    unregisters exactly the registered regions."""
    stub = tmp_path / "libcudart_stub.so"
    res = subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-o",
                          str(stub), str(STUB_CUDART_SOURCE)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    r = _run_cudart_probe(lib_path, [str(stub)], {
        "SNTF_CUDART_LIBRARY": str(stub), "STUB_CUDART_REFUSE_ABOVE": str(4 * MiB)})
    assert r["ok"] == 1, r["error"]
    small = r["after_small"]
    assert small["registers"] == 1 and small["registered_bytes"] == 1 * MiB
    assert small["flags"] == 1, "registration must be cudaHostRegisterPortable"
    big = r["after_big"]
    assert big["refusals"] == 1 and big["registers"] == 1
    assert big["last_error_reads"] >= 1 and big["pending_error"] == 0, (
        "a refused cudaHostRegister must not leave the runtime's last error set")
    assert r["pinned"] == [1, 0]
    trimmed = r["after_trim"]
    assert trimmed["unregisters"] == 1 and trimmed["pending_error"] == 0
    assert r["trimmed"] == 1 * MiB + 8 * MiB


def test_cuda_runtime_lookup_reports_a_missing_runtime(lib_path, tmp_path):
    missing = tmp_path / "no_such_libcudart.so"
    r = _run_cudart_probe(lib_path, [], {"SNTF_CUDART_LIBRARY": str(missing)})
    assert r["ok"] == 0
    assert str(missing) in r["error"], r["error"]


_PIN_LIMIT_PROBE = r"""
import ctypes, json, sys
try:
    lib = ctypes.CDLL(sys.argv[1])
except OSError:  # the op library may need TensorFlow loaded first
    import tensorflow  # noqa: F401
    lib = ctypes.CDLL(sys.argv[1])
lib.sntf_pool_global.restype = ctypes.c_void_p
lib.sntf_pool_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
out = (ctypes.c_uint64 * 17)()
lib.sntf_pool_stats(lib.sntf_pool_global(), out, 17)
print(json.dumps({"pin_limit": out[15]}))
"""


def test_global_pool_pin_limit_default_and_environment(lib_path):
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    default = min(64 * GiB, phys // 4)
    for value, want in ((None, default), (str(5 * MiB), 5 * MiB), ("5MB", default)):
        env = dict(os.environ)
        env.pop("SNTF_HOST_PIN_LIMIT", None)
        if value is not None:
            env["SNTF_HOST_PIN_LIMIT"] = value
        res = subprocess.run([sys.executable, "-c", _PIN_LIMIT_PROBE, lib_path],
                             capture_output=True, text=True, env=env, timeout=120)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout.strip().splitlines()[-1])["pin_limit"] == want
