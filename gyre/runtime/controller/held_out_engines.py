"""The held-out evaluation of a `tasks.held_out_dir`, played by the run's rollout engines and pinned to one policy
version (docs/runtime.md, "Tasks and the held-out evaluation").

`PinnedEvaluation.start(v, engines)` plays every held-out task once through the harness (`TaskPlayer.play`: its own
proxy on the controller's event loop, greedy, no records) over a routing table of its own that holds `engines`, the
rollout engines that hold version v, each behind a `PinnedEngine`; one line of `held_out.jsonl` with `"engines":
true` when it ends. Pinned means: every token of the evaluation comes from an engine that holds exactly v. What
makes it so:

1. it starts with the engines that hold v and no others: at publication v, between the stream and
   `publish_finished`, the engines the publication just loaded (those that stayed in rollout, the separate pool's,
   the returning ones: `Publication._publish_to_all`); before the first dispatch, the engines in rollout with the
   starting weights (version 0). No engine joins its table later;
2. the next publication waits for it to end before any engine opens an update (`settled`, the publication's phase
   `held_out_wait`), so no engine of its table changes version under it; the wait is bounded by the held-out
   tasks' own budgets (`limits`, each task's timeouts);
3. an engine that leaves rollout (`Cells.begin(c, TRAINING)`, `leaving`) leaves its table at once and the
   evaluation's calls in flight on it are aborted: the table (least-loaded placement) goes on with each at once on
   another engine of the table, from the tokens produced so far (`gyre.proxy.routing.generate_routed`), so the
   harness sees one answer. The last engine of its table does not leave it: its cell's move to training waits,
   once its executions were rerouted, until the evaluation ended (`hold`: the engine accepts again meanwhile, and
   only the evaluation's calls reach it; the scheduler's ledger has no execution on it), so the evaluation always
   has an engine at v. With a separate rollout pool that never happens (the pool never leaves);
4. `PinnedEngine` checks every chunk's `policy_version` against v: a chunk of another version is never passed on
   (the engine is counted off the table and the call goes on elsewhere, an error in the log): a guard, since 1-3
   leave it no way to happen.

The run's last version is never published: `evaluate_final` (the controller, after the run's last step, the
training executions stopped) streams the core's last weights to the engines in rollout (cell 0's engine, its
memory resumed, when none is: every cell trained the last step) as that version, by the publication's weight
stream without telling the scheduler (the run ends), then evaluates it on them.

Which publication is evaluated (`due`): publication v (v optimizer steps) when a multiple of `tasks.eval_every`
lies in (u, v], u the version published before it; so with one step per burst every `eval_every`-th version, and
with `algo.mu` steps per burst the first publication at or after each multiple.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import TYPE_CHECKING

from gyre.engine.protocol import EngineLoad, EngineUnavailableError, GenerateRequest, TokenChunk
from gyre.proxy.routing import RoutingTable
from gyre.runtime.controller.held_out import HeldOutLog
from gyre.runtime.held_out_tasks import TaskPlayer
from gyre.runtime.ids import engine_name

if TYPE_CHECKING:
    from gyre.runtime.controller.loop import Controller

log = logging.getLogger(__name__)

__all__ = ["PinnedEngine", "PinnedEvaluation", "evaluate_final", "evaluation_due"]


def evaluation_due(version: int, published: int, every: int) -> bool:
    """Whether publication `version` is evaluated: a multiple of `every` lies in (`published`, `version`]
    (`published`: the version published before it). `every` 0: never."""
    return every > 0 and version // every > published // every


class PinnedEngine:
    """An engine of the evaluation's table: passes on only tokens of `version` (module docstring, 4); counts the
    calls it served."""

    def __init__(self, name: str, engine, version: int) -> None:
        self.name, self.engine, self.version = name, engine, version
        self.calls = 0  # calls it served a token or a finish of
        self.off = False  # it produced a token of another version: no call is sent to it again

    def load(self) -> EngineLoad:
        load = self.engine.load()
        return dataclasses.replace(load, accepting=False) if self.off else load

    async def refresh_load(self) -> EngineLoad:
        """The engine's load, read from it where it can be (the table's probe of an engine it could not reach)."""
        refresh = getattr(self.engine, "refresh_load", None)
        if refresh is not None:
            await refresh()
        return self.load()

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        if self.off:
            raise EngineUnavailableError(f"engine {self.name} left the evaluation of version {self.version}")
        served = False
        async with contextlib.aclosing(self.engine.generate_stream(request)) as stream:  # closed early: aborted
            async for chunk in stream:
                if chunk.policy_version != self.version:
                    self.off = True
                    log.error(
                        "held-out evaluation of version %d: engine %s produced a token of version %d; its call goes "
                        "on elsewhere and it serves the evaluation no more",
                        self.version,
                        self.name,
                        chunk.policy_version,
                    )
                    raise EngineUnavailableError(f"engine {self.name} holds version {chunk.policy_version}")
                if not served:
                    served = True
                    self.calls += 1
                yield chunk


class PinnedEvaluation:
    """The held-out evaluation in flight (at most one) on the rollout engines, and the curve (module docstring)."""

    def __init__(self, player: TaskPlayer, template, *, out: HeldOutLog, every: int) -> None:
        self.player, self.template, self.out, self.every = player, template, out, every
        self.version: int | None = None  # the version of the evaluation in flight (or the last one)
        self.table: RoutingTable | None = None  # its table, while it runs
        self.task: asyncio.Task | None = None
        self.kept: str | None = None  # the engine kept in rollout for it (the last of its table)
        self.calls: dict[int, dict[str, int]] = {}  # version -> engine -> calls it served
        self._engines: dict[str, PinnedEngine] = {}
        self._cancel: asyncio.Event | None = None
        self.stopped = False  # the run stops: no evaluation starts any more

    @property
    def results(self) -> list[dict]:
        return self.out.results

    def due(self, version: int, published: int) -> bool:
        """Whether publication `version` is evaluated (`evaluation_due`)."""
        return evaluation_due(version, published, self.every)

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(
        self,
        version: int,
        engines: Mapping[str, object],
        *,
        wall_time_s: float,
        spawn: Callable[[Coroutine], asyncio.Task] = asyncio.ensure_future,
    ) -> asyncio.Task | None:
        """Evaluate `version` on `engines` (routing name -> engine, each holding `version`); the task that writes the
        line (`spawn` makes it: the controller's, whose error ends the run). None, with a warning, without engines."""
        if self.running:
            raise RuntimeError(f"held-out evaluation of version {self.version} still running: {version} cannot start")
        if self.stopped:
            return None
        if not engines:
            log.warning("held-out evaluation of version %d skipped: no engine holds it", version)
            return None
        self.version, self.kept, self._cancel = version, None, asyncio.Event()
        self._engines = {name: PinnedEngine(name, engine, version) for name, engine in engines.items()}
        self.table = RoutingTable(self._engines, placement="least_loaded")
        log.info("held-out evaluation of version %d on %s", version, ", ".join(sorted(engines)))
        self.task = spawn(self._run(version, wall_time_s, self._cancel))
        return self.task

    async def _run(self, version: int, wall_time_s: float, cancel: asyncio.Event) -> dict | None:
        started = time.monotonic()
        try:
            report = await self.player.play(self.table, self.template, version=version, cancel=cancel)
        finally:
            self.calls[version] = {name: engine.calls for name, engine in self._engines.items()}
            self.table, self.kept, self._engines = None, None, {}
        if cancel.is_set():
            log.info("held-out evaluation of version %d cancelled: no line written", version)
            return None
        seconds = time.monotonic() - started
        return self.out.append(report, version=version, wall_time_s=wall_time_s, seconds=seconds, engines=True)

    def leaving(self, name: str) -> None:
        """Engine `name` leaves rollout now (it stopped accepting): it leaves the evaluation's table and the
        evaluation's calls on it go on elsewhere, unless it is the table's last engine: then it is kept (`hold`)."""
        table = self.table
        if not self.running or table is None or name not in table.engines:
            return
        if len(table.engines) == 1:
            self.kept = name
            return
        table.drop_engine(name)
        calls = table.calls_in_flight(engine=name)
        for call in calls:
            self._engines[name].abort(call.engine_request_id)
        log.info("held-out evaluation of version %d: %s left it (%d calls moved)", self.version, name, len(calls))

    async def hold(self, name: str, engine) -> float:
        """A cell's move to training, its executions rerouted: if its engine `name` is the one kept for the evaluation,
        it accepts (only the evaluation's calls come: the scheduler's ledger has none of the run's executions on it)
        until the evaluation ended, then stops accepting. The seconds it waited."""
        if self.kept != name or not self.running:
            return 0.0
        started = time.monotonic()
        log.info("held-out evaluation of version %d: engine %s kept in rollout until it ends", self.version, name)
        engine.resume_accepting()
        try:
            await asyncio.wait({self.task})  # its error is the controller's (the task's); the move goes on
        finally:
            engine.stop_accepting()
        return time.monotonic() - started

    async def settled(self) -> None:
        """Once no evaluation is in flight (the next publication waits here; an evaluation's error is its task's)."""
        if self.running:
            await asyncio.wait({self.task})

    def cancel(self) -> None:
        """The run stops: the evaluation in flight stops (its executions are cancelled, no line is written) and no
        other starts."""
        self.stopped = True
        if self.running and self._cancel is not None:
            self._cancel.set()


async def evaluate_final(ctl: Controller, version: int) -> dict | None:
    """After the run's last step, the training executions stopped: the core's last weights to the engines in rollout
    (cell 0's brought back when none is) as `version`, then their evaluation, awaited (module docstring). Its line,
    or None if it was cancelled."""
    evaluation = ctl.held_out_engines
    await evaluation.settled()
    if evaluation.stopped:
        return None
    engines = ctl.cells.rollout_engines()
    if not engines:
        # Every cell trained the last step (colocate): cell 0's engine serves again. Its other ranks, if any, are
        # not told: the run ends after this, and they only stream the weights below.
        engine = ctl.parts.engines[0]
        await engine.resume_memory()
        engines = {engine_name(0): engine}
    begun = ctl.now()
    await ctl.cells.publication.stream_final(list(engines.values()), version)
    for engine in engines.values():
        engine.resume_accepting()
    log.info("final version %d streamed to %s in %.2fs", version, ", ".join(sorted(engines)), ctl.now() - begun)
    task = evaluation.start(version, engines, wall_time_s=ctl.now())
    return None if task is None else await task
