"""One iteration of the RL loop in one process, for real: the template of the runtime's controller (docs/runtime.md,
"The sample path, one process").

Warm-started tiny model -> `NativeEngine` behind its endpoint (`ServerThread`, reached with `RemoteEngine`) ->
`start_proxy` over a scheduler-placement `RoutingTable` -> a `Scheduler` in colocate mode with K = 1 and
`buffer_verdicts=True`, driven by its actions exactly:

- Dispatch: a demo task drawn per group, its `GroupOutcomes`, the group registered in the `TrajectoryBuffer`;
- Start: the execution's key (`SessionRegistry.issue`), its engine (`RoutingTable.assign`), `run_episode` with the
  builtin harness; `on_harness_end` closes the session and reports `harness_ended`; the episode's outcome is
  `execution_closed`; a closed group is admitted (J_max) into the buffer, and the verdict is reported (a refused
  group is dropped from the buffer);
- Cancel: the execution's cancel event (none happen without oversampling; handled all the same);
- BeginTransition to training: the engine leaves rollout (`gyre.runtime.controller.transitions.leave_rollout`), the
  trainer
  is built (`NativeTrainable`), then `transition_finished`;
- BeginStep: `train_step` on a worker thread, its claims lazy on the loop (`tests/local_claims.py`), then
  `step_finished`;
- Publish: the engine returns to rollout with the trainer's weights (`engine_weights(trainer)`) as the new version
  (`return_to_rollout`: resume, update, then accept), `publish_finished`; the transition back to rollout waits for
  it: back to rollout (the next burst's Starts are recorded, not run).

What the contract says, asserted: every model call recorded exactly once (engine requests = the proxy's trees'
calls = the record files' calls); the scheduler's counters close (d = p = f = the step's executions before the
next dispatch); the micro-steps' tokens are exactly the recorded ones with their behavior log-probs; the trainer's
log-probs of the sampled tokens equal the behavior log-probs before the update (same weights, temperature 1, fp32,
1e-4); after Publish the engine reports the new version and holds exactly the trainer's weights. Nothing here is a
fake except the engine's request counter (a subclass that counts, named as such). Measured figures are printed.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from local_claims import WAIT, LocalClaims

from gyre.config import DemoConfig, ExecutionLimits, PackingConfig, TasksConfig, TrainConfig
from gyre.config.algo import AlgoConfig
from gyre.config.cluster import ClusterConfig
from gyre.engine.endpoint import ServerThread
from gyre.engine.native import NativeEngine
from gyre.engine.remote import RemoteEngine
from gyre.harness.builtin.runner import BuiltinRunner
from gyre.harness.episode import ProxyAccess, run_episode
from gyre.harness.sandbox import LocalSandbox
from gyre.models.hf_weights import load_pretrained
from gyre.proxy.routing import RoutingTable
from gyre.proxy.start import start_proxy
from gyre.runtime.controller.transitions import leave_rollout, return_to_rollout
from gyre.runtime.controller.verdicts import judge_group, sampled_tokens, sched_outcome
from gyre.runtime.ids import ExecutionIds, engine_name
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
from gyre.tasks.demo import generate_demo_tasks
from gyre.trainer.native_trainable import NativeTrainable
from gyre.trainer.publish import engine_weights
from gyre.trainer.streaming import train_step
from gyre.traj.outcomes import GroupOutcomes
from gyre.traj.roles import classifier_for
from gyre.traj.store import load_tree

N, B, MU = 4, 2, 1  # groups of 4 executions, steps of 2 groups, one step per burst
pytestmark = pytest.mark.warm_start  # tests/conftest.py: ordered after the modules that do not need it
TIMEOUT_S = 600.0
LOGPROB_TOLERANCE = 1e-4  # fp32, temperature 1 on both sides (docs/engine.md, "Behavior log-probs")


@pytest.fixture(scope="module")
def warm_model() -> Path:
    from gyre.config import WarmStartConfig
    from gyre.tasks.demo.warm_start import read_meta, warm_start_dir

    model_dir = warm_start_dir(config=WarmStartConfig(max_minutes=60))  # the cached default warm start
    assert read_meta(model_dir)["complete"], read_meta(model_dir)
    return model_dir


def loop_config(seed: int = 0) -> TrainConfig:
    """The CPU demo's TrainConfig at the test's shape: colocate, one cell of C_e = N B slots, no supply wait.

    Demo tasks of single-digit operands: the warm start's sampled answers are right some of the time, so a group's
    rewards usually differ and the step moves the weights (with equal rewards every advantage, hence the gradient,
    is zero; the engine's sampling is not seeded, so this is likely, not certain)."""
    return TrainConfig(
        cluster=ClusterConfig(num_cells=1, cell_size=1, cell_capacity=N * B, separate_capacity=0),
        algo=AlgoConfig(mode="colocate", phi=0, mu=MU, group_size=N, batch_groups=B, tau_s=0.0),
        packing=PackingConfig(batch_groups=B, group_size=N, max_tokens_per_microstep=1024),
        tasks=TasksConfig(demo=DemoConfig(max_digits=1)),
        steps=1,
        seed=seed,
    )


class CountingEngine(NativeEngine):
    """The native engine, counting the requests it was asked to generate (the test's only addition)."""

    requests = 0

    async def generate(self, request):
        CountingEngine.requests += 1
        return await super().generate(request)

    async def generate_stream(self, request):
        CountingEngine.requests += 1
        async for chunk in super().generate_stream(request):
            yield chunk


class RecordingTrainable(NativeTrainable):
    """A NativeTrainable that keeps, per micro-step, the log-probs of its first (pre-update) forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_logprobs: dict[int, torch.Tensor] = {}

    def logprobs(self, step):
        logp_U = super().logprobs(step)
        self.first_logprobs.setdefault(id(step), logp_U.detach().clone())
        return logp_U


class OneProcessLoop:
    """The controller of one iteration, on one event loop: applies the scheduler's actions (module docstring)."""

    def __init__(self, cfg: TrainConfig, *, model_dir: Path, tasks, proxy, registry, table, remote, sandbox, records):
        self.cfg = cfg
        self.model_dir = model_dir
        self.tasks = tasks
        self.proxy_access = ProxyAccess(anthropic_base_url=proxy.url, openai_base_url=proxy.url + "/v1", model="gyre")
        self.registry, self.table, self.remote, self.sandbox, self.records = registry, table, remote, sandbox, records
        self.sched = Scheduler(spec_from_config(cfg.cluster, cfg.algo, buffer_verdicts=True))
        self.ids = ExecutionIds(self.sched.spec.executions_per_group)
        from gyre.data import StreamPackingBuffer, TrajectoryBuffer

        self.buffer = TrajectoryBuffer()
        self.packer = StreamPackingBuffer(self.buffer, cfg.packing)
        self.rng = random.Random(cfg.seed)
        self.t0 = time.monotonic()
        self.loop = asyncio.get_running_loop()
        self.outcomes: dict[int, GroupOutcomes] = {}
        self.task_of: dict[int, object] = {}
        self.sessions: dict[str, object] = {}
        self.cancels: dict[int, asyncio.Event] = {}
        self.verdicts: dict[int, bool] = {}
        self.tasks_running: set[asyncio.Task] = set()
        self.errors: list[BaseException] = []
        self.actions: list = []
        self.deferred_starts: list[Start] = []
        self.iteration_done = False
        self.done = asyncio.Event()
        self.changed = asyncio.Event()  # a verdict arrived: a waiting claim looks again
        self.phases: dict[str, float] = {}
        self.counters: dict[str, tuple[int, int, int]] = {}
        self.trainer: RecordingTrainable | None = None
        self.publish_task: asyncio.Task | None = None
        self.claims: LocalClaims | None = None
        self.step_result = None
        self.weights_before_update: dict[str, torch.Tensor] | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    def mark(self, phase: str) -> None:
        self.phases[phase] = self.now()

    def spawn(self, coroutine) -> asyncio.Task:
        task = self.loop.create_task(coroutine)
        self.tasks_running.add(task)

        def finished(t: asyncio.Task) -> None:
            self.tasks_running.discard(t)
            if not t.cancelled() and t.exception() is not None:
                self.errors.append(t.exception())
                self.done.set()  # fail fast: the test reports the error

        task.add_done_callback(finished)
        return task

    # -- the action applier ---------------------------------------------------------------------------------
    def apply(self, actions) -> None:
        for action in actions:
            self.actions.append(action)
            match action:
                case Dispatch():
                    self.dispatch(action)
                case Start():
                    if self.iteration_done:
                        self.deferred_starts.append(action)  # the next burst: not run by this test
                    else:
                        self.start(action)
                case Cancel():
                    self.cancels[action.execution].set()
                case BeginTransition(to=Role.TRAINING):
                    self.spawn(self.to_training(action.cell))
                case BeginTransition(to=Role.ROLLOUT):
                    self.spawn(self.to_rollout(action.cell))
                case BeginStep():
                    self.spawn(self.train(action.step))
                case Publish():
                    self.publish_task = self.spawn(self.publish(action.version))
                case WakeAt():
                    self.loop.call_later(
                        max(0.0, action.time_s - self.now()), lambda: self.apply(self.sched.tick(self.now()))
                    )
                case Reroute():
                    raise AssertionError(f"no reroute with one cell: {action}")

    def dispatch(self, action: Dispatch) -> None:
        for group in range(action.first_group, action.first_group + action.count):
            names = self.ids.names(group)
            self.task_of[group] = self.rng.choice(self.tasks)
            self.outcomes[group] = GroupOutcomes(self.cfg.algo.group_size, names)
            self.buffer.add_group(group, action.version, names, self.cfg.algo.group_size)

    def start(self, action: Start) -> None:
        execution, name = action.execution, self.ids.name(action.execution)
        session = self.registry.issue(name)
        self.sessions[name] = session
        self.table.assign(name, engine_name(action.engine))
        self.cancels[execution] = asyncio.Event()
        self.spawn(self.episode(execution, name, session.key))

    async def episode(self, execution: int, name: str, key: str) -> None:
        group = self.ids.group_of(execution)
        task = self.task_of[group]

        def harness_ended(run) -> None:  # the harness has ended: its key stops working, f moves
            self.registry.close(name)
            self.apply(self.sched.harness_ended(self.now(), execution))

        await run_episode(
            task,
            execution_id=name,
            api_key=key,
            runner=BuiltinRunner.for_task(task, backend=self.cfg.harness.backend, max_turns=4),
            sandbox=self.sandbox,
            proxy=self.proxy_access,
            limits=ExecutionLimits(harness_timeout_s=120, overall_timeout_s=240, grace_period_s=2),
            group=self.outcomes[group],
            cancel_event=self.cancels[execution],
            on_harness_end=harness_ended,
        )
        outcome = sched_outcome(self.outcomes[group].execution(name))
        if outcome is not None:
            tree = self.sessions[name].tree
            self.apply(self.sched.execution_closed(self.now(), execution, outcome, sampled_tokens(tree)))
        if self.sched.group_state(group) is GroupState.JUDGING:
            self.judge(group)

    def judge(self, group: int) -> None:
        trees = {name: self.sessions[name].tree if name in self.sessions else None for name in self.ids.names(group)}
        verdict = judge_group(
            self.buffer,
            group,
            self.outcomes[group],
            trees,
            classify=classifier_for("builtin"),
            j_max=self.cfg.algo.j_max,
            run_seed=self.cfg.seed,
        )
        self.verdicts[group] = verdict.accepted
        if not verdict.accepted:
            self.buffer.drop_group(group)  # its replacement is dispatched by group_rejected
        report = self.sched.group_accepted if verdict.accepted else self.sched.group_rejected
        self.apply(report(self.now(), group))
        self.changed.set()

    # -- transitions, the step, publication -----------------------------------------------------------------
    async def to_training(self, cell: int) -> None:
        self.mark("rollout_done")
        s = self.sched
        self.counters["to_training"] = (s.d, s.p, s.f)
        await leave_rollout(self.remote, drain_s=30.0)
        model = await asyncio.to_thread(load_pretrained, self.model_dir, torch.float32, "cpu")
        trainer_cfg = self.cfg.trainer
        self.trainer = RecordingTrainable(
            model, lr=trainer_cfg.lr, weight_decay=trainer_cfg.weight_decay, max_grad_norm=trainer_cfg.max_grad_norm
        )
        self.mark("to_training_done")
        self.apply(self.sched.transition_finished(self.now(), cell))

    async def next_unit(self):
        while (unit := self.claims.next_unit()) is WAIT:
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 60.0)
        return unit

    async def train(self, step: int) -> None:
        self.mark("step_start")
        final = self.sched.step_in_burst == self.cfg.algo.mu - 1
        self.claims = LocalClaims(self.sched, self.packer, clock=self.now, on_actions=self.apply)
        self.weights_before_update = {n: t.detach().clone() for n, t in self.trainer.model.state_dict().items()}

        def claim():  # on the trainer's thread: the claim runs on the controller's loop
            return asyncio.run_coroutine_threadsafe(self.next_unit(), self.loop).result(timeout=120)

        self.step_result = await asyncio.to_thread(
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
        self.mark("step_done")
        self.apply(self.sched.step_finished(self.now()))

    async def publish(self, version: int) -> None:
        # The one engine is the cell coming back (its BeginTransition(ROLLOUT) is in the same action list); engines
        # that stayed in rollout would take the same weights through publish_to_engines.
        await return_to_rollout(self.remote, engine_weights(self.trainer), version=version)
        self.mark("publish_done")
        self.apply(self.sched.publish_finished(self.now()))

    async def to_rollout(self, cell: int) -> None:
        assert self.publish_task is not None  # the Publish of the same action list brings the engine back
        await self.publish_task
        self.iteration_done = True
        self.mark("to_rollout_done")
        self.apply(self.sched.transition_finished(self.now(), cell))
        self.done.set()


@pytest.mark.slow
def test_one_iteration_of_the_rl_loop_in_one_process(tmp_path, warm_model):
    cfg = loop_config()
    tasks = generate_demo_tasks(16, seed=cfg.seed, out_dir=tmp_path / "tasks", config=cfg.tasks.demo)
    records = tmp_path / "records"
    engine_models: list = []
    CountingEngine.requests = 0
    t_start = time.monotonic()

    def make_engine():
        model = load_pretrained(warm_model, torch.float32, "cpu")
        engine_models.append(model)
        return CountingEngine(model, max_running=cfg.engine.max_running)

    server = ServerThread(make_engine)
    url = server.start()
    engine_ready_s = time.monotonic() - t_start

    async def main():
        remote = await RemoteEngine.connect(url)
        table = RoutingTable(placement="scheduler")
        table.add_engine(engine_name(0), remote)
        proxy, registry = await start_proxy(cfg.proxy, model_dir=warm_model, table=table, records_dir=records)
        loop = None
        try:
            sandbox = LocalSandbox(root=tmp_path / "executions", isolate_user=False)
            loop = OneProcessLoop(
                cfg,
                model_dir=warm_model,
                tasks=tasks,
                proxy=proxy,
                registry=registry,
                table=table,
                remote=remote,
                sandbox=sandbox,
                records=records,
            )
            loop.apply(loop.sched.start(loop.now()))
            await asyncio.wait_for(loop.done.wait(), TIMEOUT_S)
            load = await remote.refresh_load()
            return loop, load
        finally:
            if loop is not None:
                for task in list(loop.tasks_running):
                    task.cancel()
            await proxy.stop()
            registry.close_all()
            await remote.close()

    try:
        loop, load = asyncio.run(main())
    finally:
        server.stop()
    assert not loop.errors, loop.errors
    sched = loop.sched
    executions = N * B * MU

    # The scheduler's counters close over the step's groups: d = p = f when the cell left rollout, every execution
    # closed with an outcome; the groups were accepted and claimed; after publication the next burst is dispatched.
    assert loop.counters["to_training"] == (executions, executions, executions)
    assert sum(sched.outcomes.values()) == executions
    assert loop.verdicts == dict.fromkeys(range(B * MU), True)
    assert sorted(loop.claims.groups) == list(range(B))
    assert sched.trainer_version == 1 and sched.published_version == 1
    assert sched.d == 2 * executions and sched.roles == [Role.ROLLOUT]
    assert len(loop.deferred_starts) == executions  # back to rollout: the next burst starts

    # Every model call recorded exactly once: the engine's requests, the proxy's trees and the record files agree.
    calls = 0
    for name, session in loop.sessions.items():
        recorded = load_tree(records / f"{name}.jsonl")
        assert [c.response.ids for c in recorded.calls] == [c.response.ids for c in session.tree.calls], name
        assert len({c.meta.request_id for c in recorded.calls}) == len(recorded.calls), name
        calls += len(recorded.calls)
    assert calls == CountingEngine.requests and calls >= executions

    # The micro-steps' tokens are exactly the recorded ones, with their behavior log-probs.
    steps = loop.claims.micro_steps
    assert steps and all(step.batch == 0 for step in steps)
    targets = 0
    for step in steps:
        for r, (start, end) in enumerate(zip(step.row_offsets_R1[:-1], step.row_offsets_R1[1:], strict=True)):
            name = step.execution_ids[step.row_execution_R[r]]
            path = load_tree(records / f"{name}.jsonl").path_tokens(int(step.row_leaf_R[r]))
            np.testing.assert_array_equal(step.ids_U[start:end], path.ids)
            row_targets = step.target_U[start:end]
            assert not (row_targets & ~path.target_mask).any()
            np.testing.assert_array_equal(
                step.behavior_logp_U[start:end][row_targets], path.behavior_logprobs[row_targets]
            )
            targets += int(row_targets.sum())
    trees = [load_tree(records / f"{name}.jsonl") for name in loop.sessions]
    if all(len(tree.leaves()) <= cfg.algo.j_max for tree in trees):  # admission then covers every sampled token
        assert targets == sum(tree.stats().target_tokens_stored for tree in trees)

    # The trainer's log-probs of the sampled tokens equal the engine's behavior log-probs (before the update).
    worst = 0.0
    for step in steps:
        trainer_logp = loop.trainer.first_logprobs[id(step)].double().numpy()[step.target_U]
        worst = max(worst, float(np.abs(trainer_logp - step.behavior_logp_U[step.target_U]).max()))
    assert worst <= LOGPROB_TOLERANCE, worst

    # After Publish the engine serves version 1 with exactly the trainer's weights.
    assert load.policy_version == 1 and load.accepting
    trained = loop.trainer.model.state_dict()
    served = engine_models[0].state_dict()
    assert set(served) == set(trained)
    for name, tensor in trained.items():
        assert torch.equal(served[name], tensor), name
    advantages = np.concatenate([step.advantage_E for step in steps])
    moved = any(not torch.equal(loop.weights_before_update[n], t) for n, t in trained.items())
    assert moved == bool(np.any(advantages != 0)), (moved, advantages)

    phases = loop.phases
    rewards = {g: loop.outcomes[g].rewards() for g in range(B)}
    print(
        f"rl loop: engine up {engine_ready_s:.1f}s; rollout {phases['rollout_done']:.1f}s "
        f"({executions} executions, {calls} calls, {sum(sampled_tokens(t) for t in trees)} sampled tokens); "
        f"to training {phases['to_training_done'] - phases['rollout_done']:.1f}s; "
        f"step {phases['step_done'] - phases['step_start']:.1f}s ({len(steps)} micro-steps, "
        f"{loop.step_result.tokens} tokens, {targets} targets, loss {loop.step_result.loss:.4f}, "
        f"{loop.step_result.update}); publish {phases['publish_done'] - phases['step_done']:.2f}s; "
        f"back to rollout at {phases['to_rollout_done']:.1f}s; max |logp diff| {worst:.2e}; rewards {rewards}; "
        f"weights moved {moved}"
    )
