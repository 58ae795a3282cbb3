"""Thin Python wrappers of sntf's ops (swap, tensor cache, diagnostics)."""

from __future__ import annotations

import operator
from typing import Any

from sntf.runtime import native as _native

# The attributes' ranges: TensorFlow stores budget and headroom as int64 and
# the kernel reads uses as an int. A value outside them failed only after the
# op had run, leaving a cache entry (and its device or pool bytes) that no
# ticket refers to, so they are checked before anything is created.
_INT64_MAX = 2**63 - 1
_INT32_MAX = 2**31 - 1


def _int_argument(name: str, value: Any, low: int, high: int, forms: str) -> int:
    """`value` as an int in [low, high]; a ValueError naming it otherwise."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"sntf.ops.cache_out: {name} must be {forms}, got "
                         f"{value!r} ({type(value).__name__})") from None
    if not low <= number <= high:
        raise ValueError(f"sntf.ops.cache_out: {name} must be {forms}, got {value!r}")
    return number


def swap_out(x, name: str = None):
    """Copies `x` into a host buffer of sntf's pool.

    Args:
      x: a tensor of any numeric, bool or complex dtype (any shape, empty or 0-d).
      name: optional op name.

    Returns:
      The parked tensor: same dtype and shape, held in host memory.
    """
    return _native.load_ops().sn_swap_out(x, name=name)


def swap_in(parked, name: str = None):
    """Copies a parked tensor back into device memory.

    Args:
      parked: the output of swap_out.
      name: optional op name.

    Returns:
      A device tensor equal to the tensor that was swapped out.
    """
    return _native.load_ops().sn_swap_in(parked, name=name)


def cache_out(x, budget: int, uses: int = 1, name: str = None,
              headroom: int = -1):
    """Hands `x` to the tensor cache (kept on the device while it fits `budget`).

    Args:
      x: a tensor of any numeric, bool or complex dtype.
      budget: device bytes: x stays on the device while the allocator's live
        bytes plus x fit, and the device's cached tensors plus x fit
        `headroom`; otherwise older cached tensors are evicted first and x
        is parked in the host pool if it still does not fit.
      uses: how many cache_in calls will read the ticket.
      name: optional op name.
      headroom: cap on the bytes of the device's cached tensors (-1: none).

    Returns:
      An int64 scalar ticket. The cache entry lives no longer than the
      ticket: once every tensor holding it is gone (all reads done, or the
      step failed), the entry and its buffers are released.

    Raises:
      ValueError: budget, uses or headroom is not an int in its range, or
        name is not a string; nothing is created then.
    """
    budget = _int_argument("budget", budget, 0, _INT64_MAX,
                           "an int number of bytes from 0 to 2**63 - 1")
    uses = _int_argument("uses", uses, 1, _INT32_MAX, "an int from 1 to 2**31 - 1")
    headroom = _int_argument("headroom", headroom, -1, _INT64_MAX,
                             "an int number of bytes from 0 to 2**63 - 1, "
                             "or -1 for no cap")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"sntf.ops.cache_out: name must be a string or None, got "
                         f"{name!r}")
    return _native.load_ops().sn_cache_out(x, budget=budget, uses=uses,
                                           headroom=headroom, name=name)


def cache_in(ticket, dtype, shape=None, name: str = None):
    """Returns the tensor behind a cache_out ticket (the device copy if cached).

    Args:
      ticket: the output of cache_out: an int64 scalar, read on the device
        that issued it.
      dtype: the tensor's dtype.
      shape: its static shape (for shape inference; None: unknown).
      name: optional op name.

    Returns:
      The tensor, equal to the one given to cache_out.

    Raises:
      tf.errors.InvalidArgumentError: the ticket is not a scalar, is unknown
        or already read `uses` times, was issued on another device, or holds
        another dtype or shape (at run time; a ticket of known non-scalar
        shape is rejected when the graph is built).
    """
    import tensorflow as tf

    return _native.load_ops().sn_cache_in(
        ticket, T=tf.as_dtype(dtype), shape=tf.TensorShape(shape), name=name)


def memory_type(x, name: str = None):
    """The memory type of a tensor's buffer, as TensorFlow's copies see it.

    A diagnostic: TensorFlow stages device copies from and to pageable host
    buffers through pinned ones, and copies pinned ones directly.

    Args:
      x: a tensor (CPU-placed) of any dtype swap_out accepts.
      name: optional op name.

    Returns:
      A string scalar: "unknown", "device", "host_pageable" or "host_pinned".
    """
    return _native.load_ops().sn_tensor_memory_type(x, name=name)
