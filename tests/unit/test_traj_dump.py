"""The readable dump, compared as exact strings on tiny trees."""

from __future__ import annotations

from gyre.traj import CallMeta, Provenance, Response, Segment, TrajectoryTree, dump_tree

SYS, USR, TOOL, OUT, HAR = (
    Provenance.SYSTEM,
    Provenance.USER,
    Provenance.TOOL,
    Provenance.SAMPLED,
    Provenance.HARNESS_ASSISTANT,
)


def call(tree, segments, ids, finish="stop", parent=None):
    meta = CallMeta("ex", f"r{len(tree.calls)}")
    return tree.insert(segments, Response.build(ids, [-1.0] * len(ids), finish), meta, parent=parent)


def test_dump_of_an_empty_tree():
    assert dump_tree(TrajectoryTree("ex", 100)) == "execution ex: 0 calls, 0 nodes, 0 tokens, 0 leaves\n"


def test_dump_shows_branches_retries_and_leaves():
    tree = TrajectoryTree("ex", 100)
    call(tree, [Segment(SYS, [1, 2, 3, 4, 5, 6, 7, 8]), Segment(USR, [10, 11])], [20, 21], "tool_use")
    call(tree, [Segment(TOOL, [30])], [40], parent=3)
    call(tree, [Segment(USR, [10, 11])], [22], "length", parent=1)  # a retry: sibling of #3
    call(tree, [Segment(USR, [10, 11])], [22], parent=1)  # identical output: same node, second call
    call(tree, [Segment(SYS, [9]), Segment(OUT, [20, 21]), Segment(HAR, [50])], [41])  # echo in a new context
    assert dump_tree(tree) == (
        "execution ex: 5 calls, 10 nodes, 20 tokens, 3 leaves\n"
        "#1 SYSTEM n=8 [1, 2, 3, 4, 5, 6, ...]\n"
        "  #2 USER n=2 [10, 11]\n"
        "    #3 SAMPLED n=2 [20, 21] calls=0 finish=tool_use\n"
        "      #4 TOOL n=1 [30]\n"
        "        #5 SAMPLED n=1 [40] calls=1 finish=stop <- leaf 5 nodes\n"
        "    #6 SAMPLED n=1 [22] calls=2,3 finish=length <- leaf 3 nodes\n"
        "#7 SYSTEM n=1 [9]\n"
        "  #8 SAMPLED n=2 [20, 21] calls=-\n"
        "    #9 HARNESS_ASSISTANT n=1 [50]\n"
        "      #10 SAMPLED n=1 [41] calls=4 finish=stop <- leaf 4 nodes\n"
    )
