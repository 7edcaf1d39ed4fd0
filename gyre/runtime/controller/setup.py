"""Rank 0's set-up and close (docs/runtime.md, "The program"): everything the controller drives, built in the order
it is needed, then the `Controller` until it ends, then the run's outputs and everything closed, each step of the
close on its own.

In order, from the run plan (`gyre.runtime.job.plan`): the task sets, the harness's sandbox, a resumed run's directory,
its own cell's engine behind its endpoint, every cell's engine and the separate rollout pool's
(`gyre.runtime.cell.pool`) reached with a `RemoteEngine`, the proxy (`start_proxy` over a
`RoutingTable(placement="scheduler")`, or `proxy.shards` processes: `gyre.runtime.controller.proxy_front`), the other
nodes' harness hosts, the metrics sinks, the held-out evaluator, the core's trainer and step (`CoreStep`, built on the
trainer thread at the core's first move to training); then `Controller.run` (`gyre.runtime.controller.loop`) and the
outputs (`gyre.runtime.controller.outputs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import json
import logging
import secrets
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gyre.config import TrainConfig
from gyre.obs.timeline import preload_plotting
from gyre.runtime.controller.agent_trajectory import atif_writer
from gyre.runtime.controller.held_out import HELD_OUT_FILE, HeldOutEvaluator, HeldOutLog
from gyre.runtime.controller.loop import Controller
from gyre.runtime.controller.outputs import write_outputs
from gyre.runtime.controller.parts import SLOW_STOP_S, ControllerParts, RunResult
from gyre.runtime.job.checkpoint import StartingPoint
from gyre.runtime.job.plan import RunPlan, run_sandbox

log = logging.getLogger(__name__)

__all__ = ["CoreStep", "proxy_counts", "run_controller"]

HOST_START_TIMEOUT_S = 300.0  # a node's harness host says its address within this (its harness checked first)


class CoreStep:
    """The core's `train_claimed_step`, with the trainer thread's own store client and weight transport (made at
    its first step, on that thread); `close()` there too, after the last step."""

    def __init__(self, cfg: TrainConfig, job) -> None:
        self.cfg, self.job = cfg, job
        self.store = self.transport = None

    def __call__(self, trainer, step: int, final: bool, version: int):
        from gyre.runtime.cell.worker import weights_transport
        from gyre.trainer.streaming import train_claimed_step

        if self.transport is None:
            self.store = self.job.store()
            self.transport = weights_transport(self.cfg, self.job, self.store)
        return train_claimed_step(
            trainer,
            store=self.store,
            step=step,
            groups=self.job.groups,
            transport=self.transport,
            version=version,
            training=True,
            final=final,
            config=self.cfg.loss,
        )

    def close(self) -> None:
        if self.transport is None:
            return
        try:
            self.transport.close()
        except Exception as error:  # the run has ended; its outputs do not depend on this
            log.warning("closing the core's weight transport failed: %r", error)


async def run_controller(plan: RunPlan, job, echo: Callable[[str], None], *, hosts: dict[int, int]) -> RunResult:
    """Rank 0's part of the job (module docstring): its result once the controller's loop ended and all is closed."""
    from gyre.config.trainer import device_kind
    from gyre.engine.endpoint import ServerThread
    from gyre.engine.remote import RemoteEngine
    from gyre.obs.sinks import build_metrics_logger
    from gyre.proxy.render import ChatTemplate
    from gyre.proxy.routing import RoutingTable
    from gyre.runtime.cell.engines import engine_factory, join_weight_group, start_timeout_s, uses_weight_groups
    from gyre.runtime.cell.trainers import save_optimizer
    from gyre.runtime.ids import POOL_ENGINE, engine_name
    from gyre.runtime.job.harness_setup import make_runner
    from gyre.runtime.job.resume import prepare_run_dir
    from gyre.runtime.job.run_shape import trainer_layout
    from gyre.runtime.job.spmd import engine_key

    cfg, run_dir, start = plan.cfg, plan.run_dir, plan.start
    if cfg.logging.timeline:  # now, before anything is served: the run's end (Ctrl-C too) writes the PNG sooner
        preload_plotting()
    model_dir, task_sets, checkpoint = plan.model_dir, plan.task_sets, plan.checkpoint
    held_out_size = task_sets.held_out.size if task_sets.held_out else 0
    echo(f"tasks: {len(task_sets.train)} training tasks, {held_out_size} held-out problems")
    template = ChatTemplate.from_pretrained(model_dir)
    sandbox = run_sandbox(plan)  # checked by the plan; it prepares itself (uid leases) at its first execution
    kept = None
    if checkpoint is not None:
        kept = prepare_run_dir(run_dir, checkpoint, records_dir=plan.records_dir, executions_dir=plan.executions_dir)
        await asyncio.to_thread(_policy_of_the_checkpoint, run_dir, start, model_dir)

    factory = await asyncio.to_thread(
        engine_factory, cfg, start.engine_dir, start.engine_version, cell_size=cfg.cluster.cell_size
    )
    # Rank 0's own engine listens on the loopback: only this process's proxy reaches it.
    server = ServerThread(factory, secret=job.secret or None)
    url = await asyncio.to_thread(server.start, start_timeout_s(cfg))
    store = job.store()
    store.set(engine_key(0), url)
    engines: dict[int, RemoteEngine] = {}
    addresses: dict[str, str] = {}  # routing name -> engine endpoint (for the proxy shards' own clients)
    front = harness_hosts = metrics = controller = end = None
    try:
        table = RoutingTable(placement="scheduler")
        # The cells' engines, then the separate rollout pool's (engine POOL: served by the pool's first rank).
        pool = [POOL_ENGINE] if cfg.cluster.separate_size > 0 else []
        for engine in [*range(cfg.cluster.num_cells), *pool]:
            # An engine starts within start_timeout_s (SGLang: minutes), beyond the store's own timeout.
            address = (await asyncio.to_thread(_wait_get, job, engine_key(engine), start_timeout_s(cfg) + 60)).decode()
            engines[engine] = await RemoteEngine.connect(address, secret=job.secret or None)
            addresses[engine_name(engine)] = address
            if uses_weight_groups(cfg):  # publications broadcast by this rank to the engine's workers
                engines[engine] = await join_weight_group(
                    engines[engine],
                    routing_name=engine_name(engine),
                    host=job.host,
                    tp_size=cfg.cluster.separate_size if engine == POOL_ENGINE else cfg.cluster.cell_size,
                    device_kind=device_kind(cfg.engine.device),
                )
            table.add_engine(engine_name(engine), engines[engine])
        front = await _proxy_front(plan, table, template, addresses, job)
        harness_hosts = await _harness_hosts(job, hosts) if hosts else None
        metrics = build_metrics_logger(cfg.logging, run_dir, run_config=_plain(cfg))
        parts = ControllerParts(
            job=job,
            engines=engines,
            proxy=front,
            hosts=harness_hosts,
            sandbox=sandbox,
            make_runner=functools.partial(make_runner, cfg.harness, provisioning=plan.provisioning),
            make_trainer=lambda: _core_trainer(cfg, start),
            core_step=CoreStep(cfg, job),
            model_dir=model_dir,
            model_config=plan.model,
            records_dir=plan.records_dir,
            save_optimizer=functools.partial(
                save_optimizer, coordinate=0, cell_size=cfg.cluster.cell_size, layout=trainer_layout(cfg)
            ),
            engine_dir=start.engine_dir,
            agent_trajectory=atif_writer(plan, template) if plan.records_dir is not None else None,
        )
        held_out, held_out_engines = _held_out(plan, template, echo, kept=kept["held_out"] if kept else [])
        controller = Controller(
            cfg,
            parts,
            train_tasks=task_sets.train,
            held_out=held_out,
            metrics=metrics,
            run_dir=run_dir,
            echo=echo,
            checkpoint=checkpoint,
            held_out_engines=held_out_engines,
        )
        front.on_engine_lost = controller.engine_lost
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, _stop_once(controller, echo))
        end = await controller.run()
        writing = time.monotonic()
        summary = write_outputs(cfg, controller, run_dir, end)
        if (elapsed := time.monotonic() - writing) >= SLOW_STOP_S:
            log.info("writing the run's outputs took %.1fs", elapsed)
        evaluator = held_out or held_out_engines
        return RunResult(end=end, summary=summary, held_out=evaluator.results if evaluator else [], run_dir=run_dir)
    finally:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        # Each step on its own: a failing close must not keep the satellites from their stop, nor hide the error.
        async with _closing_step("the metrics sinks"):
            if metrics is not None:
                metrics.close()
        async with _closing_step("the proxy"):
            if front is not None:
                await front.stop()  # and its sessions
                log.info("proxy: calls %s", json.dumps(proxy_counts((await front.stats())["total"])))
        async with _closing_step("the satellites' stop"):
            if controller is not None:
                controller.release_cells(end.reason if end is not None else "error")
        for remote in engines.values():
            async with _closing_step("an engine client"):
                await remote.close()
        async with _closing_step("the harness hosts' client"):
            if harness_hosts is not None:
                await harness_hosts.close()
        async with _closing_step("the executions' sandbox"):
            await asyncio.to_thread(sandbox.shutdown)  # a container sandbox: what is left of the run's
        await asyncio.to_thread(server.stop)


def _held_out(plan: RunPlan, template, echo, *, kept: list[dict]):
    """The held-out evaluator: a recipe's own set with its player, in process (`HeldOutEvaluator`); a set of tasks
    without one (a `tasks.held_out_dir`), on the rollout engines (`PinnedEvaluation`); (None, None) without a set."""
    from gyre.runtime.controller.held_out_engines import PinnedEvaluation
    from gyre.runtime.held_out_tasks import HELD_OUT_EXECUTIONS_DIR, TaskPlayer

    held_out = plan.task_sets.held_out
    if held_out is None:
        return None, None
    out = HeldOutLog(plan.run_dir / HELD_OUT_FILE, echo=echo, results=kept)
    if held_out.play is not None:
        return HeldOutEvaluator(held_out, template, out=out), None
    root = plan.run_dir / HELD_OUT_EXECUTIONS_DIR
    player = TaskPlayer(tasks=held_out.tasks, cfg=plan.cfg, root=root, model_dir=plan.model_dir)
    return None, PinnedEvaluation(player, template, out=out, every=plan.cfg.tasks.eval_every)


async def _harness_hosts(job, hosts: dict[int, int]):
    """The client of every other node's harness host (node -> its first rank), once each has said its address."""
    from gyre.runtime.controller.harness_hosts import HarnessHosts
    from gyre.runtime.job.spmd import harness_host_key

    urls = {}
    for node, rank in sorted(hosts.items()):
        urls[node] = (await asyncio.to_thread(_wait_get, job, harness_host_key(node), HOST_START_TIMEOUT_S)).decode()
        log.info("node %d: harness host at %s (rank %d)", node, urls[node], rank)
    return HarnessHosts(urls, secret=job.secret, controller_host=job.host, ranks=hosts)


async def _proxy_front(plan: RunPlan, table, template, addresses, job):
    """The proxy on this loop over `table` (`proxy.shards=0`), or its shards, each with its own clients of the
    engines at `addresses` (docs/proxy.md, "Shards")."""
    from gyre.runtime.controller.proxy_front import LocalFront, ShardedFront

    cfg, run_dir = plan.cfg, plan.run_dir
    model = plan.proxy.model_names[0]
    if cfg.proxy.shards == 0:
        from gyre.proxy.start import start_proxy

        proxy, registry = await start_proxy(
            plan.proxy, model_dir=plan.model_dir, table=table, records_dir=plan.records_dir, template=template
        )
        return LocalFront(proxy, registry, table, model=model)
    from gyre.proxy.shard import ShardSpec
    from gyre.proxy.shards import ProxyShards

    admin_key = "gyre-admin-" + secrets.token_urlsafe(24)
    specs = [
        ShardSpec(
            index=index,
            proxy=plan.proxy,
            model_dir=str(plan.model_dir),
            records_dir=str(plan.records_dir),
            engines=addresses,
            engine_secret=job.secret or None,
            admin_key=admin_key,
            log_file=str(run_dir / "train.log"),
        )
        for index in range(cfg.proxy.shards)
    ]
    return ShardedFront(await ProxyShards.start(specs), plan.records_dir, model=model)


def _core_trainer(cfg: TrainConfig, start: StartingPoint):
    """Rank 0's trainer (the core's first rank): on the starting checkpoint, or a resumed run's with its optimizer
    state (the core's other ranks restore theirs in `gyre.runtime.cell.worker`)."""
    from gyre.runtime.cell.trainers import build_trainable, restore_optimizer
    from gyre.runtime.job.run_shape import trainer_layout

    trainer = build_trainable(cfg, start.trainer_dir)
    if start.checkpoint is not None:
        layout = trainer_layout(cfg)
        restore_optimizer(trainer, start.trainer_dir, coordinate=0, cell_size=cfg.cluster.cell_size, layout=layout)
    return trainer


def _policy_of_the_checkpoint(run_dir: Path, start: StartingPoint, model_dir: Path) -> None:
    """`<run dir>/policy/` as the resumed run's engines serve it (a publication after the checkpoint is undone)."""
    from gyre.models.hf_weights import load_pretrained
    from gyre.runtime.job.policy_dir import POLICY_DIR, POLICY_META, write_policy

    meta = Path(run_dir) / POLICY_DIR / POLICY_META
    try:
        version = json.loads(meta.read_text())["version"]
    except (OSError, ValueError, KeyError):
        version = None
    if start.engine_version > 0 and version != start.engine_version:
        model = load_pretrained(start.engine_dir)
        write_policy(model, source_dir=model_dir, run_dir=run_dir, version=start.engine_version)


@contextlib.asynccontextmanager
async def _closing_step(what: str):
    """One step of the program's cleanup: its error is logged, and the next steps still run; one that takes a
    second or more says how long (a slow exit after Ctrl-C names its step in train.log)."""
    started = time.monotonic()
    try:
        yield
    except Exception as error:
        log.error("closing %s failed: %r", what, error)
    if (elapsed := time.monotonic() - started) >= SLOW_STOP_S:
        log.info("closing %s took %.1fs", what, elapsed)


def _wait_get(job, key: str, timeout_s: float | None = None) -> bytes:
    """`key` of the runtime store once it is set (within `timeout_s`, else the store's own timeout)."""
    client = job.store()
    if timeout_s is None:
        client.wait([key])
    else:
        client.wait([key], datetime.timedelta(seconds=timeout_s))
    return client.get(key)


def proxy_counts(total: dict[str, Any]) -> dict[str, int]:
    """The proxy's run totals, flat: requests, admitted, answered, refused, failed, hung_up, recorded, rerouted,
    kv_migrated (docs/proxy.md, "Counters"); the harnesses saw an API error exactly when refused or failed is > 0."""
    names = ("requests", "admitted", "answered", "hung_up", "recorded", "rerouted", "kv_migrated")
    flat = {name: total[name] for name in names}
    flat["refused"] = sum(total["refused"].values())
    flat["failed"] = sum(total["failed"].values())
    return flat


def _stop_once(controller: Controller, echo) -> Callable[[], None]:
    said: list[bool] = []

    def stop() -> None:  # a terminal's Ctrl-C reaches rank 0 twice: itself, then passed on by the launcher
        if not said:
            said.append(True)
            log.info("stop requested (Ctrl-C or SIGTERM)")  # train.log: the time each slow step after it is taken from
            echo("stopping: the step in flight is not published, executions are cancelled, outputs are written ...")
        controller.request_stop()

    return stop


def _plain(cfg: TrainConfig) -> dict[str, Any]:
    from dataclasses import asdict

    return json.loads(json.dumps(asdict(cfg), default=str))
