"""Random training steps for fuzzing the graph pass: specs and their models.

A spec is a plain JSON-able dict (hypothesis draws it, a failure prints it,
--replay runs it again); `build` turns it into variables and a tf.function
training step. See sntf/testing/fuzz.py for the checks.
"""

from __future__ import annotations

import math
from typing import Any

POLICIES = ("recompute", "swap", "swap+recompute")
ACTIVATIONS = ("relu", "tanh", "sigmoid", "elu", "softplus", "gelu", "swish")
# gate: a multiply by a broadcast sigmoid of the tensor's mean (squeeze and
# excitation); layernorm: per-example over the features; tied: a linear layer
# that reads an earlier layer's weights again (drawn twice as often: it
# falls back to an activation where no earlier layer's weights fit);
# causal: self-attention under a causal mask, as in a GPT block (the
# features, or a conv map's positions, are the sequence).
DENSE_OPS = ("linear", "linear", "act", "add", "mul", "concat", "split", "norm",
             "norm", "dropout", "cond", "gate", "layernorm", "softmax", "tied",
             "tied", "causal")
CONV_OPS = DENSE_OPS + ("pool", "deconv")
MAX_WIDTH = 48            # concatenations stop growing the feature axis here
# What a step writes its gradients with: "sub" applies SGD to the weights
# (v.assign_sub(lr * g)); the others accumulate them into variables of
# their own and leave the weights alone, as a gradient-accumulation
# micro-step does: acc.assign_add(g), acc.assign(acc + g), a scatter-add
# over every row (ResourceScatterAdd), and an optimizer's apply op
# (ResourceApplyGradientDescent, acc -= lr * g). Training detection must
# see each as a training step.
WRITERS = ("sub", "accumulate", "assign", "scatter", "apply")
DEVICES = ("/device:CPU:0", "/device:CPU:1")
# Deep cases: this many pre-activation residual blocks (norm, relu, linear,
# add) or more before the head. TensorFlow changes how it sums gradients
# in deep networks (Grappler's accumulators), which shallow cases never
# reach; drawn in one case of seven.
DEEP_BLOCKS = 30
RESIDUAL_BLOCKS = (0,) * 12 + (DEEP_BLOCKS, DEEP_BLOCKS + 8)
# Their width, whatever the drawn layers' (a projection leads into them):
# a chain of one-feature tensors would leave nothing to plan.
RESIDUAL_WIDTHS = (8, 16)
LEARNING_RATE = 0.05


def case_specs(policies=POLICIES, deep: bool = False):
    """A hypothesis strategy of case specs: plain JSON-able dicts.

    Args:
      policies: the policies cases draw from.
      deep: every case ends in DEEP_BLOCKS residual blocks or more (else
        one in seven does).
    """
    blocks = RESIDUAL_BLOCKS[-2:] if deep else RESIDUAL_BLOCKS
    from hypothesis import strategies as st

    @st.composite
    def spec(draw) -> dict:
        kind = draw(st.sampled_from(("dense", "conv")))
        two_devices = draw(st.booleans())
        dims = [draw(st.integers(1, 12))]
        layers = _draw_layers(draw, st, kind, two_devices, dims)
        budget = draw(st.one_of(
            st.none(), st.integers(1, 1 << 16), st.integers(1 << 16, 1 << 26),
            st.sampled_from((0.5, 1.0, 1024, "64MiB", "2TB"))))
        return {
            "kind": kind,
            "hw": draw(st.integers(2, 12)) if kind == "conv" else None,
            "dims": dims,
            "layers": layers,
            # A second loss term on an intermediate tensor (two outputs).
            "extra_loss": draw(st.one_of(st.none(), st.integers(0, len(dims) - 1))),
            # Batches large enough for activations, not weights, to set the
            # peak now and then (the planner keeps only plans that lower it).
            "batch": draw(st.integers(1, 12 if kind == "conv" else 48)),
            "unknown_batch": draw(st.booleans()),
            "two_devices": two_devices,
            # The update under a tf.cond on finite gradients, as Keras'
            # loss-scale optimizer (mixed_float16) applies it.
            "guarded_update": draw(st.booleans()),
            "policy": draw(st.sampled_from(tuple(policies))),
            "recompute_mode": draw(st.sampled_from(("speed", "memory", "auto"))),
            "budget": budget,
            "swap_min_bytes": draw(st.sampled_from((0, 0, 0, 256, 4096))),
            "batch_size_option": draw(st.booleans()),
            "seed": draw(st.integers(0, 2**16)),
            # The step run `loop` times inside a tf.while_loop in one call,
            # as Keras' steps_per_execution runs it (0: no loop). Drawn
            # last, so that the other fields of a seed's cases stay as
            # they were.
            "loop": draw(st.sampled_from((0, 0, 0, 2))),
            # Drawn after "loop" for the same reason; SGD half the time.
            "writer": draw(st.sampled_from(("sub",) * (len(WRITERS) - 1) + WRITERS[1:])),
            # Drawn last for the same reason (see with_residual_blocks).
            "residual_blocks": draw(st.sampled_from(blocks)),
            "residual_width": draw(st.sampled_from(RESIDUAL_WIDTHS)),
        }

    return spec()


def _draw_layers(draw, st, kind: str, two_devices: bool, dims: list) -> list:
    """The layers of a case (dims grows with each layer's outputs), ending
    in a head on the last tensor: every case has a weight and its gradient."""
    layers = []
    device = draw(st.integers(0, 1)) if two_devices else 0
    for _ in range(draw(st.integers(3, 12))):
        op = draw(st.sampled_from(CONV_OPS if kind == "conv" else DENSE_OPS))
        # Any earlier tensor: skip connections and long-lived activations.
        i = draw(st.integers(0, len(dims) - 1))
        # Two devices: runs of layers on one device (towers, replicas), now
        # and then switching (a cross-device edge).
        if two_devices and draw(st.integers(0, 3)) == 0:
            device = 1 - device
        layer: dict[str, Any] = {"op": op, "inputs": [i], "device": device}
        _draw_layer(draw, st, kind, layer, dims, layers)
        layers.append(layer)
    head = {"op": "linear", "inputs": [len(dims) - 1],
            "units": draw(st.integers(1, 8)), "act": "none", "device": device}
    if kind == "conv":
        head["kernel"] = 1
    layers.append(head)
    dims.append(head["units"])
    return layers


def _draw_layer(draw, st, kind: str, layer: dict, dims: list, earlier: list) -> None:
    """Fills one layer's op-specific fields and appends its output dims
    (earlier: the layers drawn before it)."""
    i = layer["inputs"][0]
    op = layer["op"]
    if op == "split" and dims[i] < 2:
        op = layer["op"] = "act"
    if op == "tied":
        # An earlier linear layer whose input has this input's width: its
        # weights fit this input too.
        sources = [k for k, l in enumerate(earlier)
                   if l["op"] == "linear" and dims[l["inputs"][0]] == dims[i]]
        if not sources:
            op = layer["op"] = "act"
        else:
            layer["source"] = draw(st.sampled_from(sources))
            layer["act"] = draw(st.sampled_from(ACTIVATIONS + ("none",)))
            dims.append(earlier[layer["source"]]["units"])
    if op == "concat":
        j = draw(st.integers(0, len(dims) - 1))
        if dims[i] + dims[j] > MAX_WIDTH:
            op = layer["op"] = "act"
        else:
            layer["inputs"].append(j)
            dims.append(dims[i] + dims[j])
    if op in ("linear", "deconv"):
        layer["units"] = draw(st.integers(1, 16))
        layer["act"] = draw(st.sampled_from(ACTIVATIONS + ("none",)))
        if kind == "conv":
            layer["kernel"] = draw(st.sampled_from((1, 3)))
        dims.append(layer["units"])
    elif op in ("add", "mul"):
        same = [j for j, d in enumerate(dims) if d == dims[i]]
        layer["inputs"].append(draw(st.sampled_from(same)))
        dims.append(dims[i])
    elif op == "split":
        k = draw(st.integers(1, dims[i] - 1))
        layer["sizes"] = [k, dims[i] - k]
        dims += layer["sizes"]
    elif op in ("act", "cond"):
        layer["act"] = draw(st.sampled_from(ACTIVATIONS))
        dims.append(dims[i])
    elif op == "dropout":
        layer["rate"] = draw(st.sampled_from((0.1, 0.5)))
        dims.append(dims[i])
    elif op == "pool":
        layer["pool"] = draw(st.sampled_from(("max", "avg")))
        dims.append(dims[i])
    elif op in ("norm", "gate", "layernorm", "softmax", "causal"):
        dims.append(dims[i])


def with_residual_blocks(spec: dict) -> dict:
    """The spec with its residual blocks spelled out as layers.

    A linear projection to spec["residual_width"] features, then
    spec["residual_blocks"] pre-activation blocks (norm, relu, a linear
    layer of the same width, and the sum with the block's input), go
    between the drawn layers and the head, which then reads the last block.

    Args:
      spec: a case spec.

    Returns:
      A new spec (the spec itself when it has no blocks).
    """
    blocks = spec.get("residual_blocks", 0)
    if not blocks:
        return spec
    layers = [dict(layer) for layer in spec["layers"]]
    head = layers.pop()
    dims = list(spec["dims"][:-1])
    current, device = head["inputs"][0], head["device"]
    width = spec.get("residual_width", dims[current])
    projection = {"op": "linear", "inputs": [current], "units": width, "act": "none",
                  "device": device}
    if spec["kind"] == "conv":
        projection["kernel"] = 1
    layers.append(projection)
    dims.append(width)
    current = len(dims) - 1
    for _ in range(blocks):
        block_input = current
        for layer in ({"op": "norm"}, {"op": "act", "act": "relu"},
                      {"op": "linear", "units": width, "act": "none"}):
            if layer["op"] == "linear" and spec["kind"] == "conv":
                layer["kernel"] = 3
            layers.append(dict(layer, inputs=[current], device=device))
            dims.append(width)
            current = len(dims) - 1
        layers.append({"op": "add", "inputs": [block_input, current], "device": device})
        dims.append(width)
        current = len(dims) - 1
    layers.append(dict(head, inputs=[current]))
    dims.append(head["units"])
    return dict(spec, layers=layers, dims=dims, residual_blocks=0)


def build(spec: dict, tf):
    """The case's variables and its tf.function training step.

    Returns:
      (step, variables): step(x) runs one SGD step (or spec["loop"] of
      them inside a tf.while_loop) and returns [loss, output, *gradients]
      of the last; variables are the weights, then the accumulators the
      step writes where spec["writer"] (default "sub") accumulates.
    """
    spec = with_residual_blocks(spec)
    conv = spec["kind"] == "conv"
    variables, params = _parameters(spec, tf)
    writer = spec.get("writer", "sub")
    if writer not in WRITERS:
        raise ValueError(f"spec writer {writer!r} is not one of {WRITERS}")
    targets = variables
    if writer != "sub":
        # One accumulator beside each weight, on the weight's device.
        targets = []
        for v in variables:
            with tf.device(v.device):
                targets.append(tf.Variable(tf.zeros_like(v), trainable=False))
    forward = _forward(spec, tf, params)
    feature = [spec["hw"], spec["hw"], spec["dims"][0]] if conv else [spec["dims"][0]]
    batch = None if spec["unknown_batch"] else spec["batch"]

    def one_step(x) -> list:
        with tf.GradientTape() as tape:
            loss, out = forward(x)
        grads = tape.gradient(loss, variables,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)

        def apply():
            for v, g in zip(targets, grads):
                _write(tf, writer, v, g)
            return tf.constant(True)

        if spec.get("guarded_update"):
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
            tf.cond(finite, apply, lambda: tf.constant(False))
        else:
            apply()
        return [loss, out] + list(grads)

    signature = [tf.TensorSpec([batch] + feature, tf.float32)]
    if writer != "sub":
        variables = variables + targets
    if not spec.get("loop"):
        return tf.function(one_step, input_signature=signature), variables

    @tf.function(input_signature=signature)
    def looped(x):
        # The last step's results leave the loop; before the first step the
        # loop carries empty placeholders of any shape.
        outputs = 2 + len(variables)
        carried = tf.while_loop(
            lambda i, *_: i < spec["loop"], lambda i, *_: [i + 1] + one_step(x),
            [tf.constant(0)] + [tf.zeros([0])] * outputs,
            shape_invariants=[tf.TensorShape([])] + [tf.TensorShape(None)] * outputs)
        return carried[1:]

    return looped, variables


def _write(tf, writer: str, v, g) -> None:
    """Writes gradient g into variable v as `writer` (see WRITERS) does."""
    if writer == "sub":
        v.assign_sub(LEARNING_RATE * g)
    elif writer == "accumulate":
        v.assign_add(g)
    elif writer == "assign":
        v.assign(v + g)
    elif writer == "scatter":
        v.scatter_add(tf.IndexedSlices(g, tf.range(tf.shape(g)[0])))
    else:
        tf.raw_ops.ResourceApplyGradientDescent(
            var=v.handle, alpha=tf.constant(LEARNING_RATE, v.dtype), delta=g)


def _parameters(spec: dict, tf) -> tuple[list, list]:
    """(every variable, each layer's dict of its variables)."""
    conv = spec["kind"] == "conv"
    dims, layers, seed = spec["dims"], spec["layers"], spec["seed"]
    variables, params = [], []

    def var(shape, k, device, scale=1.0, init=None):
        with tf.device(DEVICES[device]):
            value = (tf.fill(shape, init) if init is not None else
                     tf.random.stateless_normal(shape, seed=[seed, k]) * scale)
            v = tf.Variable(value)
        variables.append(v)
        return v

    # Node dims as each layer sees them (split adds two nodes).
    node_dims, k = [dims[0]], 0
    for layer in layers:
        d_in = node_dims[layer["inputs"][0]]
        p = {}
        if layer["op"] in ("linear", "deconv"):
            kernel = layer.get("kernel", 1)
            # conv2d_transpose's filter is [h, w, out, in].
            shape = ([kernel, kernel, d_in, layer["units"]] if layer["op"] == "linear"
                     else [kernel, kernel, layer["units"], d_in])
            shape = shape if conv else [d_in, layer["units"]]
            p["w"] = var(shape, k, layer["device"], 1.0 / math.sqrt(d_in * kernel ** 2))
            p["b"] = var([layer["units"]], k + 1, layer["device"], 0.1)
        elif layer["op"] == "tied":
            p = params[layer["source"]]
        elif layer["op"] in ("norm", "layernorm"):
            p["gamma"] = var([d_in], k, layer["device"], init=1.0)
            p["beta"] = var([d_in], k + 1, layer["device"], init=0.0)
        k += 2
        params.append(p)
        if layer["op"] == "split":
            node_dims += layer["sizes"]
        elif layer["op"] == "concat":
            node_dims.append(d_in + node_dims[layer["inputs"][1]])
        elif layer["op"] in ("linear", "deconv"):
            node_dims.append(layer["units"])
        elif layer["op"] == "tied":
            node_dims.append(layers[layer["source"]]["units"])
        else:
            node_dims.append(d_in)
    if node_dims != dims:
        raise ValueError(f"spec dims {dims} disagree with its layers {node_dims}")
    return variables, params


def _activation(tf, name: str, x):
    return {"relu": tf.nn.relu, "tanh": tf.tanh, "sigmoid": tf.sigmoid,
            "elu": tf.nn.elu, "softplus": tf.nn.softplus, "gelu": tf.nn.gelu,
            "swish": tf.nn.silu, "none": tf.identity}[name](x)


def _layer(tf, spec: dict, n: int, layer: dict, p: dict, nodes: list) -> list:
    """The output tensors of one layer."""
    conv = spec["kind"] == "conv"
    a = nodes[layer["inputs"][0]]
    op = layer["op"]
    if op in ("linear", "tied"):
        y = (tf.nn.conv2d(a, p["w"], 1, "SAME") if conv else a @ p["w"])
        return [_activation(tf, layer["act"], tf.nn.bias_add(y, p["b"]))]
    if op == "deconv":
        # A constant output shape where the batch is known, so that shape
        # inference knows the output (a tf.shape-built one hides it).
        batch = a.shape[0] if a.shape[0] is not None else tf.shape(a)[0]
        shape = [batch, spec["hw"], spec["hw"], layer["units"]]
        y = tf.nn.conv2d_transpose(a, p["w"], shape, 1, "SAME")
        return [_activation(tf, layer["act"], tf.nn.bias_add(y, p["b"]))]
    if op == "gate":
        mean = tf.reduce_mean(a, [1, 2] if conv else [-1], keepdims=True)
        return [a * tf.sigmoid(mean)]
    if op == "layernorm":
        mean, variance = tf.nn.moments(a, [-1], keepdims=True)
        return [(a - mean) * tf.math.rsqrt(variance + 1e-3) * p["gamma"] + p["beta"]]
    if op == "softmax":
        return [tf.nn.softmax(a, axis=-1)]
    if op == "causal":
        return [_causal_attention(tf, a, conv)]
    if op == "act":
        return [_activation(tf, layer["act"], a)]
    if op == "cond":
        return [tf.cond(tf.reduce_mean(a) > 0,
                        lambda: _activation(tf, layer["act"], a), lambda: a * 0.5)]
    if op == "add":
        return [a + nodes[layer["inputs"][1]]]
    if op == "mul":
        return [a * nodes[layer["inputs"][1]]]
    if op == "concat":
        return [tf.concat([a, nodes[layer["inputs"][1]]], axis=-1)]
    if op == "split":
        return list(tf.split(a, layer["sizes"], axis=-1))
    if op == "norm":
        mean, variance = tf.nn.moments(a, [0, 1, 2] if conv else [0])
        return [(a - mean) * tf.math.rsqrt(variance + 1e-3) * p["gamma"] + p["beta"]]
    if op == "dropout":
        keep = tf.random.stateless_uniform(tf.shape(a), seed=[spec["seed"], n])
        return [tf.where(keep >= layer["rate"], a / (1 - layer["rate"]),
                         tf.zeros_like(a))]
    if op == "pool":
        pool = tf.nn.max_pool2d if layer["pool"] == "max" else tf.nn.avg_pool2d
        return [pool(a, 3, 1, "SAME")]
    raise ValueError(f"unknown op {op!r}")


def _causal_attention(tf, a, conv: bool):
    """Self-attention of a sequence with itself under a causal mask: each
    position attends to itself and the positions before it (the masked
    scores are -1e9 before the softmax, as in Keras' attention layers)."""
    shape = tf.shape(a)
    seq = tf.reshape(a, [shape[0], -1, a.shape[-1]]) if conv else a[..., None]
    scores = tf.matmul(seq, seq, transpose_b=True) / math.sqrt(seq.shape[-1])
    length = tf.shape(scores)[-1]
    mask = tf.linalg.band_part(tf.ones([length, length], tf.bool), -1, 0)
    weights = tf.nn.softmax(tf.where(mask, scores, -1e9), axis=-1)
    return tf.reshape(tf.matmul(weights, seq), shape)


def _forward(spec: dict, tf, params: list):
    """The case's forward pass: x -> (loss, output)."""
    def forward(x):
        nodes = [x]
        for n, (layer, p) in enumerate(zip(spec["layers"], params)):
            with tf.device(DEVICES[layer["device"]]):
                nodes += _layer(tf, spec, n, layer, p, nodes)
        loss = tf.reduce_mean(tf.square(nodes[-1]))
        if spec["extra_loss"] is not None:
            loss += 0.5 * tf.reduce_mean(tf.square(nodes[spec["extra_loss"]]))
        return loss, nodes[-1]

    return forward


def inputs(spec: dict):
    """The two steps' inputs (a different batch size in the second step when
    the batch dimension is unknown)."""
    import numpy as np

    rng = np.random.default_rng(spec["seed"])
    feature = ((spec["hw"], spec["hw"], spec["dims"][0]) if spec["kind"] == "conv"
               else (spec["dims"][0],))
    second = spec["batch"] + 1 if spec["unknown_batch"] else spec["batch"]
    return [rng.standard_normal((b,) + feature).astype(np.float32)
            for b in (spec["batch"], second)]
