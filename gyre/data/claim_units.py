"""Claim units: how the stream of micro-steps is cut into what one training cell claims at a time.

A split execution (rows in several micro-steps, `MicroStep.split_E`) needs s_i (Eq. 5) over all its micro-steps
before any of them computes its loss; the packer emits such micro-steps consecutively, so a run of micro-steps
sharing a split execution is one unit (the claiming cell takes s_i in a no-grad pass first), and every other
micro-step is a unit alone. Pure; `gyre.distributed.claims` ships the units to the cells.
"""

from __future__ import annotations

from gyre.data.microstep import MicroStep

__all__ = ["ClaimUnitAssembler"]


def _split_executions(step: MicroStep) -> set[str]:
    return {e for e, split in zip(step.execution_ids, step.split_E.tolist(), strict=True) if split}


class ClaimUnitAssembler:
    """Groups a stream of micro-steps into claim units: a run of consecutive micro-steps sharing a split execution
    becomes one unit; any other micro-step is a unit alone. Pure; the controller feeds it in emission order."""

    def __init__(self) -> None:
        self._pending: list[MicroStep] = []
        self._pending_split: set[str] = set()

    def add(self, step: MicroStep) -> list[tuple[MicroStep, ...]]:
        """Feed one micro-step; returns the units it completes (zero, one or two)."""
        split = _split_executions(step)
        done = []
        if self._pending and not (split & self._pending_split):
            done.append(self._take())
        if split:
            self._pending.append(step)
            self._pending_split |= split
        else:
            done.append((step,))
        return done

    def flush(self) -> list[tuple[MicroStep, ...]]:
        """The held-back run, at the end of the stream."""
        return [self._take()] if self._pending else []

    def _take(self) -> tuple[MicroStep, ...]:
        unit = tuple(self._pending)
        self._pending, self._pending_split = [], set()
        return unit
