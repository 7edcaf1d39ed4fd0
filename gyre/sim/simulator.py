"""Discrete-event simulator that drives the real `gyre.sched.Scheduler` with simulated time.

The scheduler decides; the simulator carries the decisions out with a timing model: executions
last what the workload model samples, role transitions take `to_training_s` / `to_rollout_s`,
training cells claim micro-steps (`group_train_node_s / cell_size / microsteps_per_group` s each) from one
queue fed by the scheduler's `claim_group`, a satellite pulls weights for `join_s` before its first
micro-step, each step ends with `update_s` on the core, and a burst ends with `publish_s`.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import math
from dataclasses import dataclass, field

from gyre.config import SimConfig
from gyre.sched import (
    POOL,
    BeginStep,
    BeginTransition,
    Cancel,
    Dispatch,
    Publish,
    Reroute,
    Role,
    Scheduler,
    Start,
    WakeAt,
    spec_from_config,
    warmup_steps,
)
from gyre.sim.workload import DurationModel, ExecutionPlan


class SimulationError(RuntimeError):
    """The configured run cannot finish (stuck, or past max_sim_hours)."""


@dataclass
class _Cell:
    busy_until: float | None = None  # in a micro-step until then
    ready_at: float = 0.0  # after joining (weight pull)
    busy_s: float = 0.0  # time spent computing micro-steps (utilization)
    role_since: float = 0.0
    role: Role = Role.ROLLOUT


@dataclass
class Trace:
    """What happened, for the summary and the role-timeline picture."""

    role_segments: list[tuple[int, float, float, str]] = field(default_factory=list)  # (cell, start, end, state)
    busy_segments: list[tuple[int, float, float]] = field(default_factory=list)  # training compute
    load_changes: dict[int, list[tuple[float, int]]] = field(default_factory=lambda: collections.defaultdict(list))
    waterlevel: list[tuple[float, float]] = field(default_factory=list)
    capacity: list[tuple[float, float]] = field(default_factory=list)
    step_ends_s: list[float] = field(default_factory=list)
    reroutes: collections.Counter = field(default_factory=collections.Counter)  # (burst, execution) -> moves
    bursts: int = 0  # publications so far


class Simulator:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.spec = spec_from_config(cfg.cluster, cfg.algo)
        self.sched = Scheduler(self.spec)
        self.model = DurationModel(cfg.workload, cfg.seed)
        self.now = 0.0
        self._events: list[tuple[float, int, str, int]] = []
        self._seq = itertools.count()
        self._plans: dict[int, ExecutionPlan] = {}
        self._running: set[int] = set()
        self._microsteps: collections.deque[int] = collections.deque()
        self._microsteps_done = 0
        self._step_started_at = 0.0
        self._updating = False
        self.cells = [_Cell(role=role) for role in self.sched.roles]
        self.trace = Trace()
        cl = cfg.cluster
        self.microstep_s = cl.group_train_node_s / cl.cell_size / cl.microsteps_per_group

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> Trace:
        limit_s = self.cfg.max_sim_hours * 3600.0
        self._apply(self.sched.start(0.0))
        self._record_levels()
        while len(self.trace.step_ends_s) < self.cfg.steps:
            if not self._events:
                raise SimulationError(
                    f"simulation stuck at t={self.now / 3600:.2f} h after {len(self.trace.step_ends_s)} of "
                    f"{self.cfg.steps} steps: no event pending (waterlevel {self.sched.waterlevel}, "
                    f"rollout capacity {self.sched.rollout_capacity()})"
                )
            time, _, kind, arg = heapq.heappop(self._events)
            if time > limit_s:
                raise SimulationError(
                    f"simulated time passed max_sim_hours={self.cfg.max_sim_hours:g} after "
                    f"{len(self.trace.step_ends_s)} of {self.cfg.steps} steps"
                )
            self.now = time
            getattr(self, f"_on_{kind}")(arg)
            self._record_levels()
        self._close_trace()
        return self.trace

    def _at(self, time: float, kind: str, arg: int = 0) -> None:
        heapq.heappush(self._events, (time, next(self._seq), kind, arg))

    # -- carrying out the scheduler's actions -----------------------------------------------------
    def _apply(self, actions: list) -> None:
        work_may_appear = False
        for action in actions:
            if isinstance(action, Start):
                plan = self._plans[action.execution]
                self._running.add(action.execution)
                self._at(self.now + plan.duration_s, "execution_end", action.execution)
                self._load_changed(action.engine)
            elif isinstance(action, Dispatch):
                per = self.spec.executions_per_group
                for group in range(action.first_group, action.first_group + action.count):
                    for i, plan in enumerate(self.model.sample_group(per)):
                        self._plans[group * per + i] = plan
            elif isinstance(action, Reroute):
                self.trace.reroutes[self.trace.bursts, action.execution] += 1
                self._load_changed(action.source)
                self._load_changed(action.destination)
            elif isinstance(action, Cancel):
                self._running.discard(action.execution)
                self._load_all()
            elif isinstance(action, BeginTransition):
                self._set_role(action.cell, Role.TO_TRAINING if action.to is Role.TRAINING else Role.TO_ROLLOUT)
                cl = self.cfg.cluster
                overhead = cl.to_training_s if action.to is Role.TRAINING else cl.to_rollout_s
                self._at(self.now + overhead, "transition_end", action.cell)
            elif isinstance(action, BeginStep):
                self._step_started_at = self.now
                self._microsteps_done = 0
                work_may_appear = True
            elif isinstance(action, Publish):
                self.trace.bursts += 1
                self._at(self.now + self.cfg.cluster.publish_s, "publish_end")
            elif isinstance(action, WakeAt):
                self._at(max(action.time_s, self.now), "wake")
        if work_may_appear:
            self._feed_cells()

    # -- events -----------------------------------------------------------------------------------
    def _on_execution_end(self, execution: int) -> None:
        if execution not in self._running:
            return  # cancelled as surplus
        self._running.discard(execution)
        engine = self.sched.ledger.engine_of(execution)
        plan = self._plans.pop(execution)
        ready_before = self.sched.ready_unclaimed
        self._apply(self.sched.execution_finished(self.now, execution, plan.outcome, plan.tokens))
        self._load_changed(engine)
        if self.sched.ready_unclaimed > ready_before:
            self._feed_cells()

    def _on_transition_end(self, cell: int) -> None:
        self._apply(self.sched.transition_finished(self.now, cell))
        role = self.sched.roles[cell]
        self._set_role(cell, role)
        if role is Role.TRAINING:
            is_joiner = cell != 0 and self.spec.mode == "elastic"
            self.cells[cell].ready_at = self.now + (self.cfg.cluster.join_s if is_joiner else 0.0)
            if is_joiner and self.cfg.cluster.join_s > 0:
                self._at(self.cells[cell].ready_at, "cell_ready", cell)
        self._load_all()
        self._feed_cells()

    def _on_cell_ready(self, cell: int) -> None:
        self._feed_cells()

    def _on_microstep_end(self, cell: int) -> None:
        state = self.cells[cell]
        state.busy_until = None
        self._microsteps_done += 1
        if self._microsteps_done == self.spec.batch_groups * self.cfg.cluster.microsteps_per_group:
            self._updating = True
            self._at(self.now + self.cfg.cluster.update_s, "update_end")
            return
        self._feed_cells()

    def _on_update_end(self, _: int) -> None:
        self._updating = False
        self.trace.step_ends_s.append(self.now)
        if len(self.trace.step_ends_s) >= self.cfg.steps:
            return
        self._apply(self.sched.step_finished(self.now))

    def _on_publish_end(self, _: int) -> None:
        self._apply(self.sched.publish_finished(self.now))

    def _on_wake(self, _: int) -> None:
        self._apply(self.sched.tick(self.now))

    # -- training cells ---------------------------------------------------------------------------
    def _feed_cells(self) -> None:
        """Every idle training cell takes a micro-step; the queue pulls a group when it runs dry."""
        if self._updating:
            return
        per_group = self.cfg.cluster.microsteps_per_group
        for cell in self.sched.training_cells():
            state = self.cells[cell]
            if state.busy_until is not None or state.ready_at > self.now:
                continue
            if not self._microsteps:
                group, actions = self.sched.claim_group(self.now)
                self._apply(actions)
                if group is None:
                    return
                self._microsteps.extend([group] * per_group)
            self._microsteps.popleft()
            state.busy_until = self.now + self.microstep_s
            state.busy_s += self.microstep_s
            self.trace.busy_segments.append((cell, self.now, state.busy_until))
            self._at(state.busy_until, "microstep_end", cell)

    # -- bookkeeping ------------------------------------------------------------------------------
    def _set_role(self, cell: int, role: Role) -> None:
        state = self.cells[cell]
        if state.role is not role:
            self.trace.role_segments.append((cell, state.role_since, self.now, state.role.value))
            state.role, state.role_since = role, self.now

    def _load_changed(self, engine: int) -> None:
        changes = self.trace.load_changes[engine]
        load = self.sched.ledger.load(engine)
        if changes and changes[-1][0] == self.now:
            changes[-1] = (self.now, load)
        elif not changes or changes[-1][1] != load:
            changes.append((self.now, load))

    def _load_all(self) -> None:
        for engine in [POOL, *range(self.spec.num_cells)]:
            self._load_changed(engine)

    def _record_levels(self) -> None:
        for series, value in (
            (self.trace.waterlevel, self.sched.waterlevel),
            (self.trace.capacity, self.sched.rollout_capacity()),
        ):
            if not series or series[-1][1] != value:
                series.append((self.now, float(value)))

    def _close_trace(self) -> None:
        for cell, state in enumerate(self.cells):
            self.trace.role_segments.append((cell, state.role_since, self.now, state.role.value))
        self._load_all()


class LoadCurve:
    """A step function of (time_s, load) changes; slot-seconds over any window in O(log n)."""

    def __init__(self, changes: list[tuple[float, int]]) -> None:
        self.times = [t for t, _ in changes]
        self.loads = [load for _, load in changes]
        self.cumulative = [0.0]  # slot-seconds from the first change up to times[i]
        for i in range(1, len(changes)):
            self.cumulative.append(self.cumulative[-1] + self.loads[i - 1] * (self.times[i] - self.times[i - 1]))

    def integral_to(self, t: float) -> float:
        i = bisect.bisect_right(self.times, t) - 1
        if i < 0:
            return 0.0
        return self.cumulative[i] + self.loads[i] * (t - self.times[i])

    def slot_seconds(self, start: float, stop: float) -> float:
        return self.integral_to(stop) - self.integral_to(start)


def utilization(sim: Simulator) -> dict[str, float]:
    """Node-time fractions: rollout (occupied slots / capacity), training (computing), idle (the rest)."""
    cl = sim.cfg.cluster
    end = sim.now
    nodes = cl.num_cells * cl.cell_size + (cl.separate_size if cl.separate_capacity else 0)
    if end <= 0 or nodes == 0:
        return {"rollout": 0.0, "training": 0.0, "idle": 1.0}
    loads = sim.trace.load_changes
    rollout = sum(LoadCurve(loads[c]).integral_to(end) / cl.cell_capacity * cl.cell_size for c in range(cl.num_cells))
    if cl.separate_capacity:
        rollout += LoadCurve(loads[POOL]).integral_to(end) / cl.separate_capacity * cl.separate_size
    training = sum(state.busy_s for state in sim.cells) * cl.cell_size
    r, t = rollout / (nodes * end), training / (nodes * end)
    return {"rollout": r, "training": t, "idle": max(0.0, 1.0 - r - t)}


def summarize(sim: Simulator) -> dict:
    ends = sim.trace.step_ends_s
    steps = [b - a for a, b in itertools.pairwise([0.0, *ends])]
    spec = sim.spec
    warmup = warmup_steps(spec.mu, spec.extra_groups, spec.batch_groups)
    steady = sim.sched.staleness.summary(skip_steps=warmup)
    overall = sim.sched.staleness.summary()
    moves = sim.trace.reroutes
    return {
        "experiment": sim.cfg.experiment,
        "mode": sim.spec.mode,
        "phi": sim.cfg.algo.phi,
        "mu": sim.cfg.algo.mu,
        "total_time_s": ends[-1] if ends else 0.0,
        "total_time_h": (ends[-1] if ends else 0.0) / 3600.0,
        "steps": len(ends),
        "step_times_s": steps,
        "staleness": {
            # Theorem A.1 holds under boundary dispatch only.
            "target": None if spec.continuous_dispatch else sim.cfg.algo.target_staleness,
            "group_mean": steady["group_mean"],
            "token_mean": steady["token_mean"],
            "max": overall["max"],
            "group_mean_all_steps": overall["group_mean"],
            "groups_counted": steady["groups"],
            "warmup_steps": warmup,
        },
        "utilization": utilization(sim),
        "counters": {"dispatched": sim.sched.d, "started": sim.sched.p, "finished": sim.sched.f},
        "outcomes": dict(sim.sched.outcomes),
        "transitions": len(sim.sched.transitions),
        "reroutes": {
            "total": sum(moves.values()),
            "executions": len({execution for _, execution in moves}),
            "max_per_execution_in_a_burst": max(moves.values(), default=0),
        },
    }


def simulate(cfg: SimConfig) -> tuple[dict, Simulator]:
    sim = Simulator(cfg)
    sim.run()
    summary = summarize(sim)
    if not all(math.isfinite(x) for x in summary["step_times_s"]):
        raise SimulationError("non-finite step time")
    return summary, sim
