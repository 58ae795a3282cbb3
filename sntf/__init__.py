"""sntf: Superneurons-style memory management for TensorFlow 2.

    import sntf
    sntf.enable(budget="6GB")       # policy "auto"; or SNTF_BUDGET=6GB
    model.fit(...)                  # unchanged
    print(sntf.summary())           # one line per training graph

Without code changes: `SNTF_BUDGET=6GB python train.py` (the startup hook
installed with sntf), or `python -m sntf --budget 6GB train.py`. See
README.md and docs/reference.md.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

from sntf import config, ops
from sntf.config import Budget, parse_budget, parse_policy
from sntf.verify import verify, verify_graphs

__version__ = "0.1.0"
__all__ = ["enable", "disable", "enabled", "reports", "summary", "stats", "config",
           "ops", "Budget", "parse_budget", "parse_policy", "verify", "verify_graphs",
           "__version__"]

logger = logging.getLogger("sntf")
_enable_lock = threading.Lock()


def _validated(policy: Any, budget: Any, options: dict) -> config.State:
    """The State enable() would set, with every argument checked first.

    Imports nothing of TensorFlow's: the environment path calls it at
    interpreter startup.
    """
    from sntf.runtime import environment

    name = config.parse_policy(policy)
    memory = environment.device_memory_bytes()
    parsed_budget = config.parse_budget(budget, memory)
    parsed_options = config.parse_options(options)
    if parsed_budget is not None and parsed_budget.bytes is not None:
        if parsed_budget.bytes > memory:
            logger.warning("budget %s exceeds device memory (%d bytes); it can "
                           "never bind", parsed_budget.describe(), memory)
    return config.State(enabled=True, policy=name, budget=parsed_budget,
                        options=parsed_options)


def _activate(state: config.State) -> None:
    """The TensorFlow side of enabling: loads the ops, registers the plugin
    (once per process), sets the switch and installs the hooks that warn
    where sntf would do nothing. TensorFlow is imported by now."""
    from sntf.runtime import environment, keras_hooks, limit_hooks, native, noops, plugin

    with _enable_lock:
        native.load_ops()
        plugin.ensure_loaded()
        limit = state.options.host_pool_limit
        if limit is None:
            limit = config.host_pool_limit_from_environment()
        if limit is not None:
            native.set_host_pool_limit(limit)
        config.set_state(state)
        noops.install()
        keras_hooks.install()
        limit_hooks.install()
        environment.record_device_limits_if_initialized()
    noops.check_optimizer_options()


def enable(policy: str = "auto", budget: config.Budgetish = None,
           **options: Any) -> None:
    """Turns sntf on for every graph TensorFlow builds from now on.

    Loads the op library and registers the Grappler plugin (once per
    process); calling it again only changes the switch. Graphs TensorFlow
    built before (a Keras model's train step after its first fit()) are not
    built again: enable sntf first, or call model.compile() again.

    Args:
      policy: "off" (plugin loaded, graphs untouched), "recompute", "swap",
        "swap+recompute" (recompute cheap activations, swap the rest to the
        host pool) or "auto": with a budget, the least predicted extra time
        per buffer (keep, recompute or swap) that fits it; without one, as
        low as "swap+recompute" goes.
      budget: device-memory budget: bytes (at least 1 MiB; an int, or a
        float above 1), a string such as "12GB" or "512MiB", a fraction of
        device memory in (0, 1] (0.5 or "50%"), "auto" (the GPU's memory on
        a GPU, none on CPU), or None.
      **options: see sntf.config.Options (identity_rewrite, batch_size,
        host_pool_limit, max_reports, keep_graphs, recompute_mode,
        swap_min_bytes, link_bandwidth, budget_behaviour, budget_margin,
        min_gain, pin_order, exact_sums, progress, one_region).

    Raises:
      ValueError: a malformed policy, budget or option value.
      TypeError: an unknown option.
      RuntimeError: the plugin could not be registered (another graph plugin).
    """
    state = _validated(policy, budget, options)
    # TensorFlow first, outside every lock: its import runs the hooks that
    # wait for it (sntf.runtime.post_import), which may enable sntf too.
    import tensorflow  # noqa: F401

    _activate(state)


def _enable_when_tensorflow_loads(policy: Any, budget: Any, options: dict) -> None:
    """enable(), with the TensorFlow side deferred to TensorFlow's import.

    The switch is set now, so enabled() and sntf.config answer at once; the
    op library and the plugin load right after the script imports
    TensorFlow, which keeps the TF_* variables a script sets before that
    import in force. Used by SNTF_POLICY/SNTF_BUDGET and `python -m sntf`.

    Raises:
      ValueError, TypeError: as enable().
    """
    from sntf.runtime import post_import

    config.set_state(_validated(policy, budget, options))

    def activate(_module) -> None:
        state = config.current()
        if not state.enabled:
            return
        try:
            _activate(state)
        except Exception as e:  # noqa: BLE001 - never fail the user's import
            config.set_state(config.State(enabled=False))
            logger.error("could not enable sntf: %s: %s", type(e).__name__, e)

    post_import.when_imported("tensorflow", activate)


def disable() -> None:
    """Turns sntf off: graphs built from now on are handed back untouched.

    The plugin stays registered (TensorFlow cannot unregister it); graphs
    already rewritten keep running as rewritten.
    """
    with _enable_lock:
        config.set_state(config.State(enabled=False))


def enabled() -> bool:
    """Whether the pass acts on the graphs TensorFlow builds from now on.

    False while sntf is disabled, and also while TensorFlow's optimizer
    options keep plugins from running (use_plugin_optimizers=False or
    disable_meta_optimizer=True in tf.config.optimizer.set_experimental_options);
    a warning names the option.

    Returns:
      True when a graph built now would be handed to sntf's pass.
    """
    if not config.current().enabled:
        return False
    from sntf.runtime import environment

    return not environment.optimizer_blockers()


def reports() -> list[dict]:
    """One dict per graph Grappler handed to sntf, oldest first.

    Keys include graph, training, nodes, action, reason, policy,
    predicted_peak_bytes, planned_peak_bytes, lower_bound_bytes,
    budget_bytes, pass_seconds, swapped, recomputed (None where not yet
    known), and invocations (how often Grappler handed this graph over).
    docs/reference.md lists them all.
    """
    from sntf.runtime import plugin

    return plugin.reports()


def summary(all_graphs: bool = False) -> str:
    """What sntf did, one line per training graph, ready to print.

    Each line: the graph (e.g. "train step of 'wrn16_4'"), the action, the
    predicted and planned peak and the budget in MiB, how many tensors were
    swapped and recomputed, and a one-line reason. reports() keeps the full
    detail.

    Args:
      all_graphs: also list the graphs that are not training steps.

    Returns:
      The text, several lines (no trailing newline).
    """
    from sntf.runtime import plugin

    return plugin.summary(all_graphs=all_graphs)


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
      is below the tensor, or it is full): it stayed in ordinary memory,
      and a warning said so once.
    """
    from sntf.runtime import native, noops

    swap = native.swap_stats()
    swap.update(native.cache_stats())
    result = {"pool": native.pool_stats(), "swap": swap}
    noops.check_pool_fallbacks(swap, result["pool"])
    try:
        from sntf.runtime import plugin

        counters = dict(plugin._shim().counters())
        counters["registered"] = plugin.registered_path()
        result["plugin"] = counters
    except ImportError:
        result["plugin"] = None
    return result


def _enable_from_environment() -> Optional[config.State]:
    """Honours SNTF_POLICY / SNTF_BUDGET at import, with no code change, and
    checks SNTF_HOST_POOL_LIMIT with the host_pool_limit option's rules.

    Raises:
      ValueError: a malformed variable, named.
    """
    from sntf.runtime import environment

    limit = config.host_pool_limit_from_environment()
    if limit is not None:
        environment.normalize_host_pool_limit(limit)
    settings = config.from_environment(device_memory=environment.device_memory_bytes())
    if settings is None:
        return None
    policy, budget = settings
    _enable_when_tensorflow_loads(policy, None if budget is None else budget.to_user(), {})
    return config.current()


_enable_from_environment()
