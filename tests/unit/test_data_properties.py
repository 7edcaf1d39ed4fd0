"""Property tests of the stream: over random groups, budgets and hold-back, every admitted row lands in
exactly one micro-step of its batch, every micro-step fits the budget, every target keeps its behavior
log-prob and L_i, and each stream closes after exactly B groups. Plus: gyre.data stays pure."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.config import PackingConfig
from gyre.data import StreamPackingBuffer, TrajectoryBuffer
from gyre.traj import CallMeta, Provenance, Response, Segment, TrajectoryTree
from gyre.traj.admission import AdmittedTrajectory

# One execution: a list of calls, each (context length, output length); every call branches off the root
# with a distinct first token, so every call is its own leaf and all its output tokens are targets.
executions = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 4)), min_size=0, max_size=3)
groups = st.lists(st.lists(st.one_of(st.none(), st.floats(0, 1)), min_size=2, max_size=2), min_size=1, max_size=6)


def make_tree(execution: str, calls: list[tuple[int, int]]) -> tuple[TrajectoryTree, list[AdmittedTrajectory]]:
    tree = TrajectoryTree(execution, 1000)
    admitted = []
    for k, (context, output) in enumerate(calls):
        ids = list(range(100 + k, 100 + k + output))
        record = tree.insert(
            [Segment(Provenance.USER, [k + 1] * context)],
            Response.build(ids, [-0.01 * (i % 50) for i in ids], "stop"),
            CallMeta(execution, f"r{k}"),
        )
        admitted.append(
            AdmittedTrajectory(
                execution, record.response_node, "main", tree.path_tokens(record.response_node).target_mask
            )
        )
    return tree, admitted


@settings(max_examples=80, deadline=None)
@given(
    rewards=groups,
    calls=st.lists(executions, min_size=12, max_size=12),
    batch_groups=st.integers(1, 3),
    budget=st.integers(10, 25),
    min_fill=st.sampled_from([0.0, 0.5, 0.9]),
    together=st.booleans(),
)
def test_every_row_lands_once_within_budget(rewards, calls, batch_groups, budget, min_fill, together):
    buffer = TrajectoryBuffer()
    expected_rows: dict[int, set[tuple[str, int]]] = {}  # group -> rows it must produce
    num_targets: dict[str, int] = {}
    for g, group_rewards in enumerate(rewards):
        names = [f"g{g}e{k}" for k in range(2)]
        buffer.add_group(g, g % 2, names)
        admitted = {}
        for k, e in enumerate(names):
            tree, trajectories = make_tree(e, calls[2 * g + k])
            buffer.attach_tree(tree)
            admitted[e] = trajectories
            num_targets[e] = sum(t.num_targets for t in trajectories)
        buffer.mark_ready(g, dict(zip(names, group_rewards, strict=True)), admitted)
        expected_rows[g] = {
            (e, t.leaf) for e, r in zip(names, group_rewards, strict=True) if r is not None for t in admitted[e]
        }
    config = PackingConfig(
        batch_groups=batch_groups,
        group_size=2,
        max_tokens_per_microstep=budget,  # a row has <= 10 tokens; an execution <= 3 rows may exceed the budget
        keep_executions_together=together,
        min_fill=min_fill,
    )
    packer = StreamPackingBuffer(buffer, config)
    pulled: list[int] = []
    step_pull: list[int] = []  # the pull (or flush) that emitted each micro-step of the batch
    while True:
        group_id = packer.pull()
        if group_id is None and not packer.closed:
            packer.flush()  # the last, incomplete batch: nothing more will come
            step_pull += [len(pulled)] * (packer.queue.num_put - len(step_pull))
            break
        if group_id is not None:
            pulled.append(group_id)
        step_pull += [len(pulled)] * (packer.queue.num_put - len(step_pull))
        if packer.closed:
            assert len(packer.groups) == batch_groups
            steps = []
            while (step := packer.queue.claim(0)) is not None:
                steps.append(step)
            check_batch(steps, packer.groups, expected_rows, num_targets, config, step_pull)
            step_pull = []
            if buffer.num_ready == 0:
                break
            packer.next_batch()
    assert packer.rejected_groups() == []
    # Oldest version first: pull order is sorted by (v_d = g % 2, ready order = g).
    assert pulled == sorted(range(len(rewards)), key=lambda g: (g % 2, g))


def check_batch(steps, batch_groups, expected_rows, num_targets, config, step_pull):
    seen: list[tuple[str, int]] = []
    steps_of: dict[str, list[int]] = {}
    slot_of: dict[str, int] = {}
    for k, step in enumerate(steps):
        for e, slot in zip(step.execution_ids, step.batch_execution_E.tolist(), strict=True):
            steps_of.setdefault(e, []).append(k)
            assert slot_of.setdefault(e, slot) == slot and 0 <= slot < step.num_executions
    assert len(set(slot_of.values())) == len(slot_of)  # one batch slot per execution
    for e, ks in steps_of.items():
        # Flagged iff the execution's rows are in several micro-steps; all emitted by one pull (never part of
        # an execution held back); with keep_executions_together consecutively, and only when over the budget.
        assert all(steps[k].split_E[steps[k].execution_ids.index(e)] == (len(ks) > 1) for k in ks)
        assert len({step_pull[k] for k in ks}) == 1
        if config.keep_executions_together:
            assert ks == list(range(ks[0], ks[0] + len(ks)))
            rows = sum(int((steps[k].row_execution_R == steps[k].execution_ids.index(e)).sum()) for k in ks)
            tokens = sum(
                int(steps[k].row_lengths_R()[steps[k].row_execution_R == steps[k].execution_ids.index(e)].sum())
                for k in ks
            )
            assert (len(ks) > 1) == (tokens > config.max_tokens_per_microstep), (e, rows, tokens)
    for step in steps:
        assert step.num_tokens <= config.max_tokens_per_microstep
        assert step.num_executions == config.batch_groups * 2
        assert step.row_offsets_R1[0] == 0 and step.row_offsets_R1[-1] == step.num_tokens
        for k, e in enumerate(step.execution_ids):
            assert step.num_targets_E[k] == num_targets[e]
        # A row's targets are its output tokens (ids >= 100) and carry the recorded log-prob.
        assert np.array_equal(step.target_U, step.ids_U >= 100)
        np.testing.assert_allclose(step.behavior_logp_U[step.target_U], -0.01 * (step.ids_U[step.target_U] % 50))
        seen += [
            (step.execution_ids[e], int(leaf)) for e, leaf in zip(step.row_execution_R, step.row_leaf_R, strict=True)
        ]
    assert sorted(seen) == sorted(row for g in batch_groups for row in expected_rows[g])
