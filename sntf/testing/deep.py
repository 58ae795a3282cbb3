"""The deep residual network the identity and scaling benchmarks train: a
plain pre-activation (or post-activation) ResNet of 3x3 convolutions at one
width on 32x32 images, as deep as asked, compiled with SGD and momentum."""

from __future__ import annotations


def preact_resnet(blocks: int, width: int = 16, bias: bool = True, arch: str = "pre"):
    """The compiled Keras model.

    Args:
      blocks: residual blocks, two convolutions each.
      width: the convolutions' channels.
      bias: whether the convolutions have a bias.
      arch: "pre" (BN -> ReLU -> conv, twice, then the identity added) or
        "post" (conv -> BN -> ReLU, conv -> BN, added, then ReLU).

    Returns:
      The model, compiled with SGD (0.001, momentum 0.9) on sparse
      categorical cross-entropy from logits over 10 classes.
    """
    if arch not in ("pre", "post"):
        raise ValueError(f"arch {arch!r}: use 'pre' or 'post'")
    import keras
    from keras import layers

    def conv(t):
        return layers.Conv2D(width, 3, padding="same", use_bias=bias)(t)

    inp = keras.Input((32, 32, 3))
    x = conv(inp)
    for _ in range(blocks):
        if arch == "pre":
            h = conv(layers.ReLU()(layers.BatchNormalization()(x)))
            h = conv(layers.ReLU()(layers.BatchNormalization()(h)))
            x = layers.Add()([x, h])
        else:
            h = layers.ReLU()(layers.BatchNormalization()(conv(x)))
            h = layers.BatchNormalization()(conv(h))
            x = layers.ReLU()(layers.Add()([x, h]))
    out = layers.Dense(10)(layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.001, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
