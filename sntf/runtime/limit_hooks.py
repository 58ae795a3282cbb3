"""The device's allocator limit, read before any training loop's first step.

A graph on a device whose allocator has a hard limit (a GPU's memory, the
CPU's under TF_CPU_BFC_MEM_LIMIT_IN_MB) is planned to fit that limit
(sntf.planner.device_limit). The pass cannot read it: reading it runs an op,
and the pass runs inside Grappler while TensorFlow instantiates a function.
sntf.enable() reads it where TensorFlow's devices exist already, and Keras'
fit() before its first step; a step built and run any other way
(`train_on_batch`, `evaluate`, a custom `tf.function` with a
`GradientTape`) would reach the pass with no limit known.

Every such step is a `tf.function` called eagerly, and its first call is
what hands its graph to Grappler. So `tf.function`'s call is wrapped, once
per process: while sntf is enabled, the first eager call reads the limits
(sntf.runtime.environment.record_device_limits) before the function runs.
After that the wrapper only checks a flag. Calls made while a function is
being traced are not eager and read nothing (their outer call did).
"""

from __future__ import annotations

import functools
import logging
import threading

from sntf import config
from sntf.runtime import environment, post_import

logger = logging.getLogger("sntf")
FUNCTION_MODULE = "tensorflow.python.eager.polymorphic_function.polymorphic_function"

_lock = threading.Lock()
_installed = False
_read = [False]           # one attempt per process, successful or not
_reading = threading.local()


def install() -> None:
    """Wraps tf.function's call once TensorFlow's function module is
    imported (now, if it is)."""
    post_import.when_imported(FUNCTION_MODULE, _wrap)


def limits_read() -> bool:
    """Whether the first eager call while enabled has read the limits."""
    return _read[0]


def _wrap(module) -> None:
    global _installed
    with _lock:
        if _installed:
            return
        original = module.Function.__call__

        @functools.wraps(original)
        def __call__(self, *args, **kwds):
            if not _read[0]:
                _read_limits()
            return original(self, *args, **kwds)

        module.Function.__call__ = __call__
        _installed = True


def _read_limits() -> None:
    """Reads the device limits on the first eager call while sntf is
    enabled; never raises (a limit not read leaves plans unbound, as
    before)."""
    if getattr(_reading, "active", False):
        return
    _reading.active = True
    try:
        if not config.current().enabled or _read[0]:
            return
        from tensorflow.python.eager import context

        if not context.executing_eagerly():
            return
        with _lock:
            if _read[0]:
                return
            _read[0] = True
        environment.record_device_limits()
    except Exception as e:  # noqa: BLE001 - a training step must never fail here
        logger.debug("device limits not read before a function call: %s", e)
    finally:
        _reading.active = False
