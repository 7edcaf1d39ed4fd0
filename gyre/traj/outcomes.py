"""Evaluation outcomes of executions and the readiness of rollout groups (the paper's "Partial scoring").

Pure: stdlib only, no IO, no clock. Every time is a number the caller passes in (`now`, `created_at`,
`deadline`), all on one clock of the caller's choosing. The rules, in short (docs/outcomes.md has them
in full):

- An evaluation is bound to the state it scored (execution, artifact version, branch). Each execution
  keeps an append-only log of evaluations: a later evaluation never overwrites an earlier one, and
  re-evaluating the same state appends attempt k + 1.
- The execution's *final state* is the state named when it closes. Its *designated outcome* is the
  latest VALID evaluation of its final state, in log order (VALID is therefore sticky: a later PENDING
  or FAILED attempt does not take it away).
- How an execution closes (`CloseKind`, the values of the scheduler's `gyre.sched.Outcome`):
  COMPLETED and HARNESS_TIMEOUT -> the preserved work is evaluated; a timed-out execution earns a valid
  partial score, since the data plane derives no reward from elapsed time or termination status.
  OVERALL_TIMEOUT -> EXCLUDED. FAILED (total failure, no evaluable work) -> a zero-reward placeholder
  (valid, score 0.0, `placeholder=True`) so the group stays complete. CANCELLED -> surplus, outside
  the group's N. `cancel(now)` also cancels an execution that closed with evaluable work and has no
  valid outcome yet (its evaluation was stopped): CANCELLED, its log kept.
- Pending (or failed) evaluations may be retried while `now < deadline`; once the budget has run out
  without a valid outcome, `expire(now)` EXCLUDES the execution: no reward, dropped from training.
  That is not a valid zero score, which is a reward and is trained on.
- A group of N executions (plus an optional oversampling surplus) is READY when N executions have a
  valid outcome or a placeholder (the rest are then surplus), or when every execution is settled
  (valid, placeholder, excluded or cancelled). Excluded members keep their slot with reward None: the
  loss still averages over the N raw executions.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

ExecutionId = int | str
"""An execution's id: the scheduler's integer index, or a string id of the records."""

PLACEHOLDER_EVALUATOR = "gyre.placeholder"
"""Evaluator name carried by the zero-reward placeholder of a total failure."""


class Validity(enum.Enum):
    """What one evaluation attempt produced."""

    VALID = "valid"  # a score under the task's rules; a valid 0.0 is a reward like any other
    PENDING = "pending"  # the evaluator could not score yet (not run, timed out, resources busy)
    FAILED = "failed"  # the evaluator gave up on this attempt (crashed, errored); retryable within budget


class CloseKind(enum.Enum):
    """How an execution closed; the same values as the scheduler's `gyre.sched.Outcome`.

    Convert with `CloseKind(outcome.value)`; `gyre.traj` stays free of imports from other packages.
    """

    COMPLETED = "completed"  # finished: evaluate the final state
    HARNESS_TIMEOUT = "harness_timeout"  # the harness's budget ran out: evaluate the preserved work
    OVERALL_TIMEOUT = "overall_timeout"  # the overall budget ran out: excluded
    FAILED = "failed"  # total failure, no evaluable work: zero-reward placeholder
    CANCELLED = "cancelled"  # surplus under oversampling: not part of the group's N

    @property
    def evaluable(self) -> bool:
        """The execution left work that is evaluated to give its reward."""
        return self in (CloseKind.COMPLETED, CloseKind.HARNESS_TIMEOUT)


class Status(enum.Enum):
    """Where an execution stands. VALID, PLACEHOLDER, EXCLUDED and CANCELLED never change once reached."""

    OPEN = "open"  # not closed yet (queued or running)
    AWAITING = "awaiting"  # closed with evaluable work, no valid evaluation of its final state yet
    VALID = "valid"  # designated outcome: a valid evaluation of the final state
    PLACEHOLDER = "placeholder"  # total failure: zero-reward placeholder, counts as valid for the group
    EXCLUDED = "excluded"  # no valid reward (overall timeout, or budget ran out while awaiting)
    CANCELLED = "cancelled"  # surplus: outside the group's N

    @property
    def settled(self) -> bool:
        return self not in (Status.OPEN, Status.AWAITING)

    @property
    def has_reward(self) -> bool:
        return self in (Status.VALID, Status.PLACEHOLDER)


_NO_MORE_EVALUATIONS = {
    Status.EXCLUDED: "no valid reward, dropped from training",
    Status.PLACEHOLDER: "a total failure left no evaluable work",
    Status.CANCELLED: "surplus, outside the group",
}


def _check_execution_id(execution: object, what: str) -> None:
    if isinstance(execution, bool) or not isinstance(execution, int | str):
        raise TypeError(f"{what}: execution id must be an int or a str, got {execution!r}")
    if execution == "" or (isinstance(execution, int) and execution < 0):
        raise ValueError(f"{what}: execution id must be a non-negative int or a non-empty str, got {execution!r}")


def _check_time(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class EvaluatedState:
    """The state an evaluation scored: which execution, which artifact version, on which branch.

    An xLong execution may evaluate an intermediate artifact, revise it and abandon a branch, so the
    pair (artifact_version, branch) names one preserved state of one execution.
    """

    execution: ExecutionId
    artifact_version: str  # e.g. a commit or snapshot id of the workspace
    branch: str  # the branch reference available when the state was preserved

    def __post_init__(self) -> None:
        _check_execution_id(self.execution, "EvaluatedState")
        for name in ("artifact_version", "branch"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"EvaluatedState.{name} must be a non-empty str, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """One evaluation attempt of one evaluated state.

    The score is meaningful only when `validity` is VALID (a PENDING or FAILED attempt's score is kept
    for inspection and never used as a reward). A critique text an evaluator produces is NOT stored
    here as trainable content: `detail` is a diagnostic string. If a critique is later fed to the policy
    it enters the trajectory tree with EVALUATOR provenance, which the tree masks from the training
    objective.

    A placeholder (made by `ExecutionOutcomes.close(CloseKind.FAILED, ...)`, never recorded) is VALID
    with score 0.0, attempt 0, no evaluated state and evaluator `PLACEHOLDER_EVALUATOR`.
    """

    score: float
    validity: Validity
    state: EvaluatedState | None  # None only for a placeholder: a total failure left no state
    attempt: int  # 1, 2, ... per evaluated state; 0 for a placeholder
    evaluator: str  # name of the evaluator, e.g. "swe.tests"
    evaluator_version: str
    created_at: float  # caller's clock; must fall within the execution's budget when recorded
    detail: str | None = None  # diagnostics (error text, partial-credit breakdown); never a training target
    placeholder: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.score, bool) or not isinstance(self.score, int | float):
            raise TypeError(f"Evaluation.score must be a float, got {self.score!r}")
        if not math.isfinite(self.score):
            raise ValueError(f"Evaluation.score must be finite, got {self.score!r}")
        object.__setattr__(self, "score", float(self.score))
        if not isinstance(self.validity, Validity):
            raise TypeError(f"Evaluation.validity must be a Validity, got {self.validity!r}")
        object.__setattr__(self, "created_at", _check_time(self.created_at, "Evaluation.created_at"))
        if not isinstance(self.evaluator, str) or not self.evaluator:
            raise ValueError(f"Evaluation.evaluator must be a non-empty str, got {self.evaluator!r}")
        if not isinstance(self.evaluator_version, str):
            raise TypeError(f"Evaluation.evaluator_version must be a str, got {self.evaluator_version!r}")
        if self.detail is not None and not isinstance(self.detail, str):
            raise TypeError(f"Evaluation.detail must be a str or None, got {self.detail!r}")
        if isinstance(self.attempt, bool) or not isinstance(self.attempt, int):
            raise TypeError(f"Evaluation.attempt must be an int, got {self.attempt!r}")
        if self.placeholder:
            if self.state is not None or self.validity is not Validity.VALID or self.score != 0.0 or self.attempt != 0:
                raise ValueError(
                    "a placeholder Evaluation has state None, validity VALID, score 0.0 and attempt 0; got "
                    f"state={self.state!r}, validity={self.validity.name}, score={self.score}, attempt={self.attempt}"
                )
        else:
            if not isinstance(self.state, EvaluatedState):
                raise TypeError(f"Evaluation.state must be an EvaluatedState, got {self.state!r}")
            if self.attempt < 1:
                raise ValueError(f"Evaluation.attempt counts from 1, got {self.attempt}")

    @property
    def valid(self) -> bool:
        return self.validity is Validity.VALID


class ExecutionOutcomes:
    """The append-only evaluation log of one execution, its close, and its designated outcome.

    `deadline` is the end of the execution's total time budget on the caller's clock; it may be given
    at construction or later by `start` (a queued execution starts after its group is dispatched).
    Evaluations are accepted while `created_at < deadline`; `expire(now)` excludes an execution that
    is still awaiting a valid evaluation once `now >= deadline`.
    """

    def __init__(self, execution: ExecutionId, *, deadline: float | None = None) -> None:
        _check_execution_id(execution, "ExecutionOutcomes")
        self.execution = execution
        self._deadline: float | None = None
        self._log: list[Evaluation] = []
        self._attempts: dict[EvaluatedState, int] = {}
        self._close_kind: CloseKind | None = None
        self._closed_at: float | None = None
        self._final_state: EvaluatedState | None = None
        self._placeholder: Evaluation | None = None
        self._expired = False
        self._cancelled = False  # cancelled while AWAITING: the close kind stays, the status is CANCELLED
        if deadline is not None:
            self.start(deadline)

    # -- reading ------------------------------------------------------------------------------------
    @property
    def deadline(self) -> float | None:
        return self._deadline

    @property
    def evaluations(self) -> tuple[Evaluation, ...]:
        """Every recorded evaluation, in the order recorded."""
        return tuple(self._log)

    def evaluations_of(self, state: EvaluatedState) -> tuple[Evaluation, ...]:
        return tuple(e for e in self._log if e.state == state)

    def next_attempt(self, state: EvaluatedState) -> int:
        """The attempt number the next evaluation of `state` must carry."""
        return self._attempts.get(state, 0) + 1

    @property
    def close_kind(self) -> CloseKind | None:
        return self._close_kind

    @property
    def closed_at(self) -> float | None:
        return self._closed_at

    @property
    def final_state(self) -> EvaluatedState | None:
        """The state named at close; None while open and for a total failure."""
        return self._final_state

    @property
    def designated(self) -> Evaluation | None:
        """The latest VALID evaluation of the final state (or the placeholder of a total failure)."""
        if self._placeholder is not None:
            return self._placeholder
        if self._close_kind is None or not self._close_kind.evaluable or self._cancelled:
            return None
        for evaluation in reversed(self._log):
            if evaluation.valid and evaluation.state == self._final_state:
                return evaluation
        return None

    @property
    def status(self) -> Status:
        kind = self._close_kind
        if kind is None:
            return Status.OPEN
        if kind is CloseKind.CANCELLED or self._cancelled:
            return Status.CANCELLED
        if kind is CloseKind.FAILED:
            return Status.PLACEHOLDER
        if kind is CloseKind.OVERALL_TIMEOUT:
            return Status.EXCLUDED
        if self.designated is not None:
            return Status.VALID
        return Status.EXCLUDED if self._expired else Status.AWAITING

    @property
    def reward(self) -> float | None:
        """The designated score (0.0 for a placeholder); None without a valid outcome (yet, or ever)."""
        designated = self.designated
        return designated.score if designated is not None else None

    def retry_allowed(self, now: float) -> bool:
        """An evaluation of the final state may be (re)tried now: closed with evaluable work, no valid
        outcome yet, not excluded, and the budget allows (`now < deadline`)."""
        now = _check_time(now, "now")
        return self.status is Status.AWAITING and self._deadline is not None and now < self._deadline

    # -- events -------------------------------------------------------------------------------------
    def start(self, deadline: float) -> None:
        """Set the end of the execution's total time budget, once."""
        deadline = _check_time(deadline, "deadline")
        if self._deadline is not None:
            raise ValueError(f"execution {self.execution!r} already started (deadline {self._deadline})")
        if self._close_kind is not None:
            raise ValueError(f"execution {self.execution!r} is closed ({self._close_kind.name}); it cannot start")
        self._deadline = deadline

    def record(self, evaluation: Evaluation) -> None:
        """Append one evaluation attempt. Nothing is recorded when a check fails."""
        if not isinstance(evaluation, Evaluation):
            raise TypeError(f"record takes an Evaluation, got {type(evaluation).__name__}")
        if evaluation.placeholder:
            raise ValueError("placeholders are made by close(CloseKind.FAILED, ...), not recorded")
        assert evaluation.state is not None
        if evaluation.state.execution != self.execution:
            raise ValueError(
                f"evaluation of execution {evaluation.state.execution!r} recorded on execution {self.execution!r}"
            )
        status = self.status
        why = _NO_MORE_EVALUATIONS.get(status)
        if why is not None:
            raise ValueError(f"execution {self.execution!r} is {status.name}: it takes no more evaluations ({why})")
        if self._deadline is None:
            raise ValueError(f"execution {self.execution!r} has not started (no deadline): nothing to evaluate")
        if evaluation.created_at >= self._deadline:
            raise ValueError(
                f"evaluation of execution {self.execution!r} created at {evaluation.created_at} is past the "
                f"budget (deadline {self._deadline}); call expire(now) to exclude an execution without a valid outcome"
            )
        expected = self.next_attempt(evaluation.state)
        if evaluation.attempt != expected:
            raise ValueError(
                f"evaluation of {evaluation.state} carries attempt {evaluation.attempt}, expected {expected}: "
                "re-evaluating a state appends the next attempt and never replaces an earlier one"
            )
        self._log.append(evaluation)
        self._attempts[evaluation.state] = expected

    def close(self, kind: CloseKind, *, now: float, final_state: EvaluatedState | None = None) -> None:
        """Close the execution. COMPLETED and HARNESS_TIMEOUT name the final state to evaluate; FAILED
        takes none (a total failure left no evaluable work) and yields the zero-reward placeholder."""
        if not isinstance(kind, CloseKind):
            raise TypeError(f"close takes a CloseKind (CloseKind(outcome.value) for a scheduler Outcome), got {kind!r}")
        now = _check_time(now, "now")
        if self._close_kind is not None:
            raise ValueError(f"execution {self.execution!r} is already closed ({self._close_kind.name})")
        if final_state is not None:
            if not isinstance(final_state, EvaluatedState):
                raise TypeError(f"final_state must be an EvaluatedState, got {final_state!r}")
            if final_state.execution != self.execution:
                raise ValueError(
                    f"final state of execution {final_state.execution!r} given to execution {self.execution!r}"
                )
        if kind.evaluable:
            if final_state is None:
                raise ValueError(f"closing {kind.name} needs the final_state whose preserved work is evaluated")
            if self._deadline is None:
                raise ValueError(f"execution {self.execution!r} closed {kind.name} but never started (no deadline)")
        if kind is CloseKind.FAILED and final_state is not None:
            raise ValueError("a total failure (FAILED) has no evaluable work: pass no final_state")
        self._close_kind = kind
        self._closed_at = now
        self._final_state = final_state
        if kind is CloseKind.FAILED:
            self._placeholder = Evaluation(
                score=0.0,
                validity=Validity.VALID,
                state=None,
                attempt=0,
                evaluator=PLACEHOLDER_EVALUATOR,
                evaluator_version="1",
                created_at=now,
                detail="total failure: no evaluable work",
                placeholder=True,
            )

    def expire(self, now: float) -> bool:
        """Apply the budget at `now`: an execution still AWAITING once `now >= deadline` becomes EXCLUDED
        for good. Returns True when this call excluded it. Open executions are left to their close
        (the harness manager reports OVERALL_TIMEOUT)."""
        now = _check_time(now, "now")
        if self.status is Status.AWAITING and self._deadline is not None and now >= self._deadline:
            self._expired = True
            return True
        return False

    def cancel(self, now: float) -> bool:
        """Cancel the execution (surplus under oversampling, or the scheduler's cancel): an OPEN one closes
        CANCELLED; an AWAITING one (closed with evaluable work, evaluation stopped) becomes CANCELLED for good,
        keeping its close kind and its log. Returns True when this call cancelled it; a settled execution
        (VALID, PLACEHOLDER, EXCLUDED, CANCELLED) is left as it is."""
        now = _check_time(now, "now")
        status = self.status
        if status is Status.OPEN:
            self.close(CloseKind.CANCELLED, now=now)
            return True
        if status is Status.AWAITING:
            self._cancelled = True
            return True
        return False

    def __repr__(self) -> str:
        return f"ExecutionOutcomes({self.execution!r}, status={self.status.name}, evaluations={len(self._log)})"


class GroupOutcomes:
    """The outcomes of one rollout group: N executions plus an optional oversampling surplus.

    Mutate the executions through the group (`start`, `record`, `close`, `expire`) so that the order in
    which executions reach a valid outcome is the order of events: once N have a valid outcome or a
    placeholder, those N are the group's members and every other execution is surplus.
    """

    def __init__(self, group_size: int, executions: Sequence[ExecutionId]) -> None:
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TypeError(f"group_size must be an int, got {group_size!r}")
        if group_size < 1:
            raise ValueError(f"group_size (N) must be >= 1, got {group_size}")
        ids = list(executions)
        if len(ids) < group_size:
            raise ValueError(f"a group of N={group_size} needs at least N executions, got {len(ids)}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"execution ids of a group must be distinct, got {ids!r}")
        self.group_size = group_size
        self._executions = {e: ExecutionOutcomes(e) for e in ids}
        self._valid_order: list[ExecutionId] = []  # executions in the order they reached a valid outcome
        self._members: tuple[ExecutionId, ...] | None = None  # frozen when the group becomes ready

    @property
    def oversample(self) -> int:
        return len(self._executions) - self.group_size

    @property
    def executions(self) -> tuple[ExecutionId, ...]:
        return tuple(self._executions)

    def execution(self, execution: ExecutionId) -> ExecutionOutcomes:
        """Read one execution's outcomes (mutate through the group)."""
        try:
            return self._executions[execution]
        except KeyError:
            raise ValueError(f"unknown execution {execution!r}: the group holds {list(self._executions)!r}") from None

    # -- events -------------------------------------------------------------------------------------
    def start(self, execution: ExecutionId, deadline: float) -> None:
        self.execution(execution).start(deadline)

    def record(self, evaluation: Evaluation) -> None:
        if not isinstance(evaluation, Evaluation):
            raise TypeError(f"record takes an Evaluation, got {type(evaluation).__name__}")
        if evaluation.state is None:
            raise ValueError("placeholders are made by close(CloseKind.FAILED, ...), not recorded")
        self.execution(evaluation.state.execution).record(evaluation)
        self._refresh()

    def close(
        self, execution: ExecutionId, kind: CloseKind, *, now: float, final_state: EvaluatedState | None = None
    ) -> None:
        self.execution(execution).close(kind, now=now, final_state=final_state)
        self._refresh()

    def cancel(self, execution: ExecutionId, *, now: float) -> bool:
        """Cancel one execution (`ExecutionOutcomes.cancel`); True when this call cancelled it."""
        cancelled = self.execution(execution).cancel(now)
        self._refresh()
        return cancelled

    def expire(self, now: float) -> tuple[ExecutionId, ...]:
        """Apply every execution's budget at `now`; returns the executions this call excluded."""
        now = _check_time(now, "now")
        excluded = tuple(e for e, outcomes in self._executions.items() if outcomes.expire(now))
        self._refresh()
        return excluded

    # -- readiness ----------------------------------------------------------------------------------
    def _refresh(self) -> None:
        for e, outcomes in self._executions.items():
            if outcomes.status.has_reward and e not in self._valid_order:
                self._valid_order.append(e)
        if self._members is not None:
            return
        if len(self._valid_order) >= self.group_size:
            members = set(self._valid_order[: self.group_size])
        elif all(outcomes.status.settled for outcomes in self._executions.values()):
            # Fewer than N valid: excluded executions fill the remaining slots (execution order) with no
            # reward; cancelled ones never do.
            excluded = [e for e, o in self._executions.items() if o.status is Status.EXCLUDED]
            members = set(self._valid_order) | set(excluded[: self.group_size - len(self._valid_order)])
        else:
            return
        self._members = tuple(e for e in self._executions if e in members)

    @property
    def ready(self) -> bool:
        """N executions have a valid outcome or placeholder, or every execution is settled."""
        return self._members is not None

    @property
    def members(self) -> tuple[ExecutionId, ...]:
        """The group's N slots once ready (execution order); () before. Fewer than N only when
        executions were cancelled before N had a valid outcome."""
        return self._members or ()

    @property
    def surplus(self) -> tuple[ExecutionId, ...]:
        """Executions outside the members once ready (cancel those still open); () before."""
        if self._members is None:
            return ()
        return tuple(e for e in self._executions if e not in self._members)

    def retryable(self, now: float) -> tuple[ExecutionId, ...]:
        """Executions whose evaluation may be (re)tried now; surplus executions are not worth evaluating."""
        surplus = set(self.surplus)
        return tuple(e for e, o in self._executions.items() if e not in surplus and o.retry_allowed(now))

    def rewards(self) -> dict[ExecutionId, float | None]:
        """Per member: its designated score (0.0 for a placeholder), or None when excluded.

        A snapshot: a later VALID re-evaluation of a member's final state changes its designated score,
        so the trajectory buffer reads the rewards once, when it takes the ready group.
        """
        if self._members is None:
            counts: dict[str, int] = {}
            for o in self._executions.values():
                counts[o.status.name] = counts.get(o.status.name, 0) + 1
            raise ValueError(f"group is not ready (N={self.group_size}, executions by status {counts}): no rewards yet")
        return {e: self._executions[e].reward for e in self._members}

    def __repr__(self) -> str:
        return f"GroupOutcomes(N={self.group_size}, executions={len(self._executions)}, ready={self.ready})"
