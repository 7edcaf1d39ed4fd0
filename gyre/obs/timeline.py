"""Role timeline picture: which role each GPU cell (and the rollout pool) held over time.

Role
    Draws the QwenGyre-style "role timeline" as a PNG. The top panel has one horizontal lane per
    GPU cell (plus, optionally, a lane for a separate rollout pool), time on the x axis in hours,
    and colored bars for the state each lane was in. The bottom panel (drawn when a waterlevel or
    capacity series is given) shows the rollout waterlevel and rollout capacity as step lines.
    Vertical dotted lines mark the end of each training step on both panels.

Contract
    * Input is plain data (:class:`Segment` records, ``(time_s, value)`` pairs, seconds); this
      module knows nothing about the scheduler or the simulator that produced it.
    * ``Segment.state`` must be one of :data:`STATES`; ``Segment.lane`` must be one of the
      ``lanes`` passed to :func:`write_role_timeline`; ``end_s >= start_s``; times are finite;
      ``occupancy`` is ``None`` or in ``[0, 1]``. Anything else raises ``ValueError`` naming the
      offending value (and the allowed values where there is a fixed set).
    * ``occupancy`` only means something for ``"rollout"``; on other states it is ignored.
    * Colors: rollout blue (alpha = occupancy rounded to 0.1, at least 0.25; opaque when no
      occupancy is given), training green, training_wait light green with hatching, to_training
      orange, to_rollout purple.
    * Segments of the same lane and state (and, for rollout, the same occupancy rounded to 0.1)
      that touch or overlap in time are merged before drawing (:func:`merge_segments`), and each
      (lane, state) pair is drawn with a single ``broken_barh`` call, so thousands of segments
      render in well under a second.
    * Importing this module does not import matplotlib. :func:`write_role_timeline` imports it,
      selects the non-interactive Agg backend, builds a standalone ``Figure`` (never registered
      with pyplot, so repeated calls leak nothing), writes the PNG and drops the figure.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["STATES", "Segment", "merge_segments", "write_role_timeline", "write_stacked_timelines"]

STATES: tuple[str, ...] = ("rollout", "to_training", "training", "training_wait", "to_rollout")

# Fill color and hatch per state. Rollout's alpha is set per bar from its occupancy.
_HATCH_COLOR = "#5aa84e"  # hatch lines on training_wait (matplotlib draws hatches in the edge color)
_STYLE: dict[str, tuple[str, str | None]] = {
    "rollout": ("#1f77b4", None),
    "to_training": ("#ff7f0e", None),
    "training": ("#2ca02c", None),
    "training_wait": ("#b7e4b0", "///"),
    "to_rollout": ("#9467bd", None),
}
_LEGEND_LABEL: dict[str, str] = {
    "rollout": "rollout",
    "to_training": "to training",
    "training": "training",
    "training_wait": "training (waiting)",
    "to_rollout": "to rollout",
}
_MIN_ROLLOUT_ALPHA = 0.25
_MERGE_TOL_S = 1e-6  # gaps this small (float noise) still count as "touching"
_DPI = 110


@dataclass(frozen=True)
class Segment:
    """One interval of one lane in one state. Times in seconds from the start of the run."""

    lane: str  # lane label, e.g. "cell 0 (core)", "cell 3", "pool"
    start_s: float  # seconds
    end_s: float  # seconds, >= start_s
    state: str  # one of STATES
    occupancy: float | None = None  # rollout only: fraction of the lane's slots busy, in [0, 1]


def _occupancy_key(seg: Segment) -> float | None:
    """Occupancy bucket used for merging and coloring: rollout only, rounded to 0.1."""
    if seg.state != "rollout" or seg.occupancy is None:
        return None
    return round(float(seg.occupancy), 1)


def _validate(segments: Iterable[Segment], lanes: Sequence[str]) -> None:
    lane_set = set(lanes)
    for seg in segments:
        if seg.state not in STATES:
            raise ValueError(f"unknown state {seg.state!r} in {seg!r}; allowed states: {STATES}")
        if seg.lane not in lane_set:
            raise ValueError(f"lane {seg.lane!r} is not in lanes; allowed lanes: {tuple(lanes)}")
        if not (math.isfinite(seg.start_s) and math.isfinite(seg.end_s)):
            raise ValueError(f"segment times must be finite, got {seg!r}")
        if seg.end_s < seg.start_s:
            raise ValueError(f"segment ends before it starts (end_s {seg.end_s} < start_s {seg.start_s}): {seg!r}")
        if seg.occupancy is not None and not 0.0 <= seg.occupancy <= 1.0:
            raise ValueError(f"occupancy {seg.occupancy!r} is outside [0, 1] in {seg!r}")


def merge_segments(segments: Iterable[Segment], *, tol_s: float = _MERGE_TOL_S) -> list[Segment]:
    """Merge adjacent segments of the same lane and state (and rollout occupancy rounded to 0.1).

    Within each lane, segments are ordered by ``(start_s, end_s)``; a segment is folded into the
    previous output segment of that lane when it has the same state and occupancy bucket and starts
    no later than ``tol_s`` after that one ends (so touching or overlapping intervals merge, while a
    segment of another state in between keeps them apart). Rollout segments carry their rounded
    occupancy; other states carry ``None``. The result is ordered by lane (first appearance), then
    by start time. Input is not validated here; :func:`write_role_timeline` validates first.
    """
    by_lane: dict[str, list[Segment]] = {}
    for seg in segments:
        by_lane.setdefault(seg.lane, []).append(seg)

    out: list[Segment] = []
    for lane, segs in by_lane.items():
        segs.sort(key=lambda s: (s.start_s, s.end_s))
        # Current open run: (state, occupancy bucket, start, end).
        cur: tuple[str, float | None, float, float] | None = None
        for seg in segs:
            occ = _occupancy_key(seg)
            if cur is not None and cur[0] == seg.state and cur[1] == occ and seg.start_s <= cur[3] + tol_s:
                cur = (cur[0], cur[1], cur[2], max(cur[3], seg.end_s))
                continue
            if cur is not None:
                out.append(Segment(lane, cur[2], cur[3], cur[0], cur[1]))
            cur = (seg.state, occ, seg.start_s, seg.end_s)
        if cur is not None:
            out.append(Segment(lane, cur[2], cur[3], cur[0], cur[1]))
    return out


def _series_hours(series: Sequence[tuple[float, float]], name: str) -> tuple[list[float], list[float]]:
    ts: list[float] = []
    vs: list[float] = []
    for i, point in enumerate(series):
        try:
            t, v = point
            t, v = float(t), float(v)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}[{i}] must be a (time_s, value) pair of numbers, got {point!r}") from exc
        ts.append(t / 3600.0)
        vs.append(v)
    return ts, vs


def _draw_lanes(
    ax, segments: Sequence[Segment], lanes: list[str], *, title: str, scale_s: float, legend: bool = True
) -> list[float]:
    """The lanes' bars, ticks, title and legend on `ax`, times divided by `scale_s`; the bars' ends (for limits)."""
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Patch

    merged = merge_segments(segments)
    lane_row = {lane: i for i, lane in enumerate(lanes)}
    # (lane, state) -> ([(x, width), ...], [facecolor, ...])
    bars: dict[tuple[str, str], tuple[list[tuple[float, float]], list[tuple[float, float, float, float]]]] = {}
    for seg in merged:
        ranges, colors = bars.setdefault((seg.lane, seg.state), ([], []))
        ranges.append((seg.start_s / scale_s, (seg.end_s - seg.start_s) / scale_s))
        alpha = 1.0 if seg.occupancy is None else max(_MIN_ROLLOUT_ALPHA, seg.occupancy)
        colors.append(to_rgba(_STYLE[seg.state][0], alpha))
    bar_h = 0.8
    for (lane, state), (ranges, colors) in bars.items():
        hatch = _STYLE[state][1]
        ax.broken_barh(
            ranges,
            (lane_row[lane] - bar_h / 2, bar_h),
            facecolors=colors,
            edgecolor=_HATCH_COLOR if hatch else "none",
            linewidth=0.0,
            hatch=hatch,
        )
    n = len(lanes)
    ax.set_yticks(range(n), lanes)
    ax.set_ylim(n - 0.5, -0.5)  # first lane on top
    ax.tick_params(axis="y", length=0)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    if title:
        ax.set_title(title)
    handles = [
        Patch(
            facecolor=_STYLE[s][0],
            edgecolor=_HATCH_COLOR if _STYLE[s][1] else "none",
            linewidth=0.0,
            hatch=_STYLE[s][1],
            label=_LEGEND_LABEL[s],
        )
        for s in STATES
    ]
    if legend:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    return [t for r in bars.values() for x, w in r[0] for t in (x, x + w)]


def preload_plotting() -> None:
    """Import matplotlib with its Agg canvas now (~1 CPU s, measured): a run calls it when it starts, before it
    serves anything, so that writing its timeline at the end (Ctrl-C included) does not pay the import
    (docs/runtime.md). Not from a thread: two threads importing modules that import each other can deadlock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.backends.backend_agg  # what savefig renders PNGs with
    import matplotlib.figure


def write_stacked_timelines(
    path: str | os.PathLike,
    panels: Sequence[tuple[str, Sequence[Segment], Sequence[str], Sequence[float]]],
    *,
    title: str = "",
) -> None:
    """Several runs' role timelines one above the other on one time axis in minutes (as the paper's figures stack
    its modes): each panel is (title, segments, lanes, step_ends_s). Checked as `write_role_timeline` checks."""
    if not panels:
        raise ValueError("panels must hold at least one run")
    for _, segments, lanes, _ in panels:
        _validate(list(segments), list(lanes))
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    heights = [max(0.35 * len(lanes), 1.0) + 0.6 for _, _, lanes, _ in panels]
    fig = Figure(figsize=(12.0, 1.0 + sum(heights)), dpi=_DPI, layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, height_ratios=heights, squeeze=False)[:, 0]
    for i, (ax, (name, segments, lanes, step_ends_s)) in enumerate(zip(axes, panels, strict=True)):
        _draw_lanes(ax, list(segments), list(lanes), title=name, scale_s=60.0, legend=i == 0)
        ends = [float(t) / 60.0 for t in step_ends_s]
        if ends:
            ax.vlines(ends, 0, 1, transform=ax.get_xaxis_transform(), colors="0.35", linestyles=":", linewidth=0.8)
    axes[-1].set_xlabel("time (minutes)")
    axes[0].set_xlim(left=0)
    if title:
        fig.suptitle(title)
    fig.savefig(os.fspath(path), format="png", dpi=_DPI)
    fig.clear()


def write_role_timeline(
    path: str | os.PathLike,
    segments: Sequence[Segment],
    lanes: Sequence[str],  # top-to-bottom order of lanes
    *,
    title: str = "",
    waterlevel: Sequence[tuple[float, float]] = (),  # (time_s, value) step series
    capacity: Sequence[tuple[float, float]] = (),  # (time_s, value) step series
    step_ends_s: Sequence[float] = (),
) -> None:
    """Write the role timeline picture for ``segments`` to ``path`` as a PNG.

    ``lanes`` gives the lanes top to bottom; every segment's lane must be among them (lanes with
    no segments are drawn empty). ``waterlevel`` and ``capacity`` are step series (the value holds
    from its time until the next point) drawn in a second panel below the lanes when either is
    non-empty. ``step_ends_s`` are the times training steps ended, drawn as dotted vertical lines.
    Raises ``ValueError`` on invalid input (see the module docstring); the parent directory of
    ``path`` must exist.
    """
    lanes = list(lanes)
    if not lanes:
        raise ValueError("lanes must name at least one lane")
    if len(set(lanes)) != len(lanes):
        dupes = sorted({lane for lane in lanes if lanes.count(lane) > 1})
        raise ValueError(f"lanes must be unique, got duplicates {dupes}")
    segments = list(segments)
    _validate(segments, lanes)
    wl_t, wl_v = _series_hours(waterlevel, "waterlevel")
    cap_t, cap_v = _series_hours(capacity, "capacity")
    step_ends_h = [float(t) / 3600.0 for t in step_ends_s]
    if not all(math.isfinite(t) for t in step_ends_h):
        raise ValueError(f"step_ends_s must be finite, got {list(step_ends_s)!r}")

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    has_series = bool(wl_t or cap_t)
    n = len(lanes)
    height = max(2.0 + 0.35 * n, 3.0)
    fig = Figure(figsize=(12.0, height), dpi=_DPI, layout="constrained")
    if has_series:
        ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=[max(0.35 * n, 1.0), 1.3])
    else:
        ax, ax2 = fig.subplots(1, 1), None
    times = _draw_lanes(ax, segments, lanes, title=title, scale_s=3600.0) + wl_t + cap_t + step_ends_h
    if times:
        lo, hi = min(times), max(times)
        pad = 0.01 * (hi - lo) if hi > lo else 0.05
        ax.set_xlim(lo - pad, hi + pad)

    bottom = ax
    if ax2 is not None:
        if cap_t:
            ax2.step(cap_t, cap_v, where="post", color="#444444", linewidth=1.2, label="rollout capacity")
        if wl_t:
            ax2.step(wl_t, wl_v, where="post", color="#1f77b4", linewidth=1.2, label="rollout waterlevel")
        ax2.set_ylabel("rollouts")
        ax2.set_ylim(bottom=0)
        ax2.grid(alpha=0.3)
        ax2.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
        bottom = ax2
    for a in (ax, ax2):
        if a is not None and step_ends_h:
            a.vlines(step_ends_h, 0, 1, transform=a.get_xaxis_transform(), colors="0.35", linestyles=":", linewidth=0.8)
    bottom.set_xlabel("time (hours)")

    fig.savefig(os.fspath(path), format="png", dpi=_DPI)
    fig.clear()
