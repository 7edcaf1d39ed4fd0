"""Every rank but rank 0: a satellite cell's ranks, and the core's other ranks in a cell of several (a Megatron
cell of TP ranks), moved by the controller's decisions (docs/runtime.md, "The process model").

Every rank of the job but rank 0 runs `run_cell`. At start a cell leader (a satellite's first rank) serves the
cell's engine (`engine.backend`: `gyre.runtime.cell.engines`) on the starting checkpoint behind an endpoint (bound to
`job.host`, requiring `job.secret`) and writes the address under `gyre/engine/cell-<c>`; the controller reaches it
with a `RemoteEngine` and drives the engine side of every transition itself (stop accepting, reroutes, drain,
release; resume, load the published version, accept: `gyre.runtime.controller.transitions`).
With SGLang the leader's engine
runs on all the cell's GPUs (its tensor-parallel group); with the native engine a cell's other ranks serve nothing
and wait in the rollout role (docs/runtime.md, "Who serves in a cell"). The rank reads the control log
(`gyre.distributed.control`) on a listener thread and applies, in order:

- `role` (cell, to="training") for its cell: build this rank's trainer once (`gyre.runtime.cell.trainers`: the starting
  checkpoint, this rank's shard of it in a Megatron cell; a satellite pulls the core's weights when it joins a
  step; a core rank of a resumed run loads its optimizer state from the checkpoint), then ack
  (`gyre/ack/<seq>/<rank>`); if a step is in flight, wait to be admitted to it (`train_claimed_step` with
  `training=False`: it pulls the step's weights and trains, or returns None when the step closed without it);
- `step` (step, final, version): when training, `train_claimed_step` on this rank's main thread: the cell leader
  claims from the step's board and the cell's other ranks follow it, gradients summed over the prefix group onto
  the core, the core's broadcast after a non-final step (so the cell stays in sync for the burst's next step);
- `role` (cell, to="rollout"): a satellite's trainer stops training (its weights are stale from now on; the core's
  stay the run's weights); ack;
- `stream` (the core's ranks only): the core's weights streamed in buckets with rank 0 (`gyre.runtime.cell.stream`:
  a publication, or the policy directory, whose part files the stage leaders write);
- `gather` (the core's ranks only): the core's whole weights gathered over its tensor-parallel group, with rank 0
  (`gyre.trainer.publish.engine_weights`, for the held-out evaluation and checkpoints);
- `save_optimizer` (path; the core's ranks only): this rank's optimizer state written into the checkpoint being
  written (`gyre.runtime.cell.trainers.save_optimizer`), then ack: the controller completes the checkpoint after;
- `stop`: leave the loop; the engine is stopped.

Nothing is applied twice or skipped: the listener delivers the log in order, each decision once, and the rank
checks `Decision.seq`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from gyre.config import TrainConfig
from gyre.distributed.control import STOP, ControlListener
from gyre.distributed.one_sided import one_sided_transport
from gyre.runtime.cell.stream import STREAM, run_stream, stage_leaders
from gyre.runtime.cell.trainers import (
    GATHER,
    SAVE_OPTIMIZER,
    build_trainable,
    restore_optimizer,
    save_optimizer,
)
from gyre.runtime.job.checkpoint import StartingPoint
from gyre.runtime.job.run_shape import trainer_layout
from gyre.runtime.job.spmd import Job, ack_key, engine_key, step_stats_key

log = logging.getLogger(__name__)

__all__ = ["run_cell"]

POLL_S = 1.0


def weights_prefix(job: Job) -> str:
    """The weight snapshots' keys of this rank's in-cell coordinate (the core's rank there publishes)."""
    return f"gyre/weights/{job.groups.coordinate}"


def weights_transport(cfg: TrainConfig, job: Job, store):
    """This rank's one-sided transport of the core's weights (`trainer.weight_transport`), over `store`."""
    return one_sided_transport(
        store,
        kind=cfg.trainer.weight_transport,
        host=job.host,
        prefix=weights_prefix(job),
        mooncake=cfg.trainer.mooncake,
    )


def optimizer_file_of(cfg: TrainConfig, job: Job) -> dict:
    """Which optimizer file of a checkpoint is this core rank's (`gyre.runtime.cell.trainers.save_optimizer`)."""
    return {"coordinate": job.groups.coordinate, "cell_size": job.layout.cell_size, "layout": trainer_layout(cfg)}


def run_cell(cfg: TrainConfig, run_dir: Path, job: Job, start: StartingPoint) -> dict:
    """The loop of one rank (module docstring), its engine on `start.engine_dir` and its trainer built from
    `start.trainer_dir` (a resumed run's checkpoint); returns what it did."""
    from gyre.models.decoder_config import read_config
    from gyre.trainer.publish import engine_weights
    from gyre.trainer.streaming import train_claimed_step

    cell, is_core = job.groups.cell, job.groups.cell == 0
    model_config = read_config(start.trainer_dir)
    store = job.store()
    leader = job.groups.is_cell_leader
    server, url = _serve_engine(cfg, start.engine_dir, start.engine_version, job) if leader else (None, None)
    try:
        if server is not None:
            store.set(engine_key(cell), url)
        transport = weights_transport(cfg, job, store)
        listener = ControlListener(job.store)
    except BaseException:
        if server is not None:
            server.stop()
        raise
    trainer = None
    training = synced = False
    step: dict | None = None  # the step in flight, as its decision said
    done: dict = {"steps": [], "pulled": [], "stop_reason": None}
    expected = 0

    def train(fields: dict) -> None:
        nonlocal synced
        result = train_claimed_step(
            trainer,
            store=store,
            step=fields["step"],
            groups=job.groups,
            transport=transport,
            version=fields["version"],
            training=synced,
            final=fields["final"],
            config=cfg.loss,
        )
        if result is None:
            return
        if job.groups.coordinate == 0:  # the cell leader reports the cell's share of the step
            share = {
                "tokens": result.tokens,
                "loss": result.loss,
                "metrics": result.metrics.to_dict(),
                "compute_s": result.compute_s,
                "pull_s": result.pull_s,
            }
            store.set(step_stats_key(fields["step"], cell), json.dumps(share))
        if not synced:  # it pulled the core's weights of this step (joined it, or started it out of sync)
            done["pulled"].append(fields["step"])
        done["steps"].append(fields["step"])
        synced = is_core or not fields["final"]  # after a non-final step the core's broadcast keeps the cell in sync

    try:
        while True:
            decision = listener.get(POLL_S)
            if decision is None:
                continue
            if decision.seq != expected:
                raise RuntimeError(f"control decision {decision.seq} arrived, {expected} expected")
            expected += 1
            kind, fields = decision.kind, decision.fields
            if kind == STOP:
                done["stop_reason"] = fields.get("reason", "completed")
                break
            if kind == "step":
                step = fields
                if training:
                    train(fields)
                    step = None
            elif kind == "role" and fields["cell"] == cell:
                if fields["to"] == "training":
                    if trainer is None:
                        trainer = build_trainable(cfg, start.trainer_dir, core=is_core)
                        if is_core and start.checkpoint is not None:
                            restore_optimizer(trainer, start.trainer_dir, **optimizer_file_of(cfg, job))
                    training, synced = True, is_core  # the core's weights are the run's: always in sync
                    store.set(ack_key(decision.seq, job.rank), b"1")
                    if step is not None and not is_core:  # a step in flight: join it if the controller admits it
                        train(step)
                        step = None
                else:
                    training, synced = False, is_core
                    store.set(ack_key(decision.seq, job.rank), b"1")
            elif kind == GATHER and is_core:
                if trainer is None:
                    raise RuntimeError(f"control decision {decision.seq}: gather before the core's trainer exists")
                engine_weights(trainer, model_config)  # the gather's other side: rank 0 keeps the result
            elif kind == STREAM and is_core:
                if trainer is None:
                    raise RuntimeError(f"control decision {decision.seq}: stream before the core's trainer exists")
                leaders = stage_leaders(job.layout.cell_size, cfg.trainer.pipeline_parallel_size)
                run_stream(trainer, model_config, fields, rank=job.rank, leaders=leaders, store=store)
            elif kind == SAVE_OPTIMIZER and is_core:
                if trainer is None:
                    raise RuntimeError(f"control decision {decision.seq}: checkpoint before the core's trainer exists")
                save_optimizer(trainer, Path(fields["path"]), **optimizer_file_of(cfg, job))
                store.set(ack_key(decision.seq, job.rank), b"1")
            elif kind == "step_end":
                step = None
    finally:
        listener.close()
        transport.close()
        if server is not None:
            server.stop()
    log.info(
        "rank %d (cell %d): trained steps %s, pulled the core's weights at %s",
        job.rank,
        cell,
        done["steps"],
        done["pulled"],
    )
    return done


def _serve_engine(cfg: TrainConfig, model_dir: Path, version: int, job: Job):
    """The cell leader's engine (`engine.backend`: `gyre.runtime.cell.engines`) on `model_dir` (the starting checkpoint,
    or a resumed run's published policy `version`) behind an endpoint on this rank's address (`job.host`: rank 0
    reaches it from another host; not every interface), refusing calls without the job's secret: the started
    `ServerThread` and its address."""
    from gyre.engine.endpoint import ServerThread
    from gyre.runtime.cell.engines import engine_factory, start_timeout_s

    factory = engine_factory(cfg, model_dir, version, cell_size=job.layout.cell_size)
    server = ServerThread(factory, host=job.host, secret=job.secret or None)
    return server, server.start(start_timeout_s(cfg))
