"""gyre.distributed.groups on real gloo processes: every prefix and cell group sums over exactly its members.

Each rank contributes 10**rank to an all_reduce over every group it belongs to, so the sum's digits name the
members (e.g. 101 = ranks 0 and 2); the expected sums come from hand-written member lists, not from the layout.
"""

from __future__ import annotations

import pytest

from gyre.distributed.local import run_local

TIMEOUT_S = 90.0


def groups_worker(rank: int, world_size: int, *, num_cells: int, cell_size: int, num_rollout_ranks: int = 0) -> dict:
    import torch
    import torch.distributed as dist

    from gyre.distributed.groups import build_process_groups
    from gyre.distributed.layout import Layout

    layout = Layout(
        world_size=world_size, num_cells=num_cells, cell_size=cell_size, num_rollout_ranks=num_rollout_ranks
    )
    groups = build_process_groups(layout)

    def total(group) -> int:
        value = torch.tensor([10**rank], dtype=torch.int64)
        dist.all_reduce(value, group=group)
        return int(value.item())

    cell = None if groups.cell_group is None else total(groups.cell_group)
    result = {"control": total(groups.control_group), "cell": cell, "prefix": {}, "leader": groups.is_cell_leader}
    for k in range(num_cells, 0, -1):  # the order every rank follows; members of prefix k are in all smaller ones
        if groups.cell is not None and groups.cell < k:
            group = groups.prefix_group(k)
            result["prefix"][str(k)] = None if group is None else total(group)
    if groups.cell is None or (groups.cell == num_cells - 1 and num_cells > 1):
        try:
            groups.prefix_group(num_cells - 1)
        except ValueError as error:
            result["not_member_error"] = str(error)
    return result


@pytest.mark.slow  # real processes: a few seconds each on 2 cores
def test_two_cells_of_two():
    results = run_local(f"{__file__}:groups_worker", 4, kwargs={"num_cells": 2, "cell_size": 2}, timeout_s=TIMEOUT_S)
    assert [r["control"] for r in results] == [1111] * 4
    assert [r["cell"] for r in results] == [11, 11, 1100, 1100]  # cells {0,1} and {2,3}
    # prefix k=2: coordinate 0 = {0, 2} -> 101, coordinate 1 = {1, 3} -> 1010; k=1 is no group.
    assert [r["prefix"] for r in results] == [
        {"2": 101, "1": None},
        {"2": 1010, "1": None},
        {"2": 101},
        {"2": 1010},
    ]
    assert "is not in the first 1 cells" in results[3]["not_member_error"]


@pytest.mark.slow  # real processes: a few seconds each on 2 cores
def test_three_cells_of_one():
    results = run_local(f"{__file__}:groups_worker", 3, kwargs={"num_cells": 3, "cell_size": 1}, timeout_s=TIMEOUT_S)
    assert [r["control"] for r in results] == [111] * 3
    assert [r["cell"] for r in results] == [1, 10, 100]
    assert [r["prefix"] for r in results] == [
        {"3": 111, "2": 11, "1": None},
        {"3": 111, "2": 11},
        {"3": 111},
    ]
    assert "rank 2: cell 2, coordinate 0 (leader 2) is not in the first 2 cells" in results[2]["not_member_error"]


@pytest.mark.slow  # real processes: a few seconds each on 2 cores
def test_two_cells_of_one_and_a_rollout_rank():
    kwargs = {"num_cells": 2, "cell_size": 1, "num_rollout_ranks": 1}
    results = run_local(f"{__file__}:groups_worker", 3, kwargs=kwargs, timeout_s=TIMEOUT_S)
    assert [r["control"] for r in results] == [111] * 3  # the rollout rank is in the control group only
    assert [r["cell"] for r in results] == [1, 10, None]
    assert [r["leader"] for r in results] == [True, True, False]
    assert [r["prefix"] for r in results] == [{"2": 11, "1": None}, {"2": 11}, {}]
    assert results[2]["not_member_error"].startswith("num_cells_training: rank 2: rollout pool is not in the first 1")


@pytest.mark.slow  # real processes: a few seconds each on 2 cores
def test_layout_must_match_the_world():
    from gyre.distributed.local import LocalRunError

    with pytest.raises(LocalRunError, match="world_size: the layout has 4, the process group has 2"):
        run_local(f"{__file__}:mismatch_worker", 2, timeout_s=TIMEOUT_S)


def mismatch_worker(rank: int, world_size: int) -> None:
    from gyre.distributed.groups import build_process_groups
    from gyre.distributed.layout import Layout

    build_process_groups(Layout(world_size=4, num_cells=2, cell_size=2))


def hanging_worker(rank: int, world_size: int, *, pid_dir: str) -> int:
    import os
    import time
    from pathlib import Path

    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(3600)
    return rank


@pytest.mark.slow  # real processes: a few seconds each on 2 cores
def test_a_hanging_rank_is_stopped_by_pid_at_the_time_limit(tmp_path):
    import os

    from gyre.distributed.local import LocalRunError

    with pytest.raises(LocalRunError, match="timed out after 12 s"):
        run_local(f"{__file__}:hanging_worker", 2, kwargs={"pid_dir": str(tmp_path)}, timeout_s=12)
    pids = [int(path.read_text()) for path in tmp_path.glob("*.pid")]
    assert pids, "no rank started within the time limit"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
