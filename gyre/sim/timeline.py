"""The role-timeline picture of a finished simulation: lanes and segments from its trace."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gyre.obs.timeline import Segment, write_role_timeline
from gyre.sched import POOL
from gyre.sim.simulator import LoadCurve, Simulator

ROLLOUT_BINS = 200
"""Rollout lanes are cut into about this many time bins per run, each shaded by its occupancy."""


POOL_LANE = "pool"
"""The separate rollout pool's lane (a simulated run's and a real one's)."""


def cell_lane(cell: int) -> str:
    return "cell 0 (core)" if cell == 0 else f"cell {cell}"


def write_timeline(sim: Simulator, summary: dict[str, Any], path: Path) -> None:
    cfg = sim.cfg
    segments, lanes = timeline_segments(sim)
    title = (
        f"{cfg.experiment or 'gyre.sim'}: {cfg.algo.mode}, phi={cfg.algo.phi:g}, mu={cfg.algo.mu}, "
        f"{summary['steps']} steps in {summary['total_time_h']:.2f} h ({cfg.workload.name}, "
        f"{cfg.cluster.num_cells} cells x {cfg.cluster.cell_size})"
    )
    write_role_timeline(
        path,
        segments,
        lanes,
        title=title,
        waterlevel=_hold_to_end(sim.trace.waterlevel, sim.now),
        capacity=_hold_to_end(sim.trace.capacity, sim.now),
        step_ends_s=sim.trace.step_ends_s,
    )


def _hold_to_end(series: list[tuple[float, float]], end_s: float) -> list[tuple[float, float]]:
    """A step series (recorded only when it changes) extended to the end of the run, so a constant
    series still draws as a line."""
    if series and series[-1][0] < end_s:
        return [*series, (end_s, series[-1][1])]
    return list(series)


def timeline_segments(sim: Simulator) -> tuple[list[Segment], list[str]]:
    """Lanes and segments of the role timeline from a finished simulation's trace.

    A cell's "training" time is split into "training" (computing micro-steps) and "training_wait"
    (in the training role, waiting for data or for the step's update); rollout time is cut into
    about `ROLLOUT_BINS` bins per run, each with its occupancy (busy slot-seconds / capacity-seconds).
    The separate pool, when there is one, is a lane that is always in rollout.
    """
    cl, trace, end_s = sim.cfg.cluster, sim.trace, sim.now
    bin_s = end_s / ROLLOUT_BINS if end_s > 0 else 1.0
    busy: dict[int, list[tuple[float, float]]] = {}
    for cell, start, stop in trace.busy_segments:
        busy.setdefault(cell, []).append((start, stop))

    lanes = [cell_lane(c) for c in range(cl.num_cells)]
    segments: list[Segment] = []
    for cell, start, stop, state in trace.role_segments:
        lane = cell_lane(cell)
        if state == "training":
            for piece_start, piece_stop, piece_state in _split_training(start, stop, busy.get(cell, [])):
                segments.append(Segment(lane, piece_start, piece_stop, piece_state))
        elif state == "rollout":
            load = LoadCurve(trace.load_changes.get(cell, []))
            segments.extend(_rollout_bins(lane, start, stop, bin_s, load, cl.cell_capacity))
        else:
            segments.append(Segment(lane, start, stop, state))
    if cl.separate_capacity > 0:
        lanes.append(POOL_LANE)
        load = LoadCurve(trace.load_changes.get(POOL, []))
        segments.extend(_rollout_bins(POOL_LANE, 0.0, end_s, bin_s, load, cl.separate_capacity))
    return segments, lanes


def _split_training(start: float, stop: float, busy: list[tuple[float, float]]) -> Iterator[tuple[float, float, str]]:
    """Cut [start, stop] into "training" where it overlaps `busy` (sorted, disjoint) and "training_wait"."""
    cursor = start
    for busy_start, busy_stop in busy:
        lo, hi = max(busy_start, start), min(busy_stop, stop)
        if hi <= lo:
            continue
        if lo > cursor:
            yield cursor, lo, "training_wait"
        yield lo, hi, "training"
        cursor = hi
    if cursor < stop:
        yield cursor, stop, "training_wait"


def _rollout_bins(
    lane: str, start: float, stop: float, bin_s: float, load: LoadCurve, capacity: int
) -> Iterator[Segment]:
    piece_start = start
    while piece_start < stop:
        piece_stop = min(stop, (math.floor(piece_start / bin_s) + 1) * bin_s)
        if piece_stop <= piece_start:  # float rounding at a bin edge
            piece_stop = min(stop, piece_start + bin_s)
        occupancy = load.slot_seconds(piece_start, piece_stop) / (capacity * (piece_stop - piece_start))
        yield Segment(lane, piece_start, piece_stop, "rollout", min(1.0, max(0.0, occupancy)))
        piece_start = piece_stop
