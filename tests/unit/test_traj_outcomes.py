"""Evaluation outcomes and group readiness (`gyre.traj.outcomes`): the paper's "Partial scoring".

Exact cases worked out from the rules in docs/outcomes.md (times are small numbers on one made-up
clock), the misuse errors, and a hypothesis property test that plays random sequences of starts,
evaluations, closes, expiries and time against an independent model of the rules.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gyre.traj.outcomes import (
    PLACEHOLDER_EVALUATOR,
    CloseKind,
    EvaluatedState,
    Evaluation,
    ExecutionOutcomes,
    GroupOutcomes,
    Status,
    Validity,
)

VALID, PENDING, FAILED = Validity.VALID, Validity.PENDING, Validity.FAILED
COMPLETED, HARNESS_TIMEOUT, OVERALL_TIMEOUT = CloseKind.COMPLETED, CloseKind.HARNESS_TIMEOUT, CloseKind.OVERALL_TIMEOUT
TOTAL_FAILURE, CANCELLED = CloseKind.FAILED, CloseKind.CANCELLED


def state(execution, version: str = "v1", branch: str = "main") -> EvaluatedState:
    return EvaluatedState(execution=execution, artifact_version=version, branch=branch)


def evaluation(s: EvaluatedState, score: float = 1.0, validity: Validity = VALID, *, at: float = 1.0, attempt: int = 1):
    return Evaluation(
        score=score,
        validity=validity,
        state=s,
        attempt=attempt,
        evaluator="tests",
        evaluator_version="1",
        created_at=at,
    )


def record(target: ExecutionOutcomes | GroupOutcomes, s: EvaluatedState, score=1.0, validity=VALID, *, at=1.0):
    """Record the next attempt of `s` on an execution or a group."""
    outcomes = target.execution(s.execution) if isinstance(target, GroupOutcomes) else target
    target.record(evaluation(s, score, validity, at=at, attempt=outcomes.next_attempt(s)))


def started_group(group_size: int, count: int, deadline: float = 100.0) -> GroupOutcomes:
    group = GroupOutcomes(group_size, list(range(count)))
    for e in range(count):
        group.start(e, deadline)
    return group


# -- the evaluation log ----------------------------------------------------------------------------


def test_later_evaluations_never_overwrite_earlier_ones():
    ex = ExecutionOutcomes(0, deadline=10.0)
    v1, v2, v1_side = state(0, "v1"), state(0, "v2"), state(0, "v1", "side")
    record(ex, v1, 0.3, at=1.0)
    record(ex, v2, 0.6, at=2.0)
    record(ex, v1, 0.4, at=3.0)  # re-evaluating v1 appends attempt 2
    record(ex, v1_side, 0.9, at=4.0)  # same artifact on another branch is another state
    assert [(e.state, e.attempt, e.score) for e in ex.evaluations] == [
        (v1, 1, 0.3),
        (v2, 1, 0.6),
        (v1, 2, 0.4),
        (v1_side, 1, 0.9),
    ]
    assert [e.score for e in ex.evaluations_of(v1)] == [0.3, 0.4]
    assert ex.next_attempt(v1) == 3 and ex.next_attempt(state(0, "v3")) == 1
    ex.close(COMPLETED, now=5.0, final_state=v1)
    assert ex.status is Status.VALID and ex.reward == 0.4  # latest valid of the final state
    assert ex.evaluations[0].score == 0.3  # still there, still bound to v1


def test_attempt_must_be_the_next_one_and_nothing_is_recorded_otherwise():
    ex = ExecutionOutcomes(0, deadline=10.0)
    s = state(0)
    record(ex, s, 0.5)
    for attempt in (1, 3):  # a replay of attempt 1 and a skipped attempt 2
        with pytest.raises(ValueError, match="expected 2"):
            ex.record(evaluation(s, 0.9, attempt=attempt))
    assert [e.score for e in ex.evaluations] == [0.5]


def test_designated_is_the_latest_valid_evaluation_of_the_final_state():
    ex = ExecutionOutcomes(0, deadline=10.0)
    draft, final = state(0, "draft"), state(0, "final")
    record(ex, draft, 1.0, at=1.0)  # a perfect intermediate artifact, later revised
    record(ex, final, 0.25, at=2.0)
    record(ex, final, 0.0, PENDING, at=3.0)  # a later pending attempt does not take the valid one away
    record(ex, final, 0.0, FAILED, at=4.0)
    assert ex.designated is None and ex.status is Status.OPEN  # nothing is designated before close
    ex.close(HARNESS_TIMEOUT, now=5.0, final_state=final)
    assert ex.designated is ex.evaluations[1]
    assert ex.reward == 0.25 and ex.final_state == final and ex.close_kind is HARNESS_TIMEOUT


def test_valid_evaluation_before_close_of_the_state_named_final_counts():
    ex = ExecutionOutcomes(0, deadline=10.0)
    record(ex, state(0, "v3"), 0.7, at=1.0)
    ex.close(COMPLETED, now=2.0, final_state=state(0, "v3"))
    assert ex.status is Status.VALID and ex.reward == 0.7
    assert not ex.retry_allowed(3.0)  # nothing left to retry


# -- the three failure classes ---------------------------------------------------------------------


def test_pending_evaluation_retried_within_budget_then_excluded():
    ex = ExecutionOutcomes(0, deadline=10.0)
    final = state(0)
    ex.close(COMPLETED, now=2.0, final_state=final)
    assert ex.status is Status.AWAITING and ex.retry_allowed(2.0)  # the first attempt
    record(ex, final, 0.0, PENDING, at=3.0)
    record(ex, final, 0.0, FAILED, at=6.0)  # the evaluator crashed on the same preserved state
    assert ex.retry_allowed(9.5) and not ex.retry_allowed(10.0)  # the budget allows while now < deadline
    assert ex.expire(9.5) is False and ex.status is Status.AWAITING
    with pytest.raises(ValueError, match="past the budget"):
        record(ex, final, 1.0, at=10.0)
    assert ex.expire(10.0) is True
    assert ex.status is Status.EXCLUDED and ex.reward is None and ex.designated is None
    assert ex.expire(11.0) is False  # already excluded
    with pytest.raises(ValueError, match="EXCLUDED"):
        record(ex, final, 1.0, at=9.0)  # even a result timed within the budget: exclusion is final
    assert [e.validity for e in ex.evaluations] == [PENDING, FAILED]


def test_pending_then_valid_within_budget():
    ex = ExecutionOutcomes(0, deadline=10.0)
    final = state(0)
    ex.close(COMPLETED, now=1.0, final_state=final)
    record(ex, final, 0.0, PENDING, at=2.0)
    record(ex, final, 0.8, VALID, at=9.0)
    assert ex.status is Status.VALID and ex.reward == 0.8 and ex.designated.attempt == 2
    assert ex.expire(20.0) is False and ex.status is Status.VALID


def test_harness_timeout_preserved_work_earns_a_valid_partial_score():
    ex = ExecutionOutcomes(0, deadline=10.0)
    preserved = state(0, "checkpoint-7", "feature")
    ex.close(HARNESS_TIMEOUT, now=4.0, final_state=preserved)
    assert ex.status is Status.AWAITING
    record(ex, preserved, 0.35, at=5.0)
    assert ex.status is Status.VALID and ex.reward == 0.35  # no penalty for the timeout itself


def test_overall_timeout_is_excluded_even_with_earlier_valid_evaluations():
    ex = ExecutionOutcomes(0, deadline=10.0)
    record(ex, state(0), 1.0, at=3.0)
    ex.close(OVERALL_TIMEOUT, now=10.0, final_state=state(0))
    assert ex.status is Status.EXCLUDED and ex.reward is None and ex.designated is None
    assert not ex.retry_allowed(5.0)
    with pytest.raises(ValueError, match="EXCLUDED"):
        record(ex, state(0), 1.0, at=5.0)


def test_total_failure_is_a_zero_reward_placeholder():
    ex = ExecutionOutcomes(0)  # an image pull error: it never really started
    ex.close(TOTAL_FAILURE, now=1.5)
    placeholder = ex.designated
    assert ex.status is Status.PLACEHOLDER and ex.reward == 0.0
    assert placeholder.placeholder and placeholder.valid and placeholder.score == 0.0
    assert placeholder.state is None and placeholder.attempt == 0 and placeholder.created_at == 1.5
    assert placeholder.evaluator == PLACEHOLDER_EVALUATOR
    assert ex.evaluations == ()  # the placeholder is not an evaluator's attempt
    with pytest.raises(ValueError, match="no evaluable work"):
        ExecutionOutcomes(1, deadline=5.0).close(TOTAL_FAILURE, now=1.0, final_state=state(1))


# -- groups ----------------------------------------------------------------------------------------


def test_total_failure_placeholder_keeps_the_group_complete():
    group = started_group(2, 2)
    group.close(0, TOTAL_FAILURE, now=1.0)
    assert not group.ready
    group.close(1, COMPLETED, now=2.0, final_state=state(1))
    record(group, state(1), 1.0, at=3.0)
    assert group.ready and group.members == (0, 1) and group.surplus == ()
    assert group.rewards() == {0: 0.0, 1: 1.0}


def test_group_readiness_exact():
    group = started_group(3, 3, deadline=10.0)
    with pytest.raises(ValueError, match="not ready"):
        group.rewards()
    record(group, state(0), 0.5, at=1.0)  # before close: not yet designated
    assert not group.ready and group.members == ()
    group.close(0, COMPLETED, now=2.0, final_state=state(0))
    assert not group.ready  # 1 of 3 valid
    group.close(1, HARNESS_TIMEOUT, now=3.0, final_state=state(1))
    record(group, state(1), 0.0, PENDING, at=4.0)
    assert not group.ready  # 1 valid, 1 awaiting, 1 open
    group.close(2, COMPLETED, now=5.0, final_state=state(2))
    record(group, state(2), 0.25, at=6.0)
    assert not group.ready  # execution 1 still awaits a valid evaluation within its budget
    assert group.retryable(6.0) == (1,)
    assert group.expire(9.0) == () and not group.ready
    assert group.expire(10.0) == (1,)
    assert group.ready and group.members == (0, 1, 2) and group.surplus == ()
    assert group.rewards() == {0: 0.5, 1: None, 2: 0.25}  # excluded keeps its slot, without a reward
    assert group.retryable(10.0) == ()


def test_valid_zero_and_excluded_are_distinct():
    group = started_group(2, 2, deadline=10.0)
    group.close(0, COMPLETED, now=1.0, final_state=state(0))
    record(group, state(0), 0.0, at=2.0)  # a valid zero: the attempt failed the task, and that is trainable
    group.close(1, OVERALL_TIMEOUT, now=10.0)
    rewards = group.rewards()
    assert rewards == {0: 0.0, 1: None}
    assert rewards[0] is not None and rewards[1] is None
    assert group.execution(0).status is Status.VALID and group.execution(1).status is Status.EXCLUDED


def test_oversampling_surplus_after_n_valid():
    group = started_group(2, 4)  # N = 2 plus 2 oversampled
    assert group.oversample == 2
    group.close(3, COMPLETED, now=1.0, final_state=state(3))
    record(group, state(3), 0.9, at=2.0)
    group.close(0, COMPLETED, now=2.5, final_state=state(0))  # awaiting its evaluation
    assert not group.ready
    group.close(1, TOTAL_FAILURE, now=3.0)
    assert group.ready and group.members == (1, 3) and group.surplus == (0, 2)
    assert group.rewards() == {1: 0.0, 3: 0.9}
    assert group.retryable(4.0) == ()  # surplus is not worth evaluating
    record(group, state(0), 1.0, at=5.0)  # arrives late: recorded, but the members are frozen
    group.close(2, CANCELLED, now=5.0)  # the driver cancels the surplus still running
    assert group.members == (1, 3) and group.rewards() == {1: 0.0, 3: 0.9}
    assert group.execution(0).reward == 1.0 and group.execution(2).status is Status.CANCELLED


def test_oversampling_with_fewer_than_n_valid_fills_slots_with_excluded():
    group = GroupOutcomes(2, ["a", "b", "c"])
    group.start("c", 10.0)
    group.close("a", OVERALL_TIMEOUT, now=1.0)  # never started: excluded all the same
    group.close("b", CANCELLED, now=1.0)  # cancelled executions never hold a slot
    group.close("c", COMPLETED, now=2.0, final_state=state("c"))
    record(group, state("c"), 0.6, at=3.0)
    assert group.ready and group.members == ("a", "c") and group.surplus == ("b",)
    assert group.rewards() == {"a": None, "c": 0.6}


def test_group_of_all_excluded_is_ready_without_rewards():
    group = started_group(2, 3, deadline=5.0)
    for e in range(3):
        group.close(e, COMPLETED, now=1.0, final_state=state(e))
    assert group.expire(5.0) == (0, 1, 2)
    assert group.members == (0, 1) and group.surplus == (2,)
    assert group.rewards() == {0: None, 1: None}


def test_cancel_stops_an_open_or_awaiting_execution_and_leaves_a_settled_one():
    group = GroupOutcomes(2, [0, 1, 2, 3])
    group.start(0, 10.0)
    group.start(1, 10.0)
    group.start(2, 10.0)
    assert group.cancel(3, now=1.0)  # open, never started: closes CANCELLED
    assert group.execution(3).status is Status.CANCELLED and group.execution(3).close_kind is CANCELLED
    group.close(0, COMPLETED, now=1.0, final_state=state(0))
    record(group, state(0), 0.0, PENDING, at=2.0)
    assert group.cancel(0, now=3.0)  # awaiting, its evaluation stopped: CANCELLED, close kind and log kept
    zero = group.execution(0)
    assert zero.status is Status.CANCELLED and zero.reward is None and zero.designated is None
    assert zero.close_kind is COMPLETED and len(zero.evaluations) == 1
    assert not zero.retry_allowed(4.0) and not zero.expire(20.0) and group.retryable(4.0) == ()
    with pytest.raises(ValueError, match="CANCELLED"):
        record(group, state(0), 1.0, at=4.0)  # no more evaluations, nothing recorded
    assert len(zero.evaluations) == 1 and not group.cancel(0, now=5.0)  # cancelled once
    group.close(1, COMPLETED, now=5.0, final_state=state(1))
    record(group, state(1), 0.7, at=6.0)
    assert not group.cancel(1, now=7.0)  # VALID stays VALID
    assert group.execution(1).status is Status.VALID and not group.ready
    group.close(2, TOTAL_FAILURE, now=8.0)
    assert not group.cancel(2, now=9.0)  # a placeholder stays
    assert group.ready and group.members == (1, 2) and group.rewards() == {1: 0.7, 2: 0.0}


def test_cancelled_awaiting_executions_never_hold_a_slot():
    group = started_group(2, 3)
    group.close(0, COMPLETED, now=1.0, final_state=state(0))
    group.close(1, COMPLETED, now=1.0, final_state=state(1))
    group.cancel(1, now=2.0)
    record(group, state(0), 0.5, at=3.0)
    group.close(2, OVERALL_TIMEOUT, now=4.0)
    assert group.ready and group.members == (0, 2) and group.rewards() == {0: 0.5, 2: None}
    with pytest.raises(ValueError, match="unknown execution 9"):
        group.cancel(9, now=5.0)


# -- misuse ----------------------------------------------------------------------------------------


def test_unknown_execution_is_rejected():
    group = started_group(2, 2)
    with pytest.raises(ValueError, match="unknown execution 7"):
        record(group, state(7), 1.0)
    with pytest.raises(ValueError, match="unknown execution 7"):
        group.close(7, COMPLETED, now=1.0, final_state=state(7))
    with pytest.raises(ValueError, match="unknown execution"):
        group.start(7, 1.0)
    with pytest.raises(ValueError, match="recorded on execution 0"):
        ExecutionOutcomes(0, deadline=5.0).record(evaluation(state(1)))
    with pytest.raises(ValueError, match="given to execution 0"):
        ExecutionOutcomes(0, deadline=5.0).close(COMPLETED, now=1.0, final_state=state(1))


@pytest.mark.parametrize("score", [math.nan, math.inf, -math.inf])
def test_non_finite_score_is_rejected(score):
    with pytest.raises(ValueError, match="finite"):
        evaluation(state(0), score)


def test_bad_evaluation_fields_are_rejected():
    with pytest.raises(ValueError, match="finite"):
        evaluation(state(0), at=math.nan)
    with pytest.raises(ValueError, match="counts from 1"):
        evaluation(state(0), attempt=0)
    with pytest.raises(TypeError, match="score"):
        evaluation(state(0), True)
    with pytest.raises(ValueError, match="non-empty"):
        state(0, version="")
    with pytest.raises(ValueError, match="placeholder"):
        Evaluation(score=1.0, validity=VALID, state=None, attempt=0, evaluator="x", evaluator_version="1",
                   created_at=0.0, placeholder=True)  # fmt: skip
    assert evaluation(state(0), 1).score == 1.0 and isinstance(evaluation(state(0), 1).score, float)


def test_closing_twice_is_rejected():
    ex = ExecutionOutcomes(0, deadline=5.0)
    ex.close(COMPLETED, now=1.0, final_state=state(0))
    for kind in CloseKind:
        with pytest.raises(ValueError, match="already closed"):
            ex.close(kind, now=2.0, final_state=state(0) if kind.evaluable else None)
    assert ex.close_kind is COMPLETED and ex.closed_at == 1.0


def test_evaluating_after_exclusion_placeholder_or_cancel_is_rejected():
    for kind in (OVERALL_TIMEOUT, TOTAL_FAILURE, CANCELLED):
        ex = ExecutionOutcomes(0, deadline=5.0)
        ex.close(kind, now=1.0)
        with pytest.raises(ValueError, match=ex.status.name):
            record(ex, state(0), at=2.0)
        assert ex.evaluations == ()


def test_other_misuse():
    with pytest.raises(ValueError, match="must be >= 1"):
        GroupOutcomes(0, [0])
    with pytest.raises(ValueError, match="at least N"):
        GroupOutcomes(3, [0, 1])
    with pytest.raises(ValueError, match="distinct"):
        GroupOutcomes(2, [0, 0])
    ex = ExecutionOutcomes(0)
    with pytest.raises(ValueError, match="not started"):
        record(ex, state(0))
    with pytest.raises(ValueError, match="never started"):
        ex.close(COMPLETED, now=1.0, final_state=state(0))
    ex.start(5.0)
    with pytest.raises(ValueError, match="already started"):
        ex.start(6.0)
    with pytest.raises(ValueError, match="needs the final_state"):
        ex.close(HARNESS_TIMEOUT, now=1.0)
    with pytest.raises(TypeError, match="CloseKind"):
        ex.close("completed", now=1.0, final_state=state(0))
    placeholder = ExecutionOutcomes(1)
    placeholder.close(TOTAL_FAILURE, now=1.0)
    with pytest.raises(ValueError, match="not recorded"):
        ex.record(placeholder.designated)
    assert ex.status is Status.OPEN and ex.evaluations == ()


def test_close_kinds_are_the_scheduler_outcomes():
    from gyre.sched import Outcome

    assert [k.value for k in CloseKind] == [o.value for o in Outcome]
    for outcome in Outcome:
        kind = CloseKind(outcome.value)
        assert outcome.closes_group_slot == (kind.evaluable or kind is TOTAL_FAILURE)


def test_module_imports_only_the_standard_library():
    """Loaded on its own (not through a package), the module pulls in nothing outside the stdlib."""
    path = Path(__file__).resolve().parents[2] / "gyre" / "traj" / "outcomes.py"
    code = (
        "import importlib.util, sys\n"
        "before = set(sys.modules)\n"
        f"spec = importlib.util.spec_from_file_location('outcomes_alone', {str(path)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['outcomes_alone'] = module\n"
        "spec.loader.exec_module(module)\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before} - {'outcomes_alone'}\n"
        "print(','.join(sorted(m for m in new if m not in sys.stdlib_module_names)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""


# -- property test ---------------------------------------------------------------------------------


def moves(count: int):
    """Random moves on a group of `count` executions; id `count` names an execution the group lacks.

    Weighted towards the moves that make progress (valid evaluations of the version most closes name,
    evaluable closes, small time steps) so that both ways to readiness are common; refused moves
    (wrong attempt, unknown execution, past the budget, twice closed) still make up a good share."""
    execution = st.integers(0, count)
    return st.one_of(
        st.tuples(st.just("advance"), st.sampled_from([0.0, 0.25, 0.5, 2.0])),
        st.tuples(st.just("start"), execution, st.sampled_from([2.0, 10.0, 50.0])),
        st.tuples(
            st.just("record"),
            execution,
            st.sampled_from(["v1", "v1", "v1", "v2"]),
            st.sampled_from([VALID, VALID, PENDING, FAILED]),
            st.sampled_from([0.0, 0.5, 1.0]),
            st.sampled_from([0, 0, 0, 0, -1, 1]),  # offset from the correct attempt number
        ),
        st.tuples(
            st.just("close"),
            execution,
            st.sampled_from([COMPLETED] * 3 + [HARNESS_TIMEOUT] * 2 + [OVERALL_TIMEOUT, TOTAL_FAILURE, CANCELLED]),
            st.sampled_from([None, "v1", "v1", "v1", "v2"]),
        ),
        st.tuples(st.just("expire")),
    )


@st.composite
def scenarios(draw):
    group_size = draw(st.integers(1, 3))
    count = group_size + draw(st.integers(0, 2))
    budgets = draw(st.lists(st.sampled_from([None, 4.0, 20.0, 100.0]), min_size=count, max_size=count))
    return group_size, budgets, draw(st.lists(moves(count), min_size=40, max_size=100))


class Model:
    """An independent account of one execution, written from the rules in docs/outcomes.md."""

    def __init__(self) -> None:
        self.deadline: float | None = None
        self.log: list[tuple[EvaluatedState, Validity, float, int]] = []
        self.kind: CloseKind | None = None
        self.final: EvaluatedState | None = None
        self.expired = False

    def designated_score(self) -> float | None:
        if self.kind is TOTAL_FAILURE:
            return 0.0
        if self.kind not in (COMPLETED, HARNESS_TIMEOUT):
            return None
        scores = [score for s, validity, score, _ in self.log if s == self.final and validity is VALID]
        return scores[-1] if scores else None

    def status(self) -> Status:
        simple = {None: Status.OPEN, CANCELLED: Status.CANCELLED, TOTAL_FAILURE: Status.PLACEHOLDER}
        if self.kind in simple:
            return simple[self.kind]
        if self.kind is OVERALL_TIMEOUT:
            return Status.EXCLUDED
        if self.designated_score() is not None:
            return Status.VALID
        return Status.EXCLUDED if self.expired else Status.AWAITING

    def attempt_for(self, s: EvaluatedState, offset: int) -> tuple[int, int]:
        """(the attempt number a move carries, the one the rules expect)."""
        expected = sum(1 for logged, *_ in self.log if logged == s) + 1
        return max(1, expected + offset), expected


def legal(move, models: list[Model], now: float) -> bool:
    """Whether the rules allow `move` in the models' current state."""
    name = move[0]
    if name in ("advance", "expire"):
        return True
    if move[1] >= len(models):
        return False  # unknown execution
    model = models[move[1]]
    if name == "start":
        return model.deadline is None and model.kind is None
    if name == "record":
        _, e, version, _, _, offset = move
        carried, expected = model.attempt_for(state(e, version), offset)
        return (
            model.status() not in (Status.EXCLUDED, Status.PLACEHOLDER, Status.CANCELLED)
            and model.deadline is not None
            and now < model.deadline
            and carried == expected
        )
    _, _, kind, version = move
    if model.kind is not None:
        return False
    if kind.evaluable:
        return version is not None and model.deadline is not None
    return not (kind is TOTAL_FAILURE and version is not None)


def play(group: GroupOutcomes, move, models: list[Model], now: float) -> None:
    """Carry out `move` on the group (the models only name the attempt number)."""
    name = move[0]
    if name == "expire":
        group.expire(now)
    elif name == "start":
        group.start(move[1], now + move[2])
    elif name == "record":
        _, e, version, validity, score, offset = move
        model = models[e] if e < len(models) else Model()
        carried, _ = model.attempt_for(state(e, version), offset)
        group.record(evaluation(state(e, version), score, validity, at=now, attempt=carried))
    elif name == "close":
        _, e, kind, version = move
        group.close(e, kind, now=now, final_state=None if version is None else state(e, version))


def follow(move, models: list[Model], now: float) -> float:
    """Carry out a legal `move` on the models; returns the new time."""
    name = move[0]
    if name == "advance":
        return now + move[1]
    if name == "expire":
        for model in models:
            if model.status() is Status.AWAITING and now >= model.deadline:
                model.expired = True
    elif name == "start":
        models[move[1]].deadline = now + move[2]
    elif name == "record":
        _, e, version, validity, score, offset = move
        carried, _ = models[e].attempt_for(state(e, version), offset)
        models[e].log.append((state(e, version), validity, float(score), carried))
    else:
        _, e, kind, version = move
        models[e].kind, models[e].final = kind, None if version is None else state(e, version)
    return now


def snapshot(group: GroupOutcomes):
    return [
        (
            group.execution(e).evaluations,
            group.execution(e).status,
            group.execution(e).reward,
            group.execution(e).deadline,
        )
        for e in group.executions
    ]


STICKY = (Status.VALID, Status.PLACEHOLDER, Status.EXCLUDED, Status.CANCELLED)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_sequences_follow_the_rules(scenario):
    """Every move the rules allow is accepted and every other one is refused with a ValueError that
    leaves the group unchanged. After each accepted move: the logs equal the model's (append-only,
    every evaluation still bound to its state and attempt), statuses and rewards equal the model's,
    VALID/PLACEHOLDER/EXCLUDED/CANCELLED never change, retry_allowed is AWAITING within the budget,
    readiness is exact and monotone, the members never change once ready, and a member's reward is None
    exactly when it is excluded. Finally, once every execution is closed and every budget has run out,
    the group is ready (liveness)."""
    group_size, budgets, moves = scenario  # budgets: deadline per execution, None: not started yet
    count = len(budgets)
    group = GroupOutcomes(group_size, list(range(count)))
    models = [Model() for _ in range(count)]
    for e in range(count):
        if budgets[e] is not None:
            group.start(e, budgets[e])
            models[e].deadline = budgets[e]
    now = 0.0
    frozen: list[tuple] = []  # the members when the group first became ready

    def check(before: list[Status]) -> None:
        statuses = [group.execution(e).status for e in range(count)]
        for e, model in enumerate(models):
            ex = group.execution(e)
            assert statuses[e] is model.status()
            assert ex.reward == model.designated_score()
            assert [(v.state, v.validity, v.score, v.attempt) for v in ex.evaluations] == model.log
            assert ex.retry_allowed(now) == (statuses[e] is Status.AWAITING and now < model.deadline)
            if before[e] in STICKY:
                assert statuses[e] is before[e]
        with_reward = [e for e in range(count) if statuses[e].has_reward]
        if frozen:  # ready is monotone and the members never change
            assert group.ready and group.members == frozen[0]
        elif group.ready:
            frozen.append(group.members)
            event("ready with N valid" if len(with_reward) >= group_size else "ready with every execution settled")
            if len(with_reward) >= group_size:
                assert len(group.members) == group_size and set(group.members) <= set(with_reward)
            else:
                assert all(s.settled for s in statuses)
                excluded = [e for e in range(count) if statuses[e] is Status.EXCLUDED]
                assert group.members == tuple(sorted(with_reward + excluded[: group_size - len(with_reward)]))
        else:
            assert len(with_reward) < group_size and not all(s.settled for s in statuses)
            assert group.members == () and group.surplus == ()
        if group.ready:
            assert set(group.members) | set(group.surplus) == set(range(count))
            rewards = group.rewards()
            assert list(rewards) == list(group.members)
            for e, reward in rewards.items():
                assert (reward is None) == (statuses[e] is Status.EXCLUDED)

    for move in moves:
        before = snapshot(group)
        allowed = legal(move, models, now)
        try:
            play(group, move, models, now)
        except ValueError:
            event(f"refused {move[0]}")
            assert not allowed, f"a legal move was refused: {move}"
            assert snapshot(group) == before, f"a refused move changed state: {move}"
            continue
        assert allowed, f"an illegal move was accepted: {move}"
        now = follow(move, models, now)
        check([s for _, s, _, _ in before])

    event("ready before the drain" if group.ready else "ready only after the drain")
    # Liveness: once every execution is closed and every budget has run out, the group is ready.
    before = [group.execution(e).status for e in range(count)]
    for e in range(count):
        if models[e].kind is None:
            group.close(e, OVERALL_TIMEOUT, now=now)
            follow(("close", e, OVERALL_TIMEOUT, None), models, now)
    now = max([now] + [m.deadline for m in models if m.deadline is not None])
    group.expire(now)
    follow(("expire",), models, now)
    check(before)
    assert group.ready
