"""What the graph pass reads of the process, gathered for it.

The pass itself reads nothing global and changes nothing outside the graph
(sntf.passes); this module is where TensorFlow's runtime, the environment
variables and the CUDA runtime are read on its behalf. It sets no
environment variable: the pass runs on Grappler's thread, where a write to
os.environ races with other threads' getenv.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Optional

logger = logging.getLogger("sntf")

# Batch size of the input Keras fit() is about to feed (set by the Keras
# hook before the first step); the pass uses it where a graph's batch
# dimension is unknown and no batch_size option was given.
_runtime_batch: list = [None]
_gpu_total: list = []
# Device ("CPU:0", "GPU:1") -> its TensorFlow allocator's bytes_limit, read by
# record_device_limits().
_device_limits: dict = {}
_memory_growth: dict = {}   # GPU name -> whether memory growth is on
# Devices whose growing allocator sntf had take the rest of its limit as one
# region (record_device_limits) -> the bytes of that region.
_one_region: dict = {}
_limits_read: list = [False]
_unread_warned: set = set()   # GPUs whose budget resolved without their limit
_settings_lock = threading.Lock()
# Name of the Keras model whose fit() is running (set by the Keras hook):
# the plugin names that model's training graphs after it.
_fit_model: list = [None]

HOST_POOL_LIMIT_ENV = "SNTF_HOST_POOL_LIMIT"


def set_runtime_batch(batch: Optional[int]) -> None:
    """Records the batch of the input about to be trained on."""
    _runtime_batch[0] = batch


def runtime_batch() -> Optional[int]:
    """The batch recorded by set_runtime_batch (None if unknown)."""
    return _runtime_batch[0]


def set_fit_model(name: Optional[str]) -> None:
    """Records the name of the Keras model whose fit() runs now (or None)."""
    _fit_model[0] = name


def fit_model() -> Optional[str]:
    """The name recorded by set_fit_model (None outside a Keras fit())."""
    return _fit_model[0]


def optimizer_blockers() -> list[str]:
    """TensorFlow optimizer options in force that keep graph plugins from
    running, as "name=value" strings; empty when TensorFlow is not imported.

    Returns:
      e.g. ["use_plugin_optimizers=False"].
    """
    import sys

    if "tensorflow" not in sys.modules:
        return []
    try:
        from tensorflow.python.eager import context

        options = context.context().get_optimizer_experimental_options()
    except Exception:  # noqa: BLE001 - a private API; no answer means no blocker
        return []
    blockers = []
    if options.get("disable_meta_optimizer") is True:
        blockers.append("disable_meta_optimizer=True")
    if options.get("use_plugin_optimizers") is False:
        blockers.append("use_plugin_optimizers=False")
    return blockers


def normalize_host_pool_limit(limit: int) -> None:
    """Writes SNTF_HOST_POOL_LIMIT back as a plain byte count.

    The native pool reads the variable when it is first used and accepts
    only digits; sntf accepts what the host_pool_limit option does ("8GiB"),
    so the validated value goes back in the form the pool reads.

    Args:
      limit: the limit in bytes, already validated.
    """
    os.environ[HOST_POOL_LIMIT_ENV] = str(int(limit))


def onednn_enabled() -> bool:
    """Whether TensorFlow's oneDNN graph rewrites run (TF_ENABLE_ONEDNN_OPTS;
    on by default on x86 Linux). Unknown counts as on: the swap planner
    then keeps oneDNN's forward/gradient pairs intact."""
    try:
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except Exception:  # noqa: BLE001 - a private API; the safe answer
        return True


def device_memory_bytes(device: str = "CPU:0") -> int:
    """The memory a device's TensorFlow allocator may hand out, which budget
    fractions and "auto" resolve against.

    Args:
      device: "CPU:0", "GPU:1" and the like (a graph's device).

    Returns:
      The allocator's bytes_limit where record_device_limits() has read it:
      on a GPU what its BFC allocator may hand out, cut by memory_limit or a
      logical-device configuration; on CPU the limit of the BFC allocator
      under TF_CPU_BFC_MEM_LIMIT_IN_MB. Else, for a GPU, cudaMemGetInfo's
      total of the current GPU, with a warning once per device: it ignores
      memory_limit and the device's index, and asking creates a CUDA
      context on the calling thread. Physical RAM for the CPU or when the
      CUDA runtime cannot be asked.
    """
    short = _short_device(device)
    with _settings_lock:
        limit = _device_limits.get(short)
    if limit:
        return limit
    if short.startswith("GPU"):
        total = _gpu_memory_bytes()
        if total:
            _warn_unread_limit(short, total)
            return total
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _warn_unread_limit(device: str, total: int) -> None:
    """Says once per device that its budget resolves against the CUDA
    runtime's total, and how to have the allocator's limit read instead."""
    with _settings_lock:
        if device in _unread_warned:
            return
        _unread_warned.add(device)
    logger.warning(
        "budget fractions and 'auto' on %s resolve against the CUDA runtime's "
        "total of the current GPU (%d MiB), not TensorFlow's allocator limit for "
        "%s: that limit is read by the first training step sntf sees, or by "
        "sntf.enable() once TensorFlow's devices exist. Call sntf.enable() after "
        "building the model, or give the budget in bytes.", device, total >> 20, device)


def allocator_limit(device: str) -> Optional[int]:
    """The byte limit record_device_limits() read for a device, or None."""
    with _settings_lock:
        return _device_limits.get(_short_device(device))


def allocator_grows(device: str) -> bool:
    """Whether the device's BFC allocator grows by regions (allow_growth).

    The CPU's always does, unless sntf had it take the rest of its limit as
    one region (record_device_limits). A GPU's takes its whole limit as one
    region at the first allocation unless memory growth is on:
    TF_FORCE_GPU_ALLOW_GROWTH, or tf.config.experimental.set_memory_growth
    (read at fit()).
    """
    short = _short_device(device)
    if not short.startswith("GPU"):
        with _settings_lock:
            return short not in _one_region
    if os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH", "").lower() == "true":
        return True
    with _settings_lock:
        return _memory_growth.get(short, False)


def record_device_limits_if_initialized() -> None:
    """record_device_limits(), but only where TensorFlow's devices exist
    already (enable() must not be what creates them)."""
    try:
        from tensorflow.python.eager import context

        if context.context()._context_handle is None:  # noqa: SLF001
            return
    except Exception:  # noqa: BLE001 - a private API; then wait for fit()
        return
    record_device_limits()


def _short_device(device: str) -> str:
    """'/job:localhost/replica:0/task:0/device:GPU:1' -> 'GPU:1'."""
    parts = device.upper().split("DEVICE:")[-1].lstrip("/").split(":")
    if len(parts) >= 2 and parts[-1].isdigit():
        return f"{parts[-2]}:{parts[-1]}"
    return parts[0] + ":0"


def record_device_limits() -> dict:
    """Reads the byte limit of every local device's allocator, once devices
    exist (sntf.runtime.limit_hooks calls it before a training loop's first
    step, the Keras fit hook before fit()): reading it runs a
    small op, which would initialize TensorFlow's devices if enable() did it
    (and so forbid the user's own tf.config device settings after it), and
    must not run inside Grappler's graph pass.

    Returns:
      device ("CPU:0", "GPU:0", ...) -> bytes, for the devices that report
      a limit.
    """
    from sntf.runtime import native

    with _settings_lock:
        if _limits_read[0]:
            return dict(_device_limits)
    try:
        import tensorflow as tf

        # The CPU's BFC allocator has a bytes_limit even without one asked
        # for (the host's RAM): only a limit the user set binds there.
        names = (["CPU:0"] if os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB") else []) + [
            f"GPU:{i}" for i, _ in enumerate(tf.config.list_logical_devices("GPU"))]
        found = {}
        for name in names:
            limit = native.device_bytes_limit(name)
            if limit:
                found[name] = int(limit)
        growth = {f"GPU:{i}": bool(tf.config.experimental.get_memory_growth(gpu))
                  for i, gpu in enumerate(tf.config.list_physical_devices("GPU"))}
    except Exception as e:  # noqa: BLE001 - fall back to the device totals
        logger.debug("allocator limits unavailable: %s", e)
        return {}
    region = None
    if "CPU:0" in found and _one_region_asked():
        region = _reserve_cpu_region()
    with _settings_lock:
        _device_limits.update(found)
        _memory_growth.update(growth)
        if region:
            _one_region["CPU:0"] = region
        _limits_read[0] = True
    return found


def _one_region_asked() -> bool:
    """The one_region option of the switch state now (enable()'s)."""
    from sntf import config

    return config.current().options.one_region


def _reserve_cpu_region() -> Optional[int]:
    """Has the CPU's allocator, under the limit the user set, take the rest
    of it as one region before any step runs (native.reserve_cpu_region).

    It grows by regions of doubling size, the last capped by what the limit
    leaves, and a chunk never spans two: a step whose peak is well under the
    limit can still find no region for its largest request (a convolution's
    scratch). One region is what a GPU's allocator takes without memory
    growth, and what the device-limit model then plans for. Nothing is taken
    where more is left than the host's memory: such a limit binds nothing.

    Returns:
      The bytes of the region taken, or None where none was.
    """
    from sntf.runtime import native

    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        region = native.reserve_cpu_region(host)
    except Exception as e:  # noqa: BLE001 - then the allocator grows, as without sntf
        logger.debug("the CPU allocator's limit was not taken as one region: %s", e)
        return None
    if region is None:
        logger.debug("the CPU allocator could not take the rest of its limit as one region")
    return region or None


def _gpu_memory_bytes() -> Optional[int]:
    """cudaMemGetInfo's total for the current GPU, asked once per process
    (never run here: the development machines have no GPU)."""
    if not _gpu_total:
        import ctypes

        total = None
        for name in ("libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
            try:
                runtime = ctypes.CDLL(name)
            except OSError:
                continue
            free, size = ctypes.c_size_t(), ctypes.c_size_t()
            if runtime.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(size)) == 0:
                total = size.value
            break
        if total is None:
            logger.warning(
                "could not ask the CUDA runtime for the GPU's memory; "
                "fraction and 'auto' budgets use the host's RAM instead")
        _gpu_total.append(total)
    return _gpu_total[0]


def device_in_use(device: str) -> Optional[int]:
    """Bytes a device's allocator has in use now; None where it keeps no
    statistics (TensorFlow's default CPU allocator) or the device is absent."""
    try:
        from tensorflow.python.eager import context

        return int(context.context().get_memory_info(device)["current"])
    except Exception:  # noqa: BLE001 - statistics are optional
        return None


def inter_op_threads() -> Optional[int]:
    """The inter-op threads the user set (tf.config.threading), or None for
    TensorFlow's default pool (or when it cannot be read)."""
    try:
        import tensorflow as tf

        return tf.config.threading.get_inter_op_parallelism_threads() or None
    except Exception:  # noqa: BLE001 - a setting read for a heuristic only
        return None


def op_determinism() -> bool:
    """Whether TensorFlow's op determinism is on
    (tf.config.experimental.enable_op_determinism or TF_DETERMINISTIC_OPS)."""
    try:
        # Public to set, not to read: enable_op_determinism's own module.
        from tensorflow.python.framework import config as tf_config

        return bool(tf_config.is_op_determinism_enabled())
    except Exception:  # noqa: BLE001 - unreadable: the pass assumes it off
        return False


def current():
    """The Environment the pass runs in, in this process now."""
    from sntf.passes import Environment

    from sntf.runtime import xla

    return Environment(threads=os.cpu_count() or 1, onednn=onednn_enabled(),
                       runtime_batch=runtime_batch(),
                       device_memory=device_memory_bytes, in_use=device_in_use,
                       allocator_limit=allocator_limit,
                       allocator_grows=allocator_grows,
                       xla_auto_jit=xla.auto_clustering_on(),
                       inter_op_threads=inter_op_threads(),
                       op_determinism=op_determinism())
