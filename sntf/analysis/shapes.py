"""Tensor sizes from static properties, with a symbolic batch dimension.

Static shapes come from Grappler's shape inference, handed over by the
plugin as serialized OpInfo.TensorProperties. Dims it cannot compute are
negative ids (equal ids are equal dims); the batch is usually one of them.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Optional, Sequence

from sntf.graph import names, optable
from sntf.graph.index import GraphIndex

# node name -> [(DataType enum, dims with -1 for unknown, or None)] per output.
Properties = Mapping[str, Sequence[tuple[int, Optional[tuple[int, ...]]]]]

ALLOCATION_GRANULE = 256  # TensorFlow's BFC allocator rounds to 256 bytes.
# Passes over the graph that solve symbolic dims; each pass can only solve
# dims whose inputs an earlier pass solved.
MAX_RESOLVE_PASSES = 8


@dataclasses.dataclass(frozen=True)
class SymbolicSize:
    """Bytes as a linear form in the batch: const + per_batch * batch."""

    const: int = 0
    per_batch: int = 0
    known: bool = True

    def at(self, batch: Optional[int]) -> int:
        """Concrete bytes for a batch (an unknown batch counts as 1)."""
        return self.const + self.per_batch * (batch if batch else 1)


def tensor_size(dtype: int, shape: Optional[Sequence[int]]) -> SymbolicSize:
    """Size of a tensor from its static properties.

    Args:
      dtype: DataType enum value.
      shape: dims with -1 for unknown ones, or None for unknown rank.

    Returns:
      The size; an unknown first dimension is the batch, further unknown
      dimensions count as 1 (and mark the size as not fully known).
    """
    itemsize = optable.DTYPE_BYTES.get(dtype, 0)
    if itemsize == 0:
        # Resource and variant handles: no payload.
        return SymbolicSize(0, 0, known=dtype in optable.HANDLE_DTYPES)
    if shape is None:
        return SymbolicSize(itemsize, 0, known=False)
    known_elems, unknown = 1, 0
    for d in shape:
        if d is None or d < 0:
            unknown += 1
        else:
            known_elems *= d
    if unknown == 0:
        return SymbolicSize(itemsize * known_elems, 0)
    return SymbolicSize(0, itemsize * known_elems, known=unknown == 1)


def rounded(n: int) -> int:
    """Bytes the allocator actually reserves for a request of n bytes."""
    if n <= 0:
        return 0
    return -(-n // ALLOCATION_GRANULE) * ALLOCATION_GRANULE


def concrete(shape: Optional[tuple], batch: Optional[int]) -> Optional[tuple]:
    """A static shape with unknown dims set to the batch (None stays None)."""
    if shape is None:
        return None
    return tuple(d if d >= 0 else (batch or 1) for d in shape)


def shape_of(properties: Properties, g: GraphIndex, t) -> Optional[tuple]:
    """The static shape of tensor t (node, port), or None."""
    outputs = properties.get(g.names[t[0]], ())
    if t[1] < len(outputs):
        return outputs[t[1]][1]
    return None


def decode_properties(raw: dict) -> dict:
    """Serialized OpInfo.TensorProperties per node -> [(dtype, shape or None)].

    Args:
      raw: node name -> list of serialized TensorProperties (one per output).

    Returns:
      node name -> list of (DataType enum, dims with -1 for unknown, or None
      for an unknown rank).
    """
    from tensorflow.core.grappler.costs import op_performance_data_pb2 as perf

    decoded = {}
    for name, outputs in raw.items():
        items = []
        for data in outputs:
            p = perf.OpInfo.TensorProperties.FromString(data)
            shape = None if p.shape.unknown_rank else tuple(d.size for d in p.shape.dim)
            items.append((p.dtype, shape))
        decoded[name] = items
    return decoded


def with_generated(props: Properties, index: GraphIndex) -> dict:
    """Static properties extended to sntf's nodes: a recomputed clone has its
    source's outputs, a swap node the one tensor it moves.

    Args:
      props: the properties of the graph before the rewrite.
      index: the rewritten graph's index.

    Returns:
      A new dict, with an entry for every generated node it can tell.
    """
    extended = dict(props)
    for name in index.names:
        if name in extended:
            continue
        source = names.recompute_source(name)
        if source in props:
            extended[name] = props[source]
            continue
        swapped = names.swap_source(name)
        if swapped is not None:
            node, port = swapped
            node = names.recompute_source(node) or node
            if node in props and port < len(props[node]):
                extended[name] = [props[node][port]]
    return extended


def has_unknown_dims(properties: Properties) -> bool:
    """Whether any output has an unknown dimension (usually the batch)."""
    for outputs in properties.values():
        for _, shape in outputs:
            if shape is None or any(d < 0 for d in shape):
                return True
    return False


class CountedProperties(dict):
    """Resolved properties, plus element counts known for tensors whose
    shape still holds unsolved dims (name, port) -> (elements, batch power)."""

    def __init__(self, data, counts):
        super().__init__(data)
        self.counts = counts


def resolve_symbolic_dims(g: GraphIndex, properties: Properties) -> Properties:
    """Static shapes with Grappler's symbolic dims resolved where the graph
    determines them.

    Shape inference marks dims it cannot compute with negative ids; equal
    ids are equal dims. Keras' UpSampling2D, for one, reshapes through a
    computed shape, so a U-Net's decoder tensors come out as (-2, 32, 32,
    -32) and would be sized as one channel; a Dense layer on a sequence
    (Tensordot) multiplies batch and length into one symbolic dim. A dim is
    solved as n * batch**p: from element counts (a reshape keeps them; a tile
    multiplies them by the ratio of its known dims), concatenations (the
    joined axis sums its inputs) and element-wise ops (an output dim equals
    an input's). The batch - the id most often first - stays symbolic.

    Args:
      g: the graph index.
      properties: node name -> [(dtype, shape or None)].

    Returns:
      The properties with every dim solved to a number replaced by it; its
      `counts` maps (name, port) to (elements per batch**power, power) for
      tensors whose shape keeps a dim that holds the batch.
    """
    solver = _DimSolver(g, properties)
    for _ in range(MAX_RESOLVE_PASSES):
        if not solver.sweep():
            break
    if not solver.value and not solver.counts:
        return properties
    return solver.resolved()


class _DimSolver:
    """The state of resolve_symbolic_dims: what each symbol is worth, and
    the element counts known per tensor."""

    def __init__(self, g: GraphIndex, properties: Properties):
        self.g, self.properties = g, properties
        # Grappler gives the batch several ids across a graph: every id that
        # comes first in a shape counts as the batch until an element count
        # proves it a multiple of it (a sequence model's batch * length).
        self.firsts = collections.Counter(
            shape[0] for outs in properties.values() for _, shape in outs
            if shape and shape[0] is not None and shape[0] < 0)
        self.batch_ids = set(self.firsts)
        self.value: dict = {}     # symbol -> (n, p): the dim is n * batch**p
        self.counts: dict = {}    # (node, port) -> (n, p) of its element count

    def dim(self, d):
        if d is None:
            return None
        if d >= 0:
            return (d, 0)
        if d in self.value:
            return self.value[d]
        return (1, 1) if d in self.batch_ids else None

    def product(self, shape):
        n, p = 1, 0
        for d in shape:
            v = self.dim(d)
            if v is None:
                return None
            n, p = n * v[0], p + v[1]
        return n, p

    def dims(self, t):
        outs = self.properties.get(self.g.names[t[0]], ())
        return outs[t[1]][1] if t[1] < len(outs) else None

    def count(self, t):
        shape = self.dims(t)
        return (self.product(shape) if shape is not None else None) or self.counts.get(t)

    def solve(self, symbol, v) -> bool:
        # -1 is "unknown" with no identity; a dim is never 0 or fractional.
        if symbol == -1 or symbol in self.value or v is None or v[0] <= 0 or v[1] < 0:
            return False
        self.value[symbol] = v
        return True

    def sweep(self) -> bool:
        """One pass over the graph in a topological order of its data
        edges; whether it solved any symbol. What is solved depends on the
        data edges alone, so graphs that differ in control edges resolve
        alike."""
        changed = False
        for i in self.g.data_topo:
            op, inputs = self.g.ops[i], self.g.data_inputs[i]
            outs = self.properties.get(self.g.names[i], ())
            if not outs or not inputs or outs[0][1] is None:
                continue
            out = outs[0][1]
            todo = [k for k, d in enumerate(out) if self.dim(d) is None]
            if op in optable.SAME_COUNT_OPS or op == optable.TILE_OP:
                changed |= self._same_count(i, op, inputs, out, todo)
            elif op in optable.CONCAT_OPS and todo:
                changed |= self._concat(op, inputs, out, todo)
            elif op in optable.ELEMENTWISE_OPS and todo:
                changed |= self._elementwise(inputs, out, todo)
        return changed

    def _tiled(self, inputs, out, n):
        """A Tile's output elements from its input's n: (n, whether every
        multiple is known), or None when the shapes do not line up."""
        shape_in = self.dims(inputs[0])
        if shape_in is None or len(shape_in) != len(out):
            return None
        for a, b in zip(shape_in, out):
            if a == b:
                continue
            a, b = self.dim(a), self.dim(b)
            if a is None or b is None or a[1] != b[1] or b[0] % a[0]:
                return n, False
            n *= b[0] // a[0]
        return n, True

    def _same_count(self, i, op, inputs, out, todo) -> bool:
        """Reshapes, views and tiles: the output's count gives its dims."""
        out_t = (i, 0)
        src = self.count(inputs[0])
        if src is None:
            return False
        n, p = src
        if op == optable.TILE_OP:
            tiled = self._tiled(inputs, out, n)
            if tiled is None:
                return False
            n, complete = tiled
            if complete:
                self.counts.setdefault(out_t, (n, p))
            if out_t not in self.counts:
                return False
        else:
            self.counts.setdefault(out_t, (n, p))
        if len(todo) == 1:
            rest = self.product(d for k, d in enumerate(out) if k != todo[0])
            if rest and n % rest[0] == 0:
                return self.solve(out[todo[0]], (n // rest[0], p - rest[1]))
        elif not todo and out and out[0] in self.batch_ids and out[0] not in self.value:
            # A first dim taken for the batch: the counts may say it is a
            # multiple of it.
            rest = self.product(out[1:])
            if rest and n % rest[0] == 0 and (n // rest[0], p - rest[1]) != (1, 1):
                return self.solve(out[0], (n // rest[0], p - rest[1]))
        return False

    def _concat(self, op, inputs, out, todo) -> bool:
        """The joined axis sums its inputs' dims; the others agree."""
        data = inputs[:-1] if op == "ConcatV2" else inputs[1:]
        shapes = [self.dims(t) for t in data]
        if any(x is None or len(x) != len(out) for x in shapes):
            return False
        changed = False
        for k in todo:
            vals = [self.dim(x[k]) for x in shapes]
            if any(v is None for v in vals) or len({v[1] for v in vals}) != 1:
                continue
            others_agree = all(self.dim(x[j]) == self.dim(out[j])
                               and self.dim(x[j]) is not None
                               for x in shapes for j in range(len(out)) if j != k)
            if others_agree:
                changed |= self.solve(out[k], (sum(v[0] for v in vals), vals[0][1]))
        return changed

    def _elementwise(self, inputs, out, todo) -> bool:
        """An output dim equals an input's that is not broadcast."""
        changed = False
        for t in inputs:
            x = self.dims(t)
            if x is None or len(x) != len(out):
                continue
            for k in todo:
                v = self.dim(x[k])
                if v is not None and v != (1, 0):
                    changed |= self.solve(out[k], v)
        return changed

    def resolved(self) -> CountedProperties:
        """The properties with solved dims replaced, and the counts kept."""
        # The batch's main id: the one most often first, of those still the batch.
        batch_id = next((d for d, _ in self.firsts.most_common()
                         if self.value.get(d, (1, 1)) == (1, 1)), None)
        value = self.value
        resolved, kept = {}, {}
        # shape -> (the shape resolved, its count where that says its size):
        # a graph has few distinct shapes.
        seen: dict = {}
        for name, outs in self.properties.items():
            new_outs = []
            for port, (dtype, shape) in enumerate(outs):
                if shape is not None:
                    shape = shape if isinstance(shape, tuple) else tuple(shape)
                    done = seen.get(shape)
                    if done is None:
                        total = self.product(shape)
                        new = tuple(d if d is None or d >= 0 or d not in value else
                                    value[d][0] if value[d][1] == 0 else
                                    batch_id if value[d] == (1, 1) else d for d in shape)
                        # A dim left symbolic (n * batch, or an id of the
                        # batch other than the main one): the count says
                        # the size.
                        left = total is not None and any(
                            d is not None and d < 0 and d != batch_id for d in new)
                        done = seen[shape] = (new, total if left else None)
                    shape, total = done
                    if total is not None:
                        kept[(name, port)] = total
                new_outs.append((dtype, shape))
            resolved[name] = new_outs
        for (node, port), c in self.counts.items():
            kept.setdefault((self.g.names[node], port), c)
        return CountedProperties(resolved, kept)
