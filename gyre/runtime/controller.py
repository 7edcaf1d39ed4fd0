"""The controller of a training run: one asyncio loop that owns the scheduler and carries out its actions
(docs/runtime.md, "The controller").

It owns the real `gyre.sched.Scheduler` (driven with a monotonic clock through exactly the API the simulator
uses), the routing table, the proxy's sessions, the harness executions and their evaluations, the trajectory and
packing buffers, the role trace and the metrics. Every scheduler action is applied and every outcome is reported
back through the scheduler's events; nothing moves without an action:

- `Dispatch`: a task drawn per group from the training set; the group's `GroupOutcomes`; the buffer's group.
- `Start`: the execution's key, its engine (`RoutingTable.assign`), `run_episode` with the configured harness;
  reported: `harness_ended` at harness end, `execution_closed`, then the group's verdict (`group_accepted` or
  `group_rejected` once all its executions closed: one readiness rule for the scheduler and the buffers).
- `Cancel`: the execution's cancel event (the scheduler's surplus cancellation; no second mechanism).
- `BeginTransition(c, TRAINING)`: `leave_rollout` of the cell's engine, the trainer built once and kept;
  `transition_finished`.
- `BeginStep`: `train_step` on a worker thread, its claims lazy on the loop (`LocalClaims`); `step_finished`.
- `Publish(v)`: the trainer's weights as version v, written to `<run dir>/policy/`; `publish_finished`.
- `BeginTransition(c, ROLLOUT)`: after the publication, `return_to_rollout` with the published version;
  `transition_finished`.
- `WakeAt(t)`: a timer, then `tick`.

This stage runs the whole job in one process with one cell (K = 1, `cluster.num_cells=1`): the cell's engine
serves behind its endpoint on its own thread, and rank 0's trainer is the core. The run ends after `steps`
optimizer steps, at `request_stop()` (Ctrl-C, SIGTERM) or at the first error of any of its tasks; `run()` then
cancels the executions still running (their harness and evaluator processes are stopped by `run_episode`) and
returns a `RunEnd` saying which. Per step it writes a `gyre.obs.StepRecord` to the metrics logger and a console
progress line; the held-out evaluation (`HeldOutEvaluator`) runs before the first step, every `tasks.eval_every`
steps and after the last.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gyre.config import TrainConfig
from gyre.config.harness import ExecutionLimits
from gyre.data import StreamPackingBuffer, TrajectoryBuffer
from gyre.harness.episode import ProxyAccess, run_episode
from gyre.obs.progress import format_progress
from gyre.obs.record import StepRecord, TransitionRecord
from gyre.obs.sinks import MetricsLogger
from gyre.proxy.routing import RoutingTable
from gyre.runtime.held_out import HeldOutEvaluator
from gyre.runtime.ids import ExecutionIds, engine_name
from gyre.runtime.local_claims import WAIT, LocalClaims
from gyre.runtime.policy_dir import write_policy
from gyre.runtime.trace import RoleTrace
from gyre.runtime.transitions import leave_rollout, return_to_rollout
from gyre.runtime.verdicts import judge_group, sampled_tokens, sched_outcome
from gyre.sched import (
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
from gyre.train.publish import engine_weights
from gyre.train.streaming import train_step
from gyre.traj.outcomes import GroupOutcomes
from gyre.traj.roles import classifier_for

log = logging.getLogger(__name__)

__all__ = ["Controller", "ControllerParts", "RunEnd", "StopRun"]

DRAIN_S = 30.0  # a cell leaving rollout aborts what is still in flight after this (the aborted calls are recorded)
CLAIM_WAIT_S = 3600.0  # a training cell waits this long at most for a group to become ready
CANCEL_WAIT_S = 8.0  # at the end, how long the cancelled executions get to stop their processes and close
PASS_REWARD = 1.0  # an execution passed when its reward reaches this (the demo check's full score)


class StopRun(Exception):
    """Raised into the trainer's claim when the run stops mid-step: the partial step is abandoned, not applied."""


@dataclass
class ControllerParts:
    """What the controller drives, built and closed by the program (`gyre.runtime.program`)."""

    engine: object  # the cell's Engine (a RemoteEngine in front of its endpoint)
    proxy: object  # gyre.proxy.server.ProxyServer
    registry: object  # gyre.proxy.sessions.SessionRegistry
    table: RoutingTable
    sandbox: object  # gyre.harness.sandbox.Sandbox
    make_runner: Callable  # task -> HarnessRunner
    make_trainer: Callable  # () -> Trainable with a `.model` (a DecoderLM); called once, on a worker thread
    model_dir: Path  # the starting checkpoint (its tokenizer and chat template go into the policy directory)


@dataclass
class RunEnd:
    """How `Controller.run` ended: `completed` after `steps` steps, `stopped` at `request_stop`, else `error`."""

    reason: str  # "completed" | "stopped" | "error"
    error: BaseException | None = None
    wall_time_s: float = 0.0


@dataclass
class _StepBook:
    """What happened since the last step's record: its transitions, sampled tokens and the proxy's counters."""

    transitions: list[TransitionRecord] = field(default_factory=list)
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
    ) -> None:
        self.cfg, self.parts, self.tasks = cfg, parts, train_tasks
        self.held_out, self.metrics, self.run_dir, self.echo = held_out, metrics, run_dir, echo
        self.sched = Scheduler(spec_from_config(cfg.cluster, cfg.algo, buffer_verdicts=True))
        self.ids = ExecutionIds(self.sched.spec.executions_per_group)
        self.buffer = TrajectoryBuffer()
        self.packer = StreamPackingBuffer(self.buffer, cfg.packing)
        self.rng = random.Random(cfg.seed)
        self.trace = RoleTrace(cfg.cluster.num_cells)
        self.records: list[StepRecord] = []
        self.proxy_access = ProxyAccess(
            anthropic_base_url=parts.proxy.url, openai_base_url=parts.proxy.url + "/v1", model="gyre"
        )
        self.outcomes: dict[int, GroupOutcomes] = {}
        self.task_of: dict[int, object] = {}
        self.sessions: dict[str, object] = {}
        self.cancels: dict[int, asyncio.Event] = {}
        self.episodes: dict[int, asyncio.Task] = {}
        self.background: set[asyncio.Task] = set()
        self.transition_begun: dict[int, tuple[float, Role]] = {}
        self.book = _StepBook()
        self.trainer = None
        self.published: tuple[int, object] | None = None  # (version, FlatWeights) of the last publication
        self.publishing: asyncio.Task | None = None
        self.claims: LocalClaims | None = None
        self.changed = asyncio.Event()  # a verdict arrived: a waiting claim looks again
        self.stopping = False
        self.bursts = 0  # publications so far: the burst a step belongs to
        self.end: asyncio.Future | None = None
        self.t0 = 0.0
        self.last_progress = 0.0
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- running ------------------------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> RunEnd:
        """Run until `steps` steps are done, `request_stop()` or an error; then cancel what still runs."""
        self.loop = asyncio.get_running_loop()
        self.end = self.loop.create_future()
        self.t0 = time.monotonic()
        if self.held_out is not None:  # the starting policy's pass rate, the baseline of the curve
            await self.held_out.evaluate(self.parts.model_dir, version=0, wall_time_s=0.0)
        self.t0 = time.monotonic()  # the scheduler's clock starts with the first dispatch
        self.apply(self.sched.start(self.now()))
        progress = self.spawn(self._progress_loop())
        try:
            reason, error = await self.end
        finally:
            progress.cancel()
            self.stopping = True
            self.changed.set()
            await self._cancel_executions()
        return RunEnd(reason=reason, error=error, wall_time_s=self.now())

    def request_stop(self) -> None:
        """End the run soon (Ctrl-C, SIGTERM): the step in flight is abandoned, the executions are cancelled."""
        self._finish("stopped")

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        self.stopping = True
        self.changed.set()
        if self.end is not None and not self.end.done():
            self.end.set_result((reason, error))

    def spawn(self, coroutine) -> asyncio.Task:
        task = self.loop.create_task(coroutine)
        self.background.add(task)

        def finished(t: asyncio.Task) -> None:
            self.background.discard(t)
            if not t.cancelled() and t.exception() is not None and not isinstance(t.exception(), StopRun):
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
            if self.records and self.now() - self.last_progress >= every:
                now = dataclasses.replace(  # the last step's metrics, the roles and waterlevel of now
                    self.records[-1],
                    roles=tuple(role.value for role in self.sched.roles),
                    waterlevel=float(self.sched.waterlevel),
                )
                self.echo(format_progress(now, self.cfg.steps, elapsed_s=self.now()))
                self.last_progress = self.now()

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
                    self.spawn(self.to_training(action.cell))
                case BeginTransition(to=Role.ROLLOUT):
                    self._transition_begins(action.cell, Role.ROLLOUT, "to_rollout")
                    self.spawn(self.to_rollout(action.cell))
                case BeginStep():
                    self.spawn(self.train(action.step))
                case Publish():
                    self.bursts += 1
                    self.publishing = self.spawn(self.publish(action.version))
                case WakeAt():
                    delay = max(0.0, action.time_s - self.now())
                    self.loop.call_later(delay, lambda: self.apply(self.sched.tick(self.now())))
                case Reroute():
                    raise AssertionError(f"a Reroute needs two engines; this run has one cell: {action}")
        self.trace.sample(self.now(), self.sched.waterlevel, self.sched.rollout_capacity())

    def dispatch(self, action: Dispatch) -> None:
        for group in range(action.first_group, action.first_group + action.count):
            names = self.ids.names(group)
            self.task_of[group] = self.rng.choice(self.tasks)
            self.outcomes[group] = GroupOutcomes(self.cfg.algo.group_size, names)
            self.buffer.add_group(group, action.version, names, self.cfg.algo.group_size)

    def start(self, action: Start) -> None:
        execution, name = action.execution, self.ids.name(action.execution)
        session = self.parts.registry.issue(name)
        self.sessions[name] = session
        self.parts.table.assign(name, engine_name(action.engine))
        self.cancels[execution] = asyncio.Event()
        self.episodes[execution] = self.spawn(self.episode(execution, name, session.key))

    async def episode(self, execution: int, name: str, key: str) -> None:
        group = self.ids.group_of(execution)
        task = self.task_of[group]

        def harness_ended(run) -> None:  # the harness has ended: its key stops working, f moves
            self.parts.registry.close(name)
            self.apply(self.sched.harness_ended(self.now(), execution))

        await run_episode(
            task,
            execution_id=name,
            api_key=key,
            runner=self.parts.make_runner(task),
            sandbox=self.parts.sandbox,
            proxy=self.proxy_access,
            limits=self._limits(task),
            group=self.outcomes[group],
            cancel_event=self.cancels[execution],
            on_harness_end=harness_ended,
        )
        if self.stopping:
            return
        outcome = sched_outcome(self.outcomes[group].execution(name))
        if outcome is not None:
            tokens = sampled_tokens(self.sessions[name].tree)
            self.book.sampled_tokens += int(tokens)
            self.apply(self.sched.execution_closed(self.now(), execution, outcome, tokens))
        if self.sched.group_state(group) is GroupState.JUDGING:
            self.judge(group)

    def _limits(self, task) -> ExecutionLimits:
        """The run's ceilings with the task's own budgets inside them."""
        limits = self.cfg.limits
        harness_s = min(limits.harness_timeout_s, task.harness_timeout_s or limits.harness_timeout_s)
        overall_s = min(limits.overall_timeout_s, task.overall_timeout_s or limits.overall_timeout_s)
        return ExecutionLimits(
            harness_timeout_s=harness_s,
            overall_timeout_s=max(overall_s, harness_s),
            grace_period_s=limits.grace_period_s,
            kill_wait_s=limits.kill_wait_s,
            resources=limits.resources,
        )

    def judge(self, group: int) -> None:
        names = self.ids.names(group)
        trees = {name: self.sessions[name].tree if name in self.sessions else None for name in names}
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
        self.changed.set()

    # -- transitions ------------------------------------------------------------------------------------
    def _transition_begins(self, cell: int, to: Role, state: str) -> None:
        self.transition_begun[cell] = (self.now(), to)
        self.trace.role(self.now(), cell, state)

    def _transition_ends(self, cell: int) -> None:
        start_s, to = self.transition_begun.pop(cell)
        self.book.transitions.append(
            TransitionRecord(cell=cell, to=to.value, start_s=start_s, duration_s=self.now() - start_s)
        )
        self.trace.role(self.now(), cell, to.value)
        self.apply(self.sched.transition_finished(self.now(), cell))

    async def to_training(self, cell: int) -> None:
        await leave_rollout(self.parts.engine, drain_s=DRAIN_S)
        if self.trainer is None:
            self.trainer = await asyncio.to_thread(self.parts.make_trainer)
        self._transition_ends(cell)

    async def to_rollout(self, cell: int) -> None:
        if self.publishing is not None:
            await asyncio.shield(self.publishing)  # the Publish of the same action list
        if self.published is None:
            raise RuntimeError(f"cell {cell} returns to rollout before any publication")
        version, weights = self.published
        await return_to_rollout(self.parts.engine, weights, version=version)
        self._transition_ends(cell)

    async def publish(self, version: int) -> None:
        weights = engine_weights(self.trainer)
        self.published = (version, weights)
        await asyncio.to_thread(
            write_policy, self.trainer.model, source_dir=self.parts.model_dir, run_dir=self.run_dir, version=version
        )
        # The one engine is the returning cell's (its BeginTransition(ROLLOUT) is in the same action list); engines
        # that stayed in rollout would take the weights here (gyre.train.publish.publish_to_engines).
        self.apply(self.sched.publish_finished(self.now()))

    # -- the step ----------------------------------------------------------------------------------------
    async def next_unit(self):
        while True:
            if self.stopping:
                raise StopRun()
            unit = self.claims.next_unit()
            if unit is not WAIT:
                return unit
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), CLAIM_WAIT_S)

    async def train(self, step: int) -> None:
        started = self.now()
        final = self.sched.step_in_burst == self.cfg.algo.mu - 1
        burst = self.bursts
        self.claims = LocalClaims(self.sched, self.packer, clock=self.now, on_actions=self.apply)
        first_claim: list[float] = []

        def claim():  # on the trainer's thread: the claim runs on the controller's loop
            unit = asyncio.run_coroutine_threadsafe(self.next_unit(), self.loop).result()
            if not first_claim:
                first_claim.append(self.now())
            return unit

        result = await asyncio.to_thread(
            train_step,
            self.trainer,
            claim=claim,
            cells=lambda: 1,
            prefix_group=lambda k: None,
            is_core=True,
            core_rank=0,
            final=final,
            config=self.cfg.loss,
        )
        self.packer.next_batch()
        record = self._step_record(step, burst, result, started, first_claim[0] if first_claim else started)
        self.records.append(record)
        self.metrics.write(record)
        self.trace.step_end(self.now())
        self.echo(format_progress(record, self.cfg.steps, elapsed_s=self.now()))
        self.last_progress = self.now()
        done = len(self.records) >= self.cfg.steps
        if self.held_out is not None and (done or len(self.records) % self.cfg.tasks.eval_every == 0):
            evaluation = self.held_out.evaluate(self.trainer.model, version=step + 1, wall_time_s=self.now())
            if done:
                await evaluation
            else:  # on a copy of the weights, beside the next step
                self.spawn(evaluation)
        if done:
            await asyncio.to_thread(
                write_policy,
                self.trainer.model,
                source_dir=self.parts.model_dir,
                run_dir=self.run_dir,
                version=step + 1,
            )
            self._finish("completed")
            return
        self.apply(self.sched.step_finished(self.now()))

    def _step_record(self, step: int, burst: int, result, started: float, first_claim: float) -> StepRecord:
        end = self.now()
        groups = list(self.claims.groups)
        rewards = [r for g in groups for r in self.outcomes[g].rewards().values() if r is not None]
        log_ = self.sched.staleness
        picked = [(v, t) for s, v, t in zip(log_.steps, log_.values, log_.tokens, strict=True) if s == step]
        tokens = sum(t for _, t in picked)
        book, self.book = self.book, _StepBook(started_s=end)
        wall = end - book.started_s
        train_s = end - first_claim
        return StepRecord(
            step=step,
            wall_time_s=end,
            burst=burst,
            reward_mean=sum(rewards) / len(rewards) if rewards else None,
            pass_rate=sum(r >= PASS_REWARD for r in rewards) / len(rewards) if rewards else None,
            loss={"loss": result.loss},
            grad_norm=result.update.get("grad_norm"),
            staleness_group_mean=sum(v for v, _ in picked) / len(picked) if picked else None,
            staleness_token_mean=sum(v * t for v, t in picked) / tokens if picked and tokens > 0 else None,
            staleness_max=float(max(v for v, _ in picked)) if picked else None,
            staleness_groups=len(picked),
            staleness_tokens=float(tokens),
            roles=tuple(role.value for role in self.sched.roles),
            waterlevel=float(self.sched.waterlevel),
            rollout_capacity=self.sched.rollout_capacity(),
            transitions=tuple(book.transitions),
            rollout_tokens=book.sampled_tokens,
            train_tokens=result.tokens,
            rollout_tokens_per_s=book.sampled_tokens / wall if wall > 0 else None,
            train_tokens_per_s=result.tokens / train_s if train_s > 0 else None,
        )
