"""Tells the pass the batch Keras fit() is about to train on.

Keras traces its train step with the batch dimension unknown (the last
partial batch would otherwise trace a second graph), so a training graph's
activation sizes are symbolic in the batch. Right before the first step,
fit() builds an epoch iterator over its data adapter; that adapter knows the
batch of arrays, and a tf.data input built with batch() holds it as a
constant. This hook records it (per replica, under a distribution strategy)
in sntf.config, where the pass reads it for graphs whose batch is unknown
and no batch_size option was given. A later partial batch runs the same
graph, whose plan then only over-estimates memory.
"""

from __future__ import annotations

import functools
import threading
from typing import Optional

from sntf import config

_lock = threading.Lock()
_installed = False


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


def install() -> bool:
    """Wraps Keras' TensorFlow epoch iterator once per process.

    Returns:
      Whether the hook is in place (False when Keras' TensorFlow trainer is
      not importable).
    """
    global _installed
    with _lock:
        if _installed:
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
            config.set_runtime_batch(batch)

        trainer.TFEpochIterator.__init__ = __init__
        _installed = True
        return True
