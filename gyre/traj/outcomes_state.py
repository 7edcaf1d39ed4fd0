"""A group's outcomes as plain data, and back (a run's checkpoint: docs/runtime.md, "Checkpoints and resume").

`group_outcomes_state(group)` keeps every execution's evaluation log, close, budget and flags, and the order in
which executions reached a valid outcome (which decides the group's members). `restored_group_outcomes(state,
executions)` rebuilds the group under `executions` (the same ids, or a new id in place of each execution that is
run again): an execution whose id changed starts afresh (OPEN), every other one is exactly as it was. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gyre.traj.outcomes import (
    PLACEHOLDER_EVALUATOR,
    CloseKind,
    EvaluatedState,
    Evaluation,
    ExecutionId,
    ExecutionOutcomes,
    GroupOutcomes,
    Validity,
)

__all__ = [
    "evaluation_dict",
    "evaluation_from_dict",
    "group_outcomes_state",
    "restored_group_outcomes",
    "state_dict",
]


def state_dict(state: EvaluatedState | None) -> dict | None:
    if state is None:
        return None
    return {"execution": state.execution, "artifact_version": state.artifact_version, "branch": state.branch}


def evaluation_dict(evaluation: Evaluation) -> dict[str, Any]:
    return {
        "score": evaluation.score,
        "validity": evaluation.validity.value,
        "state": state_dict(evaluation.state),
        "attempt": evaluation.attempt,
        "evaluator": evaluation.evaluator,
        "evaluator_version": evaluation.evaluator_version,
        "created_at": evaluation.created_at,
        "detail": evaluation.detail,
    }


def evaluation_from_dict(data: dict[str, Any]) -> Evaluation:
    state = data["state"]
    return Evaluation(
        score=data["score"],
        validity=Validity(data["validity"]),
        state=EvaluatedState(**state) if state is not None else None,
        attempt=data["attempt"],
        evaluator=data["evaluator"],
        evaluator_version=data["evaluator_version"],
        created_at=data["created_at"],
        detail=data["detail"],
    )


def _execution_dict(outcomes: ExecutionOutcomes) -> dict[str, Any]:
    kind = outcomes.close_kind
    return {
        "execution": outcomes.execution,
        "deadline": outcomes.deadline,
        "log": [evaluation_dict(e) for e in outcomes.evaluations],
        "close_kind": kind.value if kind is not None else None,
        "closed_at": outcomes.closed_at,
        "final_state": state_dict(outcomes.final_state),
        "expired": outcomes._expired,
        "cancelled": outcomes._cancelled,
    }


def group_outcomes_state(group: GroupOutcomes) -> dict[str, Any]:
    """`group` as JSON-ready data (module docstring)."""
    return {
        "group_size": group.group_size,
        "executions": [_execution_dict(group.execution(e)) for e in group.executions],
        "valid_order": list(group._valid_order),
    }


def _restore_execution(target: ExecutionOutcomes, data: dict[str, Any]) -> None:
    if data["deadline"] is not None:
        target.start(data["deadline"])
    for evaluation in data["log"]:
        target.record(evaluation_from_dict(evaluation))
    if data["close_kind"] is not None:
        final = data["final_state"]
        kind = CloseKind(data["close_kind"])
        target.close(kind, now=data["closed_at"], final_state=EvaluatedState(**final) if final else None)
        assert kind is not CloseKind.FAILED or target.designated.evaluator == PLACEHOLDER_EVALUATOR
    target._expired = bool(data["expired"])
    target._cancelled = bool(data["cancelled"])


def restored_group_outcomes(state: dict[str, Any], executions: Sequence[ExecutionId]) -> GroupOutcomes:
    """The group of `state` under the ids `executions` (one per saved execution, in order); an execution whose id
    differs from the saved one starts afresh. ValueError when the counts differ."""
    saved = state["executions"]
    if len(saved) != len(executions):
        raise ValueError(f"the saved group has {len(saved)} executions, {len(executions)} ids were given")
    group = GroupOutcomes(state["group_size"], list(executions))
    kept = set()
    for data, execution in zip(saved, executions, strict=True):
        if data["execution"] != execution:
            continue  # run again under its new id: OPEN
        _restore_execution(group.execution(execution), data)
        kept.add(execution)
    group._valid_order = [e for e in state["valid_order"] if e in kept]
    group._refresh()
    return group
