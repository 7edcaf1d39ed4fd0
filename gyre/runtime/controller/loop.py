"""The controller's loop, on rank 0: one asyncio loop that owns the scheduler and carries out its actions over the
job's cells (docs/runtime.md, "The controller"). Read this page first; each action is a call into a part named for
what it does.

The real `gyre.sched.Scheduler` is driven with a monotonic clock through exactly the API the simulator uses. Every
scheduler action is applied here (`apply`) and every outcome is reported back through the scheduler's events;
nothing moves without an action. In the order a step goes through them:

1. `Dispatch`, `Start`, `Cancel` -> `episodes.py`: groups of executions drawn, played by their harness through the
   proxy, their outcomes reported, each closed group judged by the buffers.
2. `BeginTransition(c, TRAINING)` with its `Reroute`s -> `cells.py`: a cell leaves rollout (its executions moved
   with their calls in flight), its ranks take the training role.
3. `BeginStep` -> `steps.py`: the cells claim micro-steps from one queue, satellites join in flight, the core
   updates; the step's record; the demo's held-out evaluation; a checkpoint (`checkpoints.py`).
4. `Publish` -> `cells.py`: the core's weights to the engines still serving and to `<run dir>/policy/`; a held-out
   directory's evaluation on those engines (`held_out_engines.py`).
5. `BeginTransition(c, ROLLOUT)` -> `cells.py`: the satellites return with the published weights.
6. `WakeAt` -> a timer, then `tick` (the supply timer).

The run ends after `steps` optimizer steps, at `request_stop()` (Ctrl-C, SIGTERM) or at the first error of any of
its tasks; `run()` then closes a step in flight (its update is never published), cancels the executions still
running (their harness and evaluator processes are stopped by `run_episode`), after a completed run evaluates a
held-out directory on the engines at the last version (`held_out_engines.evaluate_final`), and returns a
`RunEnd`. A rank whose lifeline closes (`gyre.runtime.job.lifeline`) ends it with `RankLost`. Between step ends,
every `logging.progress_every_s`, the live line (`live_line`: executions, the proxy's calls in prefill and
decoding).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from gyre.config import TrainConfig
from gyre.data import StreamPackingBuffer, TrajectoryBuffer
from gyre.distributed.control import ControlPublisher
from gyre.obs.progress import LiveState, format_live
from gyre.obs.record import StepRecord
from gyre.obs.sinks import MetricsLogger
from gyre.runtime.cell.trainer_thread import TrainerThread
from gyre.runtime.controller import checkpoints
from gyre.runtime.controller.cells import Cells
from gyre.runtime.controller.episodes import Episodes
from gyre.runtime.controller.execution_log import EXECUTIONS_FILE, ExecutionLog
from gyre.runtime.controller.held_out import HeldOutEvaluator
from gyre.runtime.controller.held_out_engines import PinnedEvaluation, evaluate_final
from gyre.runtime.controller.parts import SLOW_STOP_S, ControllerParts, RunEnd, StepBook
from gyre.runtime.controller.steps import Steps
from gyre.runtime.controller.trace import RoleTrace
from gyre.runtime.job.checkpoint import Checkpoint
from gyre.runtime.job.lifeline import RankLost, rank_lost_behind, watch_lifelines
from gyre.sched import (
    POOL,
    BeginStep,
    BeginTransition,
    Cancel,
    Dispatch,
    Publish,
    Reroute,
    Scheduler,
    Start,
    WakeAt,
    spec_from_config,
)
from gyre.sched.checkpoint import resume, resumed_scheduler

log = logging.getLogger(__name__)

__all__ = ["Controller"]


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
        held_out_engines: PinnedEvaluation | None = None,
    ) -> None:
        self.cfg, self.parts = cfg, parts
        self.held_out, self.metrics, self.run_dir, self.echo = held_out, metrics, run_dir, echo
        self.held_out_engines = held_out_engines  # a tasks.held_out_dir's evaluation, on the rollout engines
        self.final_version: int | None = None  # set after the last step: the version the run's end evaluates
        spec = spec_from_config(cfg.cluster, cfg.algo, buffer_verdicts=True)
        self.resumed_from = checkpoint
        self.sched = resumed_scheduler(spec, checkpoint.state["scheduler"]) if checkpoint else Scheduler(spec)
        self.buffer = TrajectoryBuffer()
        self.packer = StreamPackingBuffer(self.buffer, cfg.packing)
        self.trace = RoleTrace(cfg.cluster.num_cells, pool=cfg.cluster.separate_size > 0)
        self.executions = ExecutionLog(run_dir / EXECUTIONS_FILE)
        self.records: list[StepRecord] = []
        self.book = StepBook()
        self.store = parts.job.store()  # the loop thread's client: boards, the control log, acks
        self.control = ControlPublisher(self.store)
        self.trainer_thread = TrainerThread()
        # The parts, each named for what it carries out (module docstring).
        self.episodes = Episodes(self, train_tasks)
        self.cells = Cells(self)
        self.steps = Steps(self)
        self.background: set[asyncio.Task] = set()
        self.stopping = False
        self.bursts = 0  # publications so far: the burst a step belongs to
        self.end: asyncio.Future | None = None
        self.t0 = 0.0
        self.last_progress = 0.0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.clock_offset = 0.0  # a resumed run's clock goes on from its checkpoint's time
        if checkpoint is not None:
            checkpoints.restore(self, checkpoint)

    def now(self) -> float:
        return time.monotonic() - self.t0 + self.clock_offset

    # -- the loop -----------------------------------------------------------------------------------------
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
        reason, error = "error", None
        try:
            reason, error = await self.end
            if reason == "error" and not isinstance(error, RankLost) and self.parts.job.lifelines:
                error = await rank_lost_behind(error, watch)  # a rank's death, seen first as its engine's
        finally:
            progress.cancel()
            watch.cancel()
            proxy_watch.cancel()
            self.stopping = True
            self.steps.abandon()
            if self.held_out_engines is not None and reason != "completed":
                self.held_out_engines.cancel()
            stopping = time.monotonic()
            await self.episodes.cancel_all(self.background)
            if (elapsed := time.monotonic() - stopping) >= SLOW_STOP_S:  # a slow exit after Ctrl-C names its step
                log.info("stopping: the executions still running took %.1fs to stop", elapsed)
            if reason == "completed" and self.final_version is not None:
                reason, error = await self._final_evaluation(self.final_version)
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
        await self.cells.initial_roles()
        if self.held_out_engines is not None and self.resumed_from is None and not self.stopping:
            # the baseline on the engines in rollout, beside the first burst (the first publication waits for it)
            self.held_out_engines.start(0, self.cells.rollout_engines(), wall_time_s=self.now(), spawn=self.spawn)
        if not self.stopping:
            self.apply(resume(self.sched, self.now()) if self.resumed_from else self.sched.start(self.now()))

    async def _final_evaluation(self, version: int) -> tuple[str, BaseException | None]:
        """After a completed run's last step, its executions stopped: the held-out evaluation of its last version on
        the engines (`held_out_engines.evaluate_final`); how the run ends then (stopped if a stop cut it, an error
        if it failed)."""
        begun = time.monotonic()
        try:
            line = await evaluate_final(self, version)
        except Exception as error:
            log.error("the final held-out evaluation failed: %r", error)
            return "error", error
        if (elapsed := time.monotonic() - begun) >= SLOW_STOP_S:
            log.info("the final held-out evaluation took %.1fs", elapsed)
        return ("completed", None) if line is not None else ("stopped", None)

    def apply(self, actions) -> None:
        """Carry out the scheduler's actions, in the order it returned them."""
        if self.stopping:
            return
        for action in actions:
            match action:
                case Dispatch():
                    self.episodes.dispatch(action)
                case Start():
                    self.episodes.start(action)
                case Cancel():
                    self.episodes.cancel(action.execution)
                case BeginTransition():
                    self.cells.begin(action.cell, action.to)
                case Reroute():
                    self.cells.reroute(action)
                case BeginStep():  # the step's shape as the scheduler has it now, not when the task first runs
                    final = self.sched.step_in_burst == self.cfg.algo.mu - 1
                    self.spawn(self.steps.train(action.step, final, self.sched.training_cells()))
                case Publish():
                    self.bursts += 1
                    self.cells.publish(action.version)
                case WakeAt():
                    self.loop.call_later(max(0.0, action.time_s - self.now()), self._tick)
        loads = [self.sched.ledger.load(cell) for cell in range(self.sched.spec.num_cells)]
        if self.trace.pool:
            loads.append(self.sched.ledger.load(POOL))
        self.trace.sample(self.now(), self.sched.waterlevel, self.sched.rollout_capacity(), loads)

    def _tick(self) -> None:
        """A `WakeAt` timer: `tick`, its error ending the run as a task's would."""
        try:
            self.apply(self.sched.tick(self.now()))
        except Exception as error:
            log.error("the run failed: %r", error)
            self.finish("error", error)

    # -- the run's end ------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """End the run soon (Ctrl-C, SIGTERM): the step in flight is not published, the executions are cancelled (a
        held-out evaluation's too)."""
        if self.held_out_engines is not None:
            self.held_out_engines.cancel()
        self.finish("stopped")

    def finish(self, reason: str, error: BaseException | None = None) -> None:
        self.stopping = True
        if self.end is not None and not self.end.done():
            self.end.set_result((reason, error))

    def release_cells(self, reason: str) -> None:
        """The `stop` decision with the run's end (`RunEnd.reason`): every satellite leaves its loop and stops its
        engine (the set-up calls it once the proxy has stopped, so no call of the run is still on one)."""
        self.cells.release(reason)

    def engine_lost(self, event) -> None:
        """The proxy counted a cell's engine lost (`Cells.engine_lost`)."""
        self.cells.engine_lost(event)

    def spawn(self, coroutine) -> asyncio.Task:
        """A task on the loop whose error ends the run (said, not raised, once the run is stopping)."""
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
            self.finish("error", t.exception())

        task.add_done_callback(finished)
        return task

    # -- progress -----------------------------------------------------------------------------------------
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
            executions=self.episodes.live(),
            waiting=calls.waiting,
            decoding=calls.decoding,
            longest_wait_s=calls.longest_wait_s,
            longest_wait_prompt_tokens=calls.longest_wait_prompt_tokens,
        )
        last = self.records[-1] if self.records else None
        return format_live(state, self.cfg.steps, elapsed_s=self.now(), last=last)
