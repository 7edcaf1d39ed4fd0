"""gyre.distributed.claims: unit encoding, split runs as one claim unit, and the store protocol on a real TCPStore."""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch.distributed as dist

from gyre.data.claim_units import ClaimUnitAssembler
from gyre.data.microstep import TokenRow, build_microstep
from gyre.distributed.claims import StepBoard, StepClaimer, decode_unit, encode_unit


def row(execution: str, slot: int, length: int = 5, num_targets: int | None = None) -> TokenRow:
    targets = np.array([False] + [True] * (length - 1))
    return TokenRow(
        group_id=slot // 2,
        execution=execution,
        leaf=slot,
        role="main",
        ids=np.arange(length, dtype=np.int64) + slot,
        targets=targets,
        behavior_logprobs=np.where(targets, -0.5, 0.0),
        advantage=0.25 * slot,
        execution_num_targets=num_targets or int(targets.sum()),
        batch_execution=slot,
    )


def step(index: int, executions: list[str], split: tuple[str, ...] = ()):
    rows = [row(e, int(e[1:])) for e in executions]
    return build_microstep(7, index, rows, num_executions=10, split=split)


def test_a_unit_round_trips_through_bytes():
    unit = (step(0, ["e1", "e2"]), step(1, ["e3"], split=("e3",)))
    back = decode_unit(encode_unit(unit))
    assert len(back) == 2
    for a, b in zip(unit, back, strict=True):
        assert (a.batch, a.index, a.num_executions, a.execution_ids, a.group_ids) == (
            b.batch,
            b.index,
            b.num_executions,
            b.execution_ids,
            b.group_ids,
        )
        for name in ("ids_U", "row_offsets_R1", "target_U", "behavior_logp_U", "split_E", "advantage_E"):
            assert getattr(a, name).dtype == getattr(b, name).dtype
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    back[0].ids_U[0] = 99  # a copy, writable


def test_garbage_is_not_a_unit():
    with pytest.raises(ValueError, match="not an encoded claim unit"):
        decode_unit(b"hello")
    with pytest.raises(ValueError, match="trailing bytes"):
        decode_unit(encode_unit((step(0, ["e1"]),)) + b"x")
    with pytest.raises(ValueError, match="at least one"):
        encode_unit(())


def test_a_run_sharing_a_split_execution_is_one_unit():
    assembler = ClaimUnitAssembler()
    steps = [
        step(0, ["e1"]),
        step(1, ["e2", "e5"], split=("e5",)),
        step(2, ["e5"], split=("e5",)),
        step(3, ["e5", "e6"], split=("e5", "e6")),
        step(4, ["e6"], split=("e6",)),  # shares e6 with step 3: the run continues
        step(5, ["e7"], split=("e7",)),  # a new split execution: a new run
        step(6, ["e8"]),
    ]
    units = [u for s in steps for u in assembler.add(s)] + assembler.flush()
    assert [[s.index for s in u] for u in units] == [[0], [1, 2, 3, 4], [5], [6]]
    assert assembler.flush() == []


@pytest.fixture
def store():
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    yield store


def test_claims_are_disjoint_and_closed_streams_answer_none(store):
    board = StepBoard(store, 3, max_cells=3, cells=1)
    core, satellite = StepClaimer(store, 3, timeout_s=10), StepClaimer(store, 3, timeout_s=10)
    board.put(step(0, ["e1"]))
    assert board.admit() == 1
    board.put(step(1, ["e2"]))
    first, second = core.claim(), satellite.claim()
    assert (first[0], second[0]) == (0, 1)
    assert first[1][0].index == 0 and second[1][0].index == 1
    pending = satellite.claim_index()  # claimed before the stream ends: answered by a sentinel
    assert board.close() == 2
    assert satellite.receive(pending) is None
    assert core.claim() is None  # after the close: answered by a sentinel at once
    assert core.cells() == satellite.cells() == 2
    with pytest.raises(ValueError, match="closed"):
        board.put(step(2, ["e3"]))
    with pytest.raises(ValueError, match="join window"):
        board.admit()
    board.clear()
    assert not store.check(["gyre/step/3/unit/0", "gyre/step/3/next", "gyre/step/3/cells"])


def test_a_split_run_is_held_until_it_ends(store):
    board = StepBoard(store, 0, max_cells=1)
    board.put(step(0, ["e5"], split=("e5",)))
    assert board.num_units == 0  # the run may continue
    board.put(step(1, ["e5"], split=("e5",)))
    board.close()
    index, unit = StepClaimer(store, 0, timeout_s=10).claim()
    assert index == 0 and [s.index for s in unit] == [0, 1]


def test_a_wait_that_runs_out_names_the_step_and_unit(store):
    claimer = StepClaimer(store, 9, timeout_s=0.2)
    with pytest.raises(TimeoutError, match="step 9: unit 0 did not arrive"):
        claimer.claim()


def test_board_checks_its_cells(store):
    with pytest.raises(ValueError, match="cells"):
        StepBoard(store, 0, max_cells=2, cells=3)
    board = StepBoard(store, 0, max_cells=2, cells=2)
    with pytest.raises(ValueError, match="already train"):
        board.admit()


def test_join_keys_say_which_cells_train_the_step(store):
    board = StepBoard(store, 4, max_cells=3, cells=1)
    claimer = StepClaimer(store, 4, timeout_s=10)
    assert claimer.admitted(0)
    assert not store.check(["gyre/step/4/join/1"])  # undecided: a satellite waits
    assert board.admit() == 1
    assert claimer.admitted(1)
    board.close()
    assert [claimer.admitted(c) for c in range(3)] == [True, True, False]
    board.clear()
    assert not claimer.admitted(2)  # kept by clear: a refused cell may read it late


def test_flush_ends_a_held_run_and_claims_counts_the_counter(store):
    board = StepBoard(store, 5, max_cells=2)
    board.put(step(0, ["e5"], split=("e5",)))
    board.put(step(1, ["e5"], split=("e5",)))
    assert board.num_units == 0 and board.claims() == 0
    assert board.flush() == 1 and board.flush() == 0
    board.put(step(2, ["e1"]))
    claimer = StepClaimer(store, 5, timeout_s=10)
    assert [s.index for s in claimer.claim()[1]] == [0, 1]
    assert board.claims() == 1
    assert board.close() == 2


def test_a_unit_over_the_store_value_limit_travels_in_parts(store):
    from gyre.distributed.claims import PARTS, STORE_VALUE_MAX_BYTES

    board = StepBoard(store, 6, max_cells=1)
    huge = build_microstep(7, 0, [row("e1", 1, length=STORE_VALUE_MAX_BYTES // 8)], num_executions=10)
    size = len(encode_unit((huge,)))
    board.put(huge)
    board.put(step(1, ["e2"]))  # the client is still connected
    parts = -(-size // STORE_VALUE_MAX_BYTES)
    assert size > 2 * STORE_VALUE_MAX_BYTES and store.get("gyre/step/6/unit/0") == PARTS + str(parts).encode()
    claimer = StepClaimer(store, 6, timeout_s=10)
    (back,) = claimer.claim()[1]
    np.testing.assert_array_equal(back.ids_U, huge.ids_U)
    assert claimer.claim()[0] == 1
    board.close()
    board.clear()
    assert not store.check([f"gyre/step/6/unit/0/{j}" for j in range(parts)])


def test_a_part_size_outside_the_store_limit_is_refused(store):
    with pytest.raises(ValueError, match=r"part_bytes: got 9000000, expected 64 .. 8388608"):
        StepBoard(store, 1, max_cells=1, part_bytes=9_000_000)


def test_an_abandoned_step_answers_every_claim_not_yet_taken_with_closed(store):
    board = StepBoard(store, 6, max_cells=2, cells=2)
    core, satellite = StepClaimer(store, 6, timeout_s=10), StepClaimer(store, 6, timeout_s=10)
    for index in range(4):
        board.put(step(index, [f"e{index}"]))
    board.put(step(4, ["e9"], split=("e9",)))  # held back: its run may continue
    held = core.claim()  # the core holds unit 0 when the run stops
    assert board.abandon() == 3  # units 1..3 unclaimed: dropped, as is the held-back run
    assert held[0] == 0
    assert core.claim() is None and satellite.claim() is None  # each cell stops after what it holds
    assert core.cells() == 2 and board.closed and board.abandon() == 0
