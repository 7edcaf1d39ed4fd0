"""Human-readable dump of a trajectory tree (for `python -m gyre.traj.inspect --dump` and tests).

Contract: one header line, then one line per node in depth-first order, children in creation
order, two spaces of indentation per depth level:

    #<id> <PROVENANCE> n=<tokens> [<first ids>, ...]

SAMPLED nodes add `calls=<call indices>` (or `calls=-` for an echoed output with no recorded call
at this position) and the finish reason of their first call; leaves (candidate trajectories) end
with `<- leaf <path length> nodes`. The format is stable: tests compare it as exact strings.
"""

from __future__ import annotations

from gyre.traj.record import Provenance
from gyre.traj.tree import ROOT, TrajectoryTree

FIRST_IDS = 6


def format_ids(ids: object, limit: int = FIRST_IDS) -> str:
    values = list(ids)  # type: ignore[call-overload]
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}, ...]" if len(values) > limit else f"[{shown}]"


def node_line(tree: TrajectoryTree, node_id: int) -> str:
    node = tree.nodes[node_id]
    assert node.provenance is not None
    parts = [f"#{node.id}", node.provenance.name, f"n={node.num_tokens}", format_ids(node.ids)]
    if node.provenance is Provenance.SAMPLED:
        if node.calls:
            parts.append("calls=" + ",".join(str(c) for c in node.calls))
            parts.append(f"finish={tree.calls[node.calls[0]].response.finish_reason}")
        else:
            parts.append("calls=-")
    if node.is_leaf:
        parts.append(f"<- leaf {node.depth} nodes")
    return "  " * (node.depth - 1) + " ".join(parts)


def dump_tree(tree: TrajectoryTree) -> str:
    """The readable tree; the last line ends with a newline."""
    stats = tree.stats()
    lines = [
        f"execution {tree.execution}: {stats.requests} calls, {stats.unique_nodes} nodes, "
        f"{stats.tokens_stored} tokens, {stats.leaves} leaves"
    ]
    # Iterative depth-first walk: real trees are hundreds of nodes deep.
    stack = list(reversed(tree.nodes[ROOT].children.values()))
    while stack:
        node_id = stack.pop()
        lines.append(node_line(tree, node_id))
        stack.extend(reversed(tree.nodes[node_id].children.values()))
    return "\n".join(lines) + "\n"
