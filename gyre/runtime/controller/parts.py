"""What the controller's loop and its parts share (docs/runtime.md, "The controller"): what the rank-0 set-up hands
the controller (`ControllerParts`), how a run ends (`RunEnd`, `StopRun`), and what happened since the last step's
record (`StepBook`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.models.decoder_config import DecoderConfig
from gyre.obs.record import TransitionRecord

__all__ = ["SLOW_STOP_S", "ControllerParts", "RunEnd", "RunResult", "StepBook", "StopRun"]

SLOW_STOP_S = 1.0  # a step of the stop that takes this long is logged with its time (train.log)


class StopRun(Exception):
    """A wait ended because the run is stopping (not an error of the run)."""


def wait_for_keys(client, keys: list[str], *, timeout_s: float, stopping: Callable[[], bool], what: str) -> None:
    """Until every key of `keys` is in the job's store (`client`, a store client of the calling thread's own):
    `StopRun` once `stopping()`, `TimeoutError` after `timeout_s`; `what` names the wait in both."""
    import time

    deadline = time.monotonic() + timeout_s
    while not client.check(keys):
        if stopping():
            raise StopRun(f"the run stopped while {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not done in {timeout_s:g}s")
        time.sleep(0.01)


@dataclass
class ControllerParts:
    """What the controller drives, built and closed by the rank-0 set-up (`gyre.runtime.controller.setup`)."""

    job: object  # gyre.runtime.job.spmd.Job
    engines: dict[int, object]  # cell (or POOL, the separate rollout pool) -> its Engine (a RemoteEngine in front of
    # its endpoint)
    proxy: object  # gyre.runtime.controller.proxy_front.LocalFront or ShardedFront: the proxy as the controller drives
    hosts: object | None  # gyre.runtime.controller.harness_hosts.HarnessHosts: the other nodes' harness hosts; None
    sandbox: object  # gyre.harness.sandbox.Sandbox
    make_runner: Callable  # task -> HarnessRunner
    make_trainer: Callable  # () -> Trainable with a `.model`; called once, on the trainer thread
    core_step: Callable  # (trainer, step, final, version) -> StepResult: train_claimed_step of the core, its thread;
    # its `close()` runs on that thread after the run's last step
    model_dir: Path  # the starting checkpoint (its tokenizer and chat template go into the policy directory)
    model_config: DecoderConfig  # the starting checkpoint's config: the HF layout the core's weights are gathered into
    records_dir: Path | None = None  # the proxy's record files: the trees of a resumed run's finished executions
    save_optimizer: Callable | None = None  # (trainer, trainer_dir) -> rank 0's optimizer file written there; its
    # trainer thread (gyre.runtime.cell.trainers.save_optimizer); None: checkpoints keep no optimizer state
    engine_dir: Path | None = None  # the weights the engines started with (a resumed run's last publication)
    agent_trajectory: Callable | None = None  # execution -> its ATIF file for a Harbor verifier, or None (blocking;
    # gyre.runtime.controller.agent_trajectory)


@dataclass
class RunEnd:
    """How `Controller.run` ended: `completed` after `steps` steps, `stopped` at `request_stop`, else `error`."""

    reason: str  # "completed" | "stopped" | "error"
    error: BaseException | None = None
    wall_time_s: float = 0.0


@dataclass
class RunResult:
    """Rank 0's result of a run: how it ended, its summary, its held-out evaluations, where its outputs are."""

    end: RunEnd
    summary: dict[str, Any]
    held_out: list[dict]
    run_dir: Path


@dataclass
class StepBook:
    """What happened since the last step's record (the episodes and the cells write it, the step's record reads it)."""

    transitions: list[TransitionRecord] = field(default_factory=list)
    reroutes: list[int] = field(default_factory=list)  # scheduler execution ids, one per move
    calls_rerouted: int = 0
    kv_migrations: int = 0
    calls_reprefilled: int = 0  # rerouted calls whose KV did not move (no export: SGLang), re-prefilled
    sampled_tokens: int = 0
    started_s: float = 0.0
