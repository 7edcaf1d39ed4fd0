"""The separate rollout pool's ranks: they serve, never train (docs/runtime.md, "The separate rollout pool").

The `cluster.separate_size` ranks after the cells' (`gyre.distributed.layout.Layout.rollout_ranks`) run `run_pool`
instead of a cell's loop (`gyre.runtime.cell.worker`). The pool is one engine, the scheduler's engine `POOL` with
C_s = `cluster.separate_capacity` slots (`gyre.sched`): its first rank serves it (`engine.backend`, built as a
cell's is by `gyre.runtime.cell.engines.engine_factory`, on the pool's ranks: SGLang's tensor-parallel group is
`separate_size` GPUs; the native engine runs on the first rank alone and the pool's other ranks wait) behind an
endpoint bound to `job.host` that requires `job.secret`, and writes its address under `gyre/engine/pool`. From then
on the controller drives that engine as it drives a rollout cell that never trains: the proxy routes the
executions the scheduler places there (the pool first: docs/scheduler.md, "Placement"), and each publication
reaches it with the cells that stayed in rollout
(the weight stream: `gyre.runtime.controller.publication`). The pool's ranks
hold no trainer, take part in no step and apply no role decision: they read the control log only for its `stop`,
then stop the engine.
"""

from __future__ import annotations

import logging
from pathlib import Path

from gyre.config import TrainConfig
from gyre.distributed.control import STOP, ControlListener
from gyre.runtime.ids import POOL_ENGINE
from gyre.runtime.job.checkpoint import StartingPoint
from gyre.runtime.job.spmd import Job, engine_key

log = logging.getLogger(__name__)

__all__ = ["run_pool"]

POLL_S = 1.0


def run_pool(cfg: TrainConfig, run_dir: Path, job: Job, start: StartingPoint) -> dict:
    """The loop of one pool rank (module docstring), its engine on `start.engine_dir` (a resumed run's published
    policy); returns what it did, as a cell's rank does (`stop_reason`; `steps` is always empty)."""
    from gyre.engine.endpoint import ServerThread
    from gyre.runtime.cell.engines import engine_factory, start_timeout_s

    serves = job.rank == job.layout.rollout_ranks[0]
    server = None
    if serves:
        factory = engine_factory(cfg, start.engine_dir, start.engine_version, cell_size=cfg.cluster.separate_size)
        server = ServerThread(factory, host=job.host, secret=job.secret or None)
    try:
        if server is not None:
            job.store().set(engine_key(POOL_ENGINE), server.start(start_timeout_s(cfg)))
        listener = ControlListener(job.store)
    except BaseException:
        if server is not None:
            server.stop()
        raise
    done: dict = {"steps": [], "pulled": [], "stop_reason": None, "pool": True}
    try:
        while done["stop_reason"] is None:
            decision = listener.get(POLL_S)
            if decision is not None and decision.kind == STOP:
                done["stop_reason"] = decision.fields.get("reason", "completed")
    finally:
        listener.close()
        if server is not None:
            server.stop()
    log.info("rank %d (rollout pool): %s, trained no step", job.rank, "served" if serves else "waited")
    return done
