"""Every rank's start of the SPMD job: the process group, the cells' groups, and the job's gyre store
(docs/runtime.md, "The process model").

`open_job(cfg)` runs on every rank, right after the process starts:

1. on GPUs (`engine.device` or `trainer.device` `cuda`), the rank's own GPU made the current CUDA device
   (`local_gpu`: its LOCAL_RANK when it sees the node's GPUs, as under torchrun; the one it sees under
   `srun --gpus-per-task=1`), so that `cuda` in the config names it;
2. `torch.distributed.init_process_group("gloo")`: from the launcher's environment under torchrun or
   `launch_workers`; over `tcp://MASTER_ADDR:MASTER_PORT` with SLURM's rank and task count under srun; in process
   for a job of one rank run plainly (a HashStore: nothing listens);
3. `build_process_groups(Layout(**layout_fields(cfg, world_size)))`: the control group, the cell groups and the
   prefix groups, created in the same order on every rank before anything else makes a group; with
   `trainer.backend=megatron`, `build_process_groups_and_model_parallel`, which makes Megatron's tensor- and
   pipeline-parallel groups right after them, so that Megatron's groups are exactly the cells (docs/distributed.md,
   "Megatron's groups");
4. rank 0 starts a TCPStore server of its own for the runtime's keys (claims, the control log, weight snapshots,
   engine addresses, acks) and broadcasts its address over the control group; `Job.store()` makes a client (one
   per thread: a TCPStore client is used by one thread at a time);
5. every other rank connects its lifeline to rank 0 (`gyre.runtime.lifeline`): rank 0's controller ends the run
   with `RankLost` naming a rank whose process ended while the run went on.

`Job.done()` on a satellite and `Job.close(wait_s=)` on rank 0: rank 0 waits for every other rank's `done` (the
store lives on rank 0 and must outlive every client), then each rank destroys its process group. Keys:
`gyre/engine/<cell>` (a cell leader's engine endpoint), `gyre/ack/<seq>/<rank>` (a rank applied control decision
seq), `gyre/stepstats/<step>/<cell>` (a satellite's share of a step), `gyre/done/<rank>`, plus those of
`gyre.distributed.claims`, `control` and `transport_store`.
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
from gyre.config.train import layout_fields
from gyre.config.trainer import device_kind
from gyre.distributed.groups import ProcessGroups, build_process_groups
from gyre.distributed.layout import Layout
from gyre.distributed.local import HOST
from gyre.runtime.launch import LaunchError, job_env
from gyre.runtime.lifeline import LifelineServer, connect_lifeline

log = logging.getLogger(__name__)

__all__ = ["Job", "ack_key", "engine_key", "local_gpu", "open_job", "step_stats_key"]

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


def local_gpu(local_rank: int, visible: int) -> int:
    """The CUDA device index of the rank with `local_rank` on its node, where it sees `visible` GPUs: 0 when it sees
    one (srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES set per rank), else its local rank (torchrun: every rank
    sees the node's GPUs). LaunchError when it sees none or fewer than its local rank needs."""
    if visible == 1:
        return 0
    if 0 <= local_rank < visible:
        return local_rank
    raise LaunchError(
        f"LOCAL_RANK={local_rank}: this rank sees {visible} GPU{'s' if visible != 1 else ''}; run one rank per GPU "
        "(torchrun --nproc-per-node at most the node's GPUs; srun --gpus-per-task=1)"
    )


def engine_key(cell: int) -> str:
    return f"gyre/engine/{cell}"


def ack_key(seq: int, rank: int) -> str:
    return f"gyre/ack/{seq}/{rank}"


def step_stats_key(step: int, cell: int) -> str:
    """A satellite's share of step `step` (`{"tokens": n, "loss": x}`), written after its `train_claimed_step`."""
    return f"gyre/stepstats/{step}/{cell}"


@dataclass
class Job:
    """This rank's place in the job, its groups and the runtime store's address."""

    rank: int
    world_size: int
    groups: ProcessGroups
    store_host: str
    store_port: int
    server: dist.TCPStore | None = None  # rank 0: the runtime store's server
    host: str = HOST  # the address other ranks reach this one at (`rank_address`)
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


def open_job(cfg: TrainConfig) -> Job:
    """Initialize this rank's part of the job (module docstring). ConfigError when the job does not fit the cells."""
    launched = job_env(os.environ)
    if launched is not None and "cuda" in (device_kind(cfg.engine.device), device_kind(cfg.trainer.device)):
        import torch

        torch.cuda.set_device(local_gpu(launched.local_rank, torch.cuda.device_count()))
    if not dist.is_initialized():
        if launched is None:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        elif launched.launcher == "srun":  # no launcher store: rank 0 serves the rendezvous at MASTER_ADDR:PORT
            address = f"tcp://{launched.master_addr}:{launched.master_port}"
            dist.init_process_group(
                "gloo", init_method=address, rank=launched.rank, world_size=launched.world_size, timeout=PG_TIMEOUT
            )
        else:  # torchrun, or launch_workers: the launcher's store, from the environment
            dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    layout = Layout(**layout_fields(cfg, world_size))
    if cfg.trainer.backend == "megatron":
        from gyre.train.model import build_process_groups_and_model_parallel

        t = cfg.trainer
        groups = build_process_groups_and_model_parallel(
            layout,
            tensor_parallel_size=t.tensor_parallel_size,
            pipeline_parallel_size=t.pipeline_parallel_size,
            seed=cfg.seed,
        )
    else:
        groups = build_process_groups(layout)
    server = None
    lifelines = None
    address: list = [None, None, None]
    if rank == 0:
        host = os.environ.get("MASTER_ADDR", HOST) if world_size > 1 else HOST
        server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
        lifelines = LifelineServer(host) if world_size > 1 else None
        address = [host, server.port, lifelines.port if lifelines else None]
    if world_size > 1:
        dist.broadcast_object_list(address, src=0, group=groups.control_group)
    job = Job(
        rank=rank,
        world_size=world_size,
        groups=groups,
        store_host=address[0],
        store_port=address[1],
        server=server,
        host=rank_address(os.environ),
    )
    if lifelines is not None:
        job.lifelines = lifelines.accept(world_size, timeout_s=STORE_TIMEOUT.total_seconds())
    elif rank > 0:
        job.lifeline = connect_lifeline(address[0], address[2], rank)
    log.info("job ready: %s; runtime store at %s:%s; pid %d", layout.describe(rank), *address[:2], os.getpid())
    return job
