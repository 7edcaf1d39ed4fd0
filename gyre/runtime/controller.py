"""The controller of a training run, on rank 0: one asyncio loop that owns the scheduler and carries out its actions
over the job's cells (docs/runtime.md, "The controller").

It owns the real `gyre.sched.Scheduler` (driven with a monotonic clock through exactly the API the simulator
uses), the proxy's front (`gyre.runtime.proxy_front`: the proxy on this loop, or its shards), the harness
executions and their evaluations, the trajectory and
packing buffers, the role trace and the metrics. Every scheduler action is applied and every outcome is reported
back through the scheduler's events; nothing moves without an action:

- `Dispatch`: a task drawn per group from the training set, each once per epoch (`gyre.tasks.draws.TaskDeck`);
  the group's `GroupOutcomes`; the buffer's group.
- `Start`: the execution opened on the proxy with its key and its engine (`RoutingTable.assign`: the scheduler's
  placement, never a choice of the table's), `run_episode` with the configured harness against the proxy (its
  shard's URL); reported: `harness_ended` at harness end (the execution closed on the proxy; its tree read once
  final),
  `execution_closed`, then the group's verdict (`group_accepted` or `group_rejected` once all its executions
  closed: one readiness rule for the scheduler and the buffers).
- `Cancel`: the execution's cancel event (the scheduler's surplus cancellation; no second mechanism).
- `BeginTransition(c, TRAINING)`: the cell's engine stops accepting, the `Reroute`s of the same action list move
  its executions with their calls in flight (`gyre.proxy.reroute`), then `leave_rollout` (drain, release); the
  core builds its trainer once on the trainer thread, a satellite is told over the control plane and acks;
  `transition_finished`; a satellite the scheduler lets into the step in flight is admitted to the step's board.
- `BeginStep`: the step's board and pump (`gyre.distributed.step_pump`: groups claimed from the scheduler lazily,
  as the simulator's cells claim), the `step` decision, the core's `train_claimed_step` on the trainer thread;
  the record, the step's progress line; `step_finished`. Between step ends, every `logging.progress_every_s`,
  the live line (`live_line`: executions, the proxy's calls in prefill and decoding).
- `Publish(v)`: the core's weights as version v, `<run dir>/policy/`, the engines still in rollout updated (the
  separate rollout pool's with them: it never leaves rollout); `publish_finished`.
- `BeginTransition(c, ROLLOUT)`: after the publication, `return_to_rollout` with the published version (the
  engine accepts only once it holds it); the cell is told; `transition_finished`.
- `WakeAt(t)`: a timer, then `tick`.

The run ends after `steps` optimizer steps, at `request_stop()` (Ctrl-C, SIGTERM) or at the first error of any
of its tasks; `run()` then closes a step in flight (its update is never published), cancels the executions still
running (their harness and evaluator processes are stopped by `run_episode`) and returns a `RunEnd`. A rank whose
lifeline closes (`gyre.runtime.lifeline`) ends it with `RankLost`.

Checkpoints (docs/runtime.md, "Checkpoints and resume"): at a step's end, before `step_finished`, every
`checkpoint.every_steps` steps and after the last, `write_checkpoint` saves `checkpoint_state()` with the core's
weights and optimizer state (every core rank writes its own: `_save_optimizer`); a controller made with
`checkpoint=` restores from one (`_restore`): the scheduler via `gyre.sched.checkpoint`, the groups' outcomes and
buffer entries, the executions it dispatches again under their next rerun's id.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gyre.config import TrainConfig
from gyre.data import StreamPackingBuffer, TrajectoryBuffer
from gyre.distributed.claims import StepBoard
from gyre.distributed.control import STOP, ControlPublisher
from gyre.distributed.step_pump import StepPump
from gyre.harness.episode import run_episode
from gyre.models.decoder import DecoderLM
from gyre.models.decoder_config import DecoderConfig
from gyre.models.flat_weights import FlatWeights
from gyre.models.hf_weights import load_pretrained
from gyre.obs.progress import LiveState, format_live, format_progress
from gyre.obs.record import StepRecord, TransitionRecord, record_from_dict
from gyre.obs.sinks import MetricsLogger
from gyre.rl.loss_metrics import LossMetricSums
from gyre.runtime.checkpoint import Checkpoint, CheckpointError, discard_staging, stage_checkpoint, write_checkpoint
from gyre.runtime.execution_log import EXECUTIONS_FILE, ExecutionLine, ExecutionLog
from gyre.runtime.harness_setup import task_limits
from gyre.runtime.held_out import HeldOutEvaluator
from gyre.runtime.ids import ExecutionIds, engine_name
from gyre.runtime.job import Job, ack_key, step_stats_key
from gyre.runtime.lifeline import watch_lifelines
from gyre.runtime.local_claims import claim_and_pull
from gyre.runtime.policy_dir import write_policy
from gyre.runtime.trace import RoleTrace
from gyre.runtime.trainer_thread import TrainerThread
from gyre.runtime.trainers import GATHER, SAVE_OPTIMIZER, policy_model, trainer_layout
from gyre.runtime.transitions import leave_rollout, publish_to_engines, return_to_rollout
from gyre.runtime.verdicts import judge_group, sampled_tokens, sched_outcome
from gyre.sched import (
    POOL,
    BeginStep,
    BeginTransition,
    Cancel,
    Dispatch,
    GroupState,
    Publish,
    Reroute,
    Role,
    Scheduler,
    Start,
    WakeAt,
    spec_from_config,
)
from gyre.sched.checkpoint import resume, resumed_scheduler, scheduler_state
from gyre.tasks.draws import TaskDeck
from gyre.trainer.publish import engine_weights
from gyre.traj.outcomes import GroupOutcomes
from gyre.traj.outcomes_state import group_outcomes_state, restored_group_outcomes
from gyre.traj.roles import classifier_for
from gyre.traj.store import load_tree

log = logging.getLogger(__name__)

__all__ = ["Controller", "ControllerParts", "RunEnd", "StopRun"]


class StopRun(Exception):
    """A wait ended because the run is stopping (not an error of the run)."""


DRAIN_S = 30.0  # a cell leaving rollout aborts what is still in flight after this (the aborted calls are recorded)
ACK_TIMEOUT_S = 300.0  # a satellite applies a role decision within this (it loads its trainer the first time)
STATS_TIMEOUT_S = 60.0  # the satellites of a step report their share within this after the core's step returned
CANCEL_WAIT_S = 4.0  # at the end, how long the cancelled executions get to stop their processes and close
SLOW_STOP_S = 1.0  # a step of the stop that takes this long is logged with its time (train.log)
PUMP_POLL_S = 0.005  # the step pump's pass interval while a step is in flight
PASS_REWARD = 1.0  # an execution passed when its reward reaches this (the demo check's full score)


@dataclass
class ControllerParts:
    """What the controller drives, built and closed by the program (`gyre.runtime.program`)."""

    job: Job
    engines: dict[int, object]  # cell (or POOL, the separate rollout pool) -> its Engine (a RemoteEngine in front of
    # its endpoint)
    proxy: object  # gyre.runtime.proxy_front.LocalFront or ShardedFront: the proxy as the controller drives it
    hosts: object | None  # gyre.runtime.harness_hosts.HarnessHosts: the other nodes' harness hosts; None: none
    sandbox: object  # gyre.harness.sandbox.Sandbox
    make_runner: Callable  # task -> HarnessRunner
    make_trainer: Callable  # () -> Trainable with a `.model`; called once, on the trainer thread
    core_step: Callable  # (trainer, step, final, version) -> StepResult: train_claimed_step of the core, its thread;
    # its `close()` runs on that thread after the run's last step
    model_dir: Path  # the starting checkpoint (its tokenizer and chat template go into the policy directory)
    model_config: DecoderConfig  # the starting checkpoint's config: the HF layout the core's weights are gathered into
    records_dir: Path | None = None  # the proxy's record files: the trees of a resumed run's finished executions
    save_optimizer: Callable | None = None  # (trainer, trainer_dir) -> rank 0's optimizer file written there; its
    # trainer thread (gyre.runtime.trainers.save_optimizer); None: checkpoints keep no optimizer state
    engine_dir: Path | None = None  # the weights the engines started with (a resumed run's last publication)


@dataclass
class RunEnd:
    """How `Controller.run` ended: `completed` after `steps` steps, `stopped` at `request_stop`, else `error`."""

    reason: str  # "completed" | "stopped" | "error"
    error: BaseException | None = None
    wall_time_s: float = 0.0


@dataclass
class _StepBook:
    """What happened since the last step's record."""

    transitions: list[TransitionRecord] = field(default_factory=list)
    reroutes: list[int] = field(default_factory=list)  # scheduler execution ids, one per move
    calls_rerouted: int = 0
    kv_migrations: int = 0
    calls_reprefilled: int = 0  # rerouted calls whose KV did not move (no export: SGLang), re-prefilled
    sampled_tokens: int = 0
    started_s: float = 0.0


class Controller:
    """Carries out the scheduler's actions (module docstring) for one run."""

    def __init__(
        self,
        cfg: TrainConfig,
        parts: ControllerParts,
        *,
        train_tasks: list,
        held_out: HeldOutEvaluator | None,
        metrics: MetricsLogger,
        run_dir: Path,
        echo: Callable[[str], None] = print,
        checkpoint: Checkpoint | None = None,
    ) -> None:
        self.cfg, self.parts, self.tasks = cfg, parts, train_tasks
        self.held_out, self.metrics, self.run_dir, self.echo = held_out, metrics, run_dir, echo
        spec = spec_from_config(cfg.cluster, cfg.algo, buffer_verdicts=True)
        self.resumed_from = checkpoint
        self.sched = resumed_scheduler(spec, checkpoint.state["scheduler"]) if checkpoint else Scheduler(spec)
        self.ids = ExecutionIds(self.sched.spec.executions_per_group)
        self.buffer = TrajectoryBuffer()
        self.packer = StreamPackingBuffer(self.buffer, cfg.packing)
        self.rng = random.Random(cfg.seed)
        self.deck = TaskDeck(len(self.tasks), self.rng)  # the training tasks, each once per epoch
        self.trace = RoleTrace(cfg.cluster.num_cells, pool=cfg.cluster.separate_size > 0)
        self.executions = ExecutionLog(run_dir / EXECUTIONS_FILE)
        self.records: list[StepRecord] = []
        self.store = parts.job.store()  # the loop thread's client: boards, the control log, acks
        self.control = ControlPublisher(self.store)
        self.trainer_thread = TrainerThread()
        self.outcomes: dict[int, GroupOutcomes] = {}
        self.task_of: dict[int, object] = {}
        self.opened: set[str] = set()  # executions opened on the proxy in this run
        self.cancels: dict[int, asyncio.Event] = {}
        self.episodes: dict[int, asyncio.Task] = {}
        self.background: set[asyncio.Task] = set()
        self.transition_begun: dict[int, tuple[float, Role]] = {}
        self.reroutes: dict[int, list[asyncio.Task]] = {}  # source cell -> its executions' moves in flight
        self.book = _StepBook()
        self.trainer = None
        self.published: tuple[int, object] | None = None  # (version, FlatWeights) of the last publication
        self.publishing: asyncio.Task | None = None
        self.weights_ready: asyncio.Event | None = None  # set once the publication in flight has its weights
        self.pump: StepPump | None = None
        self.claimed: list[int] = []  # groups pulled into the step in flight
        self.joined: list[int] = []  # satellites admitted to the step in flight
        self.stopping = False
        self.bursts = 0  # publications so far: the burst a step belongs to
        self.end: asyncio.Future | None = None
        self.t0 = 0.0
        self.last_progress = 0.0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.reruns: dict[int, int] = {}  # execution -> how often it was dispatched again after a resume
        self.clock_offset = 0.0  # a resumed run's clock goes on from its checkpoint's time
        self.on_disk: set[str] = set()  # finished executions of a resumed run: their trees are their record files
        if checkpoint is not None:
            self._restore(checkpoint)

    # -- running ------------------------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0 + self.clock_offset

    def name(self, execution: int) -> str:
        """The execution's string id, its rerun's after a resume (`ExecutionIds.name`)."""
        return self.ids.name(execution, self.reruns.get(execution, 0))

    def names(self, group: int) -> list[str]:
        return [self.name(e) for e in self.ids.executions(group)]

    async def run(self) -> RunEnd:
        """Run until `steps` steps are done, `request_stop()` or an error; then cancel what still runs."""
        self.loop = asyncio.get_running_loop()
        self.end = self.loop.create_future()
        self.t0 = time.monotonic()
        self.spawn(self._begin())
        progress = self.spawn(self._progress_loop())
        # A rank whose process ends while the run goes on ends the run (RankLost names it); cancelled before the
        # program tells the ranks to stop, so their ends after that are no loss.
        watch = self.spawn(watch_lifelines(self.parts.job.lifelines))
        proxy_watch = self.spawn(self.parts.proxy.watch())  # a proxy shard that dies ends the run (ShardError)
        try:
            reason, error = await self.end
        finally:
            progress.cancel()
            watch.cancel()
            proxy_watch.cancel()
            self.stopping = True
            if self.pump is not None and not self.pump.closed:
                self.pump.board.abandon()  # the cells finish the unit they hold; the update is never published
            stopping = time.monotonic()
            await self._cancel_executions()
            if (elapsed := time.monotonic() - stopping) >= SLOW_STOP_S:  # a slow exit after Ctrl-C names its step
                log.info("stopping: the executions still running took %.1fs to stop", elapsed)
            self.executions.close()
            self.trainer_thread.submit(self.parts.core_step.close)  # its transport, after the last step
            self.trainer_thread.close()
        return RunEnd(reason=reason, error=error, wall_time_s=self.now())

    async def _begin(self) -> None:
        """The baseline held-out evaluation, the cells that start in the training role, the first dispatch (a task,
        so that a stop or an error during them ends the run like any other)."""
        if self.held_out is not None and self.resumed_from is None:  # the starting policy's, the curve's baseline
            await self.held_out.evaluate(self.parts.model_dir, version=0, wall_time_s=0.0)
        self.t0 = time.monotonic()  # the scheduler's clock starts with the first dispatch
        await self._initial_roles()
        if not self.stopping:
            self.apply(resume(self.sched, self.now()) if self.resumed_from else self.sched.start(self.now()))

    def _tick(self) -> None:
        """A `WakeAt` timer: `tick`, its error ending the run as a task's would."""
        try:
            self.apply(self.sched.tick(self.now()))
        except Exception as error:
            log.error("the run failed: %r", error)
            self._finish("error", error)

    def release_cells(self, reason: str) -> None:
        """The `stop` decision with the run's end (`RunEnd.reason`): every satellite leaves its loop and stops its
        engine (the program calls it once the proxy has stopped, so no call of the run is still on one)."""
        self.control.publish(STOP, reason=reason)

    async def _initial_roles(self) -> None:
        """Cells the schedule starts in the training role (async mode's static split) never serve: their engines
        stop accepting and release their memory, the core builds its trainer, a satellite is told and acks."""
        for cell, role in enumerate(self.sched.roles):
            if role is not Role.TRAINING:
                continue
            self.trace.role(self.now(), cell, "training")
            self.parts.engines[cell].stop_accepting()
            await leave_rollout(self.parts.engines[cell], drain_s=0.0)
            await self._tell_training(cell)

    def request_stop(self) -> None:
        """End the run soon (Ctrl-C, SIGTERM): the step in flight is not published, the executions are cancelled."""
        self._finish("stopped")

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        self.stopping = True
        if self.end is not None and not self.end.done():
            self.end.set_result((reason, error))

    def spawn(self, coroutine) -> asyncio.Task:
        task = self.loop.create_task(coroutine)
        self.background.add(task)

        def finished(t: asyncio.Task) -> None:
            self.background.discard(t)
            if t.cancelled() or t.exception() is None:
                return
            if self.stopping:  # the run is ending already: said, not raised
                log.warning("while stopping: %r", t.exception())
                return
            log.error("the run failed: %r", t.exception())  # the app writes the traceback to train.log
            self._finish("error", t.exception())

        task.add_done_callback(finished)
        return task

    async def _progress_loop(self) -> None:
        every = self.cfg.logging.progress_every_s
        if every <= 0:
            return
        while True:
            await asyncio.sleep(every)
            if self.now() - self.last_progress >= every:
                self.echo(self.live_line())
                self.last_progress = self.now()

    def live_line(self) -> str:
        """What runs now: executions, the model calls in prefill and decoding (a long CPU prefill says so here)."""
        calls = self.parts.proxy.in_flight.summary(time.monotonic())
        state = LiveState(
            steps_done=len(self.records),
            roles=tuple(role.value for role in self.sched.roles),
            waterlevel=float(self.sched.waterlevel),
            executions=sum(not task.done() for task in self.episodes.values()),
            waiting=calls.waiting,
            decoding=calls.decoding,
            longest_wait_s=calls.longest_wait_s,
            longest_wait_prompt_tokens=calls.longest_wait_prompt_tokens,
        )
        last = self.records[-1] if self.records else None
        return format_live(state, self.cfg.steps, elapsed_s=self.now(), last=last)

    async def _cancel_executions(self) -> None:
        for execution, task in self.episodes.items():
            if not task.done():
                self.cancels[execution].set()
        running = [task for task in self.episodes.values() if not task.done()]
        if running:
            _, late = await asyncio.wait(running, timeout=CANCEL_WAIT_S)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=CANCEL_WAIT_S)
        rest = [task for task in self.background if not task.done()]
        for task in rest:
            task.cancel()
        if rest:
            await asyncio.wait(rest, timeout=CANCEL_WAIT_S)

    # -- the action applier -------------------------------------------------------------------------------
    def apply(self, actions) -> None:
        if self.stopping:
            return
        for action in actions:
            match action:
                case Dispatch():
                    self.dispatch(action)
                case Start():
                    self.start(action)
                case Cancel():
                    self.cancels[action.execution].set()
                case BeginTransition(to=Role.TRAINING):
                    self._transition_begins(action.cell, Role.TRAINING, "to_training")
                    self.parts.engines[action.cell].stop_accepting()  # at once: no new call starts there
                    self.spawn(self.to_training(action.cell))
                case BeginTransition(to=Role.ROLLOUT):
                    self._transition_begins(action.cell, Role.ROLLOUT, "to_rollout")
                    self.spawn(self.to_rollout(action.cell))
                case Reroute():
                    self.reroutes.setdefault(action.source, []).append(self.spawn(self.reroute(action)))
                case BeginStep():  # the step's shape as the scheduler has it now, not when the task first runs
                    final = self.sched.step_in_burst == self.cfg.algo.mu - 1
                    self.spawn(self.train(action.step, final, self.sched.training_cells()))
                case Publish():
                    self.bursts += 1
                    self.weights_ready = asyncio.Event()
                    self.publishing = self.spawn(self.publish(action.version))
                case WakeAt():
                    delay = max(0.0, action.time_s - self.now())
                    self.loop.call_later(delay, self._tick)
        loads = [self.sched.ledger.load(cell) for cell in range(self.sched.spec.num_cells)]
        if self.trace.pool:
            loads.append(self.sched.ledger.load(POOL))
        self.trace.sample(self.now(), self.sched.waterlevel, self.sched.rollout_capacity(), loads)

    def dispatch(self, action: Dispatch) -> None:
        for group in range(action.first_group, action.first_group + action.count):
            names = self.names(group)
            self.task_of[group] = self.tasks[self.deck.draw()]
            self.outcomes[group] = GroupOutcomes(self.cfg.algo.group_size, names)
            self.buffer.add_group(group, action.version, names, self.cfg.algo.group_size)

    def start(self, action: Start) -> None:
        execution, name = action.execution, self.name(action.execution)
        opened = self.parts.proxy.open(name, engine_name(action.engine))
        self.opened.add(name)
        self.cancels[execution] = asyncio.Event()
        line = ExecutionLine(
            execution=name,
            group=self.ids.group_of(execution),
            task=self.task_of[self.ids.group_of(execution)].id,
            engine=engine_name(action.engine),
            start_s=self.now(),
        )
        self.episodes[execution] = self.spawn(self.episode(execution, name, opened, line))

    async def episode(self, execution: int, name: str, opened, line: ExecutionLine) -> None:
        group = self.ids.group_of(execution)
        task = self.task_of[group]

        def harness_ended(run) -> None:  # the harness has ended: its key stops working, f moves
            line.harness_end_s = self.now()
            self.parts.proxy.close(name)
            self.apply(self.sched.harness_ended(self.now(), execution))

        await opened.ready  # the proxy (its shard) knows the key
        hosts = self.parts.hosts
        line.node = hosts.place() if hosts is not None else 0
        try:
            if line.node == 0:
                result = await run_episode(
                    task,
                    execution_id=name,
                    api_key=opened.key,
                    runner=self.parts.make_runner(task),
                    sandbox=self.parts.sandbox,
                    proxy=opened.access,
                    limits=task_limits(self.cfg.limits, task),
                    group=self.outcomes[group],
                    cancel_event=self.cancels[execution],
                    on_harness_end=harness_ended,
                )
            else:  # on that node's harness host (gyre.runtime.harness_hosts)
                result = await hosts.play(
                    line.node,
                    task,
                    execution=name,
                    key=opened.key,
                    access=opened.access,
                    group=self.outcomes[group],
                    cancel_event=self.cancels[execution],
                    on_harness_end=harness_ended,
                )
        finally:
            if hosts is not None:
                hosts.ended(line.node)
        if not self.stopping:  # (a stopping run reads no tree: it reports no more outcomes)
            await self.parts.proxy.closed(name)  # its calls in flight recorded: its tree is final
        line.end_s, line.reward = self.now(), result.reward
        line.status = result.status.value if result.status is not None else None
        settled = result.status is not None and result.status.settled
        outcome = sched_outcome(self.outcomes[group].execution(name)) if settled or not self.stopping else None
        line.outcome = outcome.value if outcome is not None else None
        self.executions.write(line)
        if self.stopping:
            return
        if outcome is not None:
            tokens = sampled_tokens(self.parts.proxy.tree(name))
            self.book.sampled_tokens += int(tokens)
            self.apply(self.sched.execution_closed(self.now(), execution, outcome, tokens))
        if self.sched.group_state(group) is GroupState.JUDGING:
            self.judge(group)

    def judge(self, group: int) -> None:
        trees = {name: self._tree(name) for name in self.names(group)}
        verdict = judge_group(
            self.buffer,
            group,
            self.outcomes[group],
            trees,
            classify=classifier_for(self.cfg.harness.name),
            j_max=self.cfg.algo.j_max,
            run_seed=self.cfg.seed,
        )
        if not verdict.accepted:
            log.warning("group %d refused by the buffers (%s): replaced", group, verdict.reason)
            self.buffer.drop_group(group)  # its replacement is dispatched by group_rejected
        report = self.sched.group_accepted if verdict.accepted else self.sched.group_rejected
        self.apply(report(self.now(), group))

    # -- transitions ------------------------------------------------------------------------------------
    def _transition_begins(self, cell: int, to: Role, state: str) -> None:
        self.transition_begun[cell] = (self.now(), to)
        self.trace.role(self.now(), cell, state)

    def _transition_ends(self, cell: int, phases: dict[str, float] | None = None) -> None:
        start_s, to = self.transition_begun.pop(cell)
        self.book.transitions.append(
            TransitionRecord(
                cell=cell, to=to.value, start_s=start_s, duration_s=self.now() - start_s, phases=phases or {}
            )
        )
        self.trace.role(self.now(), cell, to.value)
        self.apply(self.sched.transition_finished(self.now(), cell))
        pump = self.pump
        joins = to is Role.TRAINING and pump is not None and pump.can_admit and cell in self.sched.training_cells()
        if joins and cell == pump.board.cells:  # a satellite joins the step in flight (cells join in cell order)
            pump.admit()
            self.joined.append(cell)
        elif joins and cell > pump.board.cells:
            raise RuntimeError(f"cell {cell} joins the step before cell {pump.board.cells}: cells join in order")

    async def reroute(self, action: Reroute) -> None:
        name = self.name(action.execution)
        moved = await self.parts.proxy.reroute(name, engine_name(action.destination))
        self.book.reroutes.append(action.execution)
        self.book.calls_rerouted += moved.calls
        self.book.kv_migrations += len(moved.migrated)
        self.book.calls_reprefilled += len(moved.restarted)

    async def _tell_training(self, cell: int) -> None:
        """The cell's ranks take the training role: the core builds its trainer once on the trainer thread; every
        other rank of the cell (a satellite's, the core's other ranks in a cell of several) is told and acks."""
        if cell == 0 and self.trainer is None:
            building = self.trainer_thread.submit(self.parts.make_trainer)
            if self.parts.job.layout.cell_size > 1:  # the core's other ranks build their shards meanwhile
                await self._acked(self.control.publish("role", cell=0, to="training"), 0)
            self.trainer = await building
        elif self._has_other_ranks(cell):
            seq = self.control.publish("role", cell=cell, to="training")
            if not self._in_step(cell):
                await self._acked(seq, cell)

    def _has_other_ranks(self, cell: int) -> bool:
        """The cell has ranks besides rank 0 (the controller), which must be told of its role decisions."""
        return cell != 0 or self.parts.job.layout.cell_size > 1

    def _in_step(self, cell: int) -> bool:
        """Whether `cell` is a member of the step in flight: its ranks are inside `train_claimed_step` and apply a
        decision only after the step, so the controller does not wait for their ack (a cell the scheduler sent
        to rollout mid-step and brings back, `Scheduler._make_room_for_the_batch`; its engine side is the
        controller's own work)."""
        return self.pump is not None and cell < self.pump.board.cells

    async def _acked(self, seq: int, cell: int) -> None:
        """Every rank of `cell` but this one (rank 0, the controller) applied control decision `seq`."""
        layout = self.parts.job.layout
        keys = [ack_key(seq, rank) for rank in range(cell * layout.cell_size, (cell + 1) * layout.cell_size) if rank]
        if not keys:
            return
        job = self.parts.job

        def wait() -> None:  # a client of its own (dropped when it returns: TCPStore has no close)
            client = job.store()
            deadline = time.monotonic() + ACK_TIMEOUT_S
            while not client.check(keys):
                if self.stopping:
                    raise StopRun(f"the run stopped while cell {cell} applied control decision {seq}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cell {cell} did not apply control decision {seq} in {ACK_TIMEOUT_S:g}s")
                time.sleep(0.01)

        await asyncio.to_thread(wait)

    async def to_training(self, cell: int) -> None:
        begun = self.now()
        moves = self.reroutes.pop(cell, [])
        await asyncio.gather(*moves)  # its executions moved before the drain
        moved = self.now()
        phases = {"reroute": moved - begun, **await leave_rollout(self.parts.engines[cell], drain_s=DRAIN_S)}
        released = self.now()
        await self._tell_training(cell)
        phases["restore"] = self.now() - released
        log.info(
            "cell %d to training: %d executions rerouted in %.2fs, drained and released in %.2fs, trainer ready in "
            "%.2fs",
            cell,
            len(moves),
            moved - begun,
            released - moved,
            phases["restore"],
        )
        self._transition_ends(cell, phases)

    async def to_rollout(self, cell: int) -> None:
        begun = self.now()
        await self._published_weights()
        phases = {"publish_wait": self.now() - begun}
        told = self.now()
        if self._has_other_ranks(cell):
            seq = self.control.publish("role", cell=cell, to="rollout")
            # With a step in flight (a cell leaving it mid-step to make room for a replacement, or a joiner sent
            # back before it was admitted) the cell's ranks are inside the step, or waiting for its admission,
            # until it ends: they apply the decision then; the engine side below needs nothing of them.
            if self.pump is None:
                await self._acked(seq, cell)
        engine = self.parts.engines[cell]
        phases["ranks"] = self.now() - told
        resumed = self.now()
        if self.published is None:  # back before any publication (mid-step, to make room): the starting weights
            await engine.resume_memory()
            engine.resume_accepting()
            phases["resume"] = self.now() - resumed
        else:
            version, weights = self.published
            phases.update(await return_to_rollout(engine, weights, version=version))
        self._transition_ends(cell, phases)

    async def _published_weights(self) -> None:
        """Until the publication of the same action list has its weights (`self.published`), not until it ends: a
        returning cell loads them while `policy/` is written and the engines that stayed are updated, and is back
        before the next dispatch's harnesses start (docs/runtime.md, "What happens at a transition"). A publication
        that fails before it has them raises its error here."""
        if self.publishing is None or self.weights_ready is None:
            return
        waiter = asyncio.ensure_future(self.weights_ready.wait())
        try:
            await asyncio.wait({waiter, self.publishing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not self.weights_ready.is_set():
            await asyncio.shield(self.publishing)  # it ended without weights: its error

    async def core_weights(self) -> FlatWeights:
        """The core's whole weights now, in HF names and the engines' dtype (`engine.dtype`: a bf16 trainer's
        weights serve fp32 engines, cast once here): on the trainer thread after the work submitted before; a
        Megatron core gathers its shards, its other ranks told with a `gather` decision (gyre.runtime.trainers)."""
        if self.parts.job.layout.cell_size > 1:
            self.control.publish(GATHER)
        gather = functools.partial(engine_weights, dtype=getattr(torch, self.cfg.engine.dtype))
        return await self.trainer_thread.submit(gather, self.trainer, self.parts.model_config)

    def _as_model(self, weights: FlatWeights | None) -> DecoderLM:
        """The core's model as a `DecoderLM`: a native trainer's own module, else one made of `weights`."""
        if isinstance(self.trainer.model, DecoderLM):
            return self.trainer.model
        return policy_model(weights, self.parts.model_config)

    async def core_model(self) -> DecoderLM:
        """The core's model now as a `DecoderLM` (for the held-out evaluation and the policy directory); a native
        trainer's needs no copy of its weights."""
        native = isinstance(self.trainer.model, DecoderLM)
        return self._as_model(None if native else await self.core_weights())

    async def publish(self, version: int) -> None:
        begun = self.now()
        weights = await self.core_weights()
        self.published = (version, weights)
        if self.weights_ready is not None:
            self.weights_ready.set()  # the returning cells load them now (to_rollout)
        gathered = self.now()
        await asyncio.to_thread(
            write_policy,
            self._as_model(weights),
            source_dir=self.parts.model_dir,
            run_dir=self.run_dir,
            version=version,
        )
        written = self.now()
        staying = [self.parts.engines[c] for c, role in enumerate(self.sched.roles) if role is Role.ROLLOUT]
        if POOL in self.parts.engines:  # the separate rollout pool never leaves rollout: updated as a staying cell
            staying.append(self.parts.engines[POOL])
        await publish_to_engines(staying, weights, version=version)  # returning cells load it in to_rollout
        phases = {"weights": gathered - begun, "policy_dir": written - gathered, "engines": self.now() - written}
        self.trace.publication(begun, self.now() - begun, version, phases)
        self.apply(self.sched.publish_finished(self.now()))

    def engine_lost(self, event) -> None:
        """The proxy counted a cell's engine lost (its endpoint gone: docs/proxy.md, "An engine that dies"): its
        calls went on on live engines and the table moved its executions. Said once; the scheduler still counts the
        cell (a dead endpoint is almost always a dead rank, whose lifeline ends the run: docs/runtime.md,
        "An engine endpoint that dies")."""
        log.error(
            "engine %s lost (%s): %d executions moved to live engines, %d had none; the scheduler still counts it",
            event.engine,
            event.reason,
            len(event.moved),
            len(event.unplaced),
        )

    # -- checkpoints -------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """The controller's state at a step's end, before `step_finished` (docs/runtime.md, "Checkpoints and
        resume"): the scheduler's (`gyre.sched.checkpoint.scheduler_state`), every open or ready group's task and
        outcomes (their finished executions' calls are their record files), the executions' reruns, the task
        sampler's RNG and its epoch's remaining draws (`TaskDeck`), the step records, the packer's batch, the clock."""
        sched = scheduler_state(self.sched)
        groups = {}
        for group in range(len(self.sched.groups)):
            if self.sched.groups[group].state in (GroupState.OPEN, GroupState.READY):
                groups[str(group)] = {
                    "task": self.task_of[group].id,
                    "outcomes": group_outcomes_state(self.outcomes[group]),
                }
        version, internal, gauss = self.rng.getstate()
        return {
            "scheduler": sched,
            "groups": groups,
            "reruns": {str(e): k for e, k in sorted(self.reruns.items())},
            "task_rng": [version, list(internal), gauss],
            "task_deck": self.deck.state(),
            "records": [record.to_dict() for record in self.records],
            "bursts": self.bursts + (1 if sched["step_in_burst"] == 0 else 0),  # a burst's end counts its publication
            "packer_batch": self.packer.batch,
            "wall_time_s": self.now(),
            "seed": self.cfg.seed,
            "executions_per_group": self.ids.executions_per_group,
            "shape": run_shape(self.cfg),
            "trainer_layout": trainer_layout(self.cfg),
        }

    async def write_checkpoint(self) -> None:
        """`<run dir>/checkpoints/step-<n>/` (`gyre.runtime.checkpoint`) with the core's weights and optimizer state,
        and the engines' weights when a burst is in flight (its last publication)."""
        begun = self.now()
        state = self.checkpoint_state()  # in one go on the loop: a consistent state
        sched = state["scheduler"]
        step, published = sched["trainer_version"], sched["published_version"]
        trainer_model = await self.core_model()
        engine_model = None
        if published not in (0, step):  # inside a burst: the engines serve the last publication
            if self.published is not None:
                version, weights = self.published
                assert version == published, (version, published)
                engine_model = policy_model(weights, self.parts.model_config)
            else:  # a resumed run before its first publication: the weights its engines started with
                engine_model = await asyncio.to_thread(load_pretrained, self.parts.engine_dir)
        staged = self.parts.save_optimizer is not None
        if staged:
            await self._save_optimizer(step)
        path = await asyncio.to_thread(
            write_checkpoint,
            self.run_dir,
            step,
            state,
            trainer_model=trainer_model,
            engine_model=engine_model,
            source_dir=self.parts.model_dir,
            keep=self.cfg.checkpoint.keep,
            protect=self.resumed_from.path if self.resumed_from else None,
            staged=staged,
        )
        log.info("checkpoint %s written in %.2fs", path, self.now() - begun)

    async def _save_optimizer(self, step: int) -> None:
        """Every rank of the core writes its own optimizer state (its shard's, in a Megatron core of several ranks)
        into checkpoint `step`'s staging directory: rank 0 on its trainer thread, the core's other ranks told with a
        `save_optimizer` decision, whose ack says the file is on disk; the checkpoint is completed only after. A
        rank that cannot write fails (its error in train.log) and the run ends naming it; the staging directory is
        removed."""
        trainer_dir = await asyncio.to_thread(stage_checkpoint, self.run_dir, step)
        try:
            own = self.trainer_thread.submit(self.parts.save_optimizer, self.trainer, trainer_dir)
            if self._has_other_ranks(0):  # after the step and its gather: decisions are applied in order
                await self._acked(self.control.publish(SAVE_OPTIMIZER, path=str(trainer_dir)), 0)
            await own
        except BaseException as error:
            discard_staging(self.run_dir, step)
            if isinstance(error, OSError):
                raise CheckpointError(
                    f"checkpoint of step {step}: rank 0's optimizer state not written: {error}"
                ) from error
            raise

    def _restore(self, checkpoint: Checkpoint) -> None:
        """The controller's state from `checkpoint` (the scheduler's is restored already): the executions the
        scheduler dispatches again get their next rerun's id, the open and ready groups their outcomes and buffer
        entries (a ready group judged again from its record files: the same verdict, admission is seeded)."""
        state = checkpoint.state
        if state["executions_per_group"] != self.ids.executions_per_group or state["seed"] != self.cfg.seed:
            raise ValueError(
                f"checkpoint {checkpoint.path} is of another run shape (seed {state['seed']}, "
                f"{state['executions_per_group']} executions per group; this run: seed {self.cfg.seed}, "
                f"{self.ids.executions_per_group}): resume with the run's own config"
            )
        self.reruns = {int(e): k for e, k in state["reruns"].items()}
        for execution in self.sched.redispatched:
            self.reruns[execution] = self.reruns.get(execution, 0) + 1
        version, internal, gauss = state["task_rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        if "task_deck" in state and not self.deck.restore(state["task_deck"]):
            log.warning("the checkpoint's task draws were of another task set: a new epoch of draws begins")
        self.records = [record_from_dict(record) for record in state["records"]]
        self.bursts = state["bursts"]
        self.packer.resume_at(state["packer_batch"])
        self.clock_offset = state["wall_time_s"]
        self.book = _StepBook(started_s=self.clock_offset)
        self.trace = RoleTrace(
            self.cfg.cluster.num_cells, pool=self.cfg.cluster.separate_size > 0, start_s=self.clock_offset
        )
        tasks = {task.id: task for task in self.tasks}
        for key, saved in sorted(state["groups"].items(), key=lambda item: int(item[0])):
            group = int(key)
            if saved["task"] not in tasks:
                raise ValueError(
                    f"checkpoint {checkpoint.path}: group {group}'s task {saved['task']!r} is not in the "
                    "training tasks: resume with the run's own task set"
                )
            names = self.names(group)
            self.task_of[group] = tasks[saved["task"]]
            self.outcomes[group] = restored_group_outcomes(saved["outcomes"], names)
            closed = set(state["scheduler"]["closed"])
            self.on_disk.update(name for e, name in zip(self.ids.executions(group), names, strict=True) if e in closed)
            entry = self.sched.groups[group]
            self.buffer.add_group(group, entry.version, names, self.cfg.algo.group_size)
            if entry.state is GroupState.READY:
                verdict = judge_group(
                    self.buffer,
                    group,
                    self.outcomes[group],
                    {name: self._tree(name) for name in names},
                    classify=classifier_for(self.cfg.harness.name),
                    j_max=self.cfg.algo.j_max,
                    run_seed=self.cfg.seed,
                )
                if not verdict.accepted:
                    raise ValueError(
                        f"checkpoint {checkpoint.path}: ready group {group} is refused on resume "
                        f"({verdict.reason}): its record files changed"
                    )

    def _tree(self, name: str):
        """An execution's trajectory tree: its session's, or (a finished execution of a resumed run) its record
        file's; None when it made no call."""
        if name in self.opened:
            return self.parts.proxy.tree(name)
        if name in self.on_disk and self.parts.records_dir is not None:
            path = self.parts.records_dir / f"{name}.jsonl"
            if path.is_file():
                tree = load_tree(path)
                tree.close()
                return tree
        return None

    # -- the step ----------------------------------------------------------------------------------------
    def refill(self) -> bool:
        """The pump runs short: claim one ready group from the scheduler and pull it into the packer."""
        group, refused = claim_and_pull(self.sched, self.packer, clock=self.now, on_actions=self.apply)
        if group is None:
            return False
        if refused is not None:
            log.warning("group %d set aside by the packer (%s): replaced", group, refused)
        else:
            self.claimed.append(group)
        return True

    async def train(self, step: int, final: bool, cells: list[int]) -> None:
        if self.stopping:
            return
        started = self.now()
        if cells != list(range(len(cells))):
            raise RuntimeError(f"step {step}: the training cells {cells} are not a prefix of the cells")
        version = step + 1  # the core's weights of this step, for satellites that join it (one snapshot per step)
        self.claimed, self.joined = [], []
        board = StepBoard(self.store, step, max_cells=self.cfg.cluster.num_cells, cells=len(cells))
        self.pump = pump = StepPump(board, self.packer.queue, refill=self.refill)
        try:
            self.control.publish("step", step=step, final=final, version=version)
            core = self.trainer_thread.submit(self.parts.core_step, self.trainer, step, final, version)
            while not pump.poll() and not core.done():
                await asyncio.sleep(PUMP_POLL_S)
            result = await core  # the core's error, if it failed with the board still open, is raised here
        finally:
            if not board.closed:
                board.abandon()  # every cell stops after the unit it holds
            self.pump = None
            self.control.publish("step_end", step=step)
        if self.stopping:
            return
        shares = await self._satellite_shares(step, result.cells)
        metrics = LossMetricSums()
        for share in shares:
            metrics.merge(LossMetricSums.from_dict(share["metrics"]))
        metrics.merge(result.metrics)
        board.clear()
        self.packer.next_batch()
        losses = {"loss": sum(s["loss"] for s in shares) + result.loss, **metrics.means()}
        record = self._step_record(
            step,
            result,
            started,
            sum(s["tokens"] for s in shares) + result.tokens,
            losses,
            compute_s=sum(s["compute_s"] for s in shares) + result.compute_s,
            pulls_s=tuple(s["pull_s"] for s in shares if s["pull_s"] > 0),
        )
        self.records.append(record)
        self.trace.step_end(record.wall_time_s)  # the record's time: its sinks (W&B) may take a while to write
        self.metrics.write(record)
        self.echo(format_progress(record, self.cfg.steps, elapsed_s=self.now()))
        self.last_progress = self.now()
        done = len(self.records) >= self.cfg.steps
        evaluates = self.held_out is not None and (done or len(self.records) % self.cfg.tasks.eval_every == 0)
        policy = await self.core_model() if done or evaluates else None
        if evaluates:
            evaluation = self.held_out.evaluate(policy, version=version, wall_time_s=self.now())
            if done:
                await evaluation
            else:  # on a copy of the weights, beside the next step
                self.spawn(evaluation)
        every = self.cfg.checkpoint.every_steps
        if done or (every > 0 and len(self.records) % every == 0):
            await self.write_checkpoint()
        if done:
            await asyncio.to_thread(
                write_policy, policy, source_dir=self.parts.model_dir, run_dir=self.run_dir, version=version
            )
            self._finish("completed")
            return
        self.apply(self.sched.step_finished(self.now()))

    async def _satellite_shares(self, step: int, cells: int) -> list[dict]:
        """What each satellite of the step did (`tokens`, `loss`, `metrics`, `compute_s`, `pull_s`): each writes its
        share after its step."""
        if cells <= 1:
            return []
        keys = [step_stats_key(step, cell) for cell in range(1, cells)]
        job = self.parts.job

        def read() -> list[dict]:
            import json

            client = job.store()  # its own (dropped when it returns)
            client.wait(keys, _seconds(STATS_TIMEOUT_S))
            shares = [json.loads(client.get(key)) for key in keys]
            for key in keys:
                client.delete_key(key)
            return shares

        return await asyncio.to_thread(read)

    def _step_record(
        self, step: int, result, started: float, tokens: int, losses: dict, *, compute_s: float, pulls_s: tuple
    ) -> StepRecord:
        end = self.now()
        rewards = [r for g in self.claimed for r in self.outcomes[g].rewards().values() if r is not None]
        log_ = self.sched.staleness
        picked = [(v, t) for s, v, t in zip(log_.steps, log_.values, log_.tokens, strict=True) if s == step]
        group_tokens = sum(t for _, t in picked)
        book, self.book = self.book, _StepBook(started_s=end)
        wall, train_s = end - book.started_s, end - started
        return StepRecord(
            step=step,
            wall_time_s=end,
            burst=self.bursts,
            reward_mean=sum(rewards) / len(rewards) if rewards else None,
            pass_rate=sum(r >= PASS_REWARD for r in rewards) / len(rewards) if rewards else None,
            loss=losses,
            grad_norm=result.update.get("grad_norm"),
            staleness_group_mean=sum(v for v, _ in picked) / len(picked) if picked else None,
            staleness_token_mean=sum(v * t for v, t in picked) / group_tokens if group_tokens > 0 else None,
            staleness_max=float(max(v for v, _ in picked)) if picked else None,
            staleness_groups=len(picked),
            staleness_tokens=float(group_tokens),
            roles=tuple(role.value for role in self.sched.roles),
            waterlevel=float(self.sched.waterlevel),
            rollout_capacity=self.sched.rollout_capacity(),
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


def run_shape(cfg: TrainConfig) -> dict:
    """What a checkpoint's state depends on: a run resumes from it only with the same (`gyre.runtime.program.
    resolve_checkpoint` compares them)."""
    cl, algo = cfg.cluster, cfg.algo
    return {
        "algo.mode": algo.mode,
        "cluster.num_cells": cl.num_cells,
        "cluster.cell_capacity": cl.cell_capacity,
        "cluster.separate_capacity": cl.separate_capacity,  # the ledger's C_s (a checkpoint without it: not compared)
        "algo.group_size": algo.group_size,
        "algo.oversample": algo.oversample,
        "algo.batch_groups": algo.batch_groups,
        "algo.mu": algo.mu,
        "algo.extra_groups": algo.extra_groups,
        "algo.dispatch": algo.dispatch,
        "seed": cfg.seed,
    }


def _seconds(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)
