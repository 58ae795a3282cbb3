"""A zoo of architectures beyond sntf.models' families, for the planner's
generality: plain Keras code, each at a batch where activations dominate.

    from sntf.testing import zoo
    model = zoo.build("preact_resnet")          # compiled: SGD with momentum
    x, y = zoo.make_data("preact_resnet", 64)

Architectures (default size; `build(name, **kw)` overrides it):

  preact_resnet   pre-activation residual network: BN -> ReLU -> Conv twice
                  per block, identity shortcut (blocks=10, width=16, 32x32)
  wide_preact     the same, wide and shallow (blocks=4, width=64)
  mobilenet_v2    inverted residuals: 1x1 expand, 3x3 depthwise, 1x1 project,
                  ReLU6, residual where shapes match (blocks=6)
  se_resnet       residual blocks with squeeze-and-excitation: a multiply by a
                  broadcast sigmoid gate (blocks=6)
  densenet_bc     densely connected, 1x1 bottleneck + 3x3, concatenations
                  (layers=6 per block, 3 blocks)
  unet_transpose  encoder-decoder, concatenated skips, Conv2DTranspose
                  upsampling (levels=3)
  transformer     encoder blocks with dropout (blocks=2, length 128)
  gpt             causal decoder, no dropout (blocks=2, length 128)
  gpt_dropout     causal decoder with dropout
  vit             a small vision transformer: patches of 4x4, encoder blocks
  mlp_gelu        a deep MLP with GELU (layers=6, width 1024)
  allconv_swish   all-convolutional: strided convolutions, swish and GELU
  keras_mobilenet_v2   keras.applications.MobileNetV2 (weights=None, 64x64)
  keras_efficientnet   keras.applications.EfficientNetB0 (weights=None, 64x64)

Every model ends in 10 classes and trains with SGD (momentum 0.9) on sparse
categorical cross-entropy from logits.
"""

from __future__ import annotations

import inspect

from sntf import models
# The families' classes and vocabulary, so that models.random_samples serves both.
from sntf.models import NUM_CLASSES, VOCAB

SEQ_LEN = 128

# name -> (input shape, default batch, integer input)
SPECS = {
    "preact_resnet": ((32, 32, 3), 32, False),
    "wide_preact": ((32, 32, 3), 32, False),
    "mobilenet_v2": ((32, 32, 3), 32, False),
    "se_resnet": ((32, 32, 3), 32, False),
    "densenet_bc": ((32, 32, 3), 32, False),
    "unet_transpose": ((32, 32, 3), 32, False),
    "transformer": ((SEQ_LEN,), 32, True),
    "gpt": ((SEQ_LEN,), 32, True),
    "gpt_dropout": ((SEQ_LEN,), 32, True),
    "vit": ((32, 32, 3), 32, False),
    "mlp_gelu": ((512,), 256, False),
    "allconv_swish": ((32, 32, 3), 32, False),
    "keras_mobilenet_v2": ((64, 64, 3), 16, False),
    "keras_efficientnet": ((64, 64, 3), 16, False),
}
NAMES = tuple(SPECS)


def _check(name: str) -> str:
    if name not in SPECS:
        raise ValueError(f"unknown zoo architecture {name!r}; expected one of "
                         f"{', '.join(NAMES)}")
    return name


def default_batch(name: str) -> int:
    """A batch at which the architecture's activations dominate its memory."""
    return SPECS[_check(name)][1]


def make_data(name: str, n: int, seed: int = 0):
    """n random samples (x, y) for an architecture (numpy arrays)."""
    shape, _, ids = SPECS[_check(name)]
    return models.random_samples(shape, n, seed, token_ids=ids)


def build(name: str, learning_rate: float = 0.01, jit_compile="auto", **kw):
    """Builds and compiles one zoo architecture.

    Args:
      name: one of NAMES.
      learning_rate: SGD's learning rate (momentum 0.9).
      jit_compile: passed to compile.
      **kw: the architecture's size options (see the module docstring).

    Returns:
      A compiled keras.Model.
    """
    import keras

    shape, _, ids = SPECS[_check(name)]
    inputs = keras.Input(shape, dtype="int32" if ids else "float32")
    outputs = _BUILDERS[name](keras, inputs, **kw)
    model = keras.Model(inputs, outputs, name=name)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    return model


def _bn_relu(keras, x):
    x = keras.layers.BatchNormalization()(x)
    return keras.layers.Activation("relu")(x)


def _preact_resnet(keras, x, blocks=10, width=16):
    layers = keras.layers
    x = layers.Conv2D(width, 3, padding="same", use_bias=False)(x)
    for _ in range(blocks):
        y = _bn_relu(keras, x)
        y = layers.Conv2D(width, 3, padding="same", use_bias=False)(y)
        y = _bn_relu(keras, y)
        y = layers.Conv2D(width, 3, padding="same", use_bias=False)(y)
        x = layers.Add()([x, y])
    x = _bn_relu(keras, x)
    x = layers.GlobalAveragePooling2D()(x)
    return layers.Dense(NUM_CLASSES)(x)


def _wide_preact(keras, x, blocks=4, width=64):
    return _preact_resnet(keras, x, blocks=blocks, width=width)


def _mobilenet_v2(keras, x, blocks=6, expand=6):
    layers = keras.layers
    x = layers.Conv2D(16, 3, padding="same", use_bias=False)(x)
    x = layers.ReLU(6.0)(layers.BatchNormalization()(x))
    channels = 16
    for block in range(blocks):
        out = 16 if block < blocks // 2 else 24
        strides = 2 if block == blocks // 2 else 1
        y = layers.Conv2D(channels * expand, 1, use_bias=False)(x)
        y = layers.ReLU(6.0)(layers.BatchNormalization()(y))
        y = layers.DepthwiseConv2D(3, strides=strides, padding="same", use_bias=False)(y)
        y = layers.ReLU(6.0)(layers.BatchNormalization()(y))
        y = layers.Conv2D(out, 1, use_bias=False)(y)
        y = layers.BatchNormalization()(y)
        x = layers.Add()([x, y]) if strides == 1 and out == channels else y
        channels = out
    x = layers.GlobalAveragePooling2D()(x)
    return layers.Dense(NUM_CLASSES)(x)


def _se_resnet(keras, x, blocks=6, width=32, ratio=4):
    layers = keras.layers
    x = layers.Conv2D(width, 3, padding="same", use_bias=False)(x)
    x = _bn_relu(keras, x)
    for _ in range(blocks):
        y = layers.Conv2D(width, 3, padding="same", use_bias=False)(x)
        y = _bn_relu(keras, y)
        y = layers.Conv2D(width, 3, padding="same", use_bias=False)(y)
        y = layers.BatchNormalization()(y)
        gate = layers.GlobalAveragePooling2D(keepdims=True)(y)
        gate = layers.Dense(width // ratio, activation="relu")(gate)
        gate = layers.Dense(width, activation="sigmoid")(gate)
        y = layers.Multiply()([y, gate])
        x = layers.Activation("relu")(layers.Add()([x, y]))
    x = layers.GlobalAveragePooling2D()(x)
    return layers.Dense(NUM_CLASSES)(x)


def _densenet_bc(keras, x, layers_per_block=6, growth=12):
    layers = keras.layers
    x = layers.Conv2D(2 * growth, 3, padding="same", use_bias=False)(x)
    for block in range(3):
        for _ in range(layers_per_block):
            y = _bn_relu(keras, x)
            y = layers.Conv2D(4 * growth, 1, use_bias=False)(y)
            y = _bn_relu(keras, y)
            y = layers.Conv2D(growth, 3, padding="same", use_bias=False)(y)
            x = layers.Concatenate()([x, y])
        if block < 2:
            x = _bn_relu(keras, x)
            x = layers.Conv2D(x.shape[-1] // 2, 1, use_bias=False)(x)
            x = layers.AveragePooling2D(2)(x)
    x = _bn_relu(keras, x)
    x = layers.GlobalAveragePooling2D()(x)
    return layers.Dense(NUM_CLASSES)(x)


def _unet_transpose(keras, x, levels=3, base=16):
    layers = keras.layers

    def conv(x, c):
        return _bn_relu(keras, layers.Conv2D(c, 3, padding="same", use_bias=False)(x))

    skips = []
    for level in range(levels):
        x = conv(conv(x, base * 2 ** level), base * 2 ** level)
        skips.append(x)
        x = layers.MaxPooling2D()(x)
    x = conv(x, base * 2 ** levels)
    for level in reversed(range(levels)):
        x = layers.Conv2DTranspose(base * 2 ** level, 2, strides=2, padding="same")(x)
        x = layers.Concatenate()([x, skips[level]])
        x = conv(conv(x, base * 2 ** level), base * 2 ** level)
    x = layers.GlobalAveragePooling2D()(x)
    return layers.Dense(NUM_CLASSES)(x)


def _attention_blocks(keras, x, blocks, dim, heads, ff, dropout, causal):
    layers = keras.layers
    for _ in range(blocks):
        a = layers.MultiHeadAttention(heads, dim // heads, dropout=dropout)(
            x, x, use_causal_mask=causal)
        if dropout:
            a = layers.Dropout(dropout)(a)
        x = layers.LayerNormalization()(layers.Add()([x, a]))
        f = layers.Dense(ff, activation="gelu")(x)
        f = layers.Dense(dim)(f)
        if dropout:
            f = layers.Dropout(dropout)(f)
        x = layers.LayerNormalization()(layers.Add()([x, f]))
    return x


_positions = []


def _position_embedding(keras):
    """A layer adding a learned position embedding (made once, lazily: this
    module imports nothing heavy, and baselines load it without sntf)."""
    if not _positions:
        class PositionEmbedding(keras.layers.Layer):
            def __init__(self, length, dim, **kwargs):
                super().__init__(**kwargs)
                self.length, self.dim = length, dim

            def build(self, input_shape):
                self.positions = self.add_weight(
                    shape=(self.length, self.dim), initializer="glorot_uniform",
                    name="positions")

            def call(self, x):
                return x + self.positions[None, :, :]

        _positions.append(PositionEmbedding)
    return _positions[0]


def _tokens(keras, x, dim):
    x = keras.layers.Embedding(VOCAB, dim)(x)
    return _position_embedding(keras)(SEQ_LEN, dim)(x)


def _transformer(keras, x, blocks=2, dim=128, heads=4, ff=512, dropout=0.1):
    x = _attention_blocks(keras, _tokens(keras, x, dim), blocks, dim, heads, ff,
                          dropout, causal=False)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.layers.Dense(NUM_CLASSES)(x)


def _gpt(keras, x, blocks=2, dim=128, heads=4, ff=512, dropout=0.0):
    x = _attention_blocks(keras, _tokens(keras, x, dim), blocks, dim, heads, ff,
                          dropout, causal=True)
    # The last position's representation predicts the class.
    x = keras.layers.Lambda(lambda t: t[:, -1, :])(x)
    return keras.layers.Dense(NUM_CLASSES)(x)


def _gpt_dropout(keras, x, **kw):
    return _gpt(keras, x, **{"dropout": 0.1, **kw})


def _vit(keras, x, blocks=2, dim=96, heads=4, ff=384, patch=4):
    layers = keras.layers
    x = layers.Conv2D(dim, patch, strides=patch)(x)
    tokens = (32 // patch) ** 2
    x = layers.Reshape((tokens, dim))(x)
    x = _position_embedding(keras)(tokens, dim)(x)
    x = _attention_blocks(keras, x, blocks, dim, heads, ff, 0.0, causal=False)
    x = layers.GlobalAveragePooling1D()(x)
    return layers.Dense(NUM_CLASSES)(x)


def _mlp_gelu(keras, x, depth=6, width=1024):
    for _ in range(depth):
        x = keras.layers.Dense(width, activation="gelu")(x)
    return keras.layers.Dense(NUM_CLASSES)(x)


def _allconv_swish(keras, x, width=32):
    layers = keras.layers
    for stage, act in enumerate(("swish", "gelu", "swish")):
        c = width * 2 ** stage
        x = layers.Conv2D(c, 3, padding="same", activation=act)(x)
        x = layers.Conv2D(c, 3, padding="same", activation=act)(x)
        x = layers.Conv2D(c, 3, strides=2, padding="same", activation=act)(x)
    x = layers.Conv2D(NUM_CLASSES, 1)(x)
    return layers.GlobalAveragePooling2D()(x)


def _keras_mobilenet_v2(keras, x, alpha=0.35):
    body = keras.applications.MobileNetV2(input_shape=x.shape[1:], alpha=alpha,
                                          include_top=False, weights=None)
    y = keras.layers.GlobalAveragePooling2D()(body(x))
    return keras.layers.Dense(NUM_CLASSES)(y)


def _keras_efficientnet(keras, x):
    body = keras.applications.EfficientNetB0(input_shape=x.shape[1:],
                                             include_top=False, weights=None)
    y = keras.layers.GlobalAveragePooling2D()(body(x))
    return keras.layers.Dense(NUM_CLASSES)(y)


_BUILDERS = {
    "preact_resnet": _preact_resnet, "wide_preact": _wide_preact,
    "mobilenet_v2": _mobilenet_v2, "se_resnet": _se_resnet,
    "densenet_bc": _densenet_bc, "unet_transpose": _unet_transpose,
    "transformer": _transformer, "gpt": _gpt, "gpt_dropout": _gpt_dropout,
    "vit": _vit, "mlp_gelu": _mlp_gelu, "allconv_swish": _allconv_swish,
    "keras_mobilenet_v2": _keras_mobilenet_v2,
    "keras_efficientnet": _keras_efficientnet,
}
# The architectures with a `blocks` option: their depth can be searched
# (benchmarks/deeper.py --family zoo:<name>).
DEEPENS = tuple(name for name, builder in _BUILDERS.items()
                if "blocks" in inspect.signature(builder).parameters)
