"""What the controller reports to the scheduler when an execution's evaluation ends and when a group closes
(docs/scheduler.md, "Events the runtime reports"; docs/runtime.md).

- `sched_outcome`: an execution's evaluated outcome (`gyre.traj.outcomes.ExecutionOutcomes`, filled by
  `gyre.harness.episode.run_episode`) -> the `gyre.sched.Outcome` of `Scheduler.execution_closed`:

  | outcomes' status | close kind | scheduler outcome |
  |---|---|---|
  | VALID | COMPLETED / HARNESS_TIMEOUT | COMPLETED / HARNESS_TIMEOUT (a valid reward: closes a slot) |
  | PLACEHOLDER | FAILED | FAILED (the zero-reward placeholder: closes a slot) |
  | EXCLUDED | any | OVERALL_TIMEOUT (no valid reward within the overall budget: no slot) |
  | CANCELLED | - | None: a cancellation is the scheduler's own (it sent the Cancel) and is not reported |

  OPEN or AWAITING (the episode has not settled the execution) is a caller's bug: ValueError.
- `judge_group`: one readiness rule. A group is ready for the scheduler exactly when it is ready for the buffers:
  once every execution of the group closed (`GroupState.JUDGING`), its trees are attached to the trajectory
  buffer, each member's trajectories are admitted (J_max, Eq. 4, seeded per execution with `execution_seed`), and
  `TrajectoryBuffer.mark_ready_from_outcomes` takes them or refuses them (a row over the micro-step budget, ...).
  The `Verdict` says which: the controller reports `group_accepted` or `group_rejected`.

Pure: the scheduler's vocabulary, the outcomes, admission and the trajectory buffer; no IO.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gyre.data.trajectory_buffer import TrajectoryBuffer
from gyre.sched.types import Outcome
from gyre.traj.admission import AdmittedTrajectory, admit, execution_seed
from gyre.traj.outcomes import CloseKind, ExecutionOutcomes, GroupOutcomes, Status
from gyre.traj.roles import RoleClassifier
from gyre.traj.tree import TrajectoryTree

__all__ = ["Verdict", "judge_group", "sampled_tokens", "sched_outcome"]


def sched_outcome(outcome: ExecutionOutcomes) -> Outcome | None:
    """The scheduler's outcome of a settled execution (table in the module docstring); None for CANCELLED."""
    status = outcome.status
    if status is Status.CANCELLED:
        return None
    if status is Status.EXCLUDED:
        return Outcome.OVERALL_TIMEOUT
    if status is Status.PLACEHOLDER:
        return Outcome.FAILED
    if status is Status.VALID:
        kind = outcome.close_kind
        assert kind in (CloseKind.COMPLETED, CloseKind.HARNESS_TIMEOUT), (outcome.execution, kind)
        return Outcome(kind.value)
    raise ValueError(
        f"execution {outcome.execution!r} is {status.name}: the scheduler hears an execution's outcome once its "
        "episode settled it (VALID, PLACEHOLDER, EXCLUDED or CANCELLED)"
    )


def sampled_tokens(tree: TrajectoryTree | None) -> int:
    """Engine-sampled tokens recorded in `tree` (the `tokens` of `execution_closed`); 0 without a tree."""
    return 0 if tree is None else tree.stats().target_tokens_stored


@dataclass(frozen=True)
class Verdict:
    """The buffers' verdict on a closed group."""

    group: int
    accepted: bool
    reason: str = ""  # why the buffers refused it (the trajectory buffer's ValueError)
    admitted: dict[str, tuple[AdmittedTrajectory, ...]] = field(default_factory=dict)  # member -> trajectories


def judge_group(
    buffer: TrajectoryBuffer,
    group: int,
    outcomes: GroupOutcomes,
    trees: Mapping[str, TrajectoryTree | None],
    *,
    classify: RoleClassifier,
    j_max: int,
    run_seed: int,
) -> Verdict:
    """Attach the group's trees, admit each member's trajectories and mark the group ready in `buffer`.

    `trees`: execution id -> its closed tree (None: the execution never made a call, or was cancelled before it
    had a session). Accepted: the group is ready in `buffer` for the packer. Refused: `buffer` holds the group as
    it was (registered, not ready; the controller drops it with `buffer.drop_group`) and the reason is the buffer's
    message.
    A caller's error (the outcomes not ready, an unregistered group) raises."""
    if not outcomes.ready:
        raise ValueError(f"group {group} is judged once its outcomes are ready (every execution closed)")
    for tree in trees.values():
        if tree is not None:
            buffer.attach_tree(tree)
    rewards = outcomes.rewards()
    admitted: dict[str, tuple[AdmittedTrajectory, ...]] = {}
    for member, reward in rewards.items():
        tree = trees.get(str(member))
        if reward is None or tree is None:
            continue
        admitted[str(member)] = tuple(admit(tree, classify, j_max, rng=execution_seed(run_seed, tree.execution)))
    try:
        buffer.mark_ready_from_outcomes(group, outcomes, admitted)
    except ValueError as error:
        return Verdict(group, accepted=False, reason=str(error))
    return Verdict(group, accepted=True, admitted=admitted)
