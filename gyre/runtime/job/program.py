"""One training run, from a checked `TrainConfig` to the run directory's outputs (docs/runtime.md, "The program").

`run_training(cfg, run_dir, recipe)` starts the SPMD job of `recipe` (`gyre.runtime.recipe.Recipe`: the starting
model when `model.model_dir` is empty, the task sets, the recipe's checks; docs/recipes.md): under torchrun or srun
this process is one of its ranks; run plainly, a job of one rank runs here and a job of more starts its own workers
(`launch_workers`, after the preflight (`gyre.runtime.job.preflight`) and the recipe's preparation ran here once, so
errors are one line before any worker starts). Every rank then runs `run_rank`: the process groups and the runtime
store (`gyre.runtime.job.spmd`), the starting checkpoint's path from rank 0, then rank 0's controller
(`gyre.runtime.controller.setup`), a satellite's cell loop (`gyre.runtime.cell.worker`) or a separate rollout pool
rank's (`gyre.runtime.cell.pool`). With `harness.hosts=nodes` every rank says its node first
(`gyre.runtime.job.nodes`), and the first rank of each node but rank 0's also hosts that node's harnesses
(`gyre.runtime.job.harness_host`, given the training tasks by rank 0).
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import traceback
from collections.abc import Callable
from pathlib import Path

from gyre.config import TrainConfig
from gyre.runtime.controller.setup import RunResult, run_controller
from gyre.runtime.job.launch import job_env, launch_workers
from gyre.runtime.job.lifeline import RankLost
from gyre.runtime.job.nodes import gather_nodes
from gyre.runtime.job.preflight import ProgramError, check_supported, prepare, run_sandbox
from gyre.runtime.recipe import Recipe

log = logging.getLogger(__name__)

__all__ = ["ProgramError", "RunResult", "run_training"]

DONE_WAIT_S = 30.0  # rank 0 waits this long for the satellites to finish before the runtime store goes
STOPPED_EXIT = 130  # a worker of a run stopped by Ctrl-C or SIGTERM
STOP_WAIT_S = 5.0  # after a stop, the satellites get this long (they may finish the unit they hold first)


def run_training(cfg: TrainConfig, run_dir: Path, recipe: Recipe, *, echo: Callable[[str], None] = print) -> RunResult:
    """One run of `recipe` (module docstring); returns rank 0's `RunResult`. `ProgramError` before anything runs."""
    from gyre.runtime.job.spmd import job_secret

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
        results = launch_workers("gyre.runtime.job.program:run_worker", [cfg, str(run_dir), recipe], world_size)
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
    pool rank's (`gyre.runtime.cell.pool`; what it did).
    `prepare_echo`: where rank 0's checks print (default `echo`)."""
    import torch.distributed as dist

    from gyre.runtime.cell.pool import run_pool
    from gyre.runtime.cell.worker import run_cell
    from gyre.runtime.job.spmd import open_job

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
            from gyre.runtime.job.resume import starting_point

            shared[0] = starting_point(prepared.model_dir, prepared.checkpoint)
            if nodes is not None and nodes.hosts:
                shared[1] = (prepared.task_sets.train, prepared.task_sets.trusted)
        if job.world_size > 1:
            dist.broadcast_object_list(shared, src=0, group=job.groups.control_group)
        if job.rank == 0:
            hosts = nodes.hosts if nodes is not None else {}
            result = asyncio.run(run_controller(cfg, run_dir, prepared, shared[0], job, echo, hosts=hosts))
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
    from gyre.runtime.job.harness_host import HarnessHost, HarnessHostThread
    from gyre.runtime.job.harness_setup import check_harness, harness_provisioning, make_runner, task_limits
    from gyre.runtime.job.spmd import harness_host_key

    sandbox = run_sandbox(cfg, run_dir, trusted_tasks=trusted)
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
