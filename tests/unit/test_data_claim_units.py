"""gyre.data.claim_units on the real packer's streams: every micro-step of a split execution lands in one claim unit,
also when the packer emits them non-consecutively (`keep_executions_together=False`), so s_i (Eq. 5) per unit is
s_i over the whole batch; units stay as small as that allows, in the order of their first micro-step."""

from __future__ import annotations

import numpy as np

from gyre.config import PackingConfig
from gyre.data import ClaimUnitAssembler, MicroStep, StreamPackingBuffer, TokenRow, TrajectoryBuffer, build_microstep
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
    assert [[s.index for s in unit] for unit in units_of(steps)] == [[0, 2], [1]]


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
