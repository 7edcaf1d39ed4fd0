"""Claim one ready group from the scheduler and pull it into the packer (docs/scheduler.md): the step pump's refill
(`gyre.runtime.controller.steps`). The simulator's rule, which the supply check depends on: a training cell claims a
group only when its local micro-steps run out, so groups stay in the scheduler's ready set until training needs
them.

A claimed group the packer sets aside (a check `mark_ready` could not make: docs/data.md) is reported to the
scheduler with `claimed_group_set_aside`: the batch's claim count goes back down and its actions (a replacement
`Dispatch`, and where no rollout capacity is left a `BeginTransition` to rollout) go to `on_actions`. Not
thread-safe: call it on the thread that owns the scheduler and the packer (the controller's event loop).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gyre.data.packing import StreamPackingBuffer
from gyre.sched.scheduler import Scheduler
from gyre.sched.types import Action

__all__ = ["claim_and_pull"]


def claim_and_pull(
    scheduler: Scheduler,
    packer: StreamPackingBuffer,
    *,
    clock: Callable[[], float],
    on_actions: Callable[[Sequence[Action]], None],
) -> tuple[int | None, str | None]:
    """Claim one ready group from the scheduler (`claim_group`) and pull it into the packer: `(group, None)`;
    `(None, None)` when no group is ready; `(group, reason)` when the packer set the claimed group aside (reported
    to the scheduler with `claimed_group_set_aside`, which replaces it). Every action goes to `on_actions`. A
    ValueError of the packer that set nothing aside is raised (a caller's bug, not a refusal)."""
    group, actions = scheduler.claim_group(clock())
    on_actions(actions)
    if group is None:
        return None, None
    try:
        packer.pull(group)
    except ValueError as error:
        if group not in (aside for aside, _ in packer.rejected_groups()):
            raise
        on_actions(scheduler.claimed_group_set_aside(clock(), group))
        return group, str(error)
    return group, None
