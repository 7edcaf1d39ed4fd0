"""The micro-step queue: FIFO, disjoint atomic claims across threads, close and drain."""

from __future__ import annotations

import threading
import time

import pytest

from gyre.data import MicroStepQueue


def test_claims_are_fifo_and_none_tells_open_from_drained():
    queue: MicroStepQueue[str] = MicroStepQueue()
    assert queue.claim(0) is None and not queue.closed_and_drained  # empty but open: claim again later
    queue.put("s0")
    queue.put("s1")
    assert queue.claim(1) == "s0"
    queue.close()
    assert not queue.closed_and_drained and queue.pending == 1
    assert queue.claim(0) == "s1"
    assert queue.claim(0) is None and queue.closed_and_drained  # the batch is done
    assert queue.claims() == [(0, 1), (1, 0)]
    with pytest.raises(ValueError, match="closed after 2 micro-steps"):
        queue.put("s2")


def test_a_waiting_claim_wakes_on_put_and_on_close():
    queue: MicroStepQueue[int] = MicroStepQueue()
    got: list[int | None] = []
    waiter = threading.Thread(target=lambda: got.extend([queue.claim(0, timeout=None), queue.claim(0, timeout=None)]))
    waiter.start()
    time.sleep(0.05)
    queue.put(7)
    time.sleep(0.05)
    queue.close()
    waiter.join(timeout=5)
    assert not waiter.is_alive() and got == [7, None]
    assert queue.claim(0, timeout=0.01) is None


def test_bad_claims():
    queue: MicroStepQueue[int] = MicroStepQueue()
    with pytest.raises(ValueError, match="cell must be a cell index"):
        queue.claim(-1)
    with pytest.raises(ValueError, match="timeout must be"):
        queue.claim(0, timeout=-1.0)


def test_threads_claim_every_micro_step_exactly_once():
    queue: MicroStepQueue[int] = MicroStepQueue()
    total, cells = 5000, 8
    claimed: dict[int, list[int]] = {cell: [] for cell in range(cells)}

    def cell_loop(cell: int) -> None:
        while True:
            step = queue.claim(cell, timeout=1.0)
            if step is not None:
                claimed[cell].append(step)
            elif queue.closed_and_drained:
                return

    threads = [threading.Thread(target=cell_loop, args=(cell,)) for cell in range(cells)]
    for t in threads:
        t.start()
    for step in range(total):  # the producer streams while the cells claim
        queue.put(step)
    queue.close()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    every = sorted(s for steps in claimed.values() for s in steps)
    assert every == list(range(total))
    assert all(steps == sorted(steps) for steps in claimed.values())  # FIFO seen from each cell
    assert sorted(seq for seq, _ in queue.claims()) == list(range(total))
    assert queue.closed_and_drained
