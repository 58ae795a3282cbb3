"""sntf: Superneurons-style memory management for TensorFlow 2.

    import sntf
    sntf.enable(budget="6GB")       # policy "auto"; or SNTF_BUDGET=6GB
    model.fit(...)                  # unchanged
    sntf.reports()                  # what the pass did to each graph

See README.md for what each policy does.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sntf import config
from sntf.config import Budget, parse_budget, parse_policy

__version__ = "0.1.0"
__all__ = ["enable", "disable", "enabled", "reports", "stats", "Budget",
           "parse_budget", "parse_policy", "__version__"]

logger = logging.getLogger("sntf")
_enable_lock = threading.Lock()


def enable(policy: str = "auto", budget: config.Budgetish = None,
           **options: Any) -> None:
    """Turns sntf on for every graph TensorFlow builds from now on.

    Loads the op library and registers the Grappler plugin (once per
    process); calling it again only changes the switch.

    Args:
      policy: "off" (plugin loaded, graphs untouched), "recompute", "swap",
        "swap+recompute" (recompute cheap activations, swap the rest to the
        host pool) or "auto": with a budget, the least predicted extra time
        per buffer (keep, recompute or swap) that fits it; without one, as
        low as "swap+recompute" goes.
      budget: device-memory budget: bytes, a string such as "12GB" or
        "512MiB", a fraction of device memory in (0, 1], "auto" (the GPU's
        memory on a GPU, none on CPU), or None.
      **options: see sntf.config.Options (identity_rewrite, batch_size,
        host_pool_limit, max_reports, keep_graphs, recompute_mode,
        swap_min_bytes, link_bandwidth, budget_behaviour).

    Raises:
      ValueError: a malformed policy, budget or option value.
      TypeError: an unknown option.
      RuntimeError: the plugin could not be registered (another graph plugin).
    """
    name = config.parse_policy(policy)
    parsed_budget = config.parse_budget(budget)
    parsed_options = config.parse_options(options)
    if parsed_budget is not None and parsed_budget.bytes is not None:
        from sntf.runtime import environment

        memory = environment.device_memory_bytes()
        if parsed_budget.bytes > memory:
            logger.warning("sntf: budget %d bytes exceeds device memory (%d bytes);"
                           " it can never bind", parsed_budget.bytes, memory)
    with _enable_lock:
        from sntf.runtime import native, plugin

        native.load_ops()
        plugin.ensure_loaded()
        if parsed_options.host_pool_limit is not None:
            native.set_host_pool_limit(parsed_options.host_pool_limit)
        config.set_state(config.State(enabled=True, policy=name,
                                      budget=parsed_budget, options=parsed_options))
        if name != "off":
            from sntf.runtime import keras_hooks

            keras_hooks.install_jit_guard()
            keras_hooks.install_batch_hook()


def disable() -> None:
    """Turns sntf off: graphs built from now on are handed back untouched.

    The plugin stays registered (TensorFlow cannot unregister it); graphs
    already rewritten keep running as rewritten.
    """
    with _enable_lock:
        config.set_state(config.State(enabled=False))


def enabled() -> bool:
    """Whether the pass currently acts on graphs."""
    return config.current().enabled


def reports() -> list[dict]:
    """One dict per graph Grappler handed to sntf, oldest first.

    Keys include graph, training, nodes, action, reason, policy,
    predicted_peak_bytes, planned_peak_bytes, lower_bound_bytes,
    pass_seconds, swapped, recomputed (None where not yet known), and
    invocations (how often Grappler handed this graph over).
    """
    from sntf.runtime import plugin

    return plugin.reports()


def stats() -> dict:
    """Runtime statistics of the host tensor pool and the swap kernels.

    Returns:
      {"pool": {...bytes_in_use, peak_bytes_in_use, bytes_reserved,
      limit_bytes, num_allocs, largest_free_block, fragmentation...},
      "swap": {swap_out_ops, swap_in_ops, bytes_to_host, bytes_to_device,
      failed_ops, cache_hits, cache_misses, cache_evictions, cache_no_stats,
      pool_fallbacks, cache_entries, cached_device_bytes}, "plugin": {calls,
      passthrough, native_errors, ...}}. A hit is a swap-in served by the
      tensor cache's device copy (no transfer); a miss copied from the host
      pool. A pool fallback is a tensor the pool could not hold (its limit
      is below the tensor, or it is full): it stayed in ordinary memory.
    """
    from sntf.runtime import native

    swap = native.swap_stats()
    swap.update(native.cache_stats())
    result = {"pool": native.pool_stats(), "swap": swap}
    try:
        from sntf.runtime import plugin

        counters = dict(plugin._shim().counters())
        counters["registered"] = plugin.registered_path()
        result["plugin"] = counters
    except ImportError:
        result["plugin"] = None
    return result


def _enable_from_environment() -> None:
    """Honours SNTF_POLICY / SNTF_BUDGET at import, with no code change."""
    settings = config.from_environment()
    if settings is not None:
        policy, budget = settings
        enable(policy=policy, budget=None if budget is None else budget.to_user())


_enable_from_environment()
