"""One training run, from a checked `TrainConfig` to the run directory's outputs (docs/runtime.md, "The program").

`run_training(cfg, run_dir, recipe)` starts the SPMD job of `recipe` (`gyre.runtime.recipe.Recipe`: the starting model
when `model.model_dir` is empty, the task sets, the recipe's checks; docs/recipes.md): under torchrun or srun this
process is one of its ranks; run plainly, a job of one rank runs here and a job of more starts its own workers
(`launch_workers`, after the run plan (`gyre.runtime.job.plan`) was built here once, the recipe's preparation with it,
so errors are one line before any worker starts, and the workers receive the plan). Every rank then runs `run_rank`: the
process groups and the runtime store (`gyre.runtime.job.spmd`), the plan from rank 0 (under torchrun or srun), then rank
0's controller (`gyre.runtime.controller.setup`), a satellite's cell loop (`gyre.runtime.cell.worker`) or a separate
rollout pool rank's (`gyre.runtime.cell.pool`). With `harness.hosts=nodes` every rank says its node first
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
from gyre.distributed.layout import Layout
from gyre.runtime.controller.parts import RunResult
from gyre.runtime.job.launch import job_env, launch_workers
from gyre.runtime.job.lifeline import RankLost
from gyre.runtime.job.nodes import gather_nodes
from gyre.runtime.job.plan import PlanError, RunPlan, build_plan, plan_layout, run_sandbox
from gyre.runtime.recipe import Recipe

log = logging.getLogger(__name__)

__all__ = ["PlanError", "RunResult", "run_training"]

DONE_WAIT_S = 30.0  # rank 0 waits this long for the satellites to finish before the runtime store goes
STOPPED_EXIT = 130  # a worker of a run stopped by Ctrl-C or SIGTERM
STOP_WAIT_S = 5.0  # after a stop, the satellites get this long (they may finish the unit they hold first)


def run_training(cfg: TrainConfig, run_dir: Path, recipe: Recipe, *, echo: Callable[[str], None] = print) -> RunResult:
    """One run of `recipe` (module docstring); returns rank 0's `RunResult`. `PlanError` before anything runs."""
    run_dir = Path(run_dir)
    launched = job_env(os.environ)
    if launched is not None:  # torchrun or srun: this process is one rank; rank 0 builds the plan (`run_rank`)
        # every rank checks the layout and its memory before its process group exists: a refusal is every rank's
        layout = plan_layout(cfg, launched.world_size, echo=echo if launched.rank == 0 else None)
        return run_rank(None, echo=echo, launched=(cfg, recipe, run_dir, layout))
    plan = build_plan(cfg, recipe, run_dir, layout=plan_layout(cfg, cfg.world_size, echo=echo), echo=echo)
    if plan.world_size == 1:
        return run_rank(plan, echo=echo)
    cl = cfg.cluster
    cells = f"{cl.num_cells} cells of {cl.cell_size} rank{'s' if cl.cell_size > 1 else ''}"
    if cl.separate_size:
        cells += f", a separate rollout pool of {cl.separate_size}"
    echo(f"starting {plan.world_size} worker processes ({cells}) ...")
    return launch_workers("gyre.runtime.job.program:run_worker", [plan], plan.world_size)[0]


def run_worker(plan: RunPlan) -> RunResult | dict:
    """A worker of a plainly launched job: its logging, its signals, its rank's part of `plan` (`run_rank`)."""
    from gyre.obs.logging import FILE_ONLY, setup_logging

    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank=rank, level=logging.INFO, log_file=plan.run_dir / "train.log")
    _share_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: every thread's stack on stderr
    try:
        result = run_rank(plan, echo=_printer if rank == 0 else log.info)
    except BaseException as error:  # one line on stderr, the traceback into train.log; the launcher names the error
        log.error("rank %d failed: %s: %s", rank, type(error).__name__, error)
        log.error("rank %d failed:\n%s", rank, "".join(traceback.format_exception(error)), extra=FILE_ONLY)
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
            log.error("the run failed: %s: %s", type(error).__name__, error)
            log.error("the run failed:\n%s", "".join(traceback.format_exception(error)), extra=FILE_ONLY)
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
    plan: RunPlan | None,
    *,
    echo: Callable[[str], None] = print,
    launched: tuple[TrainConfig, Recipe, Path, Layout] | None = None,
) -> RunResult | dict:
    """This rank's part of the job: rank 0's controller (a `RunResult`), a satellite's cell loop or a separate rollout
    pool rank's (`gyre.runtime.cell.pool`; what it did). Under torchrun or srun (`launched`: the config, the recipe,
    the run directory and the layout every rank made) rank 0 builds the plan once the process groups exist and
    sends it to every other rank."""
    import torch.distributed as dist

    from gyre.runtime.cell.pool import run_pool
    from gyre.runtime.cell.worker import run_cell
    from gyre.runtime.controller.setup import run_controller
    from gyre.runtime.job.spmd import open_job

    cfg, layout = (plan.cfg, plan.layout) if plan is not None else (launched[0], launched[3])
    job = open_job(cfg, layout)
    if job.rank > 0:  # a satellite ends at the controller's stop decision, not at the terminal's Ctrl-C
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    completed, reason = False, "error"
    host = None
    try:
        nodes = gather_nodes(job) if cfg.harness.hosts == "nodes" and job.world_size > 1 else None
        if plan is None:  # under torchrun or srun: rank 0's plan to every rank
            shared = [build_plan(cfg, launched[1], launched[2], layout=layout, echo=echo) if job.rank == 0 else None]
            if job.world_size > 1:
                dist.broadcast_object_list(shared, src=0, group=job.groups.control_group)
            plan = shared[0]
        if job.rank == 0:
            hosts = nodes.hosts if nodes is not None else {}
            result = asyncio.run(run_controller(plan, job, echo, hosts=hosts))
            reason = result.end.reason
            completed = reason != "error"
        else:
            if nodes is not None and (node := nodes.hosted_by(job.rank)) is not None:
                host = _start_harness_host(plan, job, node)
            serve = run_pool if job.groups.cell is None else run_cell  # the separate rollout pool's ranks never train
            result = serve(cfg, plan.run_dir, job, plan.start)
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


def _start_harness_host(plan: RunPlan, job, node: int):
    """Node `node`'s harness host on this rank (its first), its address in the store (docs/cluster.md, "Harness
    hosts on every node"). The harness is checked on this node too: the plan checked rank 0's node, and a node that
    cannot run it fails the job."""
    from gyre.runtime.job.harness_host import HarnessHost, HarnessHostThread
    from gyre.runtime.job.harness_setup import check_harness, make_runner, task_limits
    from gyre.runtime.job.spmd import harness_host_key

    cfg, tasks, provisioning = plan.cfg, plan.task_sets.train, plan.provisioning
    sandbox = run_sandbox(plan)
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
