"""The controller's training steps (docs/runtime.md, "A training step").

`BeginStep`: the step's board and pump (`gyre.distributed.step_pump`: groups claimed from the scheduler lazily, as
the simulator's cells claim), the `step` decision to the cells, the core's `train_claimed_step` on the trainer
thread; satellites the scheduler lets in are admitted while it runs (`admit`). At its end: the satellites' shares,
the step's record and progress line, the in-process held-out evaluation every `tasks.eval_every` steps (a recipe's
own held-out set: the demo's), a checkpoint every `checkpoint.every_steps` steps and after the last; then
`step_finished`, or the run completes.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
from typing import TYPE_CHECKING

from gyre.distributed.claims import StepBoard
from gyre.distributed.step_pump import StepPump
from gyre.obs.progress import format_progress
from gyre.obs.record import StepRecord
from gyre.rl.loss_metrics import LossMetricSums
from gyre.runtime.controller import checkpoints
from gyre.runtime.controller.claims import claim_and_pull
from gyre.runtime.controller.parts import StepBook
from gyre.runtime.held_out_tasks import PASS_REWARD
from gyre.runtime.job.spmd import step_stats_key

if TYPE_CHECKING:
    from gyre.runtime.controller.loop import Controller

log = logging.getLogger(__name__)

__all__ = ["Steps"]

STATS_TIMEOUT_S = 60.0  # the satellites of a step report their share within this after the core's step returned
PUMP_POLL_S = 0.005  # the step pump's pass interval while a step is in flight


class Steps:
    """The step in flight: its pump, the groups it claimed, the satellites that joined it."""

    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.pump: StepPump | None = None
        self.claimed: list[int] = []  # groups pulled into the step in flight
        self.joined: list[int] = []  # satellites admitted to the step in flight

    def has_member(self, cell: int) -> bool:
        """Whether `cell` is a member of the step in flight: its ranks are inside `train_claimed_step` and apply a
        decision only after the step, so the controller does not wait for their ack (a cell the scheduler sent
        to rollout mid-step and brings back, `Scheduler._make_room_for_the_batch`; its engine side is the
        controller's own work)."""
        return self.pump is not None and cell < self.pump.board.cells

    def admit(self, cell: int) -> None:
        """A cell that reached the training role joins the step in flight if the scheduler counts it in (cells join
        in cell order)."""
        pump = self.pump
        if pump is None or not pump.can_admit or cell not in self.ctl.sched.training_cells():
            return
        if cell > pump.board.cells:
            raise RuntimeError(f"cell {cell} joins the step before cell {pump.board.cells}: cells join in order")
        if cell == pump.board.cells:
            pump.admit()
            self.joined.append(cell)

    def abandon(self) -> None:
        """The run stops: the cells finish the unit they hold; the update is never published."""
        if self.pump is not None and not self.pump.closed:
            self.pump.board.abandon()

    def refill(self) -> bool:
        """The pump runs short: claim one ready group from the scheduler and pull it into the packer."""
        ctl = self.ctl
        group, refused = claim_and_pull(ctl.sched, ctl.packer, clock=ctl.now, on_actions=ctl.apply)
        if group is None:
            return False
        if refused is not None:
            log.warning("group %d set aside by the packer (%s): replaced", group, refused)
        else:
            self.claimed.append(group)
        return True

    async def train(self, step: int, final: bool, cells: list[int]) -> None:
        """One step, `BeginStep` to `step_finished` (module docstring)."""
        ctl = self.ctl
        if ctl.stopping:
            return
        started = ctl.now()
        if cells != list(range(len(cells))):
            raise RuntimeError(f"step {step}: the training cells {cells} are not a prefix of the cells")
        version = step + 1  # the core's weights of this step, for satellites that join it (one snapshot per step)
        self.claimed, self.joined = [], []
        board = StepBoard(ctl.store, step, max_cells=ctl.cfg.cluster.num_cells, cells=len(cells))
        self.pump = pump = StepPump(board, ctl.packer.queue, refill=self.refill)
        try:
            ctl.control.publish("step", step=step, final=final, version=version)
            core = ctl.trainer_thread.submit(ctl.parts.core_step, ctl.cells.trainer, step, final, version)
            while not pump.poll() and not core.done():
                await asyncio.sleep(PUMP_POLL_S)
            result = await core  # the core's error, if it failed with the board still open, is raised here
        finally:
            if not board.closed:
                board.abandon()  # every cell stops after the unit it holds
            self.pump = None
            ctl.control.publish("step_end", step=step)
        if ctl.stopping:
            return
        shares = await self._satellite_shares(step, result.cells)
        metrics = LossMetricSums()
        for share in shares:
            metrics.merge(LossMetricSums.from_dict(share["metrics"]))
        metrics.merge(result.metrics)
        board.clear()
        ctl.packer.next_batch()
        losses = {"loss": sum(s["loss"] for s in shares) + result.loss, **metrics.means()}
        record = self._record(
            step,
            result,
            started,
            sum(s["tokens"] for s in shares) + result.tokens,
            losses,
            compute_s=sum(s["compute_s"] for s in shares) + result.compute_s,
            pulls_s=tuple(s["pull_s"] for s in shares if s["pull_s"] > 0),
        )
        ctl.records.append(record)
        ctl.trace.step_end(record.wall_time_s)  # the record's time: its sinks (W&B) may take a while to write
        ctl.metrics.write(record)
        ctl.echo(format_progress(record, ctl.cfg.steps, elapsed_s=ctl.now()))
        ctl.last_progress = ctl.now()
        await self._after(version)

    async def _after(self, version: int) -> None:
        """After a step's record: the in-process held-out evaluation, a checkpoint, then the next step or the run's
        end (a `tasks.held_out_dir` is evaluated on the engines at publications and after the run's end instead:
        `gyre.runtime.controller.held_out_engines`)."""
        ctl = self.ctl
        done = len(ctl.records) >= ctl.cfg.steps
        evaluates = ctl.held_out is not None and (done or len(ctl.records) % ctl.cfg.tasks.eval_every == 0)
        policy = await ctl.cells.core_model() if evaluates else None
        if evaluates:
            evaluation = ctl.held_out.evaluate(policy, version=version, wall_time_s=ctl.now())
            if done:
                await evaluation
            else:  # on a copy of the weights, beside the next step
                ctl.spawn(evaluation)
        every = ctl.cfg.checkpoint.every_steps
        if done or (every > 0 and len(ctl.records) % every == 0):
            await checkpoints.write(ctl)
        if done:
            await ctl.cells.publication.write_policy(version)  # the run's last policy, whatever policy_every says
            if ctl.held_out_engines is not None:  # the last publication's evaluation ends; the run's end evaluates this
                await ctl.held_out_engines.settled()
                ctl.final_version = version
            ctl.finish("completed")
            return
        ctl.apply(ctl.sched.step_finished(ctl.now()))

    async def _satellite_shares(self, step: int, cells: int) -> list[dict]:
        """What each satellite of the step did (`tokens`, `loss`, `metrics`, `compute_s`, `pull_s`): each writes its
        share after its step."""
        if cells <= 1:
            return []
        keys = [step_stats_key(step, cell) for cell in range(1, cells)]
        job = self.ctl.parts.job

        def read() -> list[dict]:
            client = job.store()  # its own (dropped when it returns)
            client.wait(keys, datetime.timedelta(seconds=STATS_TIMEOUT_S))
            shares = [json.loads(client.get(key)) for key in keys]
            for key in keys:
                client.delete_key(key)
            return shares

        return await asyncio.to_thread(read)

    def _record(
        self, step: int, result, started: float, tokens: int, losses: dict, *, compute_s: float, pulls_s: tuple
    ) -> StepRecord:
        ctl = self.ctl
        end = ctl.now()
        outcomes = ctl.episodes.outcomes
        rewards = [r for g in self.claimed for r in outcomes[g].rewards().values() if r is not None]
        log_ = ctl.sched.staleness
        picked = [(v, t) for s, v, t in zip(log_.steps, log_.values, log_.tokens, strict=True) if s == step]
        group_tokens = sum(t for _, t in picked)
        book, ctl.book = ctl.book, StepBook(started_s=end)
        wall, train_s = end - book.started_s, end - started
        return StepRecord(
            step=step,
            wall_time_s=end,
            burst=ctl.bursts,
            reward_mean=sum(rewards) / len(rewards) if rewards else None,
            pass_rate=sum(r >= PASS_REWARD for r in rewards) / len(rewards) if rewards else None,
            loss=losses,
            grad_norm=result.update.get("grad_norm"),
            staleness_group_mean=sum(v for v, _ in picked) / len(picked) if picked else None,
            staleness_token_mean=sum(v * t for v, t in picked) / group_tokens if group_tokens > 0 else None,
            staleness_max=float(max(v for v, _ in picked)) if picked else None,
            staleness_groups=len(picked),
            staleness_tokens=float(group_tokens),
            roles=tuple(role.value for role in ctl.sched.roles),
            waterlevel=float(ctl.sched.waterlevel),
            rollout_capacity=ctl.sched.rollout_capacity(),
            transitions=tuple(book.transitions),
            reroutes=len(book.reroutes),
            rerouted_executions=tuple(book.reroutes),
            calls_rerouted=book.calls_rerouted,
            kv_migrations=book.kv_migrations,
            calls_reprefilled=book.calls_reprefilled,
            training_cells=result.cells,
            joined_cells=tuple(self.joined),
            rollout_tokens=book.sampled_tokens,
            train_tokens=tokens,
            rollout_tokens_per_s=book.sampled_tokens / wall if wall > 0 else None,
            train_tokens_per_s=tokens / train_s if train_s > 0 else None,
            train_compute_s=compute_s,
            update_s=result.update_s,
            weight_pulls_s=pulls_s,
        )
