"""Locates and loads sntf's compiled libraries.

`_sntf_ops*.so` holds the ops (SnSwapOut/SnSwapIn, SnCacheOut/SnCacheIn,
SnDeviceBytesLimit, SnTensorMemoryType, SnReserveRegion) and the host tensor
pool; it is loaded once with tf.load_op_library (which registers the ops) and
opened a second time with ctypes for the pool's C API (dlopen returns the same
handle, so both views share one pool). `_plugin*.so` is the Grappler plugin
shim.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from typing import Any, Optional

# The compiled libraries sit in the package root (setup.py builds sntf._sntf_ops
# and sntf._plugin).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_lock = threading.Lock()
# The loaded libraries, kept in a mutable object rather than rebound globals:
# AutoGraph converts functions called from a tf.function (ops.swap_out, then
# load_ops) and runs the converted code against a copy of the module's
# globals, where rebinding a global would be lost.
_loaded: dict = {"module": None, "cdll": None}

POOL_STAT_NAMES = ("bytes_in_use", "peak_bytes_in_use", "bytes_reserved",
                   "peak_bytes_reserved", "limit_bytes", "num_allocs",
                   "num_frees", "active_allocs", "num_failed_allocs",
                   "largest_free_block", "free_bytes", "num_regions",
                   "pinned_regions", "pinned_bytes", "pin_failures",
                   "pin_limit_bytes", "pin_over_limit")
SWAP_STAT_NAMES = ("swap_out_ops", "swap_in_ops", "bytes_to_host",
                   "bytes_to_device", "failed_ops", "cache_hits", "cache_misses",
                   "cache_evictions", "cache_no_stats", "pool_fallbacks",
                   "host_memory_passthrough")
TEST_COPIER_STAT_NAMES = ("issued", "completed", "failed", "in_flight",
                          "max_in_flight")
# Kernel label of the test-only CPU kernels that copy like a device: on
# another thread, after a delay (see set_async_test_copier).
ASYNC_TEST_LABEL = "sntf_async_test"


# Page-locking hooks of the host pool (int pin(void*, uint64), void unpin(void*)).
PIN_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64)
UNPIN_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _find(stem: str) -> str:
    matches = sorted(glob.glob(os.path.join(_PACKAGE_DIR, stem + "*.so")))
    if not matches:
        raise ImportError(
            f"sntf: compiled library {stem}*.so not found in {_PACKAGE_DIR}; "
            "install sntf with 'pip install --no-build-isolation -e .' so that "
            "it is built against the installed TensorFlow")
    return matches[0]


def ops_library_path() -> str:
    """Path of the compiled op library (swap ops + host pool)."""
    return _find("_sntf_ops")


def plugin_library_path() -> str:
    """Path of the compiled Grappler plugin shim."""
    return _find("_plugin")


def _declare(lib: ctypes.CDLL) -> None:
    """Declares the C API's signatures, so ctypes converts arguments exactly."""
    u64, vp, ptr64 = ctypes.c_uint64, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)
    i64 = ctypes.c_int64
    signatures = {
        "sntf_pool_new": (vp, [u64, u64]),
        "sntf_pool_delete": (None, [vp]),
        "sntf_pool_global": (vp, []),
        "sntf_pool_alloc": (vp, [vp, u64, ctypes.c_char_p, u64]),
        "sntf_pool_free": (ctypes.c_int, [vp, vp]),
        "sntf_pool_allocated_size": (u64, [vp, vp]),
        "sntf_pool_set_limit": (None, [vp, u64]),
        "sntf_pool_trim": (u64, [vp]),
        "sntf_pool_reset_peak": (None, [vp]),
        "sntf_pool_stats": (ctypes.c_int, [vp, ptr64, ctypes.c_int]),
        "sntf_pool_fragmentation": (ctypes.c_double, [vp]),
        "sntf_pool_set_pin_hooks": (None, [vp, PIN_FN, UNPIN_FN]),
        "sntf_pool_set_pin_limit": (None, [vp, u64]),
        "sntf_pool_block_pinned": (ctypes.c_int, [vp, vp]),
        "sntf_pool_pin_with_cuda_runtime": (ctypes.c_int, [vp, ctypes.c_char_p, u64]),
        "sntf_test_copier_configure": (None, [i64, i64]),
        "sntf_test_copier_stats": (ctypes.c_int, [ptr64, ctypes.c_int]),
        "sntf_gpu_pinning": (ctypes.c_int, []),
        "sntf_swap_stats": (ctypes.c_int, [ptr64, ctypes.c_int]),
        "sntf_cache_clear": (ctypes.c_int64, []),
        "sntf_cache_gauges": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def load_ops() -> Any:
    """Loads the op library once; returns the tf.load_op_library module."""
    with _lock:
        if _loaded["module"] is None:
            import tensorflow as tf

            path = ops_library_path()
            module = tf.load_op_library(path)
            if not hasattr(module, "sn_swap_out"):
                # TensorFlow wraps only the ops registered during its own
                # dlopen; a plain dlopen (ctypes) before it hides them.
                raise ImportError(
                    f"sntf: {path} was opened before TensorFlow loaded it as an "
                    "op library, so its ops have no Python wrappers; call "
                    "sntf.runtime.native.load_ops() before opening it with ctypes")
            lib = ctypes.CDLL(path)
            _declare(lib)
            _loaded["cdll"] = lib
            _loaded["module"] = module
    return _loaded["module"]


def ops_loaded() -> bool:
    """Whether the op library is loaded in this process (no swap kernel can
    have run before it is)."""
    return _loaded["module"] is not None


def ops_cdll() -> ctypes.CDLL:
    """The op library opened with ctypes (loaded through load_ops first)."""
    load_ops()
    return _loaded["cdll"]


def pool_stats(pool: Optional[int] = None) -> dict:
    """Statistics of a host pool (the global one by default)."""
    lib = ops_cdll()
    handle = pool if pool is not None else lib.sntf_pool_global()
    values = (ctypes.c_uint64 * len(POOL_STAT_NAMES))()
    n = lib.sntf_pool_stats(handle, values, len(POOL_STAT_NAMES))
    stats = {name: int(values[i]) for i, name in enumerate(POOL_STAT_NAMES[:n])}
    stats["fragmentation"] = float(lib.sntf_pool_fragmentation(handle))
    return stats


def swap_stats() -> dict:
    """Counters of the swap kernels in this process."""
    lib = ops_cdll()
    values = (ctypes.c_uint64 * len(SWAP_STAT_NAMES))()
    n = lib.sntf_swap_stats(values, len(SWAP_STAT_NAMES))
    return {name: int(values[i]) for i, name in enumerate(SWAP_STAT_NAMES[:n])}


def cache_stats() -> dict:
    """The tensor cache's gauges: live entries and bytes kept on a device."""
    lib = ops_cdll()
    values = (ctypes.c_int64 * 2)()
    lib.sntf_cache_gauges(values, 2)
    return {"cache_entries": int(values[0]), "cached_device_bytes": int(values[1])}


def clear_cache() -> int:
    """Drops every tensor-cache entry (after an aborted step); returns how many."""
    return int(ops_cdll().sntf_cache_clear())


def set_host_pool_limit(limit_bytes: int) -> None:
    """Sets the byte limit of the global host pool."""
    lib = ops_cdll()
    lib.sntf_pool_set_limit(lib.sntf_pool_global(), int(limit_bytes))


def physical_memory_bytes() -> int:
    """The machine's physical memory, as the host pool's default limit
    counts it (tf_ops/host_pool.cc, PhysicalMemoryBytes)."""
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 2**64 - 1
    return pages * page if pages > 0 and page > 0 else 2**64 - 1


def apply_host_pool_limit(limit_bytes: Optional[int]) -> int:
    """Sets the global host pool's limit from the host_pool_limit option.

    Args:
      limit_bytes: the option's value; None means SNTF_HOST_POOL_LIMIT when
        it is set and well-formed, else the physical memory size (the
        pool's own default).

    Returns:
      The limit set, in bytes.
    """
    if limit_bytes is None:
        from sntf import config

        try:
            limit_bytes = config.host_pool_limit_from_environment()
        except ValueError:
            # Reported when sntf was imported; the pool ignores it too.
            limit_bytes = None
    if limit_bytes is None:
        limit_bytes = physical_memory_bytes()
    set_host_pool_limit(limit_bytes)
    return int(limit_bytes)


def set_host_pin_limit(limit_bytes: int) -> None:
    """Caps the bytes of the global host pool that may be page-locked.

    Regions mapped beyond the cap stay pageable (TensorFlow then stages their
    copies); lowering it unpins nothing already pinned.

    Args:
      limit_bytes: the cap in bytes (the default is min(64 GiB, a quarter of
        physical memory), or SNTF_HOST_PIN_LIMIT).
    """
    lib = ops_cdll()
    lib.sntf_pool_set_pin_limit(lib.sntf_pool_global(), int(limit_bytes))


def device_bytes_limit(device: str) -> Optional[int]:
    """The byte limit of a device's TensorFlow allocator.

    Reads Allocator::GetStats().bytes_limit of the allocator TensorFlow uses
    for `device`: on a GPU what its BFC allocator may hand out (after
    memory_limit or a logical-device configuration), on CPU the limit of the
    BFC allocator under TF_CPU_ALLOCATOR_USE_BFC=true with
    TF_CPU_BFC_MEM_LIMIT_IN_MB. tf.config.experimental.get_memory_info gives
    no limit, and device_lib.list_local_devices creates devices anew.

    It runs a small op eagerly on `device`, so call it outside Grappler's
    graph pass (e.g. when sntf is enabled) and keep the answer.

    Args:
      device: a device name such as "GPU:0", "/device:CPU:0" or
        "/job:localhost/replica:0/task:0/device:GPU:1".

    Returns:
      The limit in bytes; None when the device does not exist in this
      process or its allocator reports no limit.

    Raises:
      ValueError: `device` does not name a device type.
    """
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device) if isinstance(device, str) else None
    if spec is None or not spec.device_type:
        raise ValueError(f"device must name a device such as 'GPU:0' or "
                         f"'CPU:0', got {device!r}")
    wanted = (spec.device_type.upper(), spec.device_index or 0)
    module = load_ops()
    with tf.init_scope(), tf.device(f"/device:{wanted[0]}:{wanted[1]}"):
        limit = module.sn_device_bytes_limit()
    # Soft placement moves an op asked for an absent device elsewhere, so
    # trust only an answer from the device asked for.
    ran_on = tf.DeviceSpec.from_string(limit.device)
    if (ran_on.device_type, ran_on.device_index) != wanted:
        return None
    value = int(limit.numpy())
    return None if value < 0 else value


def reserve_cpu_region(most_bytes: int) -> Optional[int]:
    """Has the CPU's BFC allocator take what is left of its limit as one
    region (SnReserveRegion), so that no request that fits the limit finds
    every region too small.

    It runs a small op eagerly on the CPU, so call it outside Grappler's
    graph pass, and before the step it is for.

    Args:
      most_bytes: take nothing where more than this is left (the host's
        memory: a limit above it binds nothing).

    Returns:
      The bytes of the new region; 0 where the allocator keeps no limit or
      pool statistics (TensorFlow's default CPU allocator), nothing is left
      or more than most_bytes is; None where the allocation failed.
    """
    import tensorflow as tf

    module = load_ops()
    with tf.init_scope(), tf.device("/device:CPU:0"):
        reserved = int(module.sn_reserve_region(tf.constant(int(most_bytes), tf.int64)))
    return None if reserved < 0 else reserved


def set_async_test_copier(delay_seconds: float = 0.02, fail_next: int = 0) -> None:
    """Configures the copier of the "sntf_async_test" kernels (tests only).

    Args:
      delay_seconds: how long after issue each copy completes (copies issued
        from now on; they still complete in issue order).
      fail_next: how many of the next copies fail with an Internal error.
    """
    ops_cdll().sntf_test_copier_configure(int(delay_seconds * 1e6), int(fail_next))


def async_test_copier_stats() -> dict:
    """Counters of the test copier: issued, completed, failed, in_flight,
    max_in_flight (the most copies in flight at once)."""
    lib = ops_cdll()
    values = (ctypes.c_uint64 * len(TEST_COPIER_STAT_NAMES))()
    n = lib.sntf_test_copier_stats(values, len(TEST_COPIER_STAT_NAMES))
    return {name: int(values[i]) for i, name in enumerate(TEST_COPIER_STAT_NAMES[:n])}
