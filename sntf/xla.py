"""Keeps Keras from XLA-compiling train steps behind sntf's back (DESIGN fact 11).

Keras 3 resolves `compile(jit_compile="auto")` to True whenever a non-CPU
device exists. An XLA-compiled train step is one cluster that Grappler's
plugins never see, so on a GPU machine sntf would silently do nothing. While
sntf is enabled with a rewriting policy, a compile() whose "auto" would mean
XLA gets jit_compile=False instead, and the log says so once. An explicit
`jit_compile=True` is honoured: that graph is XLA's, and the pass reports it
as skipped.
"""

from __future__ import annotations

import functools
import logging
import threading

from sntf import config

logger = logging.getLogger("sntf")
_lock = threading.Lock()
_installed = False
_warned = False

MESSAGE = ("sntf: Keras compile(jit_compile='auto') resolved to False while sntf is "
           "enabled (policy %r): an XLA-compiled train step is one cluster that "
           "sntf cannot rewrite. Pass jit_compile=True to compile(), or call "
           "sntf.disable() first, to keep XLA for a model.")


def install_keras_guard() -> bool:
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
