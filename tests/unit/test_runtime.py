"""The runtime's pure glue (gyre/runtime): ids, outcomes and verdicts, lazy claims in one process (docs/runtime.md)."""

from __future__ import annotations

import numpy as np
import pytest
from local_claims import WAIT, LocalClaims
from test_data_claim_units import step as claim_units_step

from gyre.config import PackingConfig
from gyre.data import StreamPackingBuffer, TrajectoryBuffer
from gyre.data.queue import MicroStepQueue
from gyre.proxy.sessions import check_execution_id
from gyre.runtime.controller.verdicts import judge_group, sampled_tokens, sched_outcome
from gyre.runtime.ids import POOL_NAME, ExecutionIds, engine_id, engine_name
from gyre.sched import POOL, BeginStep, Dispatch, GroupState, Outcome, SchedSpec, Scheduler, Start
from gyre.traj import CallMeta, Provenance, Response, Segment, TrajectoryTree
from gyre.traj.outcomes import CloseKind, EvaluatedState, Evaluation, GroupOutcomes, Validity
from gyre.traj.roles import classifier_for

# -- ids ---------------------------------------------------------------------------------------------------------


def test_execution_names_round_trip_name_their_group_and_are_valid_session_ids():
    ids = ExecutionIds(5)
    assert ids.name(0) == "g000000-e0000000"
    assert ids.name(12) == "g000002-e0000012"
    assert ids.names(1) == [f"g000001-e{e:07d}" for e in range(5, 10)]
    for e in (0, 4, 5, 12, 10**7 + 3):
        assert ids.execution(ids.name(e)) == e
        assert check_execution_id(ids.name(e)) == ids.name(e)
    names = [ids.name(e) for e in range(0, 300, 7)]
    assert names == sorted(names)  # record files list in execution order


@pytest.mark.parametrize("bad", ["g000001-e0000000", "g0-e0", "x", "", "g000000-e0000001.jsonl", 3])
def test_a_name_the_run_never_gave_is_a_value_error(bad):
    with pytest.raises(ValueError, match="not one of this run's"):
        ExecutionIds(5).execution(bad)


def test_bad_execution_ids_and_group_sizes_are_refused():
    with pytest.raises(ValueError, match="executions_per_group=0"):
        ExecutionIds(0)
    with pytest.raises(ValueError, match="execution=-1"):
        ExecutionIds(2).name(-1)
    with pytest.raises(ValueError, match="group=True"):
        ExecutionIds(2).names(True)


def test_engine_names_round_trip_cells_and_the_pool():
    assert engine_name(POOL) == POOL_NAME and engine_id(POOL_NAME) == POOL
    for cell in (0, 1, 17):
        assert engine_id(engine_name(cell)) == cell
    assert engine_name(3) == "cell-3"
    for bad in ("cell-01", "cell-", "engine-0", "embedded"):
        with pytest.raises(ValueError, match="is not allowed"):
            engine_id(bad)
    with pytest.raises(ValueError, match="engine=-2"):
        engine_name(-2)


# -- outcomes -> the scheduler ----------------------------------------------------------------------------------


def tree_of(execution: str, output: list[int] = (20, 21)) -> TrajectoryTree:
    """One call: path [1 2 | output], targets on the output."""
    tree = TrajectoryTree(execution, 100)
    logprobs = [-0.1 * (k + 1) for k in range(len(output))]
    tree.insert(
        [Segment(Provenance.SYSTEM, [1, 2])],
        Response.build(list(output), logprobs, "stop"),
        CallMeta(execution, "r0", role_signals={"gyre_role": "main"}),
    )
    tree.close()
    return tree


def evaluated(outcomes: GroupOutcomes, execution: str, score: float, kind: CloseKind = CloseKind.COMPLETED) -> None:
    state = EvaluatedState(execution=execution, artifact_version="v1", branch="main")
    outcomes.close(execution, kind, now=1.0, final_state=state)
    outcomes.record(
        Evaluation(
            score=score,
            validity=Validity.VALID,
            state=state,
            attempt=1,
            evaluator="t",
            evaluator_version="1",
            created_at=2.0,
        )
    )


def test_each_settled_status_maps_to_the_schedulers_outcome():
    names = ["a", "b", "c", "d", "e", "f"]
    outcomes = GroupOutcomes(5, names)
    for e in names:
        outcomes.start(e, 10.0)
    evaluated(outcomes, "a", 1.0)
    evaluated(outcomes, "b", 0.5, CloseKind.HARNESS_TIMEOUT)
    outcomes.close("c", CloseKind.FAILED, now=1.0)
    outcomes.close("d", CloseKind.OVERALL_TIMEOUT, now=1.0)
    outcomes.close(
        "e", CloseKind.COMPLETED, now=1.0, final_state=EvaluatedState(execution="e", artifact_version="v", branch="m")
    )
    outcomes.expire(10.0)  # e: no valid evaluation within its budget
    outcomes.close("f", CloseKind.CANCELLED, now=1.0)
    got = {e: sched_outcome(outcomes.execution(e)) for e in names}
    assert got == {
        "a": Outcome.COMPLETED,
        "b": Outcome.HARNESS_TIMEOUT,
        "c": Outcome.FAILED,
        "d": Outcome.OVERALL_TIMEOUT,
        "e": Outcome.OVERALL_TIMEOUT,
        "f": None,
    }
    assert [o.closes_group_slot for o in (got["a"], got["b"], got["c"], got["d"])] == [True, True, True, False]


def test_an_unsettled_execution_has_no_outcome_yet():
    outcomes = GroupOutcomes(1, ["a"])
    outcomes.start("a", 10.0)
    with pytest.raises(ValueError, match="'a' is OPEN"):
        sched_outcome(outcomes.execution("a"))
    assert sampled_tokens(None) == 0 and sampled_tokens(tree_of("a", [5, 6, 7])) == 3


# -- a closed group -> the buffers' verdict ---------------------------------------------------------------------


def test_a_closed_group_is_admitted_and_accepted():
    buffer = TrajectoryBuffer()
    buffer.add_group(0, 0, ["a", "b"], 2)
    outcomes = GroupOutcomes(2, ["a", "b"])
    for e, score in (("a", 1.0), ("b", 0.0)):
        outcomes.start(e, 10.0)
        evaluated(outcomes, e, score)
    verdict = judge_group(
        buffer,
        0,
        outcomes,
        {"a": tree_of("a"), "b": tree_of("b")},
        classify=classifier_for("builtin"),
        j_max=5,
        run_seed=0,
    )
    assert verdict.accepted and verdict.reason == ""
    assert {e: [t.num_targets for t in ts] for e, ts in verdict.admitted.items()} == {"a": [2], "b": [2]}
    assert buffer.ready_groups() == [0] and buffer.group(0).rewards == {"a": 1.0, "b": 0.0}


def test_a_group_with_a_row_over_the_budget_is_refused_and_the_buffer_keeps_it_unready():
    buffer = TrajectoryBuffer(max_row_tokens=3)
    buffer.add_group(4, 0, ["a"], 1)
    outcomes = GroupOutcomes(1, ["a"])
    outcomes.start("a", 10.0)
    evaluated(outcomes, "a", 1.0)
    verdict = judge_group(
        buffer, 4, outcomes, {"a": tree_of("a")}, classify=classifier_for("builtin"), j_max=5, run_seed=0
    )
    assert not verdict.accepted and "max_row_tokens=3" in verdict.reason
    assert buffer.ready_groups() == [] and not buffer.group(4).ready


def test_judging_a_group_whose_outcomes_are_not_ready_is_a_callers_error():
    buffer = TrajectoryBuffer()
    buffer.add_group(0, 0, ["a"], 1)
    with pytest.raises(ValueError, match="once its outcomes are ready"):
        judge_group(buffer, 0, GroupOutcomes(1, ["a"]), {}, classify=classifier_for("builtin"), j_max=5, run_seed=0)


# -- lazy claims in one process ---------------------------------------------------------------------------------

N, B = 2, 2


def async_scheduler() -> tuple[Scheduler, list]:
    """Async, K = 2: cell 0 trains from the start (a step is open at once), cell 1 rolls out N B executions."""
    spec = SchedSpec(
        num_cells=2, cell_capacity=N * B, group_size=N, batch_groups=B, extra_groups=0, mu=1, rho_min=0.5, tau_s=0.0,
        mode="async", train_cells=1, buffer_verdicts=True,
    )  # fmt: skip
    sched = Scheduler(spec)
    return sched, sched.start(0.0)


def close_group(
    sched: Scheduler, buffer: TrajectoryBuffer, group: int, ids: ExecutionIds, now: float, output=(20, 21)
) -> None:
    """Every execution of `group` ends, is evaluated and closes; the buffers accept the group."""
    names = ids.names(group)
    outcomes = GroupOutcomes(N, names)
    for e, name in zip(ids.executions(group), names, strict=True):
        sched.harness_ended(now, e)
        outcomes.start(name, 10.0)
        evaluated(outcomes, name, float(e % 2))
        sched.execution_closed(now, e, Outcome.COMPLETED, 2.0)
    verdict = judge_group(
        buffer,
        group,
        outcomes,
        {n: tree_of(n, output) for n in names},
        classify=classifier_for("builtin"),
        j_max=5,
        run_seed=0,
    )
    assert verdict.accepted
    sched.group_accepted(now, group)


def test_claims_take_one_group_at_a_time_when_the_queue_runs_dry_and_wait_for_verdicts():
    sched, actions = async_scheduler()
    assert BeginStep(0) in actions and next(a for a in actions if isinstance(a, Start)) == Start(0, 1)
    ids = ExecutionIds(N)
    buffer = TrajectoryBuffer()
    for group in range(B):
        buffer.add_group(group, 0, ids.names(group), N)
    # min_fill 0: every pull emits its micro-step at once, so each group's data is claimable when it is pulled
    packer = StreamPackingBuffer(
        buffer, PackingConfig(batch_groups=B, group_size=N, max_tokens_per_microstep=8, min_fill=0.0)
    )
    reported: list = []
    claims = LocalClaims(sched, packer, clock=lambda: 1.0, on_actions=reported.extend)
    assert claims.next_unit() is WAIT  # the step is open, no group is ready yet
    close_group(sched, buffer, 0, ids, 1.0)
    close_group(sched, buffer, 1, ids, 1.0)
    assert sched.ready_unclaimed == 2
    index, unit = claims.next_unit()
    assert index == 0 and claims.groups == [0] and sched.ready_unclaimed == 1  # lazy: only what training needs
    assert [step.group_ids for step in unit] == [(0, 0)]
    index, unit = claims.next_unit()
    assert index == 1 and claims.groups == [0, 1] and sched.ready_unclaimed == 0 and packer.closed
    assert claims.next_unit() is None  # the stream is closed and drained: the step is done
    assert [len(step.execution_ids) for step in claims.micro_steps] == [2, 2]
    assert np.all(np.concatenate([step.batch_execution_E for step in claims.micro_steps]) == [0, 1, 2, 3])
    sched.step_finished(2.0)
    assert sched.trainer_version == 1


def test_a_claimed_group_the_packer_sets_aside_is_reported_replaced_and_the_step_still_gets_b_groups():
    sched, _ = async_scheduler()
    ids = ExecutionIds(N)
    buffer = TrajectoryBuffer()  # no row budget yet: group 0 is marked ready with rows of 7 tokens
    for group in range(B):
        buffer.add_group(group, 0, ids.names(group), N)
    close_group(sched, buffer, 0, ids, 1.0, output=(20, 21, 22, 23, 24))
    packer = StreamPackingBuffer(
        buffer, PackingConfig(batch_groups=B, group_size=N, max_tokens_per_microstep=4, min_fill=0.0)
    )
    close_group(sched, buffer, 1, ids, 1.0)  # rows of 4 tokens: they fit
    reported: list = []
    claims = LocalClaims(sched, packer, clock=lambda: 2.0, on_actions=reported.extend)
    index, unit = claims.next_unit()
    assert index == 0 and claims.groups == [1] and [step.group_ids for step in unit] == [(1,)]
    assert [group for group, _ in claims.set_aside] == [0] and "max_tokens_per_microstep=4" in claims.set_aside[0][1]
    assert sched.group_state(0) is GroupState.SET_ASIDE and sched.claimed_in_batch == 1
    assert sched.staleness.values == [0]  # only the trained group's claim is recorded
    assert reported[0] == Dispatch(2, 1, 0, replaces=0)  # its replacement, started on the rollout cell
    assert [a for a in reported if isinstance(a, Start)] == [Start(4, 1), Start(5, 1)]
    index, unit = claims.next_unit()
    assert index == 1 and len(unit) == 1  # group 1's second micro-step (one execution of 4 tokens each)
    assert claims.next_unit() is WAIT  # the batch waits for the replacement
    buffer.add_group(2, 0, ids.names(2), N)
    close_group(sched, buffer, 2, ids, 3.0)
    assert [len(u) for u in (claims.next_unit()[1], claims.next_unit()[1])] == [1, 1]
    assert claims.groups == [1, 2] and packer.closed and claims.next_unit() is None
    sched.step_finished(4.0)
    assert sched.trainer_version == 1 and sched.staleness.values == [0, 0]


def test_a_pull_error_that_set_nothing_aside_is_raised():
    sched, _ = async_scheduler()
    ids = ExecutionIds(N)
    buffer = TrajectoryBuffer()
    buffer.add_group(0, 0, ids.names(0), N)
    packer = StreamPackingBuffer(buffer, PackingConfig(batch_groups=B, group_size=N, max_tokens_per_microstep=8))
    close_group(sched, buffer, 0, ids, 1.0)
    buffer.take(0)  # someone else took it: the packer cannot pull it
    claims = LocalClaims(sched, packer, clock=lambda: 1.0, on_actions=lambda actions: None)
    with pytest.raises(ValueError, match="group 0"):
        claims.next_unit()
    assert claims.set_aside == [] and packer.rejected_groups() == []


class SplitPullPacker:
    """A stand-in for the packer (named as such) whose every pull emits one split execution's micro-steps apart,
    as free-row packing does (docs/data.md, "Claim units"): a (split), b, a (split)."""

    def __init__(self) -> None:
        self.queue = MicroStepQueue()
        self.pulled: list[int] = []

    def pull(self, group: int) -> None:
        self.pulled.append(group)
        for index, executions, split in ((0, "a", "a"), (1, "b", ""), (2, "a", "a")):
            self.queue.put(claim_units_step(index, executions, split))

    def rejected_groups(self) -> list:
        return []


def test_a_pulls_split_execution_is_one_unit_handed_out_at_the_pulls_end_without_claiming_another_group():
    sched, _ = async_scheduler()
    ids = ExecutionIds(N)
    buffer = TrajectoryBuffer()
    for group in range(B):
        buffer.add_group(group, 0, ids.names(group), N)
    close_group(sched, buffer, 0, ids, 1.0)
    packer = SplitPullPacker()
    claims = LocalClaims(sched, packer, clock=lambda: 1.0, on_actions=lambda actions: None)
    first = claims.next_unit()
    assert first is not WAIT, "the pull's complete units were held back"
    second = claims.next_unit()
    assert {tuple(step.index for step in first[1]), tuple(step.index for step in second[1])} == {(0, 2), (1,)}
    assert packer.pulled == [0]  # lazy: the units of group 0 came before any other claim
