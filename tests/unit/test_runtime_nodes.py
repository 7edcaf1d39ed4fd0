"""Nodes of a job (`gyre.runtime.job.nodes`): numbered by their first rank, rank 0's node first; each other node's
harness host is its first rank; a node's name comes from the launcher's variables."""

from __future__ import annotations

from gyre.runtime.job.nodes import node_map, node_name


def test_nodes_are_numbered_by_their_first_rank_and_each_other_nodes_first_rank_hosts():
    nodes = node_map(["b", "b", "a", "c", "a", "c"])
    assert nodes.of_rank == (0, 0, 1, 2, 1, 2)
    assert nodes.hosts == {1: 2, 2: 3}
    assert [nodes.hosted_by(rank) for rank in range(6)] == [None, None, 1, 2, None, None]
    assert node_map(["x", "x"]).hosts == {}  # one node: the controller plays every execution


def test_a_nodes_name_is_the_launchers_node_index_else_the_host_name():
    assert node_name({"GROUP_RANK": "1", "SLURM_NODEID": "7"}) == "group_rank:1"
    assert node_name({"SLURM_NODEID": "7"}) == "slurm_nodeid:7"
    assert node_name({}).startswith("host:")
