"""Which node each rank of the job runs on, and which rank hosts each node's harnesses.

Role: with `harness.hosts=nodes` (docs/cluster.md, "Harness hosts on every node") every rank says its node's name
(`node_name`: torchrun's GROUP_RANK, srun's SLURM_NODEID, else the host name) over the control group at start;
`node_map` numbers the nodes by their first rank (rank 0's node is node 0, the controller's, whose executions the
controller plays itself) and names each other node's first rank as its harness host. `node_map` is pure.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["NodeMap", "gather_nodes", "node_map", "node_name"]


def node_name(env: Mapping[str, str]) -> str:
    """This process's node, the same string on each of its ranks: torchrun's GROUP_RANK, srun's SLURM_NODEID, else
    the host name (a plainly launched job runs on one machine)."""
    for variable in ("GROUP_RANK", "SLURM_NODEID"):
        if env.get(variable):
            return f"{variable.lower()}:{env[variable]}"
    return "host:" + socket.gethostname()


@dataclass(frozen=True)
class NodeMap:
    of_rank: tuple[int, ...]  # each rank's node (0: rank 0's)

    @property
    def hosts(self) -> dict[int, int]:
        """Node (1, 2, ...) -> its harness host: the node's first rank."""
        first: dict[int, int] = {}
        for rank, node in enumerate(self.of_rank):
            first.setdefault(node, rank)
        return {node: rank for node, rank in first.items() if node != 0}

    def hosted_by(self, rank: int) -> int | None:
        """The node whose harness host `rank` is, or None."""
        return next((node for node, first in self.hosts.items() if first == rank), None)


def node_map(names: Sequence[str]) -> NodeMap:
    """Nodes numbered in the order of their first rank, from each rank's node name (rank order)."""
    numbers: dict[str, int] = {}
    for name in names:
        numbers.setdefault(name, len(numbers))
    return NodeMap(tuple(numbers[name] for name in names))


def gather_nodes(job) -> NodeMap:
    """Every rank's node (a collective over the job's control group: every rank calls it)."""
    import torch.distributed as dist

    names: list[str | None] = [None] * job.world_size
    dist.all_gather_object(names, node_name(os.environ), group=job.groups.control_group)
    return node_map(names)
