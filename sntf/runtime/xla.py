"""Whether TensorFlow's XLA auto-clustering may compile the graphs sntf sees.

Auto-clustering (`TF_XLA_FLAGS=--tf_xla_auto_jit=1|2`, with
`--tf_xla_cpu_global_jit` on CPU, or `tf.config.optimizer.set_jit(True)`)
groups ops into XLA clusters after Grappler has run, so after sntf's pass.
A rewritten graph clusters differently from TensorFlow's own (a recomputed
clone or a swap op splits a cluster), and XLA then fuses, and rounds,
differently: the pass leaves such graphs alone.
"""

from __future__ import annotations

import os
import re

# --tf_xla_auto_jit values that turn auto-clustering on.
_ON = re.compile(r"--tf_xla_auto_jit=(1|2|single-gpu\(1\)|single-gpu\(2\)|fusible)\b")


def auto_clustering_on(environ=os.environ) -> bool:
    """Whether XLA auto-clustering is on for this process.

    Args:
      environ: the environment (TF_XLA_FLAGS).

    Returns:
      True when TF_XLA_FLAGS or tf.config.optimizer.get_jit() turns it on.
    """
    if _ON.search(environ.get("TF_XLA_FLAGS", "")):
        return True
    try:
        import tensorflow as tf

        return bool(tf.config.optimizer.get_jit())
    except Exception:  # noqa: BLE001 - the setting is optional; off is the default
        return False
