"""gyre.data.claim_units on the real packer's streams: every micro-step of a split execution lands in one claim unit,
also when the packer emits them non-consecutively (`keep_executions_together=False`), so s_i (Eq. 5) per unit is
s_i over the whole batch; units stay as small as that allows, in the order of their first micro-step."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.config import PackingConfig
from gyre.data import ClaimUnitAssembler, MicroStep, StreamPackingBuffer, TokenRow, TrajectoryBuffer, build_microstep
from gyre.rl import finalize_sequence_ratio, sequence_log_ratio_sums
from gyre.traj import CallMeta, Provenance, Response, Segment, TrajectoryTree
from gyre.traj.admission import AdmittedTrajectory


def make_tree(execution: str, rows: list[tuple[int, int]]) -> tuple[TrajectoryTree, list[AdmittedTrajectory]]:
    """An execution whose calls each branch off the root (a distinct first token): one row per call of
    `context + output` tokens, the output tokens (ids >= 100) its targets."""
    tree = TrajectoryTree(execution, 1000)
    admitted = []
    for k, (context, output) in enumerate(rows):
        ids = list(range(100 + k, 100 + k + output))
        record = tree.insert(
            [Segment(Provenance.USER, [k + 1] * context)],
            Response.build(ids, [-0.01 * (i % 50) for i in ids], "stop"),
            CallMeta(execution, f"r{k}"),
        )
        mask = tree.path_tokens(record.response_node).target_mask
        admitted.append(AdmittedTrajectory(execution, record.response_node, "main", mask))
    return tree, admitted


def add_group(buffer: TrajectoryBuffer, group_id: int, members: dict[str, list[tuple[int, int]]], rewards) -> None:
    buffer.add_group(group_id, 0, list(members))
    admitted = {}
    for execution, rows in members.items():
        tree, admitted[execution] = make_tree(execution, rows)
        buffer.attach_tree(tree)
    buffer.mark_ready(group_id, dict(zip(members, rewards, strict=True)), admitted)


def units_of(steps: list[MicroStep]) -> list[tuple[MicroStep, ...]]:
    """Claim units of one pull's micro-steps, as the step pump makes them (feed in order, flush at the pull's end)."""
    assembler = ClaimUnitAssembler()
    units = [unit for step in steps for unit in assembler.add(step)]
    return units + assembler.flush()


def drain(packer: StreamPackingBuffer) -> list[MicroStep]:
    steps = []
    while (step := packer.queue.claim(0)) is not None:
        steps.append(step)
    return steps


def split_executions(step: MicroStep) -> set[str]:
    return {e for e, split in zip(step.execution_ids, step.split_E.tolist(), strict=True) if split}


def sequence_ratio(steps) -> torch.Tensor:
    """s_i (Eq. 5) per batch slot over the targets of `steps`, at log-probs that differ from the behavior ones by a
    function of the token id (the same token gets the same log-prob wherever it is packed)."""
    sums_2B = torch.zeros(2, steps[0].num_executions, dtype=torch.float64)
    for step in steps:
        inputs = step.target_inputs(torch.float64)
        log_ratio_T = torch.from_numpy(0.3 * np.sin(1.7 * step.ids_U[step.target_U]))
        sum_E, count_E = sequence_log_ratio_sums(log_ratio_T, inputs["execution_T"], inputs["num_local"])
        slots = torch.from_numpy(step.batch_execution_E)
        sums_2B[0].index_add_(0, slots, sum_E)
        sums_2B[1].index_add_(0, slots, count_E.double())
    return finalize_sequence_ratio(sums_2B[0], sums_2B[1])


def assert_unit_ratios_are_the_batch_ratios(units, steps) -> None:
    whole = sequence_ratio(steps)
    for unit in units:
        per_unit = sequence_ratio(unit)
        for step in unit:
            slots = torch.from_numpy(step.batch_execution_E)
            torch.testing.assert_close(per_unit[slots], whole[slots], rtol=1e-12, atol=0)


def test_free_rows_emit_a_split_execution_non_consecutively_and_it_is_still_one_unit():
    # Budget 10. Rows, first-fit decreasing: a's 9 -> micro-step 0, b's 9 -> 1, a's 2 fits neither -> 2.
    buffer = TrajectoryBuffer()
    add_group(buffer, 0, {"a": [(6, 3), (1, 1)], "b": [(6, 3)]}, [1.0, 0.0])
    config = PackingConfig(batch_groups=1, group_size=2, max_tokens_per_microstep=10, keep_executions_together=False)
    packer = StreamPackingBuffer(buffer, config)
    assert packer.pull() == 0
    steps = drain(packer)
    assert [(s.execution_ids, split_executions(s)) for s in steps] == [
        (("a",), {"a"}),
        (("b",), set()),
        (("a",), {"a"}),
    ]
    units = units_of(steps)
    assert [[s.index for s in unit] for unit in units] == [[0, 2], [1]]
    assert_unit_ratios_are_the_batch_ratios(units, steps)
    per_part = sequence_ratio([steps[0]])[0], sequence_ratio([steps[2]])[0]  # what one unit per micro-step gave
    assert not torch.isclose(per_part[0], per_part[1]) and not torch.isclose(per_part[0], sequence_ratio(steps)[0])


def row(execution: str, slot: int) -> TokenRow:
    targets = np.array([False, True, True])
    return TokenRow(
        group_id=0,
        execution=execution,
        leaf=slot,
        role="main",
        ids=np.arange(3, dtype=np.int64),
        targets=targets,
        behavior_logprobs=np.where(targets, -0.5, 0.0),
        advantage=0.0,
        execution_num_targets=2,
        batch_execution=slot,
    )


def step(index: int, executions: str, split: str = "") -> MicroStep:
    """A micro-step with one row per letter of `executions`; the letters of `split` are split executions."""
    return build_microstep(0, index, [row(e, ord(e) - ord("a")) for e in executions], 26, split=tuple(split))


def test_units_are_the_components_linked_by_split_executions_in_the_order_of_their_first_micro_step():
    steps = [
        step(0, "a"),  # nothing held yet: a unit at once
        step(1, "bx", split="x"),
        step(2, "c"),  # after a held split micro-step: a unit alone, put at the flush
        step(3, "y", split="y"),
        step(4, "xy", split="xy"),  # links x and y: micro-steps 1, 3, 4 are one unit
        step(5, "z", split="z"),
        step(6, "dz", split="z"),
    ]
    assembler = ClaimUnitAssembler()
    assert [[s.index for s in u] for u in assembler.add(steps[0])] == [[0]]
    assert [u for s in steps[1:] for u in assembler.add(s)] == []  # held until the pull's end
    assert [[s.index for s in u] for u in assembler.flush()] == [[1, 3, 4], [2], [5, 6]]
    assert assembler.flush() == []
    assert [[s.index for s in u] for u in assembler.add(step(7, "e"))] == [[7]]  # the next pull starts afresh


# One execution: 0-3 rows of (context, output) tokens, so up to 30 tokens against budgets of 10-25: whole, split
# over consecutive micro-steps (keep_executions_together) or scattered (free rows).
executions = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 4)), min_size=0, max_size=3)


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(st.tuples(executions, executions), min_size=1, max_size=6),
    excluded=st.lists(st.booleans(), min_size=12, max_size=12),
    flush_after=st.lists(st.booleans(), min_size=6, max_size=6),
    batch_groups=st.integers(1, 3),
    budget=st.integers(10, 25),
    min_fill=st.sampled_from([0.0, 0.5, 0.9]),
    together=st.booleans(),
)
def test_every_split_execution_lands_in_one_unit_and_units_are_its_components(
    calls, excluded, flush_after, batch_groups, budget, min_fill, together
):
    buffer = TrajectoryBuffer()
    for g, members in enumerate(calls):
        names = [f"g{g}e0", f"g{g}e1"]
        rewards = [None if excluded[2 * g + k] else float(k) for k in range(2)]
        add_group(buffer, g, dict(zip(names, members, strict=True)), rewards)
    config = PackingConfig(
        batch_groups=batch_groups,
        group_size=2,
        max_tokens_per_microstep=budget,
        keep_executions_together=together,
        min_fill=min_fill,
    )
    packer = StreamPackingBuffer(buffer, config)
    steps: list[MicroStep] = []
    units: list[tuple[MicroStep, ...]] = []
    assembler = ClaimUnitAssembler()
    pulls = 0
    while True:  # as the step pump does: after each pull (or flush), feed its micro-steps, then flush
        group_id = packer.pull()
        if group_id is not None and flush_after[pulls % len(flush_after)]:
            packer.flush()  # top_up when the queue is short: a pull boundary of its own
        if group_id is None and not packer.closed:
            packer.flush()  # the last, incomplete batch
        pulled = drain(packer)
        steps += pulled
        units += [unit for step in pulled for unit in assembler.add(step)] + assembler.flush()
        pulls += 1
        if packer.closed or group_id is None:
            if steps:
                check_units(units, steps)
            if packer.closed and buffer.num_ready:
                packer.next_batch()
                steps, units = [], []
                continue
            break


def check_units(units: list[tuple[MicroStep, ...]], steps: list[MicroStep]) -> None:
    assert sorted(s.index for unit in units for s in unit) == [s.index for s in steps] == list(range(len(steps)))
    assert [unit[0].index for unit in units] == sorted(unit[0].index for unit in units)  # by first micro-step
    unit_of: dict[str, int] = {}
    for u, unit in enumerate(units):
        assert [s.index for s in unit] == sorted(s.index for s in unit)  # emission order within a unit
        for s in unit:
            for execution in split_executions(s):
                assert unit_of.setdefault(execution, u) == u, (
                    f"split execution {execution} in units {unit_of[execution]}, {u}"
                )
        # As small as allowed: a micro-step without a split execution is alone; a larger unit is connected.
        if len(unit) > 1:
            reached, frontier = {unit[0].index}, split_executions(unit[0])
            while frontier:
                linked = [s for s in unit if s.index not in reached and split_executions(s) & frontier]
                reached |= {s.index for s in linked}
                frontier = set().union(*(split_executions(s) for s in linked)) if linked else set()
            assert reached == {s.index for s in unit}
    assert_unit_ratios_are_the_batch_ratios(units, steps)
