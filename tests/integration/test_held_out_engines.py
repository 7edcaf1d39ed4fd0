"""The held-out evaluation of a `tasks.held_out_dir` on the rollout engines, pinned to one policy version
(`gyre.runtime.controller.held_out_engines`; docs/runtime.md, "Tasks and the held-out evaluation"), carried by the
controller's real parts: `Cells` (a cell's move to training) and `Publication` (the weight stream from a core's
`DecoderLM`). The engines are native engines of the tiny model in process; the evaluation plays demo tasks with
the builtin harness (real processes) through its own proxy on 127.0.0.1, scored by their evaluators in the local
sandbox. The controller around the two parts is this file's `Controller`: what they read of it, no more.

- Two engines hold version 1; an evaluation of version 1 runs on both. Cell 0 moves to training while evaluation
  calls are in flight on its engine: they go on on cell 1's engine (none starts on cell 0's after), its move ends
  (drained, released) and the evaluation scores every task. Publication 2, asked meanwhile, opens no update before
  the evaluation ended (its `held_out_wait` phase): every token of the evaluation is version 1's. The line:
  version 1, `"engines": true`. Publication 2 then starts the evaluation of version 2 on the one engine it loaded;
  a stop (`cancel`) ends it without a line.
- One engine: its cell's move to training waits until the evaluation ended (the engine kept for it, `held_out`
  phase of the transition), and the evaluation scores every task on it.
- `evaluation_due`: which publications are evaluated.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from gyre.config import DemoConfig, ExecutionLimits, TrainConfig
from gyre.config.cluster import ClusterConfig
from gyre.config.harness import HarnessConfig
from gyre.engine.native import NativeEngine
from gyre.models.hf_weights import load_pretrained
from gyre.models.tiny import tiny_model_dir
from gyre.proxy.render import ChatTemplate
from gyre.runtime.cell.trainer_thread import TrainerThread
from gyre.runtime.controller.cells import Cells
from gyre.runtime.controller.held_out import HeldOutLog
from gyre.runtime.controller.held_out_engines import PinnedEvaluation, evaluation_due
from gyre.runtime.controller.parts import StepBook
from gyre.runtime.held_out_tasks import TaskPlayer
from gyre.sched import Role
from gyre.tasks.demo import generate_demo_tasks

PACE_S = 0.02  # between two streamed chunks: an evaluation call stays in flight long enough to move its engine
TASKS = 4
TIMEOUT_S = 300.0


class PacedEngine(NativeEngine):
    """The native engine, its stream paced (`PACE_S`), recording the start of each call (with whether it accepted
    calls then), the time and version of each chunk with tokens, how each call finished, and when each update
    session began."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.starts: list[tuple[float, bool]] = []
        self.tokens: list[tuple[float, int]] = []
        self.finishes: list[str] = []
        self.updates: list[float] = []

    async def generate_stream(self, request):
        self.starts.append((time.monotonic(), self._accepting))
        async for chunk in super().generate_stream(request):
            if chunk.token_ids:
                self.tokens.append((time.monotonic(), chunk.policy_version))
            if chunk.finish_reason is not None:
                self.finishes.append(chunk.finish_reason)
            yield chunk
            await asyncio.sleep(PACE_S)

    async def begin_update(self, *, version: int) -> None:
        self.updates.append(time.monotonic())
        await super().begin_update(version=version)


class Controller:
    """What `Cells` and `Publication` read of the controller (gyre.runtime.controller.loop.Controller): its clock,
    config, parts, the scheduler's roles and answers (recorded; the roles moved as the scheduler would), its task
    spawner (an error fails the test), the trace and step book they write."""

    def __init__(self, cfg: TrainConfig, engines: dict, trainer, evaluation: PinnedEvaluation) -> None:
        # no policy directory is written after a publication (policy_every 0, as an async run of mu 1 may)
        self.cfg = SimpleNamespace(engine=cfg.engine, publication=replace(cfg.publication, policy_every=0))
        self.t0 = time.monotonic()
        self.parts = SimpleNamespace(
            engines=engines, job=SimpleNamespace(layout=SimpleNamespace(cell_size=1)), model_config=trainer.config
        )
        self.sched = SimpleNamespace(
            roles=[Role.ROLLOUT] * len(engines),
            published_version=1,
            publish_finished=self._publish_finished,
            transition_finished=self._transition_finished,
        )
        self.held_out_engines = evaluation
        self.trainer_thread = TrainerThread()
        self.book = StepBook()
        self.steps = SimpleNamespace(admit=lambda cell: None, pump=None, has_member=lambda cell: False)
        self.publications: list[dict] = []
        self.trace = SimpleNamespace(
            role=lambda now, cell, state: None,
            publication=lambda start, duration, version, phases: self.publications.append(phases),
        )
        self.errors: list[BaseException] = []
        self.cells = Cells(self)
        self.cells.trainer = trainer  # the core's trainer exists: its move to training builds nothing

    def now(self) -> float:
        return time.monotonic() - self.t0

    def apply(self, actions) -> None:
        assert list(actions) == []

    def spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or self.errors.append(t.exception()))
        return task

    def _publish_finished(self, now: float) -> list:
        self.sched.published_version = self.cells.publication.version
        return []

    def _transition_finished(self, now: float, cell: int) -> list:
        role = self.sched.roles[cell]
        self.sched.roles[cell] = Role.TRAINING if role is Role.TO_TRAINING else Role.ROLLOUT
        return []

    def to_training(self, cell: int) -> None:
        """The scheduler's `BeginTransition(cell, TRAINING)`, carried out by the real `Cells.begin`."""
        self.sched.roles[cell] = Role.TO_TRAINING
        self.cells.begin(cell, Role.TRAINING)


def config() -> TrainConfig:
    return TrainConfig(
        cluster=ClusterConfig(num_cells=2, cell_size=1, cell_capacity=TASKS, separate_capacity=0),
        harness=HarnessConfig(backend="anthropic-http", max_turns=2, isolate_user=False),
        limits=ExecutionLimits(harness_timeout_s=120.0, overall_timeout_s=180.0),
    )


@pytest.fixture(scope="module")
def tiny():
    return load_pretrained(tiny_model_dir(), torch.float32, "cpu")


def set_up(tmp_path, tiny, cells: int):
    cfg = config()
    cfg = replace(cfg, proxy=replace(cfg.proxy, sampling=replace(cfg.proxy.sampling, max_new_tokens=24)))
    tasks = generate_demo_tasks(TASKS, 3, tmp_path / "held", config=DemoConfig(max_digits=1))
    template = ChatTemplate.from_pretrained(tiny_model_dir())
    player = TaskPlayer(tasks=tuple(tasks), cfg=cfg, root=tmp_path / "held_out_executions", model_dir=tiny_model_dir())
    lines: list[str] = []
    out = HeldOutLog(tmp_path / "held_out.jsonl", echo=lines.append)
    evaluation = PinnedEvaluation(player, template, out=out, every=1)
    engines = {c: PacedEngine(copy.deepcopy(tiny), max_running=TASKS, policy_version=1) for c in range(cells)}
    return Controller(cfg, engines, copy.deepcopy(tiny), evaluation), evaluation, lines


async def until(condition, what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_an_engine_leaves_mid_evaluation_and_the_next_publication_waits_for_it(tmp_path, tiny):
    ctl, evaluation, lines = set_up(tmp_path, tiny, cells=2)
    leaving, staying = ctl.parts.engines[0], ctl.parts.engines[1]

    async def scenario():
        task = evaluation.start(1, ctl.cells.rollout_engines(), wall_time_s=0.0, spawn=ctl.spawn)
        ended: list[float] = []
        task.add_done_callback(lambda t: ended.append(time.monotonic()))
        await until(lambda: leaving.load().running > 0 and staying.load().running > 0, "calls on both engines")
        left = time.monotonic()
        ctl.to_training(0)  # its engine stops accepting; the evaluation's calls on it go on elsewhere
        ctl.cells.publish(2)  # the scheduler's next Publish, while the evaluation runs
        await asyncio.wait_for(asyncio.shield(task), TIMEOUT_S)
        await asyncio.wait_for(ctl.cells.publication.in_flight, TIMEOUT_S)
        await until(lambda: ctl.sched.roles[0] is Role.TRAINING, "cell 0's move to training")
        # Publication 2 started the evaluation of version 2 on the engine it loaded, and only there; a stop ends it.
        after = evaluation.task
        assert after is not task and evaluation.version == 2 and sorted(evaluation.table.engines) == ["cell-1"]
        evaluation.cancel()
        assert await asyncio.wait_for(after, TIMEOUT_S) is None
        return left, ended[0], task.result()

    left, ended, line = asyncio.run(scenario())
    ctl.trainer_thread.close()
    assert ctl.errors == []
    # The evaluation: every task scored, on both engines, its line and console line.
    assert line["version"] == 1 and line["engines"] is True and line["episodes"] == TASKS and line["failed"] == 0
    assert json.loads((tmp_path / "held_out.jsonl").read_text()) == line  # the cancelled evaluation wrote none
    assert lines == [lines[0]] and lines[0].startswith("held-out: policy version 1 on the rollout engines: pass")
    served = evaluation.calls[1]
    assert served["cell-0"] >= 1 and served["cell-1"] >= 1, served
    # Cell 0 left: its evaluation calls in flight were cut there (and went on on cell 1's: every task scored), no
    # call started on its engine while it accepted after that, and the move ended (drained, released).
    assert "abort" in leaving.finishes and "abort" not in staying.finishes
    assert [t for t, accepting in leaving.starts if accepting and t > left] == []
    assert leaving.load().memory_released and ctl.book.transitions[0].cell == 0
    assert "held_out" not in ctl.book.transitions[0].phases  # another engine was left: nothing kept
    # Pinned: every token of the evaluation is version 1's; publication 2 opened its update after the evaluation.
    assert {v for e in (leaving, staying) for t, v in e.tokens if t <= ended} == {1}
    assert leaving.updates == [] and len(staying.updates) == 1 and staying.updates[0] > ended
    assert staying.policy_version == 2 and leaving.policy_version == 1
    (phases,) = ctl.publications
    assert phases["held_out_wait"] > 0 and phases["returning"] >= 0, phases
    assert ctl.sched.published_version == 2


def test_the_last_engine_of_an_evaluation_is_kept_in_rollout_until_it_ends(tmp_path, tiny):
    ctl, evaluation, _ = set_up(tmp_path, tiny, cells=1)
    engine = ctl.parts.engines[0]

    async def scenario():
        task = evaluation.start(1, ctl.cells.rollout_engines(), wall_time_s=0.0, spawn=ctl.spawn)
        ended: list[float] = []
        task.add_done_callback(lambda t: ended.append(time.monotonic()))
        await until(lambda: engine.load().running > 0, "a call on the engine")
        ctl.to_training(0)
        await asyncio.wait_for(asyncio.shield(task), TIMEOUT_S)
        await until(lambda: ctl.sched.roles[0] is Role.TRAINING, "cell 0's move to training")
        return ended[0], task.result()

    ended, line = asyncio.run(scenario())
    ctl.trainer_thread.close()
    assert ctl.errors == []
    assert line["version"] == 1 and line["episodes"] == TASKS and line["failed"] == 0
    assert evaluation.calls[1]["cell-0"] >= TASKS
    (transition,) = ctl.book.transitions
    assert transition.phases["held_out"] > 0, transition.phases
    assert transition.start_s + transition.duration_s >= ended - ctl.t0  # it ended after the evaluation
    assert {v for _, v in engine.tokens} == {1} and engine.load().memory_released


@pytest.mark.parametrize(
    ("version", "published", "every", "due"),
    [
        (1, 0, 1, True),
        (2, 1, 2, True),
        (3, 2, 2, False),
        (4, 2, 3, True),  # mu = 2: versions 2, 4, 6 published; 3 lies in (2, 4]
        (6, 4, 3, True),
        (8, 6, 3, False),
        (9, 6, 3, True),
        (1, 0, 0, False),  # eval_every 0: never
    ],
)
def test_which_publications_are_evaluated(version, published, every, due):
    assert evaluation_due(version, published, every) is due
