"""Claim units: how the stream of micro-steps is cut into what one training cell claims at a time.

A split execution (rows in several micro-steps, `MicroStep.split_E`) needs s_i (Eq. 5) over all its micro-steps
before any of them computes its loss, so all of them must be in one unit: the claiming cell takes s_i in a no-grad
pass over the unit first (`gyre.trainer.streaming.accumulate_unit`). The rule (docs/data.md, "Claim units"):

- A unit is a connected component of the micro-steps fed since the last `flush`, two micro-steps being linked when
  they share a split execution (union-find over split execution ids; a micro-step splitting x and y links both
  components). A micro-step with no split execution is a unit alone. Within a unit, micro-steps keep their feeding
  (emission) order; units are in the order of their first micro-step.
- The caller calls `flush` at the end of each pull of the packer. The packer emits every micro-step of an execution
  in one pull (`StreamPackingBuffer`: part of an execution is never held back), but not necessarily consecutively:
  with `packing.keep_executions_together=False` rows pack freely and one pull can emit a1, b, a2. So a component is
  complete only at the pull's end, and `flush` returns it. The micro-steps alone cannot tell a component is
  complete earlier, so everything fed after the first held micro-step waits for the flush too (the step pump
  drains a whole pull and flushes at once, so nothing waits longer than the drain).
- Before any split micro-step is held, a micro-step with no split execution is returned by `add` at once.

Pure; `gyre.distributed.claims` ships the units to the cells.
"""

from __future__ import annotations

from gyre.data.microstep import MicroStep

__all__ = ["ClaimUnitAssembler"]


def _split_executions(step: MicroStep) -> tuple[str, ...]:
    return tuple(e for e, split in zip(step.execution_ids, step.split_E.tolist(), strict=True) if split)


class ClaimUnitAssembler:
    """Groups one pull's micro-steps into claim units: the components linked by shared split executions, and every
    other micro-step alone (see the module docstring). Pure; the controller feeds it in emission order and calls
    `flush` at each pull's end."""

    def __init__(self) -> None:
        self._held: list[tuple[MicroStep, tuple[str, ...]]] = []  # since the first held split one, in order
        self._parent: dict[str, str] = {}  # union-find forest over the held split execution ids

    def add(self, step: MicroStep) -> list[tuple[MicroStep, ...]]:
        """Feed one micro-step; returns it as a unit alone when it has no split execution and nothing is held,
        else holds it until `flush` (returns [])."""
        split = _split_executions(step)
        if not split and not self._held:
            return [(step,)]
        self._held.append((step, split))
        for execution in split:
            self._parent.setdefault(execution, execution)
        for execution in split[1:]:  # one micro-step links all its split executions
            self._parent[self._root(execution)] = self._root(split[0])
        return []

    def flush(self) -> list[tuple[MicroStep, ...]]:
        """The held micro-steps as units, at the end of a pull (or of the stream); the next pull starts afresh."""
        units: dict[object, list[MicroStep]] = {}  # component -> its micro-steps; insertion order = first one
        for position, (step, split) in enumerate(self._held):
            key = ("alone", position) if not split else self._root(split[0])
            units.setdefault(key, []).append(step)
        self._held, self._parent = [], {}
        return [tuple(unit) for unit in units.values()]

    def _root(self, execution: str) -> str:
        parent = self._parent
        while parent[execution] != execution:
            parent[execution] = parent[parent[execution]]  # path halving
            execution = parent[execution]
        return execution
