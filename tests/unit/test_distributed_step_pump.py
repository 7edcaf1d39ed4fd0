"""gyre.distributed.step_pump on a real TCPStore (127.0.0.1): lazy supply, order, split runs at a pull's end, a late
joiner, the close after the last unit, an empty step, and cells claiming from threads while the pump runs."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from local_store import store_client as client

from gyre.data.microstep import TokenRow, build_microstep
from gyre.data.queue import MicroStepQueue
from gyre.distributed.claims import StepBoard, StepClaimer
from gyre.distributed.step_pump import StepPump


def step(index: int, split: bool = False):
    execution = "long" if split else f"e{index}"
    row = TokenRow(
        group_id=index,
        execution=execution,
        leaf=0,
        role="main",
        ids=np.arange(4, dtype=np.int64),
        targets=np.array([False, True, True, True]),
        behavior_logprobs=np.array([0.0, -0.5, -0.5, -0.5]),
        advantage=1.0,
        execution_num_targets=3,
        batch_execution=index,
    )
    return build_microstep(0, index, [row], num_executions=16, split=(execution,) if split else ())


class Packer:
    """Stands in for the stream packing buffer's pulls: each refill puts one pull's micro-steps on the queue and
    closes it after the last pull (as `StreamPackingBuffer.pull` does after the B-th group)."""

    def __init__(self, pulls: list[list], ready: bool = True) -> None:
        self.queue: MicroStepQueue = MicroStepQueue()
        self.pulls, self.ready, self.calls = list(pulls), ready, 0

    def refill(self) -> bool:
        self.calls += 1
        if not self.ready or not self.pulls:
            return False
        for micro_step in self.pulls.pop(0):
            self.queue.put(micro_step)
        if not self.pulls:
            self.queue.close()
        return True


def test_units_appear_only_when_a_cell_waits_in_order_and_the_board_closes_after_the_last(store_port):
    store = client(store_port)
    packer = Packer([[step(0)], [step(1, True), step(2, True)], [step(3)]])
    pump = StepPump(StepBoard(store, 0, max_cells=2), packer.queue, refill=packer.refill)
    claimer = StepClaimer(client(store_port), 0, timeout_s=10)
    assert not pump.poll() and packer.calls == 0 and pump.board.num_units == 0  # nobody waits: no group claimed
    index = claimer.claim_index()
    assert not pump.poll() and packer.calls == 1
    assert [s.index for s in claimer.receive(index)] == [0]
    assert not pump.poll() and packer.calls == 1  # nobody waits again
    index = claimer.claim_index()
    assert not pump.poll()
    assert [s.index for s in claimer.receive(index)] == [1, 2]  # the split run, one unit at its pull's end
    index = claimer.claim_index()
    assert pump.poll() and pump.closed  # the last pull closes the queue: the board closes after unit 2
    assert [s.index for s in claimer.receive(index)] == [3]
    assert claimer.claim() is None and claimer.cells() == 1
    assert (pump.num_put, pump.board.num_units, pump.refills) == (4, 3, 3)


def test_lookahead_keeps_units_ready_before_anyone_claims(store_port):
    packer = Packer([[step(i)] for i in range(5)])
    pump = StepPump(StepBoard(client(store_port), 1, max_cells=1), packer.queue, refill=packer.refill, lookahead=2)
    assert not pump.poll() and pump.board.num_units == 2
    claimer = StepClaimer(client(store_port), 1, timeout_s=10)
    assert claimer.claim()[0] == 0
    assert not pump.poll() and pump.board.num_units == 3


def test_no_group_ready_leaves_the_cell_waiting_until_one_is(store_port):
    packer = Packer([[step(0)]], ready=False)
    pump = StepPump(StepBoard(client(store_port), 2, max_cells=1), packer.queue, refill=packer.refill)
    claimer = StepClaimer(client(store_port), 2, timeout_s=10)
    index = claimer.claim_index()
    assert not pump.poll() and not pump.poll() and pump.board.num_units == 0 and packer.calls == 2
    packer.ready = True
    assert pump.poll()
    assert claimer.receive(index)[0].index == 0


def test_a_late_joiner_is_admitted_and_the_rest_are_refused_at_the_close(store_port):
    packer = Packer([[step(0)], [step(1)], [step(2)]])
    pump = StepPump(StepBoard(client(store_port), 3, max_cells=3), packer.queue, refill=packer.refill)
    core, joiner = StepClaimer(client(store_port), 3, timeout_s=10), StepClaimer(client(store_port), 3, timeout_s=10)
    index = core.claim_index()
    pump.poll()
    assert core.receive(index)[0].index == 0
    assert pump.can_admit and pump.admit() == 1
    assert joiner.admitted(1)
    first, second = core.claim_index(), joiner.claim_index()
    assert pump.poll()
    assert [core.receive(first)[0].index, joiner.receive(second)[0].index] == [1, 2]
    assert core.claim() is None and joiner.claim() is None
    assert core.cells() == 2 and not joiner.admitted(2)
    assert not pump.can_admit
    with pytest.raises(ValueError, match="join window closed"):
        pump.admit()


def test_an_empty_step_closes_at_once(store_port):
    packer = Packer([])
    packer.queue.close()  # every group of the batch was set aside
    pump = StepPump(StepBoard(client(store_port), 4, max_cells=2, cells=2), packer.queue, refill=packer.refill)
    assert pump.poll() and packer.calls == 0
    claimers = [StepClaimer(client(store_port), 4, timeout_s=10) for _ in range(2)]
    assert [c.claim() for c in claimers] == [None, None]
    assert [c.cells() for c in claimers] == [2, 2]


def test_cells_claiming_from_threads_get_every_unit_once_while_the_pump_runs(store_port):
    num_units, got = 40, {0: [], 1: []}
    packer = Packer([[step(i)] for i in range(num_units)])
    pump = StepPump(StepBoard(client(store_port), 5, max_cells=2, cells=2), packer.queue, refill=packer.refill)

    def cell(name: int) -> None:
        claimer = StepClaimer(client(store_port), 5, timeout_s=30)
        while (claimed := claimer.claim()) is not None:
            got[name].append(claimed[1][0].index)

    threads = [threading.Thread(target=cell, args=(name,)) for name in got]
    for thread in threads:
        thread.start()
    assert pump.run(poll_s=0.001) == num_units
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(got[0] + got[1]) == list(range(num_units))
    assert all(units == sorted(units) for units in got.values())  # each cell sees the stream in order


def test_bad_arguments(store_port):
    board = StepBoard(client(store_port), 6, max_cells=1)
    with pytest.raises(ValueError, match="lookahead: got -1"):
        StepPump(board, MicroStepQueue(), refill=lambda: False, lookahead=-1)
    board.close()
    with pytest.raises(ValueError, match="step 6: the board is already closed"):
        StepPump(board, MicroStepQueue(), refill=lambda: False)
