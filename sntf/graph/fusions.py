"""The node pairs TensorFlow's oneDNN graph pass merges, and what decides it.

After Grappler (and so after sntf's pass), TensorFlow's oneDNN layout pass
(MklLayoutRewritePass, on when oneDNN is) merges four kinds of node pairs
into one kernel:

    Conv2D -> BiasAdd                      (the BiasAdd reads the Conv2D)
    Pad -> Conv2D, Pad -> _FusedConv2D     (the convolution reads the Pad)
    Conv2DBackpropFilter + BiasAddGrad     (both read the same output gradient,
                                            the filter gradient as its input 2)

It merges a pair only when both nodes have the same control inputs. A
merged kernel rounds differently from the two it replaces, so a control
input sntf adds to one node of a pair the original graph merged changes the
training's results in the last bits. The rewrite therefore gives both nodes
the same control inputs again (rewrite.fusions), and the planner's optional
edges leave such pairs alone. Conv2D -> BiasAdd is stricter: the merge then
checks that each node has exactly two inputs, control inputs included, and
aborts the process otherwise, so neither node of such a pair may gain a
control input at all.
"""

from __future__ import annotations

import dataclasses

from sntf.graph import optable


@dataclasses.dataclass(frozen=True)
class MergePair:
    """Two nodes the oneDNN pass would merge (indices into a GraphIndex).

    Attributes:
      first, second: the pair, producer (or filter gradient) first.
      strict: neither node may gain a control input: the merge aborts the
        process unless neither has one (Conv2D -> BiasAdd, and a pair that
        shares a node with such a pair).
    """

    first: int
    second: int
    strict: bool


def merge_pairs(g) -> tuple:
    """Every pair of g's nodes TensorFlow's oneDNN pass would consider merging.

    Attributes, data types and padding, which the pass also checks, are not
    checked here: a pair it would not merge for those reasons only gets
    control edges it did not need.

    Args:
      g: a GraphIndex.

    Returns:
      MergePair values, in node order.
    """
    return g.of_data_edges("merge_pairs", _merge_pairs)


def _merge_pairs(g) -> tuple:
    pairs = []
    for node, op in enumerate(g.ops):
        inputs = g.data_inputs[node]
        if op == optable.BIAS_ADD_OP and inputs:
            producer, port = inputs[0]
            # Merged only where the convolution feeds nothing else.
            if (port == 0 and g.ops[producer] == optable.CONV2D_OP
                    and all(c == node for c, _, p in g.consumers[producer] if p == 0)):
                pairs.append(MergePair(producer, node, strict=True))
        elif op in optable.PAD_MERGED_CONVOLUTIONS and inputs:
            producer, port = inputs[0]
            # Merged only where the Pad feeds nothing else.
            if (port == 0 and g.ops[producer] in optable.PAD_OPS
                    and all(c == node for c, _, p in g.consumers[producer] if p == 0)):
                pairs.append(MergePair(producer, node, strict=False))
        elif op == optable.BIAS_ADD_GRAD_OP and inputs:
            gradient = inputs[0]
            pairs += [MergePair(c, node, strict=False)
                      for c, slot, port in g.consumers[gradient[0]]
                      if port == gradient[1] and slot == 2
                      and g.ops[c] == optable.CONV_BACKPROP_FILTER_OP]
    # The pass merges only nodes placed on one device.
    pairs = [p for p in pairs if g.devices[p.first] == g.devices[p.second]]
    # A node of a Conv2D -> BiasAdd pair may gain no control input, so a
    # pair it also belongs to cannot be kept merged by giving it one.
    strict = {n for p in pairs if p.strict for n in (p.first, p.second)}
    return tuple(dataclasses.replace(p, strict=True)
                 if {p.first, p.second} & strict else p for p in pairs)


def merge_members(g) -> dict:
    """Node index -> the MergePair it belongs to (the last one, if several)."""
    members = {}
    for pair in merge_pairs(g):
        members[pair.first] = members[pair.second] = pair
    return members


def merged_kernels(g) -> dict:
    """Node index -> the node oneDNN's pass merges into its kernel (the
    executor then runs the two as one; analysis.schedule)."""
    return {pair.first: pair.second for pair in merge_pairs(g)}
