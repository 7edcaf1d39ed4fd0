"""The control plane's log (gyre.distributed.control) over a real TCPStore on 127.0.0.1.

Readers on their own threads and store clients get every decision in order exactly once, also when they start
late; waits are bounded; a bad decision never reaches the store; a listener ends on `stop` or `close`.
"""

from __future__ import annotations

import threading
import time

import pytest
from local_store import store_client as client

from gyre.distributed.control import STOP, ControlListener, ControlPublisher, ControlReader


def test_readers_get_every_decision_in_order_exactly_once_even_late(store_port):
    publisher = ControlPublisher(client(store_port))
    received: dict[int, list] = {r: [] for r in range(3)}

    def read(r: int) -> None:
        reader = ControlReader(client(store_port))
        deadline = time.monotonic() + 30
        while len(received[r]) < 40 and time.monotonic() < deadline:
            decision = reader.next(0.5)
            if decision is not None:
                received[r].append(decision)

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for i in range(40):
        assert publisher.publish("role", cell=i % 4, to="training") == i
    late = threading.Thread(target=read, args=(2,))  # started after everything was published
    late.start()
    for thread in [*threads, late]:
        thread.join(60)
    for r in range(3):
        assert [d.seq for d in received[r]] == list(range(40))
        assert [d.fields["cell"] for d in received[r]] == [i % 4 for i in range(40)]


def test_a_reader_can_start_where_it_left_off(store_port):
    publisher = ControlPublisher(client(store_port))
    for step in range(5):
        publisher.publish("step", step=step, cells=[0])
    reader = ControlReader(client(store_port), start=3)
    assert [reader.next(1.0).fields["step"] for _ in range(2)] == [3, 4]


def test_a_wait_with_nothing_new_is_bounded(store_port):
    reader = ControlReader(client(store_port))
    started = time.monotonic()
    assert reader.next(0.3) is None
    assert 0.25 < time.monotonic() - started < 2.0


def test_a_bad_decision_never_reaches_the_store(store_port):
    store = client(store_port)
    publisher = ControlPublisher(store)
    with pytest.raises(ValueError, match="non-empty string"):
        publisher.publish("")
    with pytest.raises(TypeError, match="JSON-able"):
        publisher.publish("step", cells={1, 2})
    with pytest.raises(ValueError, match="at most 8388608 travel through the store"):
        publisher.publish("gather", blob="x" * (9 << 20))
    assert publisher.publish("step", step=0) == 0  # nothing was taken by the refusals


def test_a_listener_delivers_while_its_rank_is_busy_and_ends_on_stop(store_port):
    publisher = ControlPublisher(client(store_port))
    listener = ControlListener(lambda: client(store_port))
    try:
        publisher.publish("join", cell=1, step=7)
        time.sleep(0.5)  # the rank is "in a collective"; the listener reads meanwhile
        publisher.publish(STOP, reason="done")
        deadline = time.monotonic() + 10
        while listener.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not listener.running
        assert [(d.seq, d.kind) for d in listener.drain()] == [(0, "join"), (1, STOP)]
        assert listener.get(0.1) is None
    finally:
        listener.close()


def test_a_listener_closes_promptly_without_a_stop(store_port):
    listener = ControlListener(lambda: client(store_port))
    started = time.monotonic()
    listener.close()
    assert not listener.running and time.monotonic() - started < 2.0
