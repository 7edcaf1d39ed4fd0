"""The controller's checkpoints and resume (docs/runtime.md, "Checkpoints and resume").

At a step's end, before `step_finished`, every `checkpoint.every_steps` steps and after the last, `write` saves
`state(ctl)` with the core's weights and optimizer state (every core rank writes its own: `_save_optimizer`) into
`<run dir>/checkpoints/step-<n>/` (`gyre.runtime.job.checkpoint`). A controller made with `checkpoint=` is restored
from one (`restore`): the scheduler via `gyre.sched.checkpoint` (already, when the controller is made), the groups'
outcomes and buffer entries, the executions it dispatches again under their next rerun's id.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from gyre.obs.record import record_from_dict
from gyre.runtime.cell.trainers import SAVE_OPTIMIZER
from gyre.runtime.controller.parts import StepBook
from gyre.runtime.controller.trace import RoleTrace
from gyre.runtime.job.checkpoint import Checkpoint, CheckpointError, discard_staging, stage_checkpoint, write_checkpoint
from gyre.runtime.job.run_shape import run_shape, trainer_layout
from gyre.sched import GroupState
from gyre.sched.checkpoint import scheduler_state
from gyre.traj.outcomes_state import group_outcomes_state, restored_group_outcomes

if TYPE_CHECKING:
    from gyre.runtime.controller.loop import Controller

log = logging.getLogger(__name__)

__all__ = ["restore", "state", "write"]


def state(ctl: Controller) -> dict:
    """The controller's state at a step's end, before `step_finished`: the scheduler's
    (`gyre.sched.checkpoint.scheduler_state`), every open or ready group's task and outcomes (their finished
    executions' calls are their record files), the executions' reruns, the task sampler's RNG and its epoch's
    remaining draws (`TaskDeck`), the step records, the packer's batch, the clock."""
    sched = scheduler_state(ctl.sched)
    episodes = ctl.episodes
    groups = {}
    for group in range(len(ctl.sched.groups)):
        if ctl.sched.groups[group].state in (GroupState.OPEN, GroupState.READY):
            groups[str(group)] = {
                "task": episodes.task_of[group].id,
                "outcomes": group_outcomes_state(episodes.outcomes[group]),
            }
    version, internal, gauss = episodes.rng.getstate()
    return {
        "scheduler": sched,
        "groups": groups,
        "reruns": {str(e): k for e, k in sorted(episodes.reruns.items())},
        "task_rng": [version, list(internal), gauss],
        "task_deck": episodes.deck.state(),
        "records": [record.to_dict() for record in ctl.records],
        "bursts": ctl.bursts + (1 if sched["step_in_burst"] == 0 else 0),  # a burst's end counts its publication
        "packer_batch": ctl.packer.batch,
        "wall_time_s": ctl.now(),
        "seed": ctl.cfg.seed,
        "executions_per_group": episodes.ids.executions_per_group,
        "shape": run_shape(ctl.cfg),
        "trainer_layout": trainer_layout(ctl.cfg),
    }


async def write(ctl: Controller) -> None:
    """`<run dir>/checkpoints/step-<n>/` with the core's weights and optimizer state, and the engines' weights when
    a burst is in flight (its last publication)."""
    begun = ctl.now()
    saved = state(ctl)  # in one go on the loop: a consistent state
    sched = saved["scheduler"]
    step, published = sched["trainer_version"], sched["published_version"]
    trainer_model = await ctl.cells.core_model()
    engine_model = None
    if published not in (0, step):  # inside a burst: the engines serve the last publication
        publication = ctl.cells.publication
        if publication.version is not None:  # its policy directory (docs/runtime.md, "Publication")
            assert publication.version == published, (publication.version, published)
            engine_model = await publication.policy_dir(published)
            if engine_model is None:
                raise RuntimeError(
                    f"checkpoint {step} needs the engines' weights, policy version {published}, which is not on disk "
                    f"(publication.policy_every={ctl.cfg.publication.policy_every}): set publication.policy_every=1"
                )
        else:  # a resumed run before its first publication: the weights its engines started with
            engine_model = ctl.parts.engine_dir
    staged = ctl.parts.save_optimizer is not None
    if staged:
        await _save_optimizer(ctl, step)
    path = await asyncio.to_thread(
        write_checkpoint,
        ctl.run_dir,
        step,
        saved,
        trainer_model=trainer_model,
        engine_model=engine_model,
        source_dir=ctl.parts.model_dir,
        keep=ctl.cfg.checkpoint.keep,
        protect=ctl.resumed_from.path if ctl.resumed_from else None,
        staged=staged,
    )
    log.info("checkpoint %s written in %.2fs", path, ctl.now() - begun)


async def _save_optimizer(ctl: Controller, step: int) -> None:
    """Every rank of the core writes its own optimizer state (its shard's, in a Megatron core of several ranks) into
    checkpoint `step`'s staging directory: rank 0 on its trainer thread, the core's other ranks told with a
    `save_optimizer` decision, whose ack says the file is on disk; the checkpoint is completed only after. A rank
    that cannot write fails (its error in train.log) and the run ends naming it; the staging directory is removed."""
    trainer_dir = await asyncio.to_thread(stage_checkpoint, ctl.run_dir, step)
    try:
        own = ctl.trainer_thread.submit(ctl.parts.save_optimizer, ctl.cells.trainer, trainer_dir)
        if ctl.cells.has_other_ranks(0):  # after the step and its gather: decisions are applied in order
            await ctl.cells.acked(ctl.control.publish(SAVE_OPTIMIZER, path=str(trainer_dir)), 0)
        await own
    except BaseException as error:
        discard_staging(ctl.run_dir, step)
        if isinstance(error, OSError):
            message = f"checkpoint of step {step}: rank 0's optimizer state not written: {error}"
            raise CheckpointError(message) from error
        raise


def restore(ctl: Controller, checkpoint: Checkpoint) -> None:
    """The controller's state from `checkpoint` (the scheduler's is restored already): the executions the scheduler
    dispatches again get their next rerun's id, the open and ready groups their outcomes and buffer entries (a ready
    group judged again from its record files: the same verdict, admission is seeded)."""
    saved, episodes, cfg = checkpoint.state, ctl.episodes, ctl.cfg
    if saved["executions_per_group"] != episodes.ids.executions_per_group or saved["seed"] != cfg.seed:
        raise ValueError(
            f"checkpoint {checkpoint.path} is of another run shape (seed {saved['seed']}, "
            f"{saved['executions_per_group']} executions per group; this run: seed {cfg.seed}, "
            f"{episodes.ids.executions_per_group}): resume with the run's own config"
        )
    episodes.reruns = {int(e): k for e, k in saved["reruns"].items()}
    for execution in ctl.sched.redispatched:
        episodes.reruns[execution] = episodes.reruns.get(execution, 0) + 1
    version, internal, gauss = saved["task_rng"]
    episodes.rng.setstate((version, tuple(internal), gauss))
    if "task_deck" in saved and not episodes.deck.restore(saved["task_deck"]):
        log.warning("the checkpoint's task draws were of another task set: a new epoch of draws begins")
    ctl.records = [record_from_dict(record) for record in saved["records"]]
    ctl.bursts = saved["bursts"]
    ctl.packer.resume_at(saved["packer_batch"])
    ctl.clock_offset = saved["wall_time_s"]
    ctl.book = StepBook(started_s=ctl.clock_offset)
    ctl.trace = RoleTrace(cfg.cluster.num_cells, pool=cfg.cluster.separate_size > 0, start_s=ctl.clock_offset)
    tasks = {task.id: task for task in episodes.tasks}
    closed = set(saved["scheduler"]["closed"])
    for key, group_state in sorted(saved["groups"].items(), key=lambda item: int(item[0])):
        group = int(key)
        if group_state["task"] not in tasks:
            raise ValueError(
                f"checkpoint {checkpoint.path}: group {group}'s task {group_state['task']!r} is not in the "
                "training tasks: resume with the run's own task set"
            )
        names = episodes.names(group)
        episodes.task_of[group] = tasks[group_state["task"]]
        episodes.outcomes[group] = restored_group_outcomes(group_state["outcomes"], names)
        episodes.on_disk.update(
            name for e, name in zip(episodes.ids.executions(group), names, strict=True) if e in closed
        )
        entry = ctl.sched.groups[group]
        ctl.buffer.add_group(group, entry.version, names, cfg.algo.group_size)
        if entry.state is GroupState.READY:
            verdict = episodes.verdict(group)
            if not verdict.accepted:
                raise ValueError(
                    f"checkpoint {checkpoint.path}: ready group {group} is refused on resume "
                    f"({verdict.reason}): its record files changed"
                )
