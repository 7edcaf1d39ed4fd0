"""Claims of cells of two ranks (`claim_in_cell`) from a board the controller's pump feeds, on 4 real gloo processes.

2 cells x 2 ranks: rank 0's controller thread pumps 12 micro-steps (one per pull, as they become ready) onto the
step's board and admits cell 1 after the third; in each cell the leader claims and the other rank follows over the
cell group. Both ranks of a cell must see the same units, the cells' units must be disjoint and cover the stream.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from gyre.distributed.local import run_local, shared_store

NUM_MICRO_STEPS = 12


def step(index: int):
    """A micro-step of one 4-token row (execution `e<index>`)."""
    import numpy as np

    from gyre.data.microstep import TokenRow, build_microstep

    targets = np.array([False, True, True, True])
    row = TokenRow(
        group_id=index,
        execution=f"e{index}",
        leaf=0,
        role="main",
        ids=np.arange(4, dtype=np.int64),
        targets=targets,
        behavior_logprobs=np.where(targets, -0.5, 0.0),
        advantage=1.0,
        execution_num_targets=3,
        batch_execution=index,
    )
    return build_microstep(0, index, [row], num_executions=NUM_MICRO_STEPS)


def pump_step(store) -> None:
    from gyre.data.queue import MicroStepQueue
    from gyre.distributed.claims import StepBoard
    from gyre.distributed.step_pump import StepPump

    queue, pulls = MicroStepQueue(), [[step(i)] for i in range(NUM_MICRO_STEPS)]
    next_ready = [time.monotonic()]

    def refill() -> bool:
        if not pulls or time.monotonic() < next_ready[0]:
            return False
        next_ready[0] = time.monotonic() + 0.03  # the next group is ready in 30 ms
        for micro_step in pulls.pop(0):
            queue.put(micro_step)
        if not pulls:
            queue.close()
        return True

    def admit_cell_1(pump) -> None:
        if pump.num_put >= 3 and pump.can_admit:
            pump.admit()

    pump = StepPump(StepBoard(store, 0, max_cells=2), queue, refill=refill)
    pump.run(poll_s=0.002, between=admit_cell_1)


def cell_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from gyre.distributed.claims import StepClaimer, claim_in_cell
    from gyre.distributed.groups import build_process_groups
    from gyre.distributed.layout import Layout

    groups = build_process_groups(Layout(world_size=world_size, num_cells=2, cell_size=2))
    timeout = datetime.timedelta(seconds=60)
    store, port = shared_store(timeout.total_seconds())
    dist.barrier(group=groups.control_group)
    controller = None
    if rank == 0:
        controller = threading.Thread(target=pump_step, args=(dist.TCPStore("127.0.0.1", port, world_size, False),))
        controller.start()
    claimer = StepClaimer(store, 0, timeout_s=60)
    admitted = claimer.admitted(groups.cell)
    units = []
    while (claimed := claim_in_cell(claimer, cell_group=groups.cell_group, leader_rank=2 * groups.cell)) is not None:
        units.append([claimed[0], [s.index for s in claimed[1]]])
        time.sleep(0.02)  # a unit's compute
    cells = claimer.cells()
    if controller is not None:
        controller.join(timeout=30)
    dist.barrier(group=groups.control_group)  # the store lives on rank 0
    return {"cell": groups.cell, "admitted": admitted, "units": units, "cells": cells}


@pytest.mark.slow  # 4 processes: ~10 s on 2 cores
def test_the_ranks_of_a_cell_claim_together_from_the_pumped_board():
    results = run_local(f"{__file__}:cell_worker", 4, timeout_s=120)
    assert [r["admitted"] for r in results] == [True] * 4 and [r["cells"] for r in results] == [2] * 4
    assert results[0]["units"] == results[1]["units"] and results[2]["units"] == results[3]["units"]
    core, satellite = results[0]["units"], results[2]["units"]
    assert sorted(index for index, _ in core + satellite) == list(range(NUM_MICRO_STEPS))
    assert all([index] == micro_steps for index, micro_steps in core + satellite)  # unit i is micro-step i
    assert satellite, f"cell 1 claimed nothing (core: {core}): the test exercised no join"
