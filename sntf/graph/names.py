"""Every generated node name and marker attribute, in one place.

The marker attribute on generated nodes is what makes the pass idempotent: a
graph that already holds sntf nodes is recognized and not planned again.
Leading-underscore attributes are allowed on any NodeDef and survive Grappler.
"""

from __future__ import annotations

SCOPE = "sntf"
# Attribute set on every node sntf creates; its string value names the role.
MARKER_ATTR = "_sntf_role"
ROLE_SWAP_OUT = "swap_out"
ROLE_SWAP_IN = "swap_in"
ROLE_RECOMPUTE = "recompute"
ROLES = (ROLE_SWAP_OUT, ROLE_SWAP_IN, ROLE_RECOMPUTE)

SWAP_OUT_OP = "SnSwapOut"
SWAP_IN_OP = "SnSwapIn"
CACHE_OUT_OP = "SnCacheOut"
CACHE_IN_OP = "SnCacheIn"


def swap_out_name(node: str, port: int) -> str:
    """Name of the SnSwapOut node that parks output `port` of `node`."""
    # The node's own scopes are kept and the port is always the last
    # component, so distinct tensors can never share a generated name.
    return f"{SCOPE}/swap_out/{node}/{port}"


def swap_in_name(node: str, port: int, index: int = 0) -> str:
    """Name of the index-th SnSwapIn node that restores output `port` of `node`."""
    return f"{SCOPE}/swap_in/{node}/{port}/{index}"


def recompute_name(node: str, index: int = 0) -> str:
    """Name of the index-th recomputed clone of `node`."""
    return f"{SCOPE}/recompute/{index}/{node}"


def tensor_name(node: str, port: int) -> str:
    """The "node:port" name of a node's output, as plans and reports write it."""
    return f"{node}:{port}"


def split_tensor(name: str) -> tuple[str, int]:
    """(node, port) of a "node:port" tensor name."""
    node, _, port = name.rpartition(":")
    return node, int(port)


def role_of(node_def) -> str:
    """The sntf role of a NodeDef ('' for nodes sntf did not create)."""
    if MARKER_ATTR not in node_def.attr:
        return ""
    return node_def.attr[MARKER_ATTR].s.decode("utf-8", "replace")


def mark(node_def, role: str) -> None:
    """Marks a NodeDef that sntf created."""
    if role not in ROLES:
        raise ValueError(f"unknown sntf role {role!r}; roles: {ROLES}")
    node_def.attr[MARKER_ATTR].s = role.encode("utf-8")


def recompute_source(name: str) -> str:
    """The original node a recompute clone was made from ('' if not a clone)."""
    prefix = f"{SCOPE}/recompute/"
    if not name.startswith(prefix):
        return ""
    _, _, rest = name[len(prefix):].partition("/")
    return rest


def swap_source(name: str) -> tuple[str, int] | None:
    """(node, port) a SnSwapOut/SnSwapIn node serves, or None for other names."""
    for kind in ("swap_out", "swap_in"):
        prefix = f"{SCOPE}/{kind}/"
        if name.startswith(prefix):
            parts = name[len(prefix):].split("/")
            if kind == "swap_in":
                parts = parts[:-1]          # the swap-in's index
            if len(parts) >= 2 and parts[-1].isdigit():
                return "/".join(parts[:-1]), int(parts[-1])
    return None
