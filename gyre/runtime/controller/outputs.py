"""The run's outputs, written by rank 0 when the controller's loop ends (docs/runtime.md, "Outputs"): `summary.json`
(the simulator's keys, `gyre.obs.summary`, with the run's utilization, role time and what it trained),
`timeline.json` (what the picture is drawn from) and `role_timeline.png`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre.config import TrainConfig
from gyre.runtime.controller.parts import RunEnd

if TYPE_CHECKING:
    from gyre.runtime.controller.loop import Controller

log = logging.getLogger(__name__)

__all__ = ["SUMMARY_FILE", "TIMELINE_FILE", "TRACE_FILE", "trained_summary", "write_outputs"]

SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "role_timeline.png"
TRACE_FILE = "timeline.json"  # what role_timeline.png is drawn from, and every cell's load (controller.trace)


def trained_summary(records) -> dict[str, Any]:
    """What the steps of this run trained: steps with target tokens, their tokens, and `nothing` when steps ran but
    none trained a token (every execution failed, timed out or scored nothing: docs/runtime.md, "Outputs")."""
    trained = [record.step for record in records if record.train_tokens > 0]
    return {
        "trained_steps": len(trained),
        "train_tokens": int(sum(record.train_tokens for record in records)),
        "nothing": bool(records) and not trained,
    }


def write_outputs(cfg: TrainConfig, controller: Controller, run_dir: Path, end: RunEnd) -> dict[str, Any]:
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
