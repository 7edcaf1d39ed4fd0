"""The controller's pump for one optimizer step: micro-steps from the packing buffer's queue onto the step's board.

Role: on the controller (rank 0, in the controller's thread, with that thread's own store client). The stream
packing buffer (`gyre.data.StreamPackingBuffer`) puts micro-steps on an in-process `MicroStepQueue` when it pulls
a group and closes the queue after the batch's B-th group; training cells in other processes claim from the step's
`StepBoard` in the job's TCPStore (`gyre.distributed.claims`). `StepPump` moves the one into the other.

Contract
- Lazy supply, as the simulator's cells claim (paper: "Streaming training with dynamic membership"): the pump
  asks `refill` for one more group only while the board runs short, that is while fewer than `lookahead` units are
  put and not yet claimed (with `lookahead=0`: while a cell leader already waits on an index that has no unit).
  Groups thus leave the scheduler's ready set when a cell needs them, and the scheduler's supply check sees what
  is really waiting (docs/scheduler.md).
- `refill()` is the runtime's: pull one group into the packing buffer (the scheduler's `claim_group`, then
  `StreamPackingBuffer.pull(group)`), and when none is ready it may flush the packer's held-back rows; it returns
  whether anything changed. Returning True while nothing changes forever is a caller's bug (the pump would spin).
- Order: every micro-step in the queue goes onto the board at the next `poll`, in emission order (unit indices
  follow it). After the queue is drained the board flushes its held-back units: the packer emits every micro-step
  of an execution in one pull (docs/data.md), so a split execution's unit is claimable when its pull ends.
- `admit()` lets the next satellite join the step while the board is open (`StepBoard.admit`: in cell order; the
  satellite learns it from the board's join key, `StepClaimer.admitted`).
- When the queue is closed and drained, `poll` closes the board (membership, refusals of the cells not admitted,
  then the sentinels) and returns True. An empty step (the queue closed with nothing in it) closes at once: the
  cells claim None and reduce zero gradients.
- Not thread-safe: one thread calls `poll`, `admit` and `run`, the thread that owns the packing buffer (so a
  drained queue is a pull boundary, which the flush above needs). `poll` waits only on store calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gyre.config.checks import is_int
from gyre.data.microstep import MicroStep
from gyre.data.queue import MicroStepQueue
from gyre.distributed.claims import StepBoard

__all__ = ["StepPump"]

log = logging.getLogger(__name__)

PUMP_CELL = 0  # the cell index the pump claims from the in-process queue under (the board knows who took what)


class StepPump:
    """Moves one step's micro-steps from `queue` onto `board`, lazily, and closes the board after the last."""

    def __init__(
        self,
        board: StepBoard,
        queue: MicroStepQueue[MicroStep],
        *,
        refill: Callable[[], bool],
        lookahead: int = 0,
    ) -> None:
        if not is_int(lookahead) or lookahead < 0:
            raise ValueError(f"lookahead: got {lookahead!r}, expected an integer >= 0 (units kept unclaimed)")
        if board.closed:
            raise ValueError(f"step {board.step}: the board is already closed")
        self.board, self.queue, self.refill, self.lookahead = board, queue, refill, lookahead
        self.num_put = 0  # micro-steps moved onto the board
        self.refills = 0  # calls of `refill` that returned True

    @property
    def closed(self) -> bool:
        return self.board.closed

    @property
    def can_admit(self) -> bool:
        """A satellite may still join this step: the board is open and not every cell trains."""
        return not self.board.closed and self.board.cells < self.board.max_cells

    def admit(self) -> int:
        """Let the next satellite join the step in flight; returns its cell index (ValueError once closed or full)."""
        cell = self.board.admit()
        log.info("step %d: cell %d joins after %d units", self.board.step, cell, self.board.num_units)
        return cell

    def short(self) -> bool:
        """The board holds fewer than `lookahead` unclaimed units, or a cell waits on one that is not there."""
        return self.board.num_units - self.board.claims() < self.lookahead  # lookahead 0: claims > units

    def poll(self) -> bool:
        """One pass: move queued micro-steps onto the board, refill while it runs short, close it after the last
        micro-step. Returns True once the board is closed."""
        if self.board.closed:
            return True
        while True:
            self._drain()
            if self.queue.closed_and_drained:
                units = self.board.close()
                step, cells = self.board.step, self.board.cells
                log.info("step %d: closed after %d units (%d micro-steps), %d cells", step, units, self.num_put, cells)
                return True
            if not self.short() or not self.refill():
                return False
            self.refills += 1

    def run(self, *, poll_s: float = 0.005, between: Callable[[StepPump], None] | None = None) -> int:
        """Poll until the board is closed, sleeping `poll_s` between passes and calling `between(self)` before each
        (where a caller admits joiners); returns the number of units."""
        while True:
            if between is not None:
                between(self)
            if self.poll():
                return self.board.num_units
            time.sleep(poll_s)

    def _drain(self) -> None:
        moved = False
        while (step := self.queue.claim(PUMP_CELL)) is not None:
            self.board.put(step)
            self.num_put += 1
            moved = True
        if moved:
            self.board.flush()
