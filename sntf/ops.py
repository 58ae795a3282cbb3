"""Thin Python wrappers of the SnSwapOut / SnSwapIn ops."""

from __future__ import annotations

from sntf import _native


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
