"""Where sntf would do nothing without a word: each cause detected, and
said once through the `sntf` logger with the fix.

The causes, and where each is noticed:

  after_fit       a Keras model ran fit() before sntf was enabled: its train
                  step exists and is reused (the Keras fit hook)
  rebuilt_needed  a train step built under other sntf settings keeps them
                  (the Keras fit hook)
  keras_jit       compile(jit_compile=True): XLA compiles the step, which no
                  graph plugin sees (the Keras fit hook)
  function_jit    tf.function(jit_compile=True) (the tf.function hook)
  grouped_conv    Keras runs a grouped convolution as an XLA function, so the
                  step calls XLA code (the Keras fit hook)
  xla_graph       a training graph skipped as XLA-compiled, for any other
                  reason (the plugin, from the report)
  optimizer       tf.config.optimizer options that keep plugins from running
                  (enable(), every fit(), enabled())
  eager           run_eagerly=True, or a GradientTape outside tf.function
                  (the Keras fit hook; the GradientTape hook)
  pool_fallback   the host pool could not hold swapped tensors (after fit(),
                  stats(), each graph pass, exit)

Each hook only reads, then calls what it wraps: sntf never changes what
TensorFlow or Keras do here.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import sys
import threading
import weakref
from typing import Any, Optional

from sntf import config

logger = logging.getLogger("sntf")

MESSAGES = {
    "after_fit": (
        "model {model!r} ran fit() before sntf was enabled: its train step was "
        "built then and TensorFlow reuses it, so sntf never sees it and this "
        "fit() runs unchanged. Fix: call sntf.enable() before the first fit(), "
        "or call model.compile(...) again after enabling, which rebuilds the "
        "train step."),
    "rebuilt_needed": (
        "model {model!r} keeps the train step built under earlier sntf settings "
        "({built}); the current ones ({now}) apply to graphs built from now on. "
        "Fix: call model.compile(...) again to rebuild the train step."),
    "keras_jit": (
        "model {model!r} is compiled with jit_compile=True: XLA compiles its "
        "train step into one cluster that Grappler, and so sntf, never sees; "
        "sntf leaves it unchanged and no report appears. Fix: "
        "model.compile(..., jit_compile=False), or leave jit_compile at its "
        "default 'auto', which sntf resolves to False."),
    "function_jit": (
        "tf.function {function!r} is created with jit_compile=True: XLA compiles "
        "it into one cluster that sntf never sees; sntf leaves it unchanged and "
        "no report appears. Fix: drop jit_compile=True from that tf.function."),
    "grouped_conv": (
        "model {model!r} has a convolution with groups > 1, which Keras runs on "
        "TensorFlow as an XLA function (tf.function(jit_compile=True)); sntf "
        "leaves a training step that calls XLA code unchanged. Fix: use groups=1 "
        "convolutions (for example one Conv2D per group on tf.split inputs, "
        "then Concatenate)."),
    "xla_graph": (
        "training graph {graph!r} calls XLA-compiled code (a function with "
        "jit_compile=True), so sntf leaves the whole step unchanged. Fix: drop "
        "jit_compile=True from the functions the training step calls."),
    "optimizer": (
        "TensorFlow's optimizer options keep graph plugins from running "
        "({options}), so sntf sees no graph, changes nothing, and "
        "sntf.enabled() returns False. Fix: remove that setting from "
        "tf.config.optimizer.set_experimental_options(...)."),
    "eager_keras": (
        "model {model!r} is compiled with run_eagerly=True: its train step runs "
        "op by op, with no graph for sntf to rewrite. Fix: compile it without "
        "run_eagerly=True."),
    "eager_tape": (
        "gradients are computed eagerly (tf.GradientTape outside a tf.function): "
        "there is no graph for sntf to rewrite. Fix: decorate the training step "
        "(the function that runs the tape and applies the gradients) with "
        "@tf.function."),
    "pool_fallback": (
        "the host pool (host pool limit {limit} bytes) could not hold {count} "
        "swapped tensor(s) so far: they stayed in ordinary memory and training "
        "goes on, saving less memory than planned. Fix: raise the limit with "
        "sntf.enable(host_pool_limit=...) or SNTF_HOST_POOL_LIMIT."),
}
# Causes that share one warning: an eager Keras step also runs a GradientTape
# eagerly, and a grouped convolution or a jit tf.function explains the XLA
# graph the plugin then sees.
SAME_AS = {"eager_keras": "eager", "eager_tape": "eager"}
EXPLAINS_XLA_GRAPH = ("grouped_conv", "function_jit")

_lock = threading.Lock()
_warned: set = set()
_installed = False
# Keras train functions built while sntf was enabled -> the settings then.
_built: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def warn_once(cause: str, **fields: Any) -> bool:
    """Logs the warning of a cause, the first time only.

    Args:
      cause: a key of MESSAGES.
      **fields: the message's fields.

    Returns:
      Whether it was logged now.
    """
    key = SAME_AS.get(cause, cause)
    with _lock:
        if key in _warned:
            return False
        _warned.add(key)
    logger.warning(MESSAGES[cause].format(**fields))
    return True


def warned() -> frozenset:
    """The causes warned about so far in this process (their shared keys)."""
    with _lock:
        return frozenset(_warned)


def _settings(state: config.State) -> str:
    budget = "no budget" if state.budget is None else f"budget {state.budget.describe()}"
    return f"policy {state.policy!r}, {budget}"


# ---------------------------------------------------------------- optimizer
def check_optimizer_options() -> bool:
    """Warns when TensorFlow's optimizer options keep plugins from running.

    Returns:
      Whether plugins can run.
    """
    from sntf.runtime import environment

    blockers = environment.optimizer_blockers()
    if blockers and config.current().enabled:
        warn_once("optimizer", options=", ".join(blockers))
    return not blockers


# ---------------------------------------------------------------- Keras fit
def _name(model) -> str:
    return str(getattr(model, "name", None) or type(model).__name__)


def check_fit(model) -> None:
    """Before a Keras fit(): warns about each reason it would run untouched.

    Args:
      model: the Keras model about to be trained.
    """
    state = config.current()
    if not state.enabled:
        return
    check_optimizer_options()
    if getattr(model, "run_eagerly", False):
        warn_once("eager_keras", model=_name(model))
        return
    try:
        jit = bool(model.jit_compile)
    except Exception:  # noqa: BLE001 - a hint; Keras internals vary
        jit = False
    if jit:
        warn_once("keras_jit", model=_name(model))
        return
    if _grouped_convolution(model):
        warn_once("grouped_conv", model=_name(model))
    function = getattr(model, "train_function", None)
    if function is None:
        return
    try:
        built = _built.get(function)
    except TypeError:  # not weakly referenceable: nothing to compare with
        return
    if built is None:
        warn_once("after_fit", model=_name(model))
    elif state.policy != "off" and (built.policy, built.budget, built.options) != (
            state.policy, state.budget, state.options):
        warn_once("rebuilt_needed", model=_name(model), built=_settings(built),
                  now=_settings(state))


def _grouped_convolution(model) -> bool:
    """Whether a layer of the model is a convolution with groups > 1."""
    try:
        layers = model._flatten_layers(include_self=False)
        return any((getattr(layer, "groups", 1) or 1) > 1 for layer in layers)
    except Exception:  # noqa: BLE001 - a hint; Keras internals vary
        return False


def note_fit(model) -> None:
    """After a Keras fit(): records the settings its train step was built
    under, and reports host-pool fallbacks.

    Args:
      model: the Keras model just trained.
    """
    state = config.current()
    function = getattr(model, "train_function", None)
    if state.enabled and function is not None:
        try:
            _built.setdefault(function, state)
        except TypeError:
            pass
    check_pool_fallbacks()


# ---------------------------------------------------------------- tf.function
def _jit_function(func) -> None:
    if not config.current().enabled:
        return
    module = getattr(func, "__module__", "") or ""
    if module.split(".")[0] == "keras":
        # Keras' own XLA functions (its jit_compile, a grouped convolution's
        # tf.function, created on every call whether used or not) are
        # named by check_fit from the model, and by check_report.
        return
    warn_once("function_jit", function=getattr(func, "__qualname__", None) or repr(func))


def _wrap_function(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def function(*args, **kwargs):
        result = original(*args, **kwargs)
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return result
        if not (bound.get("jit_compile") or bound.get("experimental_compile")):
            return result
        func = bound.get("func")
        if func is not None:
            _jit_function(func)
            return result
        decorator = result

        @functools.wraps(decorator)
        def decorate(inner):
            decorated = decorator(inner)
            _jit_function(inner)
            return decorated

        return decorate

    function.__sntf_wrapped__ = original
    return function


def _wrap_gradient(original):
    from tensorflow.python.eager import context

    @functools.wraps(original)
    def gradient(self, *args, **kwargs):
        if config.current().enabled and context.executing_eagerly():
            warn_once("eager_tape")
        return original(self, *args, **kwargs)

    gradient.__sntf_wrapped__ = original
    return gradient


def install() -> None:
    """Installs the tf.function and GradientTape hooks and the exit check,
    once per process (TensorFlow is imported by now)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    tf = sys.modules["tensorflow"]
    from tensorflow.python.eager import backprop

    if not hasattr(tf.function, "__sntf_wrapped__"):
        tf.function = _wrap_function(tf.function)
    tape = backprop.GradientTape
    if not hasattr(tape.gradient, "__sntf_wrapped__"):
        tape.gradient = _wrap_gradient(tape.gradient)
    atexit.register(check_pool_fallbacks)


# ---------------------------------------------------------------- reports
def check_report(report: dict) -> None:
    """After a graph pass: warns when a training graph was skipped as
    XLA-compiled (unless its cause was named already).

    Args:
      report: the pass's report of one graph.
    """
    if (report.get("training") and report.get("action") == "skipped"
            and report.get("skip") in ("xla_compiled", "xla_auto_jit")
            and not any(cause in _warned for cause in EXPLAINS_XLA_GRAPH)):
        warn_once("xla_graph", graph=report.get("graph"))


# ---------------------------------------------------------------- host pool
def check_pool_fallbacks(swap: Optional[dict] = None, pool: Optional[dict] = None) -> None:
    """Warns once when swapped tensors fell back to ordinary memory.

    The swap kernels count them; their own message goes to TensorFlow's C++
    log, which TF_CPP_MIN_LOG_LEVEL can hide, so Python says it too.

    Args:
      swap: sntf.stats()["swap"] if already read, else read here.
      pool: sntf.stats()["pool"] if already read, else read here.
    """
    if "pool_fallback" in _warned:
        return
    native = sys.modules.get("sntf.runtime.native")
    if native is None or not native.ops_loaded():
        return  # the op library is not loaded: no swap ran
    try:
        swap = swap if swap is not None else native.swap_stats()
        count = swap.get("pool_fallbacks", 0)
        if count:
            pool = pool if pool is not None else native.pool_stats()
            warn_once("pool_fallback", limit=pool.get("limit_bytes"), count=count)
    except Exception:  # noqa: BLE001 - statistics are a hint; never fail here
        pass
