"""The scheduler's state at a step's end, as plain data, and a scheduler resumed from it (docs/runtime.md,
"Checkpoints and resume").

`scheduler_state(sched)` is taken when a step's update is done and before `step_finished` is reported (the batch is
full, nothing of the next step is claimed yet). It is written as the scheduler will stand once that step is
finished: the trainer version counts the step, and a step that ended its burst counts its publication as done (the
run resumes with the engines loading that step's weights: the publication of version v is the trainer's weights of
version v), so the boundary dispatch of the next burst is due (`dispatch_due`).

`resumed_scheduler(spec, state)` rebuilds it for a run restarted from that state. A harness cannot be resumed, so
every execution that was running, or whose harness had ended and whose evaluation was still going, is
**re-dispatched**: counted as a new execution (d + 1, then p + 1 when it starts and f + 1 when its harness ends),
its old instance counted as ended (f + 1 where it was running; one whose harness ended is in f already), queued
before the executions that never started, in its own group (whose version, and so its staleness, does not change).
Executions that closed keep their outcomes, groups their states, the ready heap its order, the staleness log its
records. Every cell resumes in the rollout role (async mode: its training cells in training) with no execution
placed: the scheduler's own rules move the cells again. `Scheduler.resume(now)` (here `resume`) then gives the
first actions: the due boundary dispatch, a step for a trainer that is ready (async), the starts.

Pure: the scheduler's own state, no IO.
"""

from __future__ import annotations

import collections
import heapq
from typing import Any

from gyre.sched.groups import GroupRecord, GroupState
from gyre.sched.scheduler import Scheduler
from gyre.sched.staleness import StalenessLog
from gyre.sched.types import Action, SchedSpec

__all__ = ["STATE_VERSION", "Resumed", "resume", "resumed_scheduler", "scheduler_state"]

STATE_VERSION = 1


class Resumed(Scheduler):
    """A scheduler rebuilt from `scheduler_state` (`resumed_scheduler`); `redispatched` names the executions run
    again, `dispatch_due` whether the next burst's boundary dispatch is owed."""

    redispatched: tuple[int, ...] = ()
    redispatched_total = 0
    dispatch_due: bool = False


def scheduler_state(sched: Scheduler) -> dict[str, Any]:
    """The state of `sched` as it will be once the step in flight is reported finished (module docstring)."""
    spec = sched.spec
    if not sched.step_active or sched.claimed_in_batch != spec.batch_groups or sched.publishing:
        raise ValueError(
            "the scheduler's state is taken at a step's end, before step_finished: a step in flight with its batch "
            f"full (step_active={sched.step_active}, claimed {sched.claimed_in_batch} of {spec.batch_groups}, "
            f"publishing={sched.publishing})"
        )
    judging = [g for g in range(len(sched.groups)) if sched.groups[g].state is GroupState.JUDGING]
    if judging:
        raise ValueError(f"groups {judging} await the buffers' verdict: the state is taken between events")
    step_in_burst = sched.step_in_burst + 1
    burst_end = step_in_burst == spec.mu
    trainer_version = sched.trainer_version + 1
    book = sched.groups
    return {
        "state_version": STATE_VERSION,
        "trainer_version": trainer_version,
        "published_version": trainer_version if burst_end else sched.published_version,
        "step_in_burst": 0 if burst_end else step_in_burst,
        "dispatch_due": burst_end and not spec.continuous_dispatch,
        "d": sched.d,
        "p": sched.p,
        "f": sched.f,
        "redispatched_total": getattr(sched, "redispatched_total", 0),
        "groups": [[g.version, g.closed, g.slots, g.tokens, g.state.value, g.replaces] for g in book._groups],
        "ready": sorted(book._ready),
        "ready_order": book._ready_order,
        "rejected": list(book.rejected),
        "set_aside": list(book.set_aside),
        "queue": list(sched._queue),
        "evaluating": sorted(sched._evaluating),
        "closed": sorted(sched._closed),
        "outcomes": dict(sched.outcomes),
        "staleness": {
            "steps": list(sched.staleness.steps),
            "values": list(sched.staleness.values),
            "tokens": list(sched.staleness.tokens),
        },
    }


def resumed_scheduler(spec: SchedSpec, state: dict[str, Any]) -> Resumed:
    """A scheduler for `spec` resumed from `state` (module docstring). ValueError for a state of another shape."""
    if state.get("state_version") != STATE_VERSION:
        raise ValueError(f"scheduler state version {state.get('state_version')!r}: this gyre reads {STATE_VERSION}")
    sched = Resumed(spec)
    per = spec.executions_per_group
    book = sched.groups
    for version, closed, slots, tokens, value, replaces in state["groups"]:
        book._groups.append(
            GroupRecord(
                version=version, closed=closed, slots=slots, tokens=tokens, state=GroupState(value), replaces=replaces
            )
        )
    book._ready = [tuple(entry) for entry in state["ready"]]
    heapq.heapify(book._ready)
    book._ready_order = state["ready_order"]
    book.rejected = list(state["rejected"])
    book.set_aside = list(state["set_aside"])
    book.unjudged = sum(1 for g in book._groups if g.state in (GroupState.OPEN, GroupState.JUDGING))
    for group, entry in enumerate(book._groups):
        if entry.state is GroupState.READY and not any(g == group for _, _, g in book._ready):
            raise ValueError(f"group {group} is ready but not in the ready heap: the state is inconsistent")
    queued = list(state["queue"])
    evaluating, closed = set(state["evaluating"]), set(state["closed"])
    waiting = evaluating | closed | set(queued)
    running = [e for e in range(len(book) * per) if e not in waiting]
    again = sorted([*running, *evaluating])
    sched.d = state["d"] + len(again)
    sched.p = state["p"]
    sched.f = state["f"] + len(running)
    sched._queue = collections.deque([*again, *queued])
    sched._closed = closed
    sched.outcomes = collections.Counter(state["outcomes"])
    sched.trainer_version = state["trainer_version"]
    sched.published_version = state["published_version"]
    sched.step_in_burst = state["step_in_burst"]
    log = state["staleness"]
    sched.staleness = StalenessLog(list(log["steps"]), list(log["values"]), list(log["tokens"]))
    sched.redispatched = tuple(again)
    sched.redispatched_total = state.get("redispatched_total", 0) + len(again)
    sched.dispatch_due = bool(state["dispatch_due"])
    return sched


def resume(sched: Resumed, now: float) -> list[Action]:
    """The first actions of a resumed run: the due boundary dispatch, a step for a ready trainer (async mode), the
    starts and role decisions of `_settle`."""
    spec = sched.spec
    actions: list[Action] = []
    if sched.dispatch_due:
        sched.dispatch_due = False
        actions.append(sched._dispatch(spec.mu * spec.batch_groups))
    if spec.mode == "async" and sched._trainer_ready():
        actions += sched._begin_step(now)
    return actions + sched._settle(now)
