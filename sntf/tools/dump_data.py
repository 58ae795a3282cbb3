"""The batch tools/sntf_dump trains on: the model file's make_data(n), or
random inputs and targets made from the model's shapes and its loss."""

from __future__ import annotations

from sntf.tools.dump_output import one_line


class DumpError(Exception):
    """An input problem: reported as one line, exit status 2."""


def _shapes(shape) -> list:
    """A Keras input/output shape as a list of tuples (one per tensor)."""
    if isinstance(shape, dict):
        return [tuple(s) for s in shape.values()]
    if isinstance(shape, (list, tuple)) and shape and isinstance(shape[0], (list, tuple)):
        return [tuple(s) for s in shape]
    return [tuple(shape)]


def _loss_name(loss, index: int) -> str:
    if isinstance(loss, (list, tuple)):
        loss = loss[index] if index < len(loss) else None
    elif isinstance(loss, dict):
        values = list(loss.values())
        loss = values[index] if index < len(values) else None
    if loss is None:
        return ""
    if isinstance(loss, str):
        return loss.lower()
    name = getattr(loss, "name", None) or getattr(loss, "__name__", None) or ""
    return f"{type(loss).__name__} {name}".lower()


def _concrete(shape: tuple, n: int, what: str) -> tuple:
    dims = (n,) + tuple(shape[1:])
    if any(d is None for d in dims):
        raise DumpError(f"the model's {what} shape {shape} has unknown dimensions "
                        "besides the batch; define make_data(n) in the model file")
    return dims


def synthesize_data(model, n: int):
    """Random inputs and targets for n samples, from the model's shapes and loss."""
    import numpy as np

    rng = np.random.default_rng(0)
    inputs = []
    dtypes = [getattr(t, "dtype", "float32") for t in (getattr(model, "inputs", None) or [])]
    for i, shape in enumerate(_shapes(model.input_shape)):
        dims = _concrete(shape, n, "input")
        dtype = np.dtype(str(dtypes[i]) if i < len(dtypes) else "float32")
        if np.issubdtype(dtype, np.integer):
            inputs.append(rng.integers(0, 2, dims).astype(dtype))
        else:
            inputs.append(rng.random(dims, dtype=np.float32).astype(dtype))
    targets = []
    for i, shape in enumerate(_shapes(model.output_shape)):
        dims = _concrete(shape, n, "output")
        loss = _loss_name(getattr(model, "loss", None), i)
        classes = dims[-1] if len(dims) > 1 else 1
        if "sparse" in loss:
            targets.append(rng.integers(0, max(classes, 1), dims[:-1]).astype(np.int64))
        elif "categorical" in loss:
            labels = rng.integers(0, max(classes, 1), dims[:-1])
            targets.append(np.eye(classes, dtype=np.float32)[labels])
        else:
            targets.append(rng.random(dims, dtype=np.float32))
    x = inputs[0] if len(inputs) == 1 else inputs
    y = targets[0] if len(targets) == 1 else targets
    return x, y


def make_data(model, module, n: int):
    """(x, y, where from): the model file's make_data(n), or synthesized."""
    fn = getattr(module, "make_data", None) if module is not None else None
    if callable(fn):
        try:
            data = fn(n)
            x, y = data
        except Exception as e:  # noqa: BLE001 - the user's code
            raise DumpError(f"make_data({n}) failed: {type(e).__name__}: "
                            f"{one_line(e)}") from None
        return x, y, "make_data"
    x, y = synthesize_data(model, n)
    return x, y, "synthesized"


def first_batch(data, batch: int):
    """The first `batch` samples of the tool's inputs or targets (an array, or
    a list/dict of arrays)."""
    import tensorflow as tf

    return tf.nest.map_structure(lambda a: a[:batch], data)
