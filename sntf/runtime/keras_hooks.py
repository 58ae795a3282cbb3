"""Hooks into Keras: no XLA behind sntf's back, the batch fit() feeds, and
a look at each fit() for the reasons sntf would leave it alone.

XLA. Keras 3 resolves `compile(jit_compile="auto")` to True whenever a non-CPU
device exists. An XLA-compiled train step is one cluster that Grappler's
plugins never see, so on a GPU machine sntf would silently do nothing. While
sntf is enabled with a rewriting policy, a compile() whose "auto" would mean
XLA gets jit_compile=False instead, and the log says so once. An explicit
`jit_compile=True` is honoured: that graph is XLA's, and the pass reports it
as skipped.

The batch. Keras traces its train step with the batch dimension unknown (the
last partial batch would otherwise trace a second graph), so a training
graph's activation sizes are symbolic in the batch. Right before the first
step, fit() builds an epoch iterator over its data adapter; that adapter
knows the batch of arrays, and a tf.data input built with batch() holds it
as a constant. A hook records it (per replica, under a distribution
strategy), where the pass reads it for graphs whose batch is unknown and no
batch_size option was given. A later partial batch runs the same graph,
whose plan then only over-estimates memory.

Each fit(). Before it, sntf.runtime.noops warns about what would make sntf
do nothing to it (a train step built before sntf was enabled, jit_compile,
run_eagerly); during it, the plugin names the training graphs after the
model; after it, host-pool fallbacks are reported.

The hooks are installed when Keras' trainer modules finish importing
(sntf.runtime.post_import): sntf may be enabled while Keras is still being
imported, and never imports Keras itself.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Optional

from sntf import config
from sntf.runtime import environment, noops, post_import

logger = logging.getLogger("sntf")
_lock = threading.Lock()
_installed = False
_batch_installed = False
_fit_installed = False
_warned = False

TRAINER_MODULE = "keras.src.trainers.trainer"
TF_TRAINER_MODULE = "keras.src.backend.tensorflow.trainer"

MESSAGE = ("Keras compile(jit_compile='auto') resolved to False while sntf is "
           "enabled (policy %r): an XLA-compiled train step is one cluster that "
           "sntf cannot rewrite. Pass jit_compile=True to compile(), or call "
           "sntf.disable() first, to keep XLA for a model.")


def install() -> None:
    """Installs every Keras hook once Keras' trainer modules are imported
    (now, if they are)."""
    post_import.when_imported(TRAINER_MODULE, lambda _module: install_jit_guard())
    post_import.when_imported(TF_TRAINER_MODULE, lambda _module: (
        install_batch_hook(), install_fit_hook()))


def install_fit_hook() -> bool:
    """Wraps Keras' TensorFlowTrainer.fit once per process.

    Returns:
      Whether Keras' TensorFlow trainer was found and is wrapped.
    """
    global _fit_installed
    with _lock:
        if _fit_installed:
            return True
        try:
            from keras.src.backend.tensorflow import trainer
        except ImportError:
            return False
        original = trainer.TensorFlowTrainer.fit

        @functools.wraps(original)
        def fit(self, *args, **kwargs):
            try:
                noops.check_fit(self)
                if config.current().enabled:
                    # Devices exist by now: budgets resolve against what
                    # their allocators may hand out.
                    environment.record_device_limits()
            except Exception:  # noqa: BLE001 - a warning must never break fit()
                pass
            outer = environment.fit_model()
            environment.set_fit_model(getattr(self, "name", None))
            try:
                return original(self, *args, **kwargs)
            finally:
                environment.set_fit_model(outer)
                try:
                    noops.note_fit(self)
                except Exception:  # noqa: BLE001
                    pass

        trainer.TensorFlowTrainer.fit = fit
        _fit_installed = True
        return True


def install_jit_guard() -> bool:
    """Wraps Keras' Trainer.compile once per process.

    Returns:
      Whether Keras' trainer was found and is guarded.
    """
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from keras.src.trainers import trainer
        except ImportError:
            return False
        original = trainer.Trainer.compile
        # jit_compile's position in compile(self, optimizer, loss, loss_weights,
        # metrics, weighted_metrics, run_eagerly, steps_per_execution, jit_compile)
        position = 7

        @functools.wraps(original)
        def compile(self, *args, **kwargs):
            jit = args[position] if len(args) > position else kwargs.get("jit_compile", "auto")
            run_eagerly = args[5] if len(args) > 5 else kwargs.get("run_eagerly", False)
            state = config.current()
            if (jit == "auto" and not run_eagerly and state.enabled
                    and state.policy != "off" and self._resolve_auto_jit_compile()):
                if len(args) > position:
                    args = args[:position] + (False,) + args[position + 1:]
                else:
                    kwargs["jit_compile"] = False
                _warn_once(state.policy)
            return original(self, *args, **kwargs)

        trainer.Trainer.compile = compile
        _installed = True
        return True


def _warn_once(policy: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(MESSAGE, policy)


def dataset_batch(dataset) -> Optional[int]:
    """The batch size a tf.data pipeline was batched with, if it is constant.

    Walks back through the pipeline's input datasets (map, prefetch, shuffle,
    cache...) to the first batch() whose batch_size is a constant.

    Args:
      dataset: a tf.data.Dataset (or None).

    Returns:
      The batch size, or None when it cannot be known before running.
    """
    import tensorflow as tf

    seen = 0
    while dataset is not None and seen < 64:
        size = getattr(dataset, "_batch_size", None)
        if size is not None:
            value = tf.get_static_value(size)
            return int(value) if value is not None and int(value) > 0 else None
        dataset = getattr(dataset, "_input_dataset", None)
        seen += 1
    return None


def adapter_batch(adapter, strategy=None) -> Optional[int]:
    """The per-replica batch a Keras data adapter will feed.

    Args:
      adapter: a keras.src.trainers.data_adapters DataAdapter.
      strategy: the tf.distribute strategy fit() runs under, or None.

    Returns:
      The batch each replica's train step sees, or None if unknown.
    """
    batch = None
    try:
        batch = adapter.batch_size
    except (AttributeError, NotImplementedError, TypeError):
        pass
    if batch is None:
        dataset = getattr(adapter, "_dataset", None)
        batch = dataset_batch(dataset)
    if batch is None:
        return None
    replicas = getattr(strategy, "num_replicas_in_sync", 1) or 1
    return max(1, int(batch) // int(replicas))


def install_batch_hook() -> bool:
    """Wraps Keras' TensorFlow epoch iterator once per process.

    Returns:
      Whether the hook is in place (False when Keras' TensorFlow trainer is
      not importable).
    """
    global _batch_installed
    with _lock:
        if _batch_installed:
            return True
        try:
            from keras.src.backend.tensorflow import trainer
        except ImportError:
            return False
        original = trainer.TFEpochIterator.__init__

        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            try:
                batch = adapter_batch(self.data_adapter,
                                      getattr(self, "_distribute_strategy", None))
            except Exception:  # noqa: BLE001 - a hint must never break fit()
                batch = None
            environment.set_runtime_batch(batch)

        trainer.TFEpochIterator.__init__ = __init__
        _batch_installed = True
        return True
