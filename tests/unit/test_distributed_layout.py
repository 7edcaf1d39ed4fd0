"""gyre.distributed.layout: cells, coordinates, leaders and prefix groups against hand-written lists."""

from __future__ import annotations

import pytest

from gyre.distributed.layout import GroupSpec, Layout


def test_three_cells_of_two_with_a_rollout_rank():
    layout = Layout(world_size=7, num_cells=3, cell_size=2, num_rollout_ranks=1)
    assert [layout.cell_of(r) for r in range(7)] == [0, 0, 1, 1, 2, 2, None]
    assert [layout.coordinate_of(r) for r in range(7)] == [0, 1, 0, 1, 0, 1, None]
    assert layout.cell_leaders == (0, 2, 4)
    assert [layout.cell_ranks(c) for c in range(3)] == [(0, 1), (2, 3), (4, 5)]
    assert layout.core_ranks == (0, 1)
    assert layout.rollout_ranks == (6,)
    assert layout.prefix_ranks(2, 1) == (1, 3)
    assert layout.prefix_ranks(3, 0) == (0, 2, 4)
    assert layout.prefix_ranks(1, 1) == (1,)
    assert layout.describe(3) == "rank 3: cell 1, coordinate 1 (leader 2)"
    assert layout.describe(6) == "rank 6: rollout pool"


def test_prefix_groups_of_one_coordinate_are_largest_first():
    layout = Layout(world_size=8, num_cells=4, cell_size=2)
    assert [g.ranks for g in layout.prefix_groups(1)] == [(1, 3, 5, 7), (1, 3, 5), (1, 3)]
    assert [g.num_cells for g in layout.prefix_groups(0)] == [4, 3, 2]


def test_creation_order_two_cells_of_two():
    layout = Layout(world_size=4, num_cells=2, cell_size=2)
    assert layout.creation_order() == (
        GroupSpec(kind="control", ranks=(0, 1, 2, 3)),
        GroupSpec(kind="cell", ranks=(0, 1), cell=0),
        GroupSpec(kind="cell", ranks=(2, 3), cell=1),
        GroupSpec(kind="prefix", ranks=(0, 2), coordinate=0, num_cells=2),
        GroupSpec(kind="prefix", ranks=(1, 3), coordinate=1, num_cells=2),
    )


def test_creation_order_three_cells_of_two_plus_rollout():
    layout = Layout(world_size=7, num_cells=3, cell_size=2, num_rollout_ranks=1)
    order = [(g.kind, g.ranks) for g in layout.creation_order()]
    assert order == [
        ("control", (0, 1, 2, 3, 4, 5, 6)),
        ("cell", (0, 1)),
        ("cell", (2, 3)),
        ("cell", (4, 5)),
        ("prefix", (0, 2, 4)),
        ("prefix", (1, 3, 5)),
        ("prefix", (0, 2)),
        ("prefix", (1, 3)),
    ]
    # K-1 prefix groups per coordinate, never a 1-cell group.
    assert sum(g.kind == "prefix" for g in layout.creation_order()) == (3 - 1) * 2


def test_one_cell_has_no_prefix_groups():
    layout = Layout(world_size=2, num_cells=1, cell_size=2)
    assert [g.kind for g in layout.creation_order()] == ["control", "cell"]
    assert layout.prefix_groups(0) == ()


def test_three_cells_of_one():
    layout = Layout(world_size=3, num_cells=3, cell_size=1)
    assert layout.cell_leaders == (0, 1, 2)
    assert [g.ranks for g in layout.creation_order()] == [(0, 1, 2), (0,), (1,), (2,), (0, 1, 2), (0, 1)]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"world_size": 5, "num_cells": 2, "cell_size": 2},
            "world_size: got 5, expected 4 (world_size 5 is not divisible",
        ),
        ({"world_size": 6, "num_cells": 2, "cell_size": 2}, "world_size: got 6, expected 4 (num_cells * cell_size"),
        ({"world_size": 4, "num_cells": 2, "cell_size": 2, "num_rollout_ranks": 1}, "world_size: got 4, expected 5"),
        ({"world_size": 4, "num_cells": 0, "cell_size": 2}, "num_cells: got 0, expected an integer >= 1"),
        ({"world_size": 4, "num_cells": 2, "cell_size": 2.0}, "cell_size: got 2.0"),
        ({"world_size": 4, "num_cells": 2, "cell_size": 2, "num_rollout_ranks": -1}, "num_rollout_ranks: got -1"),
    ],
)
def test_invalid_layouts_name_the_field(fields, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace("*", r"\*")):
        Layout(**fields)


def test_out_of_range_queries_name_the_field():
    layout = Layout(world_size=4, num_cells=2, cell_size=2)
    with pytest.raises(ValueError, match="rank: got 4"):
        layout.cell_of(4)
    with pytest.raises(ValueError, match="cell: got 2"):
        layout.cell_ranks(2)
    with pytest.raises(ValueError, match="num_cells: got 3"):
        layout.prefix_ranks(3, 0)
    with pytest.raises(ValueError, match="coordinate: got 2"):
        layout.prefix_ranks(2, 2)
