"""One training run, from a checked `TrainConfig` to the run directory's outputs (docs/runtime.md, "The program").

`run_training(cfg, run_dir, recipe)` starts the SPMD job of `recipe` (`gyre.runtime.recipe.Recipe`: the starting
model when `model.model_dir` is empty, the task sets, the recipe's checks; docs/recipes.md): under torchrun or srun
this process is one of its ranks; run plainly, a job of one rank runs here and a job of more starts its own workers
(`launch_workers`, after the checks and the recipe's preparation ran here once, so errors are one line before any
worker starts). Every rank then runs
`run_rank`: the process groups and the runtime store (`gyre.runtime.job`), the starting checkpoint's path from
rank 0, then rank 0's controller, a satellite's cell loop (`gyre.runtime.cell_worker`) or a separate rollout pool
rank's (`gyre.runtime.pool_worker`). With `harness.hosts=nodes` every rank says its node first
(`gyre.runtime.nodes`), and the first rank of each node but rank 0's also hosts that node's harnesses
(`gyre.runtime.harness_host`, given the training tasks by rank 0).

Rank 0 (`_controller`): the task sets, the harness runner and sandbox (checked), its own cell's engine behind its
endpoint, every cell's engine and the separate rollout pool's (`gyre.runtime.pool_worker`) reached with a
`RemoteEngine`, the proxy (`start_proxy` over a `RoutingTable(placement="scheduler")`, or `proxy.shards` processes:
`gyre.runtime.proxy_front`), the other nodes' harness hosts, the metrics sinks, the held-out evaluator, then the
`Controller` until it ends; then `summary.json` (the simulator's keys, `gyre.obs.summary`) and `role_timeline.png`,
and everything closed.

Errors a user can fix before anything runs raise `ProgramError` (one line naming the field): a layout this runtime
does not drive yet (context parallelism), an engine backend that cannot run here (SGLang not installed, or asked
to serve on a CPU), a model a Megatron cell cannot shard, a resumed checkpoint of another trainer layout, a missing
model directory or task directory, a held-out task that is also a training task, what the recipe refuses, a harness
or sandbox missing here.
The app (`gyre.train.app`) prints that line and exits 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import faulthandler
import functools
import json
import logging
import os
import secrets
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gyre.config import ConfigError, TrainConfig
from gyre.config.proxy import ProxyConfig
from gyre.config.train import check_context_limit, layout_fields
from gyre.obs.timeline import preload_plotting
from gyre.runtime.checkpoint import Checkpoint, StartingPoint
from gyre.runtime.controller import SLOW_STOP_S, Controller, ControllerParts, RunEnd
from gyre.runtime.held_out import HELD_OUT_FILE, HeldOutEvaluator
from gyre.runtime.launch import job_env, launch_workers
from gyre.runtime.lifeline import RankLost
from gyre.runtime.nodes import gather_nodes
from gyre.runtime.recipe import Recipe, RecipeError, TaskSets
from gyre.runtime.task_sets import TaskSetError

log = logging.getLogger(__name__)

__all__ = ["ProgramError", "RunResult", "resolve_model_dir", "run_training"]

RECORDS_DIR = "records"
EXECUTIONS_DIR = "executions"
SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "role_timeline.png"
TRACE_FILE = "timeline.json"  # what role_timeline.png is drawn from, and every cell's load (gyre.runtime.trace)
DONE_WAIT_S = 30.0  # rank 0 waits this long for the satellites to finish before the runtime store goes
STOPPED_EXIT = 130  # a worker of a run stopped by Ctrl-C or SIGTERM
STOP_WAIT_S = 5.0  # after a stop, the satellites get this long (they may finish the unit they hold first)
HOST_START_TIMEOUT_S = 300.0  # a node's harness host says its address within this (its harness checked first)


class ProgramError(ValueError):
    """The run cannot start as configured (one line naming the field and what to do)."""


@dataclass
class RunResult:
    end: RunEnd
    summary: dict[str, Any]
    held_out: list[dict]
    run_dir: Path


@dataclass
class Prepared:
    model_dir: Path
    task_sets: TaskSets
    checkpoint: Checkpoint | None = None  # the checkpoint the run resumes from (`resume`)


def check_supported(cfg: TrainConfig, world_size: int) -> None:
    """What this runtime runs: the job's size fits the cells and the separate rollout pool's ranks; native cells of
    one rank or Megatron cells of TP x PP ranks."""
    try:
        layout_fields(cfg, world_size)
    except ConfigError as error:
        raise ProgramError(str(error)) from None
    from gyre.runtime.engines import backend_problem

    if problem := backend_problem(cfg):
        raise ProgramError(problem)
    if cfg.trainer.context_parallel_size != 1:
        import importlib.util

        import torch

        has_te = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
        why = (
            "this runtime does not split rows over ranks yet"
            if has_te
            else "context parallelism needs TransformerEngine's attention on CUDA, absent here"
        )
        raise ProgramError(
            f"trainer.context_parallel_size={cfg.trainer.context_parallel_size}: {why} (expected 1; long rows train "
            "with trainer.recompute=full and chunked log-probs instead: docs/training.md, 'Long rows')"
        )


def proxy_config(cfg: TrainConfig) -> ProxyConfig:
    """The proxy's config: `cfg.proxy`, recording each call's routed experts when the trainer replays them."""
    if cfg.trainer.routing_replay and not cfg.proxy.record_routed_experts:
        return replace(cfg.proxy, record_routed_experts=True)
    return cfg.proxy


def check_model_layout(cfg: TrainConfig, config) -> None:
    """A Megatron trainer can shard the model over the cell's ranks (heads, KV heads, vocabulary divisible by TP;
    layers by PP)."""
    if cfg.trainer.routing_replay and not config.num_experts:
        raise ProgramError(
            f"trainer.routing_replay=true: the model ({config.model_type}) has no experts to route; leave it false"
        )
    if cfg.trainer.backend != "megatron":
        return
    from gyre.trainer.model import validate_layout

    t = cfg.trainer
    tp, pp, ep = t.tensor_parallel_size, t.pipeline_parallel_size, t.expert_parallel_size
    try:
        validate_layout(config, tp, pp, ep)
    except ValueError as error:
        fields = f"trainer.tensor_parallel_size={tp}" + (f" trainer.pipeline_parallel_size={pp}" if pp > 1 else "")
        fields += f" trainer.expert_parallel_size={ep}" if ep > 1 else ""
        raise ProgramError(f"{fields}: {error}") from None


def resolve_model_dir(cfg: TrainConfig, recipe: Recipe, echo: Callable[[str], None] = print) -> Path:
    """The starting checkpoint: `model.model_dir`, or the recipe's starting model; checked against the config's
    context limit, the trainer's layout and the recipe's own rules."""
    from gyre.models.decoder_config import read_config

    if cfg.model.model_dir:
        model_dir = Path(cfg.model.model_dir)
        if not (model_dir / "config.json").is_file():
            raise ProgramError(
                f"model.model_dir={cfg.model.model_dir!r}: no config.json there (expected an HF-layout checkpoint "
                "directory: config.json, safetensors, tokenizer files with a chat template)"
            )
    else:
        try:
            model_dir = Path(recipe.starting_model(cfg, echo))
        except RecipeError as error:
            raise ProgramError(str(error)) from None
    config = read_config(model_dir)
    try:
        limit = check_context_limit(cfg, config.max_position_embeddings)
    except ConfigError as error:
        raise ProgramError(str(error)) from None
    check_model_layout(cfg, config)
    try:
        recipe.check(cfg, model_dir, limit)
    except RecipeError as error:
        raise ProgramError(str(error)) from None
    return model_dir


def check_proxy_port(host: str, port: int) -> None:
    """A fixed `proxy.port` is free on `proxy.host` now (0 picks a free one at start and is not checked)."""
    if port == 0:
        return
    probe = socket.socket()
    try:
        probe.bind((host, port))
    except OSError as error:
        raise ProgramError(
            f"proxy.port={port}: cannot listen on {host}:{port} ({error.strerror}); choose another port, or 0 for a "
            "free one"
        ) from None
    finally:
        probe.close()


def check_run_dir(run_dir: Path) -> None:
    """The run directory can be written (a file is created, synced and removed there)."""
    probe = Path(run_dir) / f".write-probe-{os.getpid()}"
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with open(probe, "w") as handle:
            handle.write("gyre\n")
            handle.flush()
            os.fsync(handle.fileno())
        probe.unlink()
    except OSError as error:
        raise ProgramError(
            f"hydra.run.dir={str(run_dir)!r}: cannot write there ({error.strerror or error}); free space or choose a "
            "writable directory"
        ) from None


def resolve_checkpoint(cfg: TrainConfig, run_dir: Path, echo: Callable[[str], None]) -> Checkpoint | None:
    """The checkpoint `resume` names (docs/runtime.md, "Checkpoints and resume"); ProgramError for one that cannot
    be resumed here."""
    from gyre.runtime.resume import ResumeError, checkpoint_to_resume

    try:
        checkpoint = checkpoint_to_resume(cfg.resume, run_dir)
    except ResumeError as error:
        raise ProgramError(str(error)) from None
    if checkpoint is None:
        if cfg.resume == "auto":
            echo("resume=auto: no complete checkpoint in the run directory, starting afresh")
        return None
    from gyre.runtime.controller import run_shape
    from gyre.runtime.trainers import trainer_layout

    saved = checkpoint.state.get("shape", {})
    changed = [f"{k}={v!r} (the checkpoint's: {saved[k]!r})" for k, v in run_shape(cfg).items() if saved.get(k, v) != v]
    if changed:
        raise ProgramError(
            f"resume: {', '.join(changed)}: a run resumes with the schedule of its checkpoint ({checkpoint.path})"
        )
    layout = trainer_layout(cfg)
    saved = checkpoint.state.get("trainer_layout", layout)  # a checkpoint of before it was kept: its files say
    changed = [f"{k}={v!r} (the checkpoint's: {saved[k]!r})" for k, v in layout.items() if saved.get(k, v) != v]
    if changed:
        raise ProgramError(
            f"resume: {', '.join(changed)}: the checkpoint's optimizer state is laid out for its trainer; resume "
            f"with its layout, or start a new run from its weights alone with model.model_dir={checkpoint.trainer_dir} "
            "(AdamW afresh)"
        )
    if checkpoint.step >= cfg.steps:
        raise ProgramError(
            f"steps={cfg.steps}: the checkpoint {checkpoint.path} has {checkpoint.step} steps done already; raise "
            "steps to train on from it"
        )
    echo(f"resuming from {checkpoint.path} (step {checkpoint.step} of {cfg.steps})")
    return checkpoint


def prepare(cfg: TrainConfig, recipe: Recipe, run_dir: Path, echo: Callable[[str], None]) -> Prepared:
    """The checks that need no process group, the checkpoint to resume, the recipe's task sets, the harness
    preflight, then the starting checkpoint (ProgramError)."""
    from gyre.runtime.harness_setup import HarnessSetupError, check_harness, harness_provisioning, make_runner

    check_run_dir(run_dir)
    check_proxy_port(cfg.proxy.host, cfg.proxy.port)
    checkpoint = resolve_checkpoint(cfg, run_dir, echo)
    try:
        task_sets = recipe.task_sets(cfg, run_dir)
    except (RecipeError, TaskSetError) as error:
        raise ProgramError(str(error)) from None
    if not task_sets.train:
        raise ProgramError(f"recipe.name={recipe.name!r}: the recipe gave no training task")
    held_out_dir_tasks = []
    if cfg.tasks.held_out_dir and cfg.tasks.eval_every > 0 and task_sets.held_out is None:
        from gyre.runtime.held_out_tasks import load_held_out_tasks

        try:
            held_out_dir_tasks = load_held_out_tasks(cfg, task_sets.train)
        except TaskSetError as error:
            raise ProgramError(str(error)) from None
    # The harness before the starting model: a harness that cannot run is one line now, not after a warm start.
    try:
        sandbox = _sandbox(cfg, run_dir, trusted_tasks=task_sets.trusted)
        held_out = task_sets.held_out.tasks if task_sets.held_out is not None else held_out_dir_tasks
        provisioning = harness_provisioning(cfg.harness)
        runner = make_runner(cfg.harness, task_sets.train[0], provisioning)
        check_harness(runner, sandbox, [*task_sets.train, *held_out])
    except HarnessSetupError as error:
        raise ProgramError(str(error)) from None
    model_dir = resolve_model_dir(cfg, recipe, echo)
    if held_out_dir_tasks:
        from gyre.runtime.held_out_tasks import held_out_tasks

        task_sets = replace(task_sets, held_out=held_out_tasks(cfg, run_dir, held_out_dir_tasks, model_dir))
    return Prepared(model_dir=model_dir, task_sets=task_sets, checkpoint=checkpoint)


def _sandbox(cfg: TrainConfig, run_dir: Path, *, trusted_tasks: bool):
    from gyre.runtime.harness_setup import make_sandbox

    (run_dir / RECORDS_DIR).mkdir(parents=True, exist_ok=True)
    return make_sandbox(
        cfg.harness,
        cfg.limits,
        root=run_dir / EXECUTIONS_DIR,
        trusted_tasks=trusted_tasks,
        protected=(run_dir / RECORDS_DIR,),
    )


def run_training(cfg: TrainConfig, run_dir: Path, recipe: Recipe, *, echo: Callable[[str], None] = print) -> RunResult:
    """One run of `recipe` (module docstring); returns rank 0's `RunResult`. `ProgramError` before anything runs."""
    from gyre.runtime.job import job_secret

    run_dir = Path(run_dir)
    launched = job_env(os.environ)
    world_size = launched.world_size if launched else cfg.world_size
    check_supported(cfg, world_size)
    try:
        job_secret(os.environ)  # a $GYRE_JOB_SECRET that cannot be sent is one line here, not a failed worker
    except ValueError as error:
        raise ProgramError(str(error)) from None
    if launched is None and world_size > 1:
        prepare(cfg, recipe, run_dir, echo)  # one line for a mistake, and the warm start once, before any worker
        cells = (
            f"{cfg.cluster.num_cells} cells of {cfg.cluster.cell_size} rank{'s' if cfg.cluster.cell_size > 1 else ''}"
        )
        if cfg.cluster.separate_size:
            cells += f", a separate rollout pool of {cfg.cluster.separate_size}"
        echo(f"starting {world_size} worker processes ({cells}) ...")
        results = launch_workers("gyre.runtime.program:run_worker", [cfg, str(run_dir), recipe], world_size)
        return results[0]
    return run_rank(cfg, run_dir, recipe, echo=echo)


def run_worker(cfg: TrainConfig, run_dir: str, recipe: Recipe) -> RunResult | dict:
    """A worker of a plainly launched job: its logging, its signals, its rank's part (`run_rank`)."""
    from gyre.obs.logging import setup_logging

    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank=rank, level=logging.INFO, log_file=Path(run_dir) / "train.log")
    _share_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: every thread's stack on stderr
    try:
        # The launcher ran the checks and printed the warm start's lines already: here they go to train.log only.
        result = run_rank(cfg, Path(run_dir), recipe, echo=_printer if rank == 0 else log.info, prepare_echo=log.info)
    except BaseException as error:  # the traceback into train.log; the launcher names the error
        log.error("rank %d failed:\n%s", rank, "".join(traceback.format_exception(error)))
        raise
    reason = result.end.reason if isinstance(result, RunResult) else result["stop_reason"]
    if reason == "stopped":
        # Ctrl-C or SIGTERM reached the launcher, which waits for the workers to exit and reads no result: exit
        # now (a returned value would wait for a reader until the launcher's shutdown timeout kills us), without
        # running destructors (the core's trainer thread may still be in the abandoned step's collective). The
        # outputs are written and fsynced; the log is flushed here.
        logging.shutdown()
        os._exit(STOPPED_EXIT)
    if isinstance(result, RunResult) and result.end.error is not None:
        # The run failed (its outputs are written): rank 0 fails as a worker, so the launcher names its error
        # (satellites cut off in a collective may fail after it; the first failure is what the user reads).
        error = result.end.error
        if isinstance(error, RankLost):  # its message says all there is (which rank, how it was seen to end)
            log.error("the run failed: %s", error)
        else:
            log.error("the run failed:\n%s", "".join(traceback.format_exception(error)))
        raise RuntimeError(f"{type(error).__name__}: {error}") from None
    return result


def _share_cpu_threads(local_processes: int) -> None:
    """Each of this machine's workers gets its share of the CPU for torch's intra-op threads (torchrun sets
    OMP_NUM_THREADS=1 for the same reason); an OMP_NUM_THREADS the user set wins."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_processes)))


def _printer(line: str) -> None:
    print(line, flush=True)


def run_rank(
    cfg: TrainConfig,
    run_dir: Path,
    recipe: Recipe,
    *,
    echo: Callable[[str], None] = print,
    prepare_echo: Callable[[str], None] | None = None,
) -> RunResult | dict:
    """This rank's part of the job: rank 0's controller (a `RunResult`), a satellite's cell loop or a separate rollout
    pool rank's (`gyre.runtime.pool_worker`; what it did).
    `prepare_echo`: where rank 0's checks print (default `echo`)."""
    import torch.distributed as dist

    from gyre.runtime.cell_worker import run_cell
    from gyre.runtime.job import open_job
    from gyre.runtime.pool_worker import run_pool

    job = open_job(cfg)
    if job.rank > 0:  # a satellite ends at the controller's stop decision, not at the terminal's Ctrl-C
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    completed, reason = False, "error"
    host = None
    try:
        nodes = gather_nodes(job) if cfg.harness.hosts == "nodes" and job.world_size > 1 else None
        prepared = prepare(cfg, recipe, run_dir, prepare_echo or echo) if job.rank == 0 else None
        shared: list = [None, None]  # the starting point; the training tasks, for the nodes' harness hosts
        if prepared is not None:
            from gyre.runtime.resume import starting_point

            shared[0] = starting_point(prepared.model_dir, prepared.checkpoint)
            if nodes is not None and nodes.hosts:
                shared[1] = (prepared.task_sets.train, prepared.task_sets.trusted)
        if job.world_size > 1:
            dist.broadcast_object_list(shared, src=0, group=job.groups.control_group)
        if job.rank == 0:
            hosts = nodes.hosts if nodes is not None else {}
            result = asyncio.run(_controller(cfg, run_dir, prepared, shared[0], job, echo, hosts=hosts))
            reason = result.end.reason
            completed = reason != "error"
        else:
            if nodes is not None and (node := nodes.hosted_by(job.rank)) is not None:
                host = _start_harness_host(cfg, run_dir, job, node, *shared[1])
            serve = run_pool if job.groups.cell is None else run_cell  # the separate rollout pool's ranks never train
            result = serve(cfg, run_dir, job, shared[0])
            try:
                job.done()
            except Exception as error:  # rank 0 (the store's server) has gone already: the run has ended anyway
                log.warning("rank %d: could not say done (%r)", job.rank, error)
            completed = True
        return result
    finally:
        if host is not None:  # its executions cancelled (the run has stopped them already)
            host.stop()
        # Rank 0 waits for the satellites' done (they have the stop decision) before its store goes, longer after a
        # completed run; a satellite does not wait.
        job.close(wait_s=DONE_WAIT_S if completed and reason == "completed" else STOP_WAIT_S)


def _start_harness_host(cfg: TrainConfig, run_dir: Path, job, node: int, tasks: list, trusted: bool):
    """Node `node`'s harness host on this rank (its first), its address in the store (docs/cluster.md, "Harness
    hosts on every node"). The harness is checked here as on rank 0: a node that cannot run it fails the job."""
    from gyre.runtime.harness_host import HarnessHost, HarnessHostThread
    from gyre.runtime.harness_setup import check_harness, harness_provisioning, make_runner, task_limits
    from gyre.runtime.job import harness_host_key

    sandbox = _sandbox(cfg, run_dir, trusted_tasks=trusted)
    provisioning = harness_provisioning(cfg.harness)
    check_harness(make_runner(cfg.harness, tasks[0], provisioning), sandbox, tasks)
    thread = HarnessHostThread(
        lambda: HarnessHost(
            tasks=tasks,
            make_runner=lambda task: make_runner(cfg.harness, task, provisioning),
            sandbox=sandbox,
            limits_of=lambda task: task_limits(cfg.limits, task),
            secret=job.secret,
            host=job.host,
        )
    )
    url = thread.start()
    job.store().set(harness_host_key(node), url)
    log.info("node %d: harness host at %s (rank %d)", node, url, job.rank)
    return thread


class CoreStep:
    """The core's `train_claimed_step`, with the trainer thread's own store client and weight transport (made at
    its first step, on that thread); `close()` there too, after the last step."""

    def __init__(self, cfg: TrainConfig, job) -> None:
        self.cfg, self.job = cfg, job
        self.store = self.transport = None

    def __call__(self, trainer, step: int, final: bool, version: int):
        from gyre.runtime.cell_worker import weights_transport
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


async def _controller(
    cfg: TrainConfig, run_dir: Path, prepared: Prepared, start: StartingPoint, job, echo, *, hosts: dict[int, int]
) -> RunResult:
    from gyre.config.trainer import device_kind
    from gyre.engine.endpoint import ServerThread
    from gyre.engine.remote import RemoteEngine
    from gyre.models.decoder_config import read_config
    from gyre.obs.sinks import build_metrics_logger
    from gyre.proxy.render import ChatTemplate
    from gyre.proxy.routing import RoutingTable
    from gyre.runtime.engines import engine_factory, join_weight_group, start_timeout_s, uses_weight_groups
    from gyre.runtime.harness_setup import harness_provisioning, make_runner
    from gyre.runtime.ids import POOL_ENGINE, engine_name
    from gyre.runtime.job import engine_key
    from gyre.runtime.resume import prepare_run_dir
    from gyre.runtime.trainers import save_optimizer, trainer_layout

    if cfg.logging.timeline:  # now, before anything is served: the run's end (Ctrl-C too) writes the PNG sooner
        preload_plotting()
    model_dir, task_sets, checkpoint = prepared.model_dir, prepared.task_sets, prepared.checkpoint
    held_out_size = task_sets.held_out.size if task_sets.held_out else 0
    echo(f"tasks: {len(task_sets.train)} training tasks, {held_out_size} held-out problems")
    template = ChatTemplate.from_pretrained(model_dir)
    sandbox = _sandbox(cfg, run_dir, trusted_tasks=task_sets.trusted)
    sandbox.check()
    kept = None
    if checkpoint is not None:
        kept = prepare_run_dir(
            run_dir, checkpoint, records_dir=run_dir / RECORDS_DIR, executions_dir=run_dir / EXECUTIONS_DIR
        )
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
        front = await _proxy_front(cfg, model_dir, run_dir, table, template, addresses, job)
        harness_hosts = await _harness_hosts(job, hosts) if hosts else None
        metrics = build_metrics_logger(cfg.logging, run_dir, run_config=_plain(cfg))
        parts = ControllerParts(
            job=job,
            engines=engines,
            proxy=front,
            hosts=harness_hosts,
            sandbox=sandbox,
            make_runner=functools.partial(make_runner, cfg.harness, provisioning=harness_provisioning(cfg.harness)),
            make_trainer=lambda: _core_trainer(cfg, start),
            core_step=CoreStep(cfg, job),
            model_dir=model_dir,
            model_config=read_config(model_dir),
            records_dir=run_dir / RECORDS_DIR,
            save_optimizer=functools.partial(
                save_optimizer, coordinate=0, cell_size=cfg.cluster.cell_size, layout=trainer_layout(cfg)
            ),
            engine_dir=start.engine_dir,
        )
        held_out = None
        if task_sets.held_out is not None:
            held_out = HeldOutEvaluator(task_sets.held_out, template, out_path=run_dir / HELD_OUT_FILE, echo=echo)
            held_out.results = list(kept["held_out"]) if kept else []
        controller = Controller(
            cfg,
            parts,
            train_tasks=task_sets.train,
            held_out=held_out,
            metrics=metrics,
            run_dir=run_dir,
            echo=echo,
            checkpoint=checkpoint,
        )
        front.on_engine_lost = controller.engine_lost
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, _stop_once(controller, echo))
        end = await controller.run()
        writing = time.monotonic()
        summary = _write_outputs(cfg, controller, run_dir, end)
        if (elapsed := time.monotonic() - writing) >= SLOW_STOP_S:
            log.info("writing the run's outputs took %.1fs", elapsed)
        return RunResult(end=end, summary=summary, held_out=held_out.results if held_out else [], run_dir=run_dir)
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
        await asyncio.to_thread(server.stop)


async def _harness_hosts(job, hosts: dict[int, int]):
    """The client of every other node's harness host (node -> its first rank), once each has said its address."""
    from gyre.runtime.harness_hosts import HarnessHosts
    from gyre.runtime.job import harness_host_key

    urls = {}
    for node, rank in sorted(hosts.items()):
        urls[node] = (await asyncio.to_thread(_wait_get, job, harness_host_key(node), HOST_START_TIMEOUT_S)).decode()
        log.info("node %d: harness host at %s (rank %d)", node, urls[node], rank)
    return HarnessHosts(urls, secret=job.secret, controller_host=job.host, ranks=hosts)


async def _proxy_front(cfg: TrainConfig, model_dir: Path, run_dir: Path, table, template, addresses, job):
    """The proxy on this loop over `table` (`proxy.shards=0`), or its shards, each with its own clients of the
    engines at `addresses` (docs/proxy.md, "Shards")."""
    from gyre.runtime.proxy_front import LocalFront, ShardedFront

    model = cfg.proxy.model_names[0]
    if cfg.proxy.shards == 0:
        from gyre.proxy.start import start_proxy

        proxy, registry = await start_proxy(
            proxy_config(cfg), model_dir=model_dir, table=table, records_dir=run_dir / RECORDS_DIR, template=template
        )
        return LocalFront(proxy, registry, table, model=model)
    from gyre.proxy.shard import ShardSpec
    from gyre.proxy.shards import ProxyShards

    admin_key = "gyre-admin-" + secrets.token_urlsafe(24)
    specs = [
        ShardSpec(
            index=index,
            proxy=proxy_config(cfg),
            model_dir=str(model_dir),
            records_dir=str(run_dir / RECORDS_DIR),
            engines=addresses,
            engine_secret=job.secret or None,
            admin_key=admin_key,
            log_file=str(run_dir / "train.log"),
        )
        for index in range(cfg.proxy.shards)
    ]
    return ShardedFront(await ProxyShards.start(specs), run_dir / RECORDS_DIR, model=model)


def _core_trainer(cfg: TrainConfig, start: StartingPoint):
    """Rank 0's trainer (the core's first rank): on the starting checkpoint, or a resumed run's with its optimizer
    state (the core's other ranks restore theirs in `gyre.runtime.cell_worker`)."""
    from gyre.runtime.trainers import build_trainable, restore_optimizer, trainer_layout

    trainer = build_trainable(cfg, start.trainer_dir)
    if start.checkpoint is not None:
        layout = trainer_layout(cfg)
        restore_optimizer(trainer, start.trainer_dir, coordinate=0, cell_size=cfg.cluster.cell_size, layout=layout)
    return trainer


def _policy_of_the_checkpoint(run_dir: Path, start: StartingPoint, model_dir: Path) -> None:
    """`<run dir>/policy/` as the resumed run's engines serve it (a publication after the checkpoint is undone)."""
    from gyre.models.hf_weights import load_pretrained
    from gyre.runtime.policy_dir import POLICY_DIR, POLICY_META, write_policy

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


def trained_summary(records) -> dict[str, Any]:
    """What the steps of this run trained: steps with target tokens, their tokens, and `nothing` when steps ran but
    none trained a token (every execution failed, timed out or scored nothing: docs/runtime.md, "Outputs")."""
    trained = [record.step for record in records if record.train_tokens > 0]
    return {
        "trained_steps": len(trained),
        "train_tokens": int(sum(record.train_tokens for record in records)),
        "nothing": bool(records) and not trained,
    }


def _write_outputs(cfg: TrainConfig, controller: Controller, run_dir: Path, end: RunEnd) -> dict[str, Any]:
    from gyre.obs.summary import build_summary, write_summary
    from gyre.sched.staleness import warmup_steps

    sched, spec = controller.sched, controller.sched.spec
    end_s = end.wall_time_s
    utilization = pool_utilization = None
    if end_s > 0:  # node-time fractions, as the simulator defines them (cells of one node each in its terms)
        cl = cfg.cluster
        by_lane = controller.trace.slot_seconds(end_s)
        busy = sum(by_lane[: cl.num_cells]) / cl.cell_capacity  # node-seconds the cells' slots ran executions
        nodes = cl.num_cells
        if controller.trace.pool:  # the pool's ranks as nodes of a cell's size, busy by its C_s slots' share
            pool_nodes = cl.separate_size / cl.cell_size
            busy += by_lane[cl.num_cells] / cl.separate_capacity * pool_nodes
            nodes += pool_nodes
            pool_utilization = by_lane[cl.num_cells] / (cl.separate_capacity * end_s)
        rollout = busy / (nodes * end_s)
        training = sum(r.train_compute_s for r in controller.records) / (nodes * end_s)
        utilization = {"rollout": rollout, "training": training, "idle": max(0.0, 1.0 - rollout - training)}
    summary = build_summary(
        controller.records,
        experiment="",
        mode=spec.mode,
        phi=cfg.algo.phi,
        mu=cfg.algo.mu,
        target_staleness=None if spec.continuous_dispatch else cfg.algo.target_staleness,
        warmup_steps=warmup_steps(spec.mu, spec.extra_groups, spec.batch_groups),
        counters={
            "dispatched": sched.d,
            "started": sched.p,
            "finished": sched.f,
            "redispatched": getattr(sched, "redispatched_total", 0),
        },
        outcomes=dict(sched.outcomes),
        utilization=utilization,
    )
    summary["training"] = trained_summary(controller.records)
    # Each lane's seconds by role (the separate pool's: all rollout), and the pool's slots' busy share.
    summary["role_time_s"] = controller.trace.role_time_s(end_s)
    if pool_utilization is not None:
        summary["pool"] = {
            "ranks": cfg.cluster.separate_size,
            "capacity": cfg.cluster.separate_capacity,
            "slot_utilization": pool_utilization,
        }
    write_summary(run_dir / SUMMARY_FILE, summary)
    try:
        write_summary(run_dir / TRACE_FILE, controller.trace.to_dict(end_s))  # the same atomic JSON write
    except OSError as error:
        log.error("%s not written: %s", TRACE_FILE, error)
    if cfg.logging.timeline:
        cl = cfg.cluster
        title = (
            f"gyre.train: {spec.mode}, phi={cfg.algo.phi:g}, mu={cfg.algo.mu}, {len(controller.records)} steps in "
            f"{end.wall_time_s / 60:.1f} min ({cl.num_cells} cells x {cl.cell_size}"
            + (f", pool of {cl.separate_size}, C_s {cl.separate_capacity})" if cl.separate_size else ")")
        )
        try:
            controller.trace.write_png(run_dir / TIMELINE_FILE, end_s=end.wall_time_s, title=title)
        except (OSError, ValueError) as error:
            log.error("role_timeline.png not written: %s", error)
    return summary
