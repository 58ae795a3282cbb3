"""Liveness: which buffer every tensor lives in, and the steps each lives.

The executor's and the CPU allocator's rules, as the memory model
(sntf.analysis.memory) counts them: an op's outputs are allocated when it
runs; views and element-wise kernels that can share an input's buffer do;
variables and constants are persistent; a buffer is freed after the last
reader of every tensor in it.
"""

from __future__ import annotations

import collections
from typing import Optional

from sntf.analysis.costs import has_workspace, workspace_bytes
from sntf.analysis.facts import SCRATCH_PORT, VARIABLE_PORT
from sntf.analysis.shapes import concrete, rounded, shape_of
from sntf.graph import optable
from sntf.graph.index import GraphIndex
from sntf.graph.training import handle_root


# How Liveness places an op's outputs (_placing): most ops allocate each
# output a buffer of its own (_PLAIN); a forwarding kernel takes over an
# input's buffer where it can (_FORWARD); a view shares its input's buffer
# (_ALIAS); a handle or a resource op holds none (_FREE); the others, and
# what the fast paths do not settle, are decided per output (_place).
# A constant's outputs are persistent (_PERSISTENT).
_PLAIN, _FORWARD, _ALIAS, _FREE, _PERSISTENT, _SPECIAL = range(6)


def _placing(ops: tuple) -> list:
    """Per op, how its outputs are placed, in the order _place tests."""
    kinds = {}
    for op in set(ops):
        kinds[op] = (_SPECIAL if op in optable.REDUCTION_OPS else
                     _FREE if op in optable.FREE_OPS else
                     _ALIAS if op in optable.ALIAS_OPS else
                     _PERSISTENT if op in optable.PERSISTENT_OPS else
                     _FORWARD if op in optable.FORWARDING_OPS else _PLAIN)
    return [kinds[op] for op in ops]


class Liveness:
    """Which buffer every tensor lives in, and the steps each buffer lives.

    Aliases share their source's buffer; forwarding kernels take over an
    input buffer of the same size that they read last; a variable's reads
    share the variable's persistent buffer.
    """

    def __init__(self, g: GraphIndex, order, properties, sizes: dict):
        self.g, self.order, self.properties, self.sizes = g, order, properties, sizes
        self.step_of = {node: s for s, node in enumerate(order)}
        self.owner: dict = {}          # tensor -> buffer id
        self.tensors = collections.defaultdict(list)   # buffer id -> its tensors
        self.buffer_bytes: dict = {}   # buffer id -> rounded bytes
        self.buffer_free: dict = {}    # buffer id -> last step any alias is read
        self.buffer_alloc: dict = {}   # buffer id -> step allocated
        self.persistent: set = set()
        # Per node, its output tensors; most nodes have one output.
        self.outputs_of = outputs_of(g, properties)
        self.last_use = self._last_uses()
        self.fetched = self._fetched()
        self._run_all()
        for t in self.fetched:
            b = self.owner.get(t)
            if b is not None:
                self.buffer_free[b] = len(order)

    def _last_uses(self) -> dict:
        """tensor -> the step of its last consumer."""
        last_use = {}
        data_inputs = self.g.data_inputs
        for s, i in enumerate(self.order):     # steps ascending: the last wins
            for t in data_inputs[i]:
                last_use[t] = s
        return last_use

    def _fetched(self) -> set:
        """Tensors the step hands back: alive to its end."""
        g, fetched = self.g, set()
        for f in g.fetch:
            for p, port in g.data_inputs[f]:
                fetched.add((p, port))
            if g.ops[f] != "_Retval":
                fetched.update((f, port) for port in
                               range(len(self.properties.get(g.names[f], ()))))
        fetched.update(t for i, op in enumerate(g.ops) if op == "_Retval"
                       for t in g.data_inputs[i])
        return fetched

    def _allocate(self, t, s: int, persistent: bool = False, buffer=None) -> None:
        b = t if buffer is None else buffer
        self.owner[t] = b
        self.tensors[b].append(t)
        if persistent:
            self.buffer_bytes.setdefault(b, rounded(self.sizes[t]))
            self.buffer_alloc[b] = -1
            self.persistent.add(b)
        else:
            self.buffer_bytes[b] = rounded(self.sizes[t])
            self.buffer_alloc[b] = s

    def _share(self, t, b) -> None:
        """Output t lives in buffer b, which another tensor allocated."""
        self.owner[t] = b
        self.tensors[b].append(t)

    def _place(self, s: int, i: int, t) -> None:
        """Decides the buffer of output t of node i, run at step s."""
        op, inputs, owner = self.g.ops[i], self.g.data_inputs[i], self.owner
        if op in optable.REDUCTION_OPS and t[1] == 0 and self._reduces_nothing(i):
            self._share(t, owner[inputs[0]])
            return
        if op in optable.FREE_OPS or self.sizes.get(t, 0) == 0:
            return
        if op in optable.ALIAS_OPS:
            if inputs and inputs[0] in owner:
                self._share(t, owner[inputs[0]])
                return
            if op in optable.CONTROL_FLOW_OPS:
                return      # a handle or an input carried into a frame or branch
            if inputs and self._reads_variable(inputs[0][0]):
                # A read of a variable is a view of the variable's buffer:
                # persistent, and counted once however often it is read.
                root = handle_root(self.g, inputs[0][0])
                self._allocate(t, s, persistent=True, buffer=(root, VARIABLE_PORT))
                return
        if op in optable.PERSISTENT_OPS:
            self._allocate(t, s, persistent=True)
            return
        reused = None
        if op in optable.FORWARDING_OPS and t[1] == 0:
            reused = self._forwardable_input(inputs, rounded(self.sizes[t]), s)
        if reused is not None:
            self._share(t, reused)
        else:
            self._allocate(t, s)

    def _run_all(self) -> None:
        """Places every op's outputs, step by step, and extends the life of
        every buffer an op reads and writes to its step (steps run in order:
        each is the latest yet). The common cases are _place's, inline."""
        owner, free, place = self.owner, self.buffer_free, self._place
        data_inputs, outputs_of = self.g.data_inputs, self.outputs_of
        placing, sizes, tensors = _placing(self.g.ops), self.sizes, self.tensors
        buffer_bytes, buffer_alloc = self.buffer_bytes, self.buffer_alloc
        forwardable = self._forwardable_input
        persistent = self.persistent
        for s, i in enumerate(self.order):
            outputs, inputs, kind = outputs_of[i], data_inputs[i], placing[i]
            if kind == _PLAIN or kind == _FORWARD:
                # Each output with bytes gets a buffer of its own (_allocate),
                # but where a forwarding kernel takes over an input's. Only
                # the first output is forwarded, before any other is placed.
                for t in outputs:
                    n = sizes.get(t, 0)
                    if not n:
                        continue
                    b = (forwardable(inputs, rounded(n), s)
                         if kind == _FORWARD and t[1] == 0 else None)
                    if b is None:
                        owner[t] = t
                        tensors[t] = [t]
                        buffer_bytes[t] = rounded(n)
                        buffer_alloc[t] = free[t] = s
                    else:
                        owner[t] = b
                        tensors[b].append(t)
                        free[b] = s
            elif kind == _PERSISTENT:
                for t in outputs:
                    n = sizes.get(t, 0)
                    if n:
                        owner[t] = t
                        tensors[t] = [t]
                        buffer_bytes.setdefault(t, rounded(n))
                        buffer_alloc[t] = -1
                        persistent.add(t)
                        free[t] = s
            else:
                if kind == _ALIAS:
                    for t in outputs:
                        if sizes.get(t, 0) and inputs and inputs[0] in owner:
                            b = owner[inputs[0]]
                            owner[t] = b
                            tensors[b].append(t)
                        else:
                            place(s, i, t)
                elif kind == _SPECIAL:
                    for t in outputs:
                        place(s, i, t)
                for t in outputs:
                    b = owner.get(t)
                    if b is not None:
                        free[b] = s
            for t in inputs:
                b = owner.get(t)
                if b is not None:
                    free[b] = s

    def _reduces_nothing(self, i: int) -> bool:
        """Whether reduction i keeps every element of its input: its output
        is as large, or, its size unknown, every reader reshapes it to a
        known size that is (a Reshape keeps the element count)."""
        g, inputs = self.g, self.g.data_inputs[i]
        need = self.sizes.get(inputs[0], 0) if inputs and inputs[0] in self.owner else 0
        if not need:
            return False
        if self.sizes.get((i, 0), 0) == need:
            return True
        readers = [c for c, _, port in g.consumers[i] if port == 0]
        return bool(readers) and all(g.ops[c] == optable.RESHAPE_OP and self.sizes.get((c, 0)) == need
                                     for c in readers)

    def _reads_variable(self, producer: int) -> bool:
        """Whether a tensor comes from a resource handle (through Identity ops)."""
        return self.g.ops[handle_root(self.g, producer)] in optable.FREE_OPS

    def _forwardable_input(self, inputs, need: int, step: int):
        """The buffer of an input this op reads last and can overwrite, if any."""
        owner, persistent, fetched = self.owner, self.persistent, self.fetched
        last_use = self.last_use
        for t in inputs:
            b = owner.get(t)
            if b is None or b in persistent or t in fetched:
                continue
            # need > 0: a buffer of another size, or none, is not taken over.
            if self.buffer_bytes.get(b) != need:
                continue
            # Every tensor living in the buffer must be done by this step.
            if self.buffer_free.get(b, -1) > step:
                continue
            for other in self.tensors[b]:
                if last_use.get(other, -1) > step or other in fetched:
                    break
            else:
                return b
        return None

    def input_shapes(self, i: int) -> list:
        return input_shapes(self.g, self.properties, i)

    def itemsize(self, i: int) -> int:
        return itemsize(self.g, self.properties, i)

    def add_scratch(self, batch: Optional[int], threads: int, onednn: bool) -> None:
        """Scratch buffers: live only while their op runs."""
        ops = self.g.ops
        for s, i in enumerate(self.order):
            if not has_workspace(ops[i], onednn):
                continue
            outs = self.properties.get(self.g.names[i], ())
            ws = workspace_bytes(self.g.ops[i],
                                 [concrete(x, batch) for x in self.input_shapes(i)],
                                 [concrete(o[1], batch) for o in outs],
                                 self.itemsize(i), threads, onednn)
            if ws:
                b = (i, SCRATCH_PORT)
                self.buffer_bytes[b] = rounded(ws)
                self.buffer_alloc[b] = s
                self.buffer_free[b] = s

    def handover(self) -> dict:
        """Buffer -> the variable buffer it becomes: the value of an
        AssignVariableOp that reads it last, which the kernel adopts
        (forward_input) instead of copying it into the variable."""
        found = {}
        for i in self.g.of_data_edges("assignments", _assignments):
            inputs = self.g.data_inputs[i]
            if i not in self.step_of:
                continue
            b = self.owner.get(inputs[1])
            target = (handle_root(self.g, inputs[0][0]), VARIABLE_PORT)
            if (b is not None and b not in self.persistent and target in self.persistent
                    and self.buffer_free.get(b) == self.step_of[i]
                    and self.buffer_bytes[b] == self.buffer_bytes[target]
                    and not any(t in self.fetched for t in self.tensors[b])):
                found[b] = target
        return found

    def release(self) -> tuple[dict, dict]:
        """Drops what only the timeline needs, and the shapes and sizes
        (the lower bound and the op costs, computed when first read, find
        them again): what an analysis keeps for them is its buffers.
        Returns (buffer -> bytes, tensor -> buffer) as plain dicts, which
        it keeps in their place, so that an analysis and this share them."""
        del self.step_of, self.last_use, self.buffer_free, self.buffer_alloc, self.fetched
        del self.properties, self.sizes, self.outputs_of
        return self.buffer_bytes, self.owner

    def persistent_bytes(self) -> int:
        return sum(self.buffer_bytes[b] for b in self.persistent)

    def intervals(self) -> dict:
        """Buffer -> (allocating step, last step), persistent buffers aside."""
        alloc, free, persistent = self.buffer_alloc, self.buffer_free, self.persistent
        return {b: (start, free.get(b, start)) for b, start in alloc.items()
                if b not in persistent}


def _assignments(g: GraphIndex) -> tuple:
    """The AssignVariableOps of a graph that have a value input."""
    return tuple(i for i, op in enumerate(g.ops)
                 if op == optable.ASSIGN_VARIABLE_OP and len(g.data_inputs[i]) >= 2)


def outputs_of(g: GraphIndex, properties) -> list:
    """Per node, its output tensors (most nodes have one)."""
    outputs = properties.get
    return [[(i, 0)] if k == 1 else [(i, port) for port in range(k)]
            for i, k in enumerate(len(outputs(name, ())) for name in g.names)]


def input_shapes(g: GraphIndex, properties, i: int) -> list:
    return [shape_of(properties, g, t) for t in g.data_inputs[i]]


def itemsize(g: GraphIndex, properties, i: int) -> int:
    outs = properties.get(g.names[i])
    return optable.DTYPE_BYTES.get(outs[0][0], 4) if outs else 4
