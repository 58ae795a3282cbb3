"""Which graph is "the same graph" across Grappler's two iterations."""

from __future__ import annotations

import hashlib
from typing import Sequence

from sntf.graph import optable

# Name scopes of nodes that Grappler's own optimizers create or rename.
GRAPPLER_SCOPES = ("ConstantFolding/", "ArithmeticOptimizer/", "LayoutOptimizer",
                   "DependencyOptimizer/", "Remapper/", "ScopedAllocator",
                   "LoopOptimizer/", "MemoryOptimizer/", "AutoMixedPrecision/")


def graph_key(graph_def, fetch: Sequence[str]) -> bytes:
    """Identity of "the same graph" across Grappler's two iterations.

    The second iteration sees the graph after other optimizers touched it, so
    its bytes differ; the names of its computing nodes do not, except for
    constants and nodes those optimizers generate under their own scopes.
    A graph they did change structurally gets a second report, which is the
    honest outcome.

    Args:
      graph_def: the GraphDef handed over.
      fetch: its fetch node names.

    Returns:
      A 16-byte digest.
    """
    stable = sorted(n.name for n in graph_def.node
                    if n.op not in optable.CONST_OPS
                    and not n.name.startswith(GRAPPLER_SCOPES))
    h = hashlib.blake2b(digest_size=16)
    for part in list(fetch) + ["|"] + stable:
        h.update(part.encode("utf-8", "replace") + b"\0")
    return h.digest()
