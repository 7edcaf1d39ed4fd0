"""What a real run's role timeline is drawn from: every cell's role over time, the waterlevel and the rollout
capacity, the step ends (docs/runtime.md, "Outputs"). The picture itself is `gyre.obs.timeline`'s, the one the
simulator draws, with the simulator's lane names (`gyre.sim.timeline.cell_lane`), so a real and a simulated
`role_timeline.png` read the same way.

`RoleTrace` is pure: the controller calls `role(now, cell, state)` when a cell's role changes (a transition begun
or finished), `sample(now, waterlevel, capacity)` after each batch of scheduler actions, and `step_end(now)`; times
are seconds from the run's start. `segments(end_s)` closes every open interval at `end_s`. States are the
timeline's (`gyre.obs.timeline.STATES`); a cell in the training role is drawn `training` throughout (this trace
does not split compute from waiting as the simulator does).
"""

from __future__ import annotations

from pathlib import Path

from gyre.obs.timeline import STATES, Segment, write_role_timeline
from gyre.sim.timeline import cell_lane

__all__ = ["RoleTrace"]


class RoleTrace:
    """Every cell's role intervals, the waterlevel and capacity step series, the step ends."""

    def __init__(self, num_cells: int, *, start_state: str = "rollout") -> None:
        if start_state not in STATES:
            raise ValueError(f"start_state={start_state!r}: expected one of {STATES}")
        self.num_cells = num_cells
        self._open: list[tuple[str, float]] = [(start_state, 0.0)] * num_cells
        self._closed: list[Segment] = []
        self.waterlevel: list[tuple[float, float]] = []
        self.capacity: list[tuple[float, float]] = []
        self.step_ends_s: list[float] = []

    def lanes(self) -> list[str]:
        return [cell_lane(cell) for cell in range(self.num_cells)]

    def role(self, now: float, cell: int, state: str) -> None:
        """Cell `cell` is in `state` from `now` on."""
        if state not in STATES:
            raise ValueError(f"state={state!r}: expected one of {STATES}")
        current, since = self._open[cell]
        if state == current:
            return
        if now > since:
            self._closed.append(Segment(cell_lane(cell), since, now, current))
        self._open[cell] = (state, now)

    def sample(self, now: float, waterlevel: float, capacity: float) -> None:
        """The waterlevel and rollout capacity at `now` (kept only when they change)."""
        for series, value in ((self.waterlevel, waterlevel), (self.capacity, capacity)):
            if not series or series[-1][1] != value:
                series.append((now, float(value)))

    def step_end(self, now: float) -> None:
        self.step_ends_s.append(now)

    def segments(self, end_s: float) -> list[Segment]:
        """Every interval up to `end_s`, the open ones closed there."""
        tail = [
            Segment(cell_lane(c), since, end_s, state) for c, (state, since) in enumerate(self._open) if end_s > since
        ]
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
