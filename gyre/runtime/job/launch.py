"""How one program becomes one process per slot: under torchrun or srun, or by launching its own workers.

The SPMD job (docs/runtime.md, "Launching") runs the same entry point on every rank. Three ways to start it:

- **torchrun** sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` and `TORCHELASTIC_RUN_ID` for
  each worker; **srun** sets `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` and `SLURM_JOB_ID` (the batch script
  must export `MASTER_ADDR`, the job's first host, and `MASTER_PORT`). `job_env(os.environ)` reads either into a
  `JobEnv`; None when the program was run plainly.
- **plainly** (`python -m ...` on a laptop, or a Hydra `-m` sweep): the one process launches `nprocs` workers itself
  with torch's `elastic_launch` (`launch_workers`), rendezvous on 127.0.0.1, no restarts. A worker that fails ends
  the job: the agent stops the others and `WorkerFailed` names the first failing rank and its error (the worker
  function must be wrapped in torch's `@record`, which `launch_workers` does). Ctrl-C or SIGTERM to the launching
  process is passed to every worker, which gets torch's shutdown timeout (30 s) to end before it is killed; then
  `LaunchStopped`.

Under a launcher every rank resolves Hydra's run directory itself, and timestamped directories differ between ranks
(docs/distributed.md): `fixed_run_dir_overrides` pins it to one directory named by the job's id, unless the user
fixed it, and refuses a `-m` sweep, which under a launcher would rerun the sweep in every rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.config.checks import is_int
from gyre.distributed.local import HOST  # the workers' rendezvous: the loopback, as local runs use

__all__ = [
    "JOB_SECRET_ENV",
    "JobEnv",
    "LaunchError",
    "LaunchStopped",
    "WorkerFailed",
    "fixed_run_dir_overrides",
    "job_env",
    "job_secret",
    "launch_workers",
]


class LaunchError(ValueError):
    """The job's environment or command line cannot start the job (one line, naming what to fix)."""


class LaunchStopped(Exception):
    """The launching process got Ctrl-C or SIGTERM: the workers were sent the same signal and waited for (each ends
    its part of the run: rank 0 writes the run's outputs), then stopped. `signal` names it."""

    def __init__(self, sig) -> None:
        super().__init__(f"stopped by {getattr(sig, 'name', sig)}")
        self.signal = sig


class WorkerFailed(RuntimeError):
    """A worker of a plainly launched job failed; the job was stopped. `rank` and `error` name the first failure."""

    def __init__(self, rank: int, error: str):
        super().__init__(f"rank {rank} failed: {error}")
        self.rank, self.error = rank, error


@dataclass(frozen=True, kw_only=True)
class JobEnv:
    """This process's place in a job started by torchrun or srun."""

    launcher: str  # "torchrun" | "srun"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    job_id: str  # the same on every rank: names the run directory


JOB_SECRET_ENV = "GYRE_JOB_SECRET"  # the job's secret, when the launcher sets one (rank 0 reads it)


def job_secret(env: Mapping[str, str]) -> str:
    """Rank 0's choice of the job's secret: $GYRE_JOB_SECRET when set, else 32 random bytes (URL-safe base64).
    ValueError (which does not show the value) when the variable cannot travel in an HTTP header."""
    given = env.get(JOB_SECRET_ENV)
    if not given:
        return secrets.token_urlsafe(32)
    if not (given.isascii() and given.isprintable()) or " " in given:
        raise ValueError(
            f"{JOB_SECRET_ENV} (value not shown): expected printable ASCII without spaces, it is sent as a bearer token"
        )
    return given


def _int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} in the environment: expected an integer") from None


def job_env(env: Mapping[str, str]) -> JobEnv | None:
    """The job this process belongs to, from torchrun's or srun's variables; None when run plainly."""
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env):
        launcher, rank, world, local = "torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK")
        job_id = env.get("TORCHELASTIC_RUN_ID", "") or "torchrun"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        launcher, rank, world = "srun", _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        step = f".{env['SLURM_STEP_ID']}" if "SLURM_STEP_ID" in env else ""
        job_id = f"slurm-{env.get('SLURM_JOB_ID', 'job')}{step}"
    else:
        return None
    if not 0 <= rank < world:
        raise LaunchError(f"{launcher}: rank {rank} is outside world size {world}")
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise LaunchError(
            f"{launcher}: MASTER_ADDR and MASTER_PORT must be set for every rank (the batch script exports them: "
            "MASTER_ADDR is the first host of the job, MASTER_PORT a free port there)"
        )
    return JobEnv(
        launcher=launcher,
        rank=rank,
        world_size=world,
        local_rank=local,
        master_addr=env["MASTER_ADDR"],
        master_port=_int(env, "MASTER_PORT"),
        job_id="".join(c if c.isalnum() or c in "-_." else "_" for c in job_id),
    )


def fixed_run_dir_overrides(argv: Sequence[str], job: JobEnv | None, *, root: str) -> list[str]:
    """`argv` (Hydra's command line) with the run directory fixed for every rank of `job` (`root/<job id>`).

    Unchanged when run plainly or when the user set `hydra.run.dir`. A `-m`/`--multirun` sweep under a launcher is
    a `LaunchError`: run the sweep plainly and each of its runs launches its own workers."""
    arguments = list(argv)
    if job is None:
        return arguments
    if any(a in ("-m", "--multirun") or a.startswith("--multirun=") for a in arguments):
        raise LaunchError(
            f"a Hydra sweep (-m) cannot run under {job.launcher}: every rank would rerun the whole sweep; run the "
            "sweep plainly (each run starts its own workers)"
        )
    if any(a.lstrip("+").startswith("hydra.run.dir=") for a in arguments):
        return arguments
    return [*arguments, f"hydra.run.dir={root}/{job.job_id}"]


def launch_workers(
    target: str,
    args: Sequence[Any],
    nprocs: int,
    *,
    run_id: str | None = None,
    monitor_interval_s: float = 0.1,
) -> dict[int, Any]:
    """Run `target(*args)` on `nprocs` local worker processes (torch.distributed's environment set in each), wait
    for all, and return their results by rank. `target` is `"package.module:function"` (see
    `gyre.distributed.local.resolve`).

    The workers fork from a forkserver that imported torch and `target`'s module once (multiprocessing's
    "forkserver" start method; nothing else of this process is inherited, as with "spawn"): a spawned worker
    imported them itself, ~2.5 CPU s each, so a 4-rank job paid them four times before its first step. The
    forkserver imports torch._dynamo too: a torch optimizer's first construction imports it (torch._compile's
    disable wrapper), 2-5 CPU s a rank paid as its cell first went to training, in which time the rank answered no
    control decision (a Ctrl-C then waited for it)."""
    import multiprocessing

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not is_int(nprocs) or nprocs < 1:
        raise LaunchError(f"nprocs={nprocs!r}: expected an integer >= 1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        rdzv_backend="c10d",
        rdzv_endpoint=f"{HOST}:0",
        run_id=run_id or uuid.uuid4().hex,
        max_restarts=0,
        monitor_interval=monitor_interval_s,
        start_method="forkserver",
        local_addr=HOST,
    )
    multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", target.partition(":")[0]])
    try:
        return elastic_launch(config, _recorded_worker)(target, list(args))
    except SignalException as signalled:  # Ctrl-C or SIGTERM: the agent passed it to the workers and waited
        raise LaunchStopped(signalled.sigval) from None
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        message = failure.message
        if isinstance(message, dict):  # the worker's error file: {"message": "...", "extraInfo": {...}}
            message = message.get("message", str(message))
        rank, message = _earliest_failure(Path(failure.error_file), rank, message)
        raise WorkerFailed(rank, message or f"exit code {failure.exitcode}") from None


FAILED_AT_FILE = "failed_at_ns"  # beside a worker's error file: when it failed, in ns


def _earliest_failure(error_file: Path, rank: int, message: str | None) -> tuple[int, str | None]:
    """The rank that failed first, and its message. Torch's agent reports the first worker whose exit it saw; a
    rank that raised makes its peers fail too (gloo: "Connection closed by peer"), and a peer's exit can be seen
    first (with the forkserver, whose exit notices pass through its loop, seen in a test). Every worker that
    raised stamped its failure (`_recorded_worker`); the earliest stamp names the cause."""
    stamped = []
    with contextlib.suppress(OSError):
        for rank_dir in error_file.parent.parent.iterdir():  # .../attempt_N/<local rank>/error.json
            try:
                at = int((rank_dir / FAILED_AT_FILE).read_text())
                data = json.loads((rank_dir / "error.json").read_text())
                stamped.append((at, int(rank_dir.name), str(data["message"]["message"])))
            except (OSError, ValueError, KeyError, TypeError):
                continue
    if not stamped:
        return rank, message
    _, earliest, text = min(stamped)
    return earliest, text


def _recorded_worker(target: str, args: list[Any]) -> Any:
    """What every spawned worker runs: `target(*args)`, its exception written to the agent's error file (what torch's
    `@record` does) so that `WorkerFailed` can name it. Module-level, so the workers unpickle it by name."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    from gyre.distributed.local import resolve

    handler = get_error_handler()
    handler.initialize()
    try:
        return resolve(target)(*args)
    except Exception as error:
        handler.record_exception(error)
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:  # torch's timestamp has whole seconds: peers failing in the same second need finer
            with contextlib.suppress(OSError):
                Path(error_file).with_name(FAILED_AT_FILE).write_text(str(time.time_ns()))
        raise
