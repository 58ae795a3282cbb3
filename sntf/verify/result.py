"""The verifier's result and its text, and the rows that show the first
differing op's inputs in both graphs. Nothing here imports TensorFlow."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Optional, Sequence

from sntf.graph import names
from sntf.graph.index import parse_input
from sntf.verify.core import (CLONE, DIFFERENT, DIGEST_CHARS, IDENTICAL,
                              IDENTICAL_UP_TO_SUM_ORDER, KINDS, NONDETERMINISTIC,
                              REF_WRITERS, SAME_RESULTS, SKIP_REF, SWAP_IN, SWAP_OUT, TENSOR,
                              Node, Pair, comparable)

@dataclasses.dataclass(frozen=True)
class InputDigest:
    """One input of the first differing op, in both graphs.

    Attributes:
      slot: the data input's slot, or -1 for a value written into a ref
        input (`via` names the writer).
      original, rewritten: the input tensor in each graph ('' where the op
        has no such input there).
      original_digest, rewritten_digest: sha256 hex digests, or None where
        not fetched (`note` says why).
      via: for a value written into a ref input: the writer node (an
        AssignAdd of Grappler's accumulators) in each graph, "orig | rew".
      note: why a digest is missing, or ''.
    """

    slot: int
    original: str
    rewritten: str
    original_digest: Optional[str]
    rewritten_digest: Optional[str]
    via: str = ""
    note: str = ""

    @property
    def same(self) -> Optional[bool]:
        """Whether both digests are known and equal (None if not both known)."""
        if self.original_digest is None or self.rewritten_digest is None:
            return None
        return self.original_digest == self.rewritten_digest


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """What sntf.verify / verify_graphs found.

    Attributes:
      verdict: "identical" (every compared tensor and variable holds the
        same bits); "identical_up_to_sum_order" (every tensor holds the same
        bits from identical inputs, but for the sums in `ordered_sums`,
        which TensorFlow adds in the order their terms arrive: the
        rewritten graph adds the same terms, bit for bit, in one order it
        holds); "different" (an op of the rewritten graph computes other
        bits from identical inputs); or "nondeterministic" (the original
        graph does not repeat its own bits from the same inputs, so no
        difference can be blamed on the rewrite; `first_op` names its first
        tensor that did not repeat). `ok` is true for the first two.
      first_op, first_op_type: the first differing op in the original
        graph's topological order (the rewritten node: a clone or a swap-in
        where that is what differs), or None.
      first_tensor, first_original_tensor: its differing output in the
        rewritten graph and the original tensor it must equal.
      first_kind: "tensor", "clone", "swap_out" or "swap_in".
      first_digests: (original, rewritten) sha256 hex digests of it.
      inputs: the op's inputs in both graphs with their digests.
      first_variable: the first variable (in argument order) whose value
        after the update differs, or None.
      tensors_compared: pairs of tensors compared (all kinds).
      tensors_total: pairs there were to compare.
      clones_compared, swap_ins_compared, swap_outs_compared: of those, how
        many were recomputed clones, swapped-in and parked tensors.
      variables_compared, variables_differing: variables compared after
        the update, and how many differed.
      outputs_compared: the step's outputs (its _Retval values) compared.
      skipped: reason -> original outputs not compared.
      original_only, rewritten_only: comparable outputs with no
        counterpart in the other graph.
      chunks_run, chunks_total: chunks compared (the verifier stops after
        the first chunk with a difference) and chunks there were.
      runs: Session runs made (both graphs together).
      graph, policy, action: the graph's name, the policy and what sntf did
        with it (from its report; '' when verify_graphs was called directly).
      nodes: (original, rewritten) node counts.
      ordered_sums: the sums whose bits differ only by the order of their
        terms (DestroyTemporaryVariable nodes of Grappler's accumulators).
      sums_checked: order-dependent sums checked from identical terms.
      notes: anything else worth saying.
      seconds: wall time.
    """

    verdict: str
    first_op: Optional[str] = None
    first_op_type: Optional[str] = None
    first_tensor: Optional[str] = None
    first_original_tensor: Optional[str] = None
    first_kind: Optional[str] = None
    first_digests: Optional[tuple] = None
    inputs: tuple = ()
    first_variable: Optional[str] = None
    tensors_compared: int = 0
    tensors_total: int = 0
    clones_compared: int = 0
    swap_ins_compared: int = 0
    swap_outs_compared: int = 0
    variables_compared: int = 0
    variables_differing: int = 0
    outputs_compared: int = 0
    skipped: dict = dataclasses.field(default_factory=dict)
    original_only: int = 0
    rewritten_only: int = 0
    chunks_run: int = 0
    chunks_total: int = 0
    runs: int = 0
    graph: str = ""
    policy: str = ""
    action: str = ""
    nodes: tuple = (0, 0)
    ordered_sums: tuple = ()
    sums_checked: int = 0
    notes: tuple = ()
    seconds: float = 0.0

    @property
    def identical(self) -> bool:
        """Whether the verdict is "identical": every bit as TensorFlow's."""
        return self.verdict == IDENTICAL

    @property
    def ok(self) -> bool:
        """Whether the rewrite computes what TensorFlow's step computes: the
        verdict is "identical" or "identical_up_to_sum_order"."""
        return self.verdict in SAME_RESULTS

    def text(self) -> str:
        """The report, several lines (no trailing newline)."""
        return "\n".join(report_lines(self))

    def __str__(self) -> str:
        return self.text()


def short(hexdigest: Optional[str]) -> str:
    """A digest as the report prints it."""
    return "(not fetched)" if hexdigest is None else hexdigest[:DIGEST_CHARS]


def counted(pairs: Iterable[Pair]) -> dict:
    """kind -> number of pairs."""
    counts = dict.fromkeys(KINDS, 0)
    for pair in pairs:
        counts[pair.kind] += 1
    return counts


def report_lines(result: VerifyResult) -> list:
    """The lines of VerifyResult.text()."""
    head = "sntf.verify"
    if result.graph:
        head += f": {result.graph}"
    verdict = result.verdict.upper()
    if result.verdict == IDENTICAL_UP_TO_SUM_ORDER:
        count = len(result.ordered_sums)
        verdict = f"IDENTICAL UP TO THE ORDER OF {count} SUM{'S' if count != 1 else ''}"
    lines = [f"{head}: {verdict}"]
    about = []
    if result.policy:
        about.append(f"policy '{result.policy}'")
    if result.action:
        about.append(f"graph {result.action}")
    about.append(f"{result.nodes[0]} -> {result.nodes[1]} nodes")
    lines.append("  " + ", ".join(about))
    if result.first_op is not None:
        what = {DIFFERENT: "first differing op",
                NONDETERMINISTIC: "first op the original graph does not repeat"
                }[result.verdict]
        lines.append(f"  {what}: {result.first_op} ({result.first_op_type})")
        kind = {TENSOR: "", CLONE: ", a recomputed clone",
                SWAP_IN: ", a swapped-in tensor", SWAP_OUT: ", a swap-out's parked copy"}
        lines.append(f"    output {result.first_tensor}{kind.get(result.first_kind, '')}"
                     + (f" (of {result.first_original_tensor})"
                        if result.first_original_tensor != result.first_tensor else ""))
        if result.first_digests:
            first, second = result.first_digests
            label = ("original", "rewritten") if result.verdict == DIFFERENT else (
                "1st run", "2nd run")
            lines.append(f"    {label[0]:<9} sha256 {short(first)}")
            lines.append(f"    {label[1]:<9} sha256 {short(second)}")
        if result.inputs:
            lines.append("    inputs (original | rewritten):")
            for row in result.inputs:
                lines.append("      " + input_line(row))
    if result.ordered_sums:
        shown = ", ".join(result.ordered_sums[:8]) + (
            f" and {len(result.ordered_sums) - 8} more" if len(result.ordered_sums) > 8 else "")
        lines.append(f"  same terms, fixed order ({len(result.ordered_sums)} of "
                     f"{result.sums_checked} order-dependent sums): {shown}")
    if result.first_variable is not None:
        lines.append(f"  first variable that differs after the update: "
                     f"{result.first_variable} ({result.variables_differing} of "
                     f"{result.variables_compared} differ)")
    lines.append(f"  compared: {result.tensors_compared} of {result.tensors_total} "
                 f"tensor pairs ({result.clones_compared} recomputed clones, "
                 f"{result.swap_ins_compared} swapped-in, {result.swap_outs_compared} "
                 f"parked), {result.variables_compared} variables after the update, "
                 f"{result.outputs_compared} step outputs; {result.runs} runs")
    if result.chunks_run < result.chunks_total:
        lines.append(f"  stopped after chunk {result.chunks_run} of {result.chunks_total}"
                     " (the first with a difference)")
    left = [f"{count} {why}" for why, count in sorted(result.skipped.items()) if count]
    if left:
        lines.append("  not compared (outputs of the original): " + ", ".join(left))
    if result.original_only or result.rewritten_only:
        lines.append(f"  without a counterpart: {result.original_only} original, "
                     f"{result.rewritten_only} rewritten outputs")
    for note in result.notes:
        lines.append(f"  note: {note}")
    return lines


def input_line(row: InputDigest) -> str:
    """One input row of the report."""
    if row.slot >= 0:
        label = f"{row.slot}"
    else:
        label = f"via {row.via}:"
    if row.original == row.rewritten:
        names_text = row.original
    else:
        names_text = f"{row.original or '-'} | {row.rewritten or '-'}"
    if row.note:
        digests = row.note
    else:
        digests = f"{short(row.original_digest)} | {short(row.rewritten_digest)}"
        if row.same is not None:
            digests += "  same" if row.same else "  DIFFERENT"
    return f"{label} {names_text}  {digests}"


def data_inputs(node: Node) -> list:
    """A node's data inputs as "node:port" names, in slot order."""
    out = []
    for text in node.inputs:
        src, port, control = parse_input(text)
        if not control:
            out.append(names.tensor_name(src, port))
    return out


def ref_writers(producer: str, port: int, nodes: Sequence[Node]) -> list:
    """The nodes that write a value into a ref output (Grappler's
    accumulators: AssignAdd into a TemporaryVariable), with the tensor each
    writes, in the given order.

    Args:
      producer, port: the ref output.
      nodes: the graph's nodes.

    Returns:
      [(writer name, its op, the "node:port" value it writes)].
    """
    target = names.tensor_name(producer, port)
    out = []
    for n in nodes:
        if n.op not in REF_WRITERS:
            continue
        inputs = data_inputs(n)
        if inputs and inputs[0] == target and len(inputs) > 1:
            out.append((n.name, n.op, inputs[-1]))
    return out


def input_rows(pair: Pair, original: Sequence[Node], rewritten: Sequence[Node]) -> list:
    """What to show of the first differing op's inputs: per data slot, the
    input tensor in each graph; for a ref input (not fetchable), also the
    values its writers write, as rows of their own; for a swap, the
    swapped-out tensor and the parked value (or ticket) the swap-in reads.

    Args:
      pair: the first differing pair.
      original, rewritten: the graphs' nodes.

    Returns:
      [(slot, original tensor, rewritten tensor, via)] where via is '' or
      "writer | writer" for a ref input's written value (slot -1).
    """
    orig = {n.name: n for n in original}
    rew = {n.name: n for n in rewritten}
    r_node = rew[pair.node]
    if pair.kind in (SWAP_IN, SWAP_OUT):
        parked = data_inputs(r_node)
        return [(0, pair.original, parked[0] if parked else "", "")]
    o_node = orig[names.split_tensor(pair.original)[0]]
    o_inputs, r_inputs = data_inputs(o_node), data_inputs(r_node)
    rows = []
    for slot in range(max(len(o_inputs), len(r_inputs))):
        o_in = o_inputs[slot] if slot < len(o_inputs) else ""
        r_in = r_inputs[slot] if slot < len(r_inputs) else ""
        rows.append((slot, o_in, r_in, ""))
        o_ref = _ref_output(o_in, orig)
        r_ref = _ref_output(r_in, rew)
        if o_ref or r_ref:
            o_w = ref_writers(*names.split_tensor(o_in), original) if o_ref else []
            r_w = ref_writers(*names.split_tensor(r_in), rewritten) if r_ref else []
            r_by_name = {w[0]: w for w in r_w}
            for name, op, value in o_w:
                match = r_by_name.pop(name, None)
                rows.append((-1, value, match[2] if match else "",
                             f"{name} ({op})" if match else f"{name} ({op}) | -"))
            for name, op, value in r_by_name.values():
                rows.append((-1, "", value, f"- | {name} ({op})"))
    return rows


def _ref_output(tensor: str, nodes: Mapping[str, Node]) -> bool:
    if not tensor:
        return False
    node, port = names.split_tensor(tensor)
    n = nodes.get(node)
    return bool(n and port < len(n.outputs) and comparable(n.outputs[port]) == SKIP_REF)
