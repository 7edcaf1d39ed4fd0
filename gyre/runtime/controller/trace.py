"""What a real run's role timeline is drawn from: every cell's role over time, the waterlevel and the rollout
capacity, the step ends (docs/runtime.md, "Outputs"). The picture itself is `gyre.obs.timeline`'s, the one the
simulator draws, with the simulator's lane names (`gyre.sim.timeline.cell_lane`), so a real and a simulated
`role_timeline.png` read the same way.

`RoleTrace` is pure: the controller calls `role(now, cell, state)` when a cell's role changes (a transition begun
or finished), `sample(now, waterlevel, capacity, loads)` after each batch of scheduler actions (`loads`: every
lane's running executions, the ledger's: the cells', then the separate pool's when there is one), and
`step_end(now)`; times are seconds from the run's start. A run with a separate rollout pool (`pool=True`) has one
more lane, `pool` (the simulator's name for it), always in `rollout`: the pool never trains.
`segments(end_s)` closes every open interval at `end_s`. States are the timeline's (`gyre.obs.timeline.STATES`); a
cell in the training role is drawn `training` throughout (this trace does not split compute from waiting as the
simulator does). `to_dict(end_s)` is what `timeline.json` holds; `slot_seconds(end_s)` integrates each lane's load
for the node-time utilization, `role_time_s(end_s)` sums each lane's seconds by role (`summary.json`'s
`role_time_s`; docs/runtime.md, "Outputs").
"""

from __future__ import annotations

from pathlib import Path

from gyre.obs.timeline import STATES, Segment, write_role_timeline
from gyre.sim.timeline import POOL_LANE, cell_lane

__all__ = ["RoleTrace"]


class RoleTrace:
    """Every cell's role intervals, the waterlevel and capacity step series, the step ends."""

    def __init__(
        self, num_cells: int, *, pool: bool = False, start_state: str = "rollout", start_s: float = 0.0
    ) -> None:
        """`pool`: the run has a separate rollout pool (a last lane, always in rollout); `start_s`: when the trace
        begins (a resumed run's: its checkpoint's time)."""
        if start_state not in STATES:
            raise ValueError(f"start_state={start_state!r}: expected one of {STATES}")
        self.num_cells, self.pool = num_cells, pool
        self._open: list[tuple[str, float]] = [(start_state, start_s)] * num_cells + [("rollout", start_s)] * pool
        self._closed: list[Segment] = []
        self.waterlevel: list[tuple[float, float]] = []
        self.capacity: list[tuple[float, float]] = []
        self.loads: list[list[tuple[float, int]]] = [[] for _ in self.lanes()]  # per lane: (time_s, running)
        self.step_ends_s: list[float] = []
        self.publications: list[dict] = []  # version, start_s, duration_s, phases (seconds by phase)

    def lanes(self) -> list[str]:
        """The cells' lanes (core first), then the pool's when there is one."""
        return [cell_lane(cell) for cell in range(self.num_cells)] + [POOL_LANE] * self.pool

    def role(self, now: float, cell: int, state: str) -> None:
        """Cell `cell` is in `state` from `now` on."""
        if state not in STATES:
            raise ValueError(f"state={state!r}: expected one of {STATES}")
        if not 0 <= cell < self.num_cells:
            raise ValueError(f"cell={cell!r}: expected 0 <= cell < {self.num_cells} (the pool's role never changes)")
        current, since = self._open[cell]
        if state == current:
            return
        if now > since:
            self._closed.append(Segment(self.lanes()[cell], since, now, current))
        self._open[cell] = (state, now)

    def sample(self, now: float, waterlevel: float, capacity: float, loads: list[int] | None = None) -> None:
        """The waterlevel, rollout capacity and every lane's running executions at `now` (kept when they change)."""
        for series, value in ((self.waterlevel, waterlevel), (self.capacity, capacity)):
            if not series or series[-1][1] != value:
                series.append((now, float(value)))
        for series, load in zip(self.loads, loads or (), strict=False):
            if series and series[-1][0] == now:
                series[-1] = (now, int(load))
            elif not series or series[-1][1] != load:
                series.append((now, int(load)))

    def slot_seconds(self, end_s: float) -> list[float]:
        """Per lane, executions x seconds run on its engine up to `end_s` (the integral of its load)."""
        totals = []
        for series in self.loads:
            total = 0.0
            for (t, load), (t_next, _) in zip(series, [*series[1:], (end_s, 0)], strict=True):
                total += load * max(0.0, min(t_next, end_s) - t)
            totals.append(total)
        return totals

    def role_time_s(self, end_s: float) -> dict[str, dict[str, float]]:
        """Per lane, its seconds in each role up to `end_s` (only the roles it held): the pool's are all
        `rollout`."""
        times: dict[str, dict[str, float]] = {lane: {} for lane in self.lanes()}
        for segment in self.segments(end_s):
            spent = min(segment.end_s, end_s) - segment.start_s
            if spent > 0:
                times[segment.lane][segment.state] = times[segment.lane].get(segment.state, 0.0) + spent
        return times

    def to_dict(self, end_s: float) -> dict:
        """Plain data of the whole trace (`timeline.json`): lanes, segments, series, loads, step ends."""
        return {
            "end_s": end_s,
            "lanes": self.lanes(),
            "segments": [[s.lane, s.start_s, s.end_s, s.state] for s in self.segments(end_s)],
            "waterlevel": [list(p) for p in self.waterlevel],
            "capacity": [list(p) for p in self.capacity],
            "loads": [[list(p) for p in series] for series in self.loads],
            "step_ends_s": list(self.step_ends_s),
            "publications": list(self.publications),
        }

    def publication(self, start_s: float, duration_s: float, version: int, phases: dict[str, float]) -> None:
        """A publication of `version` began at `start_s` and took `duration_s` (its phases in seconds)."""
        self.publications.append({"version": version, "start_s": start_s, "duration_s": duration_s, "phases": phases})

    def step_end(self, now: float) -> None:
        self.step_ends_s.append(now)

    def segments(self, end_s: float) -> list[Segment]:
        """Every interval up to `end_s`, the open ones closed there."""
        lanes = self.lanes()
        tail = [Segment(lanes[i], since, end_s, state) for i, (state, since) in enumerate(self._open) if end_s > since]
        return [*self._closed, *tail]

    def write_png(self, path: Path, *, end_s: float, title: str) -> None:
        """The role timeline of the run up to `end_s` as a PNG at `path` (`gyre.obs.timeline.write_role_timeline`)."""

        def held(series: list[tuple[float, float]]) -> list[tuple[float, float]]:
            return [*series, (end_s, series[-1][1])] if series and series[-1][0] < end_s else list(series)

        write_role_timeline(
            path,
            self.segments(end_s),
            self.lanes(),
            title=title,
            waterlevel=held(self.waterlevel),
            capacity=held(self.capacity),
            step_ends_s=self.step_ends_s,
        )
