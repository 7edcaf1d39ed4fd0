"""One training run, from a checked `TrainConfig` to the run directory's outputs (docs/runtime.md, "The program").

`run_training(cfg, run_dir)` resolves the starting policy (a checkpoint directory, or the tiny model warm-started
on the demo family, cached), loads the task sets, starts the cell's engine behind its endpoint, the proxy and the
sessions, builds the harness and the sandbox, and runs the `Controller` until `steps` steps are done, Ctrl-C or
SIGTERM (`request_stop`), or an error. Whatever ended it, it then writes `summary.json` (the simulator's keys,
`gyre.obs.summary`) and `role_timeline.png`, closes the metrics sinks (`metrics.jsonl`, W&B), the proxy and the
engine, and returns a `RunResult`.

Errors a user can fix before anything runs raise `ProgramError` (one line naming the field): a world size this
stage does not run, a trainer backend it does not drive, a missing model directory or task directory, a harness or
sandbox missing here. The app (`gyre.runtime.app`) prints that line and exits 2.

This stage runs one process with one cell (K = 1: `cluster.num_cells=1`); the multi-process job (K cells on K
processes with the control plane and satellites) is the next stage of the runtime (docs/runtime.md, "State").
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.config import ConfigError, TrainConfig
from gyre.config.train import check_context_limit
from gyre.runtime.controller import Controller, ControllerParts, RunEnd
from gyre.runtime.held_out import HeldOutEvaluator
from gyre.runtime.task_sets import TaskSetError, load_task_sets

log = logging.getLogger(__name__)

__all__ = ["ProgramError", "RunResult", "resolve_model_dir", "run_training"]

RECORDS_DIR = "records"
EXECUTIONS_DIR = "executions"
SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "role_timeline.png"


class ProgramError(ValueError):
    """The run cannot start as configured (one line naming the field and what to do)."""


@dataclass
class RunResult:
    end: RunEnd
    summary: dict[str, Any]
    held_out: list[dict]
    run_dir: Path


def check_stage(cfg: TrainConfig, world_size: int) -> None:
    """What this stage of the runtime runs: one process with one cell, the native trainer."""
    if cfg.cluster.num_cells != 1 or cfg.cluster.separate_size != 0 or world_size != 1:
        raise ProgramError(
            f"cluster.num_cells={cfg.cluster.num_cells} (world size {world_size}): this runtime runs one cell in one "
            "process so far (cluster=one_cell, or cluster.num_cells=1 cluster.separate_capacity=0); the job of K cells "
            "on K processes is being built (docs/runtime.md, 'State')"
        )
    if cfg.trainer.backend != "native":
        raise ProgramError(
            f"trainer.backend={cfg.trainer.backend}: the one-process runtime trains with the native trainer "
            "(trainer.backend=native); Megatron cells come with the multi-process job (docs/runtime.md, 'State')"
        )


def resolve_model_dir(cfg: TrainConfig, echo: Callable[[str], None] = print) -> Path:
    """The starting checkpoint: `model.model_dir`, or the tiny model (warm-started, or its random init), cached."""
    from gyre.models.hf_weights import read_config

    if cfg.model.model_dir:
        model_dir = Path(cfg.model.model_dir)
        if not (model_dir / "config.json").is_file():
            raise ProgramError(
                f"model.model_dir={cfg.model.model_dir!r}: no config.json there (expected an HF-layout checkpoint "
                "directory: config.json, safetensors, tokenizer files with a chat template)"
            )
    elif cfg.model.init == "warm_start":
        from gyre.tasks.demo.warm_start import read_meta, warm_start_dir

        echo("warm start of the tiny model (cached after the first run; a few minutes of CPU the first time) ...")
        model_dir = warm_start_dir(config=cfg.model.warm_start, seed=cfg.model.warm_start_seed)
        meta = read_meta(model_dir) or {}
        echo(f"warm start: {model_dir} (steps {meta.get('steps_done')}, final loss {meta.get('final_loss')})")
    else:
        from gyre.models.tiny import tiny_model_dir

        model_dir = tiny_model_dir(spec=cfg.model.tiny)
    try:
        check_context_limit(cfg, read_config(model_dir).max_position_embeddings)
    except ConfigError as error:
        raise ProgramError(str(error)) from None
    return model_dir


def run_training(cfg: TrainConfig, run_dir: Path, *, world_size: int = 1, echo: Callable[[str], None] = print):
    """One run (module docstring); returns its `RunResult`. `ProgramError` before anything runs."""
    check_stage(cfg, world_size)
    run_dir = Path(run_dir)
    model_dir = resolve_model_dir(cfg, echo)
    try:
        task_sets = load_task_sets(cfg.tasks, run_dir, seed=cfg.seed)
    except TaskSetError as error:
        raise ProgramError(str(error)) from None
    echo(f"tasks: {len(task_sets.train)} training tasks, {len(task_sets.held_out)} held-out problems")
    return asyncio.run(_run(cfg, run_dir, model_dir, task_sets, echo))


async def _run(cfg: TrainConfig, run_dir: Path, model_dir: Path, task_sets, echo) -> RunResult:
    import torch

    from gyre.engine.endpoint import ServerThread
    from gyre.engine.native import NativeEngine
    from gyre.engine.remote import RemoteEngine
    from gyre.models.hf_weights import load_pretrained
    from gyre.obs.sinks import build_metrics_logger
    from gyre.proxy.render import ChatTemplate
    from gyre.proxy.routing import RoutingTable
    from gyre.runtime.harness_setup import HarnessSetupError, check_harness, make_runner, make_sandbox
    from gyre.runtime.ids import engine_name
    from gyre.serve.stack import start_proxy
    from gyre.train.native_trainable import NativeTrainable

    template = ChatTemplate.from_pretrained(model_dir)
    (run_dir / RECORDS_DIR).mkdir(parents=True, exist_ok=True)
    sandbox = make_sandbox(
        cfg.harness,
        cfg.limits,
        root=run_dir / EXECUTIONS_DIR,
        demo_tasks=cfg.tasks.uses_demo,
        protected=(run_dir / RECORDS_DIR,),
    )
    try:
        check_harness(make_runner(cfg.harness, task_sets.train[0]), sandbox)
    except HarnessSetupError as error:
        raise ProgramError(str(error)) from None

    def make_trainer():
        torch.manual_seed(cfg.seed)
        model = load_pretrained(model_dir, torch.float32, cfg.trainer.device)
        t = cfg.trainer
        return NativeTrainable(model, lr=t.lr, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm)

    engine_model = await asyncio.to_thread(
        load_pretrained, model_dir, getattr(torch, cfg.engine.dtype), cfg.engine.device
    )
    server = ServerThread(lambda: NativeEngine(engine_model, max_running=cfg.engine.max_running, policy_version=0))
    url = await asyncio.to_thread(server.start)
    remote = proxy = registry = metrics = controller = None
    try:
        remote = await RemoteEngine.connect(url)
        table = RoutingTable(placement="scheduler")
        table.add_engine(engine_name(0), remote)
        proxy, registry = await start_proxy(
            cfg.proxy, model_dir=model_dir, table=table, records_dir=run_dir / RECORDS_DIR, template=template
        )
        metrics = build_metrics_logger(cfg.logging, run_dir, run_config=_plain(cfg))
        parts = ControllerParts(
            engine=remote,
            proxy=proxy,
            registry=registry,
            table=table,
            sandbox=sandbox,
            make_runner=lambda task: make_runner(cfg.harness, task),
            make_trainer=make_trainer,
            model_dir=model_dir,
        )
        held_out = None
        if task_sets.held_out:
            held_out = HeldOutEvaluator(task_sets.held_out, template, out_path=run_dir / "held_out.jsonl", echo=echo)
        controller = Controller(
            cfg, parts, train_tasks=task_sets.train, held_out=held_out, metrics=metrics, run_dir=run_dir, echo=echo
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, _stop_once(controller, echo))
        end = await controller.run()
        summary = _write_outputs(cfg, controller, run_dir, end, echo)
        return RunResult(end=end, summary=summary, held_out=held_out.results if held_out else [], run_dir=run_dir)
    finally:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if metrics is not None:
            metrics.close()
        if proxy is not None:
            await proxy.stop()
            log.info("proxy: calls %s", json.dumps(proxy_counts(proxy.stats()["total"])))
        if registry is not None:
            registry.close_all()
        if remote is not None:
            await remote.close()
        await asyncio.to_thread(server.stop)


def proxy_counts(total: dict[str, Any]) -> dict[str, int]:
    """The proxy's run totals, flat: requests, answered, refused, failed, hung_up, recorded, rerouted, kv_migrated
    (docs/proxy.md, "Counters"); a run's harnesses saw an API error exactly when refused or failed is nonzero."""
    flat = {name: total[name] for name in ("requests", "answered", "hung_up", "recorded", "rerouted", "kv_migrated")}
    flat["refused"] = sum(total["refused"].values())
    flat["failed"] = sum(total["failed"].values())
    return flat


def _stop_once(controller: Controller, echo) -> Callable[[], None]:
    def stop() -> None:
        echo("stopping: the step in flight is abandoned, executions are cancelled, outputs are written ...")
        controller.request_stop()

    return stop


def _plain(cfg: TrainConfig) -> dict[str, Any]:
    from dataclasses import asdict

    return json.loads(json.dumps(asdict(cfg), default=str))


def _write_outputs(cfg: TrainConfig, controller: Controller, run_dir: Path, end: RunEnd, echo) -> dict[str, Any]:
    from gyre.obs.summary import build_summary, write_summary
    from gyre.sched.staleness import warmup_steps

    sched, spec = controller.sched, controller.sched.spec
    summary = build_summary(
        controller.records,
        experiment="",
        mode=spec.mode,
        phi=cfg.algo.phi,
        mu=cfg.algo.mu,
        target_staleness=None if spec.continuous_dispatch else cfg.algo.target_staleness,
        warmup_steps=warmup_steps(spec.mu, spec.extra_groups, spec.batch_groups),
        counters={"dispatched": sched.d, "started": sched.p, "finished": sched.f},
        outcomes=dict(sched.outcomes),
    )
    write_summary(run_dir / SUMMARY_FILE, summary)
    if cfg.logging.timeline:
        title = (
            f"gyre.train: {spec.mode}, phi={cfg.algo.phi:g}, mu={cfg.algo.mu}, {len(controller.records)} steps in "
            f"{end.wall_time_s / 60:.1f} min ({cfg.cluster.num_cells} cell x {cfg.cluster.cell_size})"
        )
        try:
            controller.trace.write_png(run_dir / TIMELINE_FILE, end_s=end.wall_time_s, title=title)
        except (OSError, ValueError) as error:
            log.error("role_timeline.png not written: %s", error)
    return summary
