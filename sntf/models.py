"""Keras model families used by sntf's tests, benchmarks and tools.

    from sntf import models
    model = models.build("resnet", depth=3)          # compiled, 10 classes
    x, y = models.make_data("resnet", 64 * 2)        # numpy arrays
    model.fit(x, y, batch_size=64)

Every family is ordinary Keras code with nothing sntf-specific in it. Keras is
imported inside the functions, so `import sntf.models` stays cheap (no
TensorFlow import).

Families and what `depth` means (default in brackets):

  mlp          Dense(width)+ReLU layers on a 256-d input [4 hidden layers]
  vgg          32x32x3, 3 stages of conv3x3+BN+ReLU (32/64/128 channels), MaxPool
               after each stage [2 convs per stage]
  resnet       CIFAR ResNet-(6n+2), n = depth: conv stem, 3 stages (16/32/64
               channels) of basic blocks (conv-BN-ReLU-conv-BN, skip Add,
               ReLU) [2 blocks per stage, ResNet-14]; len(model.layers) =
               10 + 21*depth, so depth=48 gives 1018 layers
  densenet     32x32x3, 3 dense blocks of BN-ReLU-Conv3x3 (growth 12) joined
               by Concatenate, transitions BN-ReLU-Conv1x1-AvgPool [4 layers
               per dense block]
  transformer  token ids (length 64, vocab 1000), token + learned positional
               embedding, encoder blocks (MultiHeadAttention, Dropout, Add,
               LayerNormalization, FFN), GlobalAveragePooling1D, Dense 10
               [2 blocks]
  mobilenet    32x32x3, conv stem, depthwise-separable blocks (DepthwiseConv2D
               3x3 + BN + ReLU6, Conv2D 1x1 + BN + ReLU6) in 3 stages
               (32/64/128 channels, the last two starting with stride 2)
               [2 blocks per stage]
  unet         32x32x3 U-Net: `depth` down levels of two conv3x3+BN+ReLU
               (16, 32, 64... channels) and MaxPool, a bottleneck, and as many
               up levels (UpSampling2D, Concatenate with the level's skip, two
               conv3x3+BN+ReLU), then GlobalAveragePooling2D and Dense 10
               [3 levels]

Default sizes keep one training step at batch 64 well under a couple of
seconds on 2 CPU cores, while the conv nets' activations (tens of MiB at batch
64) dominate their memory rather than weights or framework overhead.
"""

from __future__ import annotations

import sys

FAMILIES = ("mlp", "vgg", "resnet", "densenet", "transformer", "mobilenet", "unet")
NUM_CLASSES = 10
SEQ_LEN = 64
VOCAB = 1000

_DEFAULT_DEPTH = {"mlp": 4, "vgg": 2, "resnet": 2, "densenet": 4,
                  "transformer": 2, "mobilenet": 2, "unet": 3}
_INPUT_SHAPES = {"mlp": (256,), "vgg": (32, 32, 3), "resnet": (32, 32, 3),
                 "densenet": (32, 32, 3), "transformer": (SEQ_LEN,),
                 "mobilenet": (32, 32, 3), "unet": (32, 32, 3)}


def _check(family: str) -> str:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of "
                         f"{', '.join(FAMILIES)}")
    return family


def input_shape(family: str) -> tuple:
    """Shape of one input sample (without the batch dimension)."""
    return _INPUT_SHAPES[_check(family)]


def default_depth(family: str) -> int:
    """The depth `build` uses when none is given."""
    return _DEFAULT_DEPTH[_check(family)]


def make_data(family: str, n: int, seed: int = 0):
    """n random samples for `family`: (x, y) numpy arrays.

    x is float32 in [0, 1) for the dense and conv families and int32 token ids
    in [0, VOCAB) for the transformer; y holds int32 labels in [0, 10).
    """
    return random_samples(input_shape(family), n, seed, token_ids=family == "transformer")


def random_samples(shape: tuple, n: int, seed: int = 0, token_ids: bool = False):
    """n random samples of one input shape, with labels in [0, NUM_CLASSES).

    Args:
      shape: one sample's shape (without the batch dimension).
      n: the number of samples.
      seed: the generator's seed.
      token_ids: int32 ids in [0, VOCAB) instead of float32 in [0, 1).

    Returns:
      (x, y) numpy arrays.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    if token_ids:
        x = rng.integers(0, VOCAB, (n,) + shape, dtype=np.int32)
    else:
        x = rng.random((n,) + shape, dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, n, dtype=np.int32)
    return x, y


REMAT_OPTIONS = (None, "remat_scope", "recompute_grad")


def build(family: str, depth: int | None = None, *, learning_rate: float = 1e-3,
          metrics=None, jit_compile="auto", remat: str | None = None,
          run_eagerly: bool = False, **kw):
    """Builds and compiles one model of `family`.

    Args:
      family: one of FAMILIES.
      depth: the family's depth knob (see the module docstring); None takes
        the family's default.
      learning_rate: Adam's learning rate.
      metrics: passed to compile (default: none, so the training graph holds
        only the model, its loss and the optimizer).
      jit_compile: passed to compile.
      remat: the user's own alternatives to sntf, which change the model
        code: None (plain model), "remat_scope" (layers built inside
        keras.RematScope(mode="full")) or "recompute_grad" (each block of
        vgg/resnet/densenet wrapped in tf.recompute_grad: a VGG stage, a
        residual block, a dense layer).
      run_eagerly: passed to compile (RematScope's custom gradients accept
        keyword arguments only when run eagerly, in Keras 3.15's TensorFlow
        backend).
      **kw: family-specific size options: mlp(width=1024),
        vgg(channels=(32, 64, 128)), resnet(channels=(16, 32, 64)),
        densenet(growth=12, stem=24), transformer(dim=128, heads=4, ff=256,
        dropout=0.1), mobilenet(channels=(32, 64, 128), stem=32),
        unet(base=16).

    Returns:
      A compiled keras.Model (Adam, sparse categorical crossentropy from
      logits, 10 classes).

    Raises:
      ValueError: unknown family, a depth < 1 or an unknown remat option.
      TypeError: an option the family does not have.
    """
    _check(family)
    if depth is None:
        depth = _DEFAULT_DEPTH[family]
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be a positive int, got {depth!r}")
    if remat not in REMAT_OPTIONS:
        raise ValueError(f"unknown remat option {remat!r}; expected one of {REMAT_OPTIONS}")
    if remat == "recompute_grad" and family not in _BLOCK_FAMILIES:
        raise ValueError(f"remat='recompute_grad' is built for {_BLOCK_FAMILIES}, "
                         f"not {family!r}")
    import contextlib

    import keras

    builder = {"mlp": _mlp, "vgg": _vgg, "resnet": _resnet, "densenet": _densenet,
               "transformer": _transformer, "mobilenet": _mobilenet,
               "unet": _unet}[family]
    inputs = keras.Input(input_shape(family),
                         dtype="int32" if family == "transformer" else "float32")
    global _WRAP_BLOCKS
    _WRAP_BLOCKS = remat == "recompute_grad"
    scope = (keras.RematScope(mode="full") if remat == "remat_scope"
             else contextlib.nullcontext())
    try:
        with scope:
            outputs = builder(keras, inputs, depth, **kw)
    finally:
        _WRAP_BLOCKS = False
    # Keras maps a functional graph recursively (a few frames per layer):
    # a 1000-layer ResNet needs more than Python's default limit of 1000.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))
    try:
        model = keras.Model(inputs, outputs, name=f"{family}{depth}")
    finally:
        sys.setrecursionlimit(limit)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=metrics, jit_compile=jit_compile, run_eagerly=run_eagerly)
    return model


_BLOCK_FAMILIES = ("vgg", "resnet", "densenet")
_WRAP_BLOCKS = False      # set by build(remat="recompute_grad") while building


def _block(keras, x, body):
    """Applies body(x); under remat="recompute_grad" as one sub-model whose
    call runs inside tf.recompute_grad (what a user writes by hand)."""
    if not _WRAP_BLOCKS:
        return body(x)
    inner_input = keras.Input(x.shape[1:], dtype=x.dtype)
    block = keras.Model(inner_input, body(inner_input))
    return _recompute_grad_layer(keras)(block)(x)


def _recompute_grad_layer(keras):
    class RecomputeGrad(keras.layers.Layer):
        """Runs a block under tf.recompute_grad: its activations are
        recomputed in the backward pass instead of kept."""

        def __init__(self, block, **kwargs):
            super().__init__(**kwargs)
            self.block = block

        def call(self, x, training=None):
            import tensorflow as tf

            return tf.recompute_grad(lambda y: self.block(y, training=training))(x)

    return RecomputeGrad


def _mlp(keras, x, depth, width=1024):
    layers = keras.layers
    for _ in range(depth):
        x = layers.Dense(width, activation="relu")(x)
    return layers.Dense(NUM_CLASSES)(x)


def _conv_bn_relu(keras, x, filters, kernel=3, strides=1):
    layers = keras.layers
    x = layers.Conv2D(filters, kernel, strides=strides, padding="same",
                      use_bias=False)(x)
    x = layers.BatchNormalization()(x)
    return layers.Activation("relu")(x)


def _vgg(keras, x, depth, channels=(32, 64, 128)):
    layers = keras.layers
    for c in channels:
        def stage(x, c=c):
            for _ in range(depth):
                x = _conv_bn_relu(keras, x, c)
            return layers.MaxPooling2D()(x)
        x = _block(keras, x, stage)
    x = layers.Flatten()(x)
    x = layers.Dense(128, activation="relu")(x)
    return layers.Dense(NUM_CLASSES)(x)


def _resnet(keras, x, depth, channels=(16, 32, 64)):
    layers = keras.layers
    x = _conv_bn_relu(keras, x, channels[0])
    for stage, c in enumerate(channels):
        for block in range(depth):
            strides = 2 if stage > 0 and block == 0 else 1

            def residual(x, c=c, strides=strides):
                shortcut = x
                y = _conv_bn_relu(keras, x, c, strides=strides)
                y = layers.Conv2D(c, 3, padding="same", use_bias=False)(y)
                y = layers.BatchNormalization()(y)
                if strides != 1 or shortcut.shape[-1] != c:
                    shortcut = layers.Conv2D(c, 1, strides=strides,
                                             use_bias=False)(shortcut)
                    shortcut = layers.BatchNormalization()(shortcut)
                x = layers.Add()([y, shortcut])
                return layers.Activation("relu")(x)
            x = _block(keras, x, residual)
    x = layers.GlobalAveragePooling2D()(x)
    return layers.Dense(NUM_CLASSES)(x)


def _densenet(keras, x, depth, growth=12, stem=24):
    layers = keras.layers
    x = layers.Conv2D(stem, 3, padding="same", use_bias=False)(x)
    for block in range(3):
        for _ in range(depth):
            def dense_layer(x):
                y = layers.BatchNormalization()(x)
                y = layers.Activation("relu")(y)
                y = layers.Conv2D(growth, 3, padding="same", use_bias=False)(y)
                return layers.Concatenate()([x, y])
            x = _block(keras, x, dense_layer)
        if block < 2:
            x = layers.BatchNormalization()(x)
            x = layers.Activation("relu")(x)
            x = layers.Conv2D(x.shape[-1] // 2, 1, use_bias=False)(x)
            x = layers.AveragePooling2D(2)(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    return layers.Dense(NUM_CLASSES)(x)


_position_embedding_cls = None


def position_embedding(keras):
    """A layer adding a learned position embedding to token embeddings
    (created once, on first use, so that Keras is imported lazily)."""
    global _position_embedding_cls
    if _position_embedding_cls is None:
        class PositionEmbedding(keras.layers.Layer):
            def __init__(self, length, dim, **kwargs):
                super().__init__(**kwargs)
                self.length = length
                self.dim = dim

            def build(self, input_shape):
                self.positions = self.add_weight(
                    shape=(self.length, self.dim), initializer="glorot_uniform",
                    name="positions")

            def call(self, x):
                return x + self.positions[None, :, :]

            def get_config(self):
                return {**super().get_config(), "length": self.length,
                        "dim": self.dim}

        _position_embedding_cls = PositionEmbedding
    return _position_embedding_cls


def _transformer(keras, x, depth, dim=128, heads=4, ff=256, dropout=0.1):
    layers = keras.layers
    x = layers.Embedding(VOCAB, dim)(x)
    x = position_embedding(keras)(SEQ_LEN, dim)(x)
    for _ in range(depth):
        a = layers.MultiHeadAttention(heads, dim // heads, dropout=dropout)(x, x)
        a = layers.Dropout(dropout)(a)
        x = layers.LayerNormalization()(layers.Add()([x, a]))
        f = layers.Dense(ff, activation="relu")(x)
        f = layers.Dense(dim)(f)
        f = layers.Dropout(dropout)(f)
        x = layers.LayerNormalization()(layers.Add()([x, f]))
    x = layers.GlobalAveragePooling1D()(x)
    return layers.Dense(NUM_CLASSES)(x)


def _mobilenet(keras, x, depth, channels=(32, 64, 128), stem=32):
    layers = keras.layers
    x = layers.Conv2D(stem, 3, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization()(x)
    x = layers.ReLU(6.0)(x)
    for stage, c in enumerate(channels):
        for block in range(depth):
            strides = 2 if stage > 0 and block == 0 else 1
            x = layers.DepthwiseConv2D(3, strides=strides, padding="same",
                                       use_bias=False)(x)
            x = layers.BatchNormalization()(x)
            x = layers.ReLU(6.0)(x)
            x = layers.Conv2D(c, 1, use_bias=False)(x)
            x = layers.BatchNormalization()(x)
            x = layers.ReLU(6.0)(x)
    x = layers.GlobalAveragePooling2D()(x)
    return layers.Dense(NUM_CLASSES)(x)


def _unet(keras, x, depth, base=16):
    layers = keras.layers
    if 32 % (2 ** depth):
        raise ValueError(f"unet depth {depth} does not halve 32x32 inputs evenly")
    skips = []
    for level in range(depth):
        x = _conv_bn_relu(keras, x, base * 2 ** level)
        x = _conv_bn_relu(keras, x, base * 2 ** level)
        skips.append(x)
        x = layers.MaxPooling2D()(x)
    x = _conv_bn_relu(keras, x, base * 2 ** depth)
    for level in reversed(range(depth)):
        x = layers.UpSampling2D()(x)
        x = layers.Concatenate()([x, skips[level]])
        x = _conv_bn_relu(keras, x, base * 2 ** level)
        x = _conv_bn_relu(keras, x, base * 2 ** level)
    x = layers.GlobalAveragePooling2D()(x)
    return layers.Dense(NUM_CLASSES)(x)
