"""A satellite cell's rank: its engine in the rollout role, its trainer in the training role, moved by the
controller's decisions (docs/runtime.md, "The process model").

Every rank of cells 1..K-1 runs `run_cell`. At start its leader serves the native engine on the starting
checkpoint behind an endpoint and writes the address under `gyre/engine/<cell>`; the controller reaches it with a
`RemoteEngine` and drives the engine side of every transition itself (stop accepting, reroutes, drain, release;
resume, load the published version, accept: `gyre.runtime.transitions`). The rank reads the control log
(`gyre.distributed.control`) on a listener thread and applies, in order:

- `role` (cell, to="training"): build the trainer once (the starting checkpoint; it pulls the core's weights when
  it joins a step), then ack (`gyre/ack/<seq>/<rank>`); if a step is in flight, wait to be admitted to it
  (`train_claimed_step` with `training=False`: it pulls the step's weights and trains, or returns None when the
  step closed without it);
- `step` (step, final, version): when training, `train_claimed_step` on this rank's main thread: claims from the
  step's board, gradients summed over the prefix group onto the core, the core's broadcast after a non-final step
  (so the cell stays in sync for the burst's next step);
- `role` (cell, to="rollout"): the trainer stops training (its weights are stale from now on); ack;
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
from gyre.distributed.transport import one_sided_transport
from gyre.runtime.job import Job, ack_key, engine_key, step_stats_key

log = logging.getLogger(__name__)

__all__ = ["run_cell"]

POLL_S = 1.0


def weights_prefix(job: Job) -> str:
    """The weight snapshots' keys of this rank's in-cell coordinate (the core's rank there publishes)."""
    return f"gyre/weights/{job.groups.coordinate}"


def run_cell(cfg: TrainConfig, run_dir: Path, job: Job, model_dir: Path) -> dict:
    """The loop of one satellite rank (module docstring); returns what it did."""
    import torch

    from gyre.engine.endpoint import ServerThread
    from gyre.engine.native import NativeEngine
    from gyre.models.hf_weights import load_pretrained
    from gyre.train.native_trainable import NativeTrainable
    from gyre.train.streaming import train_claimed_step

    cell = job.groups.cell
    store = job.store()
    engine_model = load_pretrained(model_dir, getattr(torch, cfg.engine.dtype), cfg.engine.device)
    server = ServerThread(lambda: NativeEngine(engine_model, max_running=cfg.engine.max_running, policy_version=0))
    url = server.start()
    try:
        store.set(engine_key(cell), url)
        transport = one_sided_transport(store, kind="store", prefix=weights_prefix(job))
        listener = ControlListener(job.store)
    except BaseException:
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
            share = {"tokens": result.tokens, "loss": result.loss}
            store.set(step_stats_key(fields["step"], cell), json.dumps(share))
        if not synced:  # it pulled the core's weights of this step (joined it, or started it out of sync)
            done["pulled"].append(fields["step"])
        done["steps"].append(fields["step"])
        synced = not fields["final"]  # after a non-final step the core's broadcast keeps the cell in sync

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
                        model = load_pretrained(model_dir, torch.float32, cfg.trainer.device)
                        t = cfg.trainer
                        trainer = NativeTrainable(
                            model, lr=t.lr, weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm
                        )
                    training, synced = True, False
                    store.set(ack_key(decision.seq, job.rank), b"1")
                    if step is not None:  # a step in flight: join it if the controller admits this cell
                        train(step)
                        step = None
                else:
                    training = synced = False
                    store.set(ack_key(decision.seq, job.rank), b"1")
            elif kind == "step_end":
                step = None
    finally:
        listener.close()
        transport.close()
        server.stop()
    log.info("cell %d: trained steps %s, pulled the core's weights at %s", cell, done["steps"], done["pulled"])
    return done
