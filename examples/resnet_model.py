"""A deeper CIFAR ResNet (depth 8: ResNet-50, 178 Keras layers) for tools/sntf_dump.

    .venv/bin/python tools/sntf_dump --model examples/resnet_model.py --batch 32 \
        --budget 64MiB --out dump

draws the predicted memory timeline of its training step as TensorFlow would
run it and as sntf's policy "auto" plans it under the budget (the picture in
the README).
"""


def build_model():
    from sntf import models

    return models.build("resnet", depth=8)


def make_data(n):
    from sntf import models

    return models.make_data("resnet", n)
