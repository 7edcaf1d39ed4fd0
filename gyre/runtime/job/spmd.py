"""Every rank's start of the SPMD job: the process group, the cells' groups, and the job's gyre store
(docs/runtime.md, "The process model").

`open_job(cfg, layout)` runs on every rank, right after the process starts:

0. on a CPU trainer (`trainer.device=cpu`), glibc is told to give freed memory back to the system
   (`gyre.runtime.job.allocator`), so a rank's peak is what it holds, as the memory plan counts it;
1. the backends (`job_backends`, gyre.distributed.backends): gloo on CPU cells; on GPUs (`engine.device` and
   `trainer.device` `cuda`) `cpu:gloo,cuda:nccl` with the rank's own GPU made the current CUDA device
   (`local_gpu`: its LOCAL_RANK when it sees the node's GPUs, as under torchrun; the one it sees under
   `srun --gpus-per-task=1`), so that `cuda` in the config names it;
2. `torch.distributed.init_process_group(<that backend>, device_id=<the GPU, if any>)`: from the launcher's
   environment under torchrun or `launch_workers`; over `tcp://MASTER_ADDR:MASTER_PORT` with SLURM's rank and task
   count under srun; in process for a job of one rank run plainly (a HashStore: nothing listens);
3. `build_process_groups(layout, backend=)` on the run plan's layout (`gyre.runtime.job.plan`): the control group
   (gloo), the cell groups and the prefix groups (the data backend), created in the same order on every rank before
   anything else makes a group; with `trainer.backend=megatron`, `build_process_groups_and_model_parallel`, which makes
   Megatron's tensor- and pipeline-parallel groups right after them, so that Megatron's groups are exactly the cells
   (docs/distributed.md, "Megatron's groups");
4. rank 0 starts a TCPStore server of its own for the runtime's keys (claims, the control log, weight snapshots,
   engine addresses, acks), listening on rank 0's address only (`store_host`; a socket gyre binds and hands to
   the store: torch's own would listen on every interface), makes the job's secret (`$GYRE_JOB_SECRET` if the
   launcher set one, else `secrets.token_urlsafe(32)`) and broadcasts both over the control group; `Job.store()`
   makes a client (one per thread: a TCPStore client is used by one thread at a time);
5. every other rank connects its lifeline to rank 0 (`gyre.runtime.job.lifeline`): rank 0's controller ends the run
   with `RankLost` naming a rank whose process ended while the run went on.

The secret guards the engine endpoints (`gyre.engine.endpoint`, `Authorization: Bearer`): every rank has it in
`Job.secret`, and nothing writes it to a log, the metrics, the run's config or a harness's environment.

`Job.done()` on a satellite and `Job.close(wait_s=)` on rank 0: rank 0 waits for every other rank's `done` (the
store lives on rank 0 and must outlive every client), then each rank destroys its process group. Keys:
`gyre/engine/cell-<c>` and `gyre/engine/pool` (an engine endpoint's address), `gyre/ack/<seq>/<rank>` (a rank
applied control decision seq), `gyre/stepstats/<step>/<cell>` (a satellite's share of a step), `gyre/done/<rank>`,
plus those of `gyre.distributed.claims`, `control` and `transport_store`.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch.distributed as dist

from gyre.config import TrainConfig
from gyre.config.trainer import device_kind
from gyre.distributed.backends import BackendError, Backends, choose_backends
from gyre.distributed.groups import ProcessGroups, build_process_groups
from gyre.distributed.layout import Layout
from gyre.distributed.local import HOST
from gyre.runtime.ids import engine_name
from gyre.runtime.job.allocator import return_freed_memory
from gyre.runtime.job.launch import JOB_SECRET_ENV, LaunchError, job_env, job_secret
from gyre.runtime.job.lifeline import LifelineServer, connect_lifeline

log = logging.getLogger(__name__)

__all__ = [
    "JOB_SECRET_ENV",
    "Job",
    "ack_key",
    "engine_key",
    "harness_host_key",
    "job_secret",
    "open_job",
    "step_stats_key",
    "store_host",
]

STORE_TIMEOUT = datetime.timedelta(seconds=300)  # a store call that waits longer fails (the job is broken)
PG_TIMEOUT = datetime.timedelta(seconds=1800)  # a collective waits this long at most (the warm start is minutes)


LOOPBACK = ("", "localhost", "127.0.0.1", "::1")
RANK_ADDR_ENV = "GYRE_RANK_ADDR"  # the address other ranks reach this one at, when the default guess is wrong


def rank_address(env: Mapping[str, str]) -> str:
    """The address other ranks reach this rank at (a one-sided weight transport listens there): $GYRE_RANK_ADDR if
    set; the loopback address when the job's rendezvous is on this machine's loopback (every rank is local); else
    this host's name resolved, or, where that resolves to a loopback address (Debian maps the host name to
    127.0.1.1), the address of the interface that routes to MASTER_ADDR (a UDP socket's connect: no packet)."""
    if env.get(RANK_ADDR_ENV):
        return env[RANK_ADDR_ENV]
    master = env.get("MASTER_ADDR", "")
    if master in LOOPBACK:
        return HOST
    address = socket.gethostbyname(socket.gethostname())
    if address.startswith("127."):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, 1))
                address = probe.getsockname()[0]
        except OSError:  # no route to the rendezvous host from here: keep the name's address
            pass
    return address


def store_host(env: Mapping[str, str], world_size: int) -> str:
    """Where rank 0 serves the runtime store, the address it binds and every rank connects to: the loopback for a
    job of one rank; $GYRE_RANK_ADDR if set; MASTER_ADDR's address when it is one of this host's and not a loopback
    one (the address the launcher's rendezvous already reached); else rank 0's `rank_address`. ValueError when that
    is a loopback address but the job spans hosts (the host name resolves to 127.0.1.1 and MASTER_ADDR names this
    host): $GYRE_RANK_ADDR says which."""
    if world_size == 1:
        return HOST
    master = env.get("MASTER_ADDR", "")
    if not env.get(RANK_ADDR_ENV) and master not in LOOPBACK:
        try:
            resolved = socket.gethostbyname(master)
        except OSError:
            resolved = None
        if resolved is not None and not resolved.startswith("127.") and _is_local(resolved):
            return resolved
    address = rank_address(env)
    if address.startswith("127.") and env.get("MASTER_ADDR", "") not in LOOPBACK and not _one_host(env, world_size):
        raise ValueError(
            f"rank 0's address resolves to {address} while MASTER_ADDR={env.get('MASTER_ADDR')!r} and the job spans "
            f"hosts: set {RANK_ADDR_ENV} to the address the other hosts reach rank 0 at"
        )
    return address


def _is_local(address: str) -> bool:
    """An IPv4 address of one of this host's interfaces (one a socket can bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def _one_host(env: Mapping[str, str], world_size: int) -> bool:
    """Every rank runs on this host, as torchrun's LOCAL_WORLD_SIZE or srun's SLURM_NNODES say."""
    return env.get("LOCAL_WORLD_SIZE") == str(world_size) or env.get("SLURM_NNODES") == "1"


def _listening_socket(host: str) -> socket.socket:
    """A TCP socket bound to `host` on a free port and listening (the runtime store's server takes it over)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address)
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def engine_key(engine: int) -> str:
    """Where a cell leader (or the separate pool's first rank, `engine` POOL) writes its engine's address."""
    return f"gyre/engine/{engine_name(engine)}"


def harness_host_key(node: int) -> str:
    """Where node `node`'s harness host (its first rank: `gyre.runtime.job.nodes`) writes its address."""
    return f"gyre/harness_host/{node}"


def ack_key(seq: int, rank: int) -> str:
    return f"gyre/ack/{seq}/{rank}"


def step_stats_key(step: int, cell: int) -> str:
    """A satellite's share of step `step` (`{"tokens": n, "loss": x}`), written after its `train_claimed_step`."""
    return f"gyre/stepstats/{step}/{cell}"


@dataclass
class Job:
    """This rank's place in the job, its groups, the runtime store's address and the job's secret."""

    rank: int
    world_size: int
    groups: ProcessGroups
    store_host: str
    store_port: int
    server: dist.TCPStore | None = None  # rank 0: the runtime store's server
    host: str = HOST  # the address other ranks reach this one at (`rank_address`)
    secret: str = field(default="", repr=False)  # the engine endpoints' bearer token (module docstring); never logged
    lifelines: dict[int, socket.socket] = field(default_factory=dict)  # rank 0: every other rank's (`lifeline`)
    lifeline: socket.socket | None = None  # another rank: its own to rank 0, open until the process ends

    @property
    def layout(self) -> Layout:
        return self.groups.layout

    def store(self) -> dist.TCPStore:
        """A new client of the runtime store (use it from one thread)."""
        return dist.TCPStore(self.store_host, self.store_port, is_master=False, timeout=STORE_TIMEOUT)

    def done(self) -> None:
        """This rank is finished with the runtime store (a satellite says so before it exits)."""
        self.store().set(f"gyre/done/{self.rank}", b"1")

    def close(self, *, wait_s: float = 0.0) -> None:
        """Rank 0: wait up to `wait_s` for every other rank's `done` (the store server lives here and must outlive
        their clients); then end the process group. No collective: a rank that died must not hang the others."""
        if self.server is not None and wait_s > 0 and self.world_size > 1:
            keys = [f"gyre/done/{rank}" for rank in range(1, self.world_size)]
            deadline = time.monotonic() + wait_s
            while not self.server.check(keys) and time.monotonic() < deadline:
                time.sleep(0.05)
        if dist.is_initialized():
            dist.destroy_process_group()


def job_backends(cfg: TrainConfig, local_rank: int | None) -> Backends:
    """This rank's group backends (gyre.distributed.backends): gloo on CPU cells; on CUDA cells NCCL for CUDA
    tensors, with this rank's GPU (`local_rank` None: a job of one process run plainly, whose GPU is the one
    `trainer.device` names, `cuda:N` or `cuda` for 0). LaunchError when the GPUs are not there."""
    kinds = (device_kind(cfg.engine.device), device_kind(cfg.trainer.device))
    visible = 0
    if "cuda" in kinds:
        import torch

        visible = torch.cuda.device_count()
    if local_rank is None:
        _, _, index = str(cfg.trainer.device).partition(":")
        local_rank = int(index) if index.isdigit() else 0
    try:
        return choose_backends(kinds, local_rank=local_rank, visible_gpus=visible)
    except BackendError as error:
        raise LaunchError(str(error)) from None


def open_job(cfg: TrainConfig, layout: Layout) -> Job:
    """Initialize this rank's part of the job (module docstring) on the run plan's `layout` (checked there:
    `gyre.runtime.job.plan.plan_layout`)."""
    if device_kind(cfg.trainer.device) == "cpu":
        return_freed_memory()
    launched = job_env(os.environ)
    backends = job_backends(cfg, launched.local_rank if launched is not None else None)
    init = {"backend": backends.default}
    if backends.device_index is not None:
        import torch

        torch.cuda.set_device(backends.device_index)
        init["device_id"] = torch.device("cuda", backends.device_index)
    if not dist.is_initialized():
        if launched is None:
            dist.init_process_group(**init, store=dist.HashStore(), rank=0, world_size=1)
        elif launched.launcher == "srun":  # no launcher store: rank 0 serves the rendezvous at MASTER_ADDR:PORT
            address = f"tcp://{launched.master_addr}:{launched.master_port}"
            dist.init_process_group(
                **init, init_method=address, rank=launched.rank, world_size=launched.world_size, timeout=PG_TIMEOUT
            )
        elif int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
            # torchrun restarted the job's workers: the group's keys of this attempt under a prefix of their own, so
            # that no rank reads an address of the attempt that failed
            attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
            store = dist.TCPStore(
                launched.master_addr, launched.master_port, launched.world_size, is_master=False, timeout=PG_TIMEOUT
            )
            dist.init_process_group(
                **init,
                store=dist.PrefixStore(f"gyre/attempt-{attempt}", store),
                rank=launched.rank,
                world_size=launched.world_size,
                timeout=PG_TIMEOUT,
            )
        else:  # torchrun, or launch_workers: the launcher's store, from the environment
            dist.init_process_group(**init, timeout=PG_TIMEOUT)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    assert layout.world_size == world_size, (layout, world_size)  # the plan's layout is of this job's size
    if cfg.trainer.backend == "megatron":
        from gyre.trainer.model import build_process_groups_and_model_parallel

        t = cfg.trainer
        groups = build_process_groups_and_model_parallel(
            layout,
            tensor_parallel_size=t.tensor_parallel_size,
            pipeline_parallel_size=t.pipeline_parallel_size,
            expert_parallel_size=t.expert_parallel_size,
            seed=cfg.seed,
            backend=backends.data,
        )
    else:
        groups = build_process_groups(layout, backend=backends.data)
    server = None
    lifelines = None
    shared: list = [None, None, None, None]  # the store's host and port, the lifelines' port, the job's secret
    if rank == 0:
        host = store_host(os.environ, world_size)
        listening = _listening_socket(host)
        port = listening.getsockname()[1]
        server = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=STORE_TIMEOUT,
            master_listen_fd=listening.detach(),  # the store's server owns the socket from here
        )
        lifelines = LifelineServer(host) if world_size > 1 else None
        shared = [host, server.port, lifelines.port if lifelines else None, job_secret(os.environ)]
    if world_size > 1:
        dist.broadcast_object_list(shared, src=0, group=groups.control_group)
    store_address, store_port, lifeline_port, secret = shared
    job = Job(
        rank=rank,
        world_size=world_size,
        groups=groups,
        store_host=store_address,
        store_port=store_port,
        server=server,
        host=rank_address(os.environ),
        secret=secret,
    )
    if lifelines is not None:
        job.lifelines = lifelines.accept(world_size, timeout_s=STORE_TIMEOUT.total_seconds())
    elif rank > 0:
        job.lifeline = connect_lifeline(store_address, lifeline_port, rank)
    log.info(
        "job ready: %s; runtime store at %s:%s; pid %d", layout.describe(rank), store_address, store_port, os.getpid()
    )
    return job
