"""Capacity ledger (Eq. 1) and the placement of running executions on rollout engines.

C_R(t) = C_s + (K - k(t)) C_e, where k(t) counts cells not serving rollout (training or in a
transition either way). Engines are the separate pool (POOL) and the cells in the rollout role.
Placement and rerouting share one order: the separate pool first, then rollout cells in reverse
index order, so the destination expected to stay in rollout longest fills first and an execution
is not rerouted twice within a burst (cells leave for training in index order).
"""

from __future__ import annotations

from gyre.sched.types import POOL, Reroute, Role


class CapacityLedger:
    def __init__(self, num_cells: int, cell_capacity: int, separate_capacity: int, roles: list[Role]) -> None:
        assert len(roles) == num_cells
        self.cell_capacity = cell_capacity
        self.separate_capacity = separate_capacity
        self.roles = list(roles)
        self._on: dict[int, set[int]] = {engine: set() for engine in [POOL, *range(num_cells)]}
        self._where: dict[int, int] = {}

    # -- Eq. 1 ------------------------------------------------------------------------------------
    def rollout_capacity(self) -> int:
        """C_R(t) = C_s + (K - k(t)) C_e (Eq. 1)."""
        return self.separate_capacity + self.cell_capacity * sum(role is Role.ROLLOUT for role in self.roles)

    @property
    def running(self) -> int:
        return len(self._where)

    def capacity_of(self, engine: int) -> int:
        if engine == POOL:
            return self.separate_capacity
        return self.cell_capacity if self.roles[engine] is Role.ROLLOUT else 0

    def load(self, engine: int) -> int:
        return len(self._on[engine])

    def is_running(self, execution: int) -> bool:
        return execution in self._where

    def engine_of(self, execution: int) -> int:
        return self._where[execution]

    def executions_on(self, engine: int) -> list[int]:
        return sorted(self._on[engine])

    # -- placement --------------------------------------------------------------------------------
    def destinations(self, exclude: int | None = None) -> list[int]:
        """Separate pool first, then rollout cells in reverse index order."""
        order = [POOL] if self.separate_capacity > 0 else []
        order += [c for c in reversed(range(len(self.roles))) if self.roles[c] is Role.ROLLOUT and c != exclude]
        return order

    def place(self, execution: int) -> int | None:
        """Start an execution on the first engine with a free slot; None when all are full."""
        for engine in self.destinations():
            if self.load(engine) < self.capacity_of(engine):
                self._put(execution, engine)
                return engine
        return None

    def remove(self, execution: int) -> int:
        engine = self._where.pop(execution)
        self._on[engine].discard(execution)
        return engine

    def evacuate(self, cell: int) -> list[Reroute]:
        """Reserve destination slots for every execution on `cell` and move them there.

        The caller has checked Eq. 2 (or its whole-pool form), so the destinations have room.
        """
        moves = []
        for execution in self.executions_on(cell):
            destination = next((e for e in self.destinations(exclude=cell) if self.load(e) < self.capacity_of(e)), None)
            assert destination is not None, "evacuation without room: Eq. 2 was not checked"
            self.remove(execution)
            self._put(execution, destination)
            moves.append(Reroute(execution, cell, destination))
        return moves

    def _put(self, execution: int, engine: int) -> None:
        assert execution not in self._where
        self._on[engine].add(execution)
        self._where[execution] = engine
