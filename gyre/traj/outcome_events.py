"""An execution's outcomes kept on another node: its events as plain data, applied to the group where it lives.

Role: an execution run by a node's harness host (docs/cluster.md, "Harness hosts on every node") is played by
`run_episode` on that node, while its group (`GroupOutcomes`: which executions are members, which are surplus)
lives in the controller. The host gives `run_episode` a `MirrorGroup`: the execution's own `ExecutionOutcomes`,
kept there for what the episode reads, and every mutation (`start`, `record`, `close`, `cancel`, `expire`) also
written as an event; the controller applies each event to the real group in order (`apply_event`), so the group
sees the same calls, in the same order, as when the episode runs beside it.

Times: an event carries the host's monotonic clock (`at`, when it was written, and the times of the call);
`apply_event` moves them onto the controller's clock by `offset`: the controller's now at the receipt of the
execution's first event minus its `at`, one offset for all of its events, so that its budget's deadline and its
expiry stay one instant apart as on the host (the offset is off by the first event's transit time). Pure: no IO.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from gyre.traj.outcomes import CloseKind, EvaluatedState, Evaluation, ExecutionId, ExecutionOutcomes, GroupOutcomes
from gyre.traj.outcomes_state import evaluation_dict, evaluation_from_dict, state_dict

__all__ = ["MirrorGroup", "apply_event"]

OPS = ("start", "record", "close", "cancel", "expire")


class MirrorGroup:
    """`GroupOutcomes`'s face for one execution, on the node that runs it (module docstring). `emit(event)` gets
    each mutation as a JSON-able dict with `now()`'s time in `at`. `surplus` is always empty here: the owner cancels
    a surplus execution (the scheduler's `Cancel`), which the episode sees as its cancel."""

    def __init__(self, execution: ExecutionId, emit: Callable[[dict], None], now: Callable[[], float]) -> None:
        self.execution_id = execution
        self._group = GroupOutcomes(1, [execution])
        self._emit, self._now = emit, now

    def execution(self, execution: ExecutionId) -> ExecutionOutcomes:
        return self._group.execution(execution)

    @property
    def surplus(self) -> tuple[ExecutionId, ...]:
        return ()

    def start(self, execution: ExecutionId, deadline: float) -> None:
        self._group.start(execution, deadline)
        self._send("start", deadline=deadline)

    def record(self, evaluation: Evaluation) -> None:
        self._group.record(evaluation)
        self._send("record", evaluation=evaluation_dict(evaluation))

    def close(
        self, execution: ExecutionId, kind: CloseKind, *, now: float, final_state: EvaluatedState | None = None
    ) -> None:
        self._group.close(execution, kind, now=now, final_state=final_state)
        self._send("close", kind=kind.value, now=now, final_state=state_dict(final_state))

    def cancel(self, execution: ExecutionId, *, now: float) -> bool:
        cancelled = self._group.cancel(execution, now=now)
        self._send("cancel", now=now)
        return cancelled

    def expire(self, now: float) -> tuple[ExecutionId, ...]:
        excluded = self._group.expire(now)
        self._send("expire", now=now)
        return excluded

    def _send(self, op: str, **fields: Any) -> None:
        self._emit({"op": op, "execution": self.execution_id, "at": self._now(), **fields})


def apply_event(group: GroupOutcomes, event: dict, *, offset: float) -> bool:
    """Apply one `MirrorGroup` event to `group` (the execution's real group), its times moved by `offset`; False when
    it came too late to apply: a `record` or `cancel` of an execution the group has settled meanwhile (another
    member's `expire` excluded it at its deadline while the event was on its way; beside the group an evaluation
    past the deadline is not recorded either). ValueError for an event that is not one (unknown op, missing field,
    an execution not in `group`)."""
    op, execution = event.get("op"), event.get("execution")
    if op not in OPS:
        raise ValueError(f"an outcome event's op is one of {OPS}, got {op!r}")
    if op in ("record", "cancel") and group.execution(execution).status.settled:
        return False
    group.execution(execution)  # ValueError for an execution the group does not hold
    try:
        if op == "start":
            group.start(execution, event["deadline"] + offset)
        elif op == "record":
            evaluation = evaluation_from_dict(event["evaluation"])
            group.record(dataclasses.replace(evaluation, created_at=evaluation.created_at + offset))
        elif op == "close":
            final = event["final_state"]
            group.close(
                execution,
                CloseKind(event["kind"]),
                now=event["now"] + offset,
                final_state=EvaluatedState(**final) if final is not None else None,
            )
        elif op == "cancel":
            group.cancel(execution, now=event["now"] + offset)
        else:
            group.expire(event["now"] + offset)
    except (KeyError, TypeError) as error:
        raise ValueError(f"outcome event {op!r} of {execution!r} is malformed: {error!r}") from None
    return True
