"""sntf.verify: check, op by op, that sntf's rewrite of your training step
computes the same bits as TensorFlow's graph.

    import sntf
    result = sntf.verify(model, x, y, policy="swap")
    print(result)              # verdict, first differing op, its inputs' digests
    assert result.ok           # identical, or identical up to the order of sums

`verify` runs one training step of a compiled Keras model on one batch
under sntf (with the policy, budget and options given, the graphs kept),
takes the graph Grappler handed sntf and the graph sntf handed back, and
hands both to `verify_graphs`, which runs each in a Session of its own from
the same variable values and inputs and compares them bit for bit. The
model's variables are as before the call when it returns, and sntf's switch
is as the caller left it. docs/reference.md ("Checking the identity") says
what it compares, what it costs and where it cannot look.

The pure parts are in sntf.verify.core (which tensors correspond, their
order, the chunks) and sntf.verify.result (the result and its text); the
Sessions in sntf.verify.execute. Import them as
`from sntf.verify.core import ...`:
after `import sntf`, the attribute `sntf.verify` is this function, not
this package.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    from sntf.verify.result import VerifyResult

__all__ = ["verify", "verify_graphs", "VerifyResult", "InputDigest", "IDENTICAL",
           "IDENTICAL_UP_TO_SUM_ORDER", "DIFFERENT", "NONDETERMINISTIC",
           "DEFAULT_CHUNK_BYTES"]

# `import sntf` imports this package, also at interpreter start through the
# startup hook: numpy and the verifier's modules load on first use only.
DEFAULT_CHUNK_BYTES = 256 << 20
_LAZY = {"VerifyResult": "result", "InputDigest": "result", "IDENTICAL": "core",
         "IDENTICAL_UP_TO_SUM_ORDER": "core",
         "DIFFERENT": "core", "NONDETERMINISTIC": "core"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"sntf.verify.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'sntf.verify' has no attribute {name!r}")


def verify_graphs(original_graph_def: Any, rewritten_graph_def: Any, inputs: Any,
                  variable_names: Optional[dict] = None,
                  max_chunk_bytes: Union[int, str] = DEFAULT_CHUNK_BYTES,
                  check_repeat: bool = True) -> "VerifyResult":
    """Runs one step of two graphs from the same inputs and compares them bit
    for bit: sntf.verify.execute.verify_graphs, whose docstring gives the
    arguments, the result and the errors. This wrapper keeps `import sntf`
    from loading TensorFlow's Session machinery before it is used."""
    from sntf.verify import execute

    return execute.verify_graphs(original_graph_def, rewritten_graph_def, inputs,
                                 variable_names=variable_names,
                                 max_chunk_bytes=max_chunk_bytes, check_repeat=check_repeat)


_UNSET = object()


def verify(model: Any, x: Any, y: Any = None, sample_weight: Any = None,
           policy: Optional[str] = None, budget: Any = _UNSET,
           max_chunk_bytes: Union[int, str] = DEFAULT_CHUNK_BYTES,
           **options: Any) -> "VerifyResult":
    """Checks that sntf's rewrite of a Keras model's training step computes,
    on one batch, the same bits as TensorFlow's graph.

    Runs the model's train_step once as a tf.function with sntf on (the
    policy, budget and options given, keep_graphs on), so that Grappler
    hands the graph to sntf's pass; then runs the graph it handed over and
    the graph sntf handed back, each from the variables' values before that
    step, and compares every tensor both compute, each recomputed clone and
    swapped-in tensor against its source, the step's outputs, and every
    variable after the update. The model's variables (weights, optimizer
    slots, metrics, seed generators) are restored afterwards, and sntf's
    switch is put back as it was.

    Args:
      model: a compiled keras.Model (with an optimizer), already built.
      x, y, sample_weight: one batch, as model.train_on_batch takes it.
      policy: the sntf policy to check ("recompute", "swap",
        "swap+recompute", "auto", "off"); None: the policy in force, or
        "auto" while sntf is off.
      budget: as sntf.enable's; not given: the budget in force (none while
        sntf is off).
      max_chunk_bytes: the most bytes of tensors one Session run fetches
        from one graph (bytes or a size string), on top of a step's memory.
      **options: sntf options (sntf.enable's); not given: those in force.

    Returns:
      A VerifyResult: `.verdict`, `.ok` (the first two of "identical",
      "identical_up_to_sum_order", "different", "nondeterministic"),
      `.first_op` and its inputs' digests; `str()` is the report.

    Raises:
      ValueError: a model that is not a compiled, built Keras model; a bad
        policy, budget, option or max_chunk_bytes; a step that captures a
        resource that is not a variable.
      TypeError: an unknown option.
      RuntimeError: no training graph reached sntf's pass (the reports'
        reasons are given).
    """
    import sntf
    from sntf import config, sizes

    keras = _check_model(model)
    sizes.parse_size(max_chunk_bytes, "max_chunk_bytes")
    saved = config.current()
    policy, budget, merged = _settings(saved, policy, budget, options)
    # Every argument is checked before anything runs.
    sntf._validated(policy, budget, merged)
    import tensorflow as tf

    data = tf.nest.map_structure(tf.convert_to_tensor, _batch(x, y, sample_weight))
    optimizer = model.optimizer
    if not getattr(optimizer, "built", True):
        optimizer.build(model.trainable_variables)
    step = tf.function(model.train_step)
    concrete = step.get_concrete_function(data)
    handles = _captures(concrete, model, keras)
    # reports() hands out copies; the GraphDefs in them are the pass' own
    # objects, so a graph's identity tells a new report from an old one.
    before = _seen(sntf.reports())
    try:
        sntf.enable(policy=policy, budget=budget, **merged)
        concrete(data)
    finally:
        config.set_state(saved)
        _restore(handles)
    report = _training_report(sntf.reports(), before)
    inputs, labels = _step_inputs(concrete, tf.nest.flatten(data), handles)
    result = verify_graphs(report["original_graph"], report["rewritten_graph"], inputs,
                           variable_names=labels, max_chunk_bytes=max_chunk_bytes)
    notes = result.notes
    if report.get("action") != "rewritten":
        notes += (f"sntf handed this graph back {report.get('action')}: "
                  f"{report.get('reason')}",)
    return dataclasses.replace(result, graph=f"train step of {model.name!r}",
                               policy=report.get("policy") or policy,
                               action=report.get("action") or "", notes=notes)


def _batch(x: Any, y: Any, sample_weight: Any) -> tuple:
    """The batch as train_step takes it: (x,), (x, y) or (x, y, sample_weight)."""
    if y is None and sample_weight is None:
        return (x,)
    return (x, y) if sample_weight is None else (x, y, sample_weight)


def _step_inputs(concrete: Any, tensors: list, handles: list) -> tuple[dict, dict]:
    """(_Arg index -> value, _Arg index -> variable name): the batch's
    tensors first, then each captured variable's value before the step."""
    n_data = len(concrete.inputs) - len(concrete.captured_inputs)
    inputs = {k: t.numpy() for k, t in enumerate(tensors)}
    labels = {}
    for k, capture in enumerate(handles):
        inputs[n_data + k] = capture.value
        if capture.name:
            labels[n_data + k] = capture.name
    return inputs, labels


def _check_model(model: Any):
    """The keras module, once `model` is known to be a compiled, built model."""
    import keras

    if not isinstance(model, keras.Model):
        raise ValueError(f"sntf.verify: model must be a compiled keras.Model, got "
                         f"{type(model).__name__}")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise ValueError(f"sntf.verify: model {model.name!r} is not compiled; call "
                         "model.compile(optimizer=..., loss=...) first")
    if not model.built:
        raise ValueError(f"sntf.verify: model {model.name!r} is not built; build it "
                         "(keras.Input, model.build(shape), or one call on a batch) first")
    return keras


def _settings(saved, policy: Optional[str], budget: Any, options: dict) -> tuple:
    """(policy, budget, options) to verify under: those given, else those in
    force, else sntf.enable's defaults; keep_graphs always on."""
    if policy is None:
        policy = saved.policy if saved.enabled else "auto"
    if budget is _UNSET:
        budget = saved.budget.to_user() if saved.enabled and saved.budget else None
    merged = dataclasses.asdict(saved.options) if saved.enabled else {}
    merged.update(options)
    merged["keep_graphs"] = True
    return policy, budget, merged


@dataclasses.dataclass
class _Capture:
    """One captured input of the step: its handle, value before the step,
    and a name for the report."""

    handle: Any
    value: Any
    name: str
    variable: Any


def _captures(concrete, model, keras) -> list:
    """The step's captured inputs with their values now, in order.

    Raises:
      ValueError: a captured resource that is not a variable (a lookup
        table, an iterator): its state cannot be read and restored.
    """
    import tensorflow as tf

    known = {}
    for v in concrete.variables:
        known[id(v.handle)] = (v, v.name)
    # Keras' own names (paths) where its variables are the captured ones.
    pool = list(model.variables) + list(getattr(model.optimizer, "variables", []))
    for v in pool:
        inner = getattr(v, "value", None)
        handle = getattr(inner, "handle", None)
        if handle is not None and id(handle) in known:
            known[id(handle)] = (known[id(handle)][0], getattr(v, "path", None) or v.name)
    out = []
    for t in concrete.captured_inputs:
        if t.dtype == tf.resource:
            if id(t) not in known:
                raise ValueError("sntf.verify: the train step captures a resource that "
                                 f"is not a variable ({t!r}); only variables' values can "
                                 "be read and restored")
            variable, name = known[id(t)]
            out.append(_Capture(t, variable.numpy(), name, variable))
        else:
            out.append(_Capture(t, t.numpy(), "", None))
    return out


def _restore(captures: list) -> None:
    """Puts every captured variable back to its value before the step."""
    for capture in captures:
        if capture.variable is not None:
            capture.variable.assign(capture.value)


def _seen(reports: list) -> dict:
    """id of each kept original graph -> how often Grappler handed it over."""
    return {id(r["original_graph"]): r.get("invocations") or 0
            for r in reports if r.get("original_graph") is not None}


def _training_report(reports: list, before: dict) -> dict:
    """The report of the training graph the step just handed sntf: a report
    with a graph not seen before, or (a graph TensorFlow handed over again
    merges into its earlier report) one handed over more often than before.

    Raises:
      RuntimeError: there is none; the reports' reasons are given.
    """
    new = [r for r in reports if r.get("original_graph") is not None
           and (id(r["original_graph"]) not in before
                or (r.get("invocations") or 0) > before[id(r["original_graph"])])]
    training = [r for r in new if r.get("training")]
    if not training:
        latest = reports[-len(new) - 3:] if reports else []
        reasons = "; ".join(f"{r.get('graph')}: {r.get('action')}: {r.get('reason')}"
                            for r in latest) or "no graph reached sntf's pass"
        raise RuntimeError("sntf.verify: no training graph reached sntf's pass, so there "
                           f"is no rewrite to check (latest reports: {reasons})")
    return training[-1]
