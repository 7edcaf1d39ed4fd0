"""A test stand-in (tests/unit/test_runtime.py, tests/integration/test_rl_loop.py): lazy claims of one optimizer
step in one process: the scheduler's `claim_group`, the packer's pull, claim units.

The simulator's rule, which the supply check depends on (docs/scheduler.md): a training cell claims a group only
when its local micro-steps run out, so groups stay in the scheduler's ready set until training needs them.
`LocalClaims.next_unit()` is the claim of `gyre.trainer.streaming.train_step` for a trainer in the controller's own
process (K = 1 colocate, the first stage of the runtime; the multi-process runtime moves the same units onto the
step's board with `gyre.distributed.step_pump.StepPump`):

1. a claim unit already assembled is handed out (a run of micro-steps sharing a split execution is one unit,
   `gyre.data.claim_units`);
2. else a micro-step waiting in the packer's queue is claimed and fed to the assembler;
3. else, while the stream is open, one group is claimed from the scheduler (`claim_group(now)`: the actions it
   returns go to `on_actions`) and pulled into the packer by id, so the packer packs exactly the group the
   scheduler accounted for (its staleness, its batch count);
4. once the packer's stream is closed and drained, the assembler's held-back run, then None: the step is done.

`next_unit` returns `WAIT` when no group is ready yet (the caller retries after the next group verdict), and while
the step's trainer is out (the scheduler sent it back to rollout to run a replacement, below).
A claimed group the packer sets aside (a check `mark_ready` could not make: docs/data.md) is reported to the scheduler
with `claimed_group_set_aside`: the batch's claim count goes back down, its actions (a replacement `Dispatch`, and
where no rollout capacity is left a `BeginTransition` to rollout) go to `on_actions`, `set_aside` lists it, and the
next group is claimed (docs/scheduler.md). A `ValueError` of `pull` that set nothing aside (a caller's error) is
raised. Not thread-safe: call it on the thread that owns the scheduler and the packer (the controller's event loop).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Final

from gyre.data.claim_units import ClaimUnitAssembler
from gyre.data.microstep import MicroStep
from gyre.data.packing import StreamPackingBuffer
from gyre.runtime.controller.claims import claim_and_pull
from gyre.sched.scheduler import Scheduler
from gyre.sched.types import Action

__all__ = ["WAIT", "LocalClaims"]

CLAIM_CELL = 0  # the in-process queue's claim is taken under cell 0's index (the one trainer of this process)


class _Wait:
    def __repr__(self) -> str:
        return "WAIT"


WAIT: Final = _Wait()
"""`next_unit`'s answer while the stream is open and no group is ready: ask again after the next verdict."""


class LocalClaims:
    """One step's claim units for the trainer of this process (see the module docstring)."""

    def __init__(
        self,
        scheduler: Scheduler,
        packer: StreamPackingBuffer,
        *,
        clock: Callable[[], float],
        on_actions: Callable[[Sequence[Action]], None],
    ) -> None:
        self.scheduler = scheduler
        self.packer = packer
        self._clock = clock
        self._on_actions = on_actions
        self._assembler = ClaimUnitAssembler()
        self._units: list[tuple[MicroStep, ...]] = []
        self._index = itertools.count()
        self.groups: list[int] = []  # groups claimed into this step and packed, in claim order
        self.set_aside: list[tuple[int, str]] = []  # claimed groups the packer set aside, with the reason
        self.micro_steps: list[MicroStep] = []  # every micro-step handed out, in order

    def next_unit(self) -> tuple[int, tuple[MicroStep, ...]] | _Wait | None:
        """The next (unit index, claim unit), None once the step's stream is done, or WAIT."""
        while not self._units:
            step = self.packer.queue.claim(CLAIM_CELL)
            if step is not None:
                self._units += self._assembler.add(step)
                continue
            # The queue is empty: the pull's micro-steps are all in, so the units they hold back are complete
            # (a pull's end is a flush point, docs/data.md "Claim units"); hand those out before claiming more.
            self._units += self._assembler.flush()
            if self._units:
                break
            if self.packer.queue.closed_and_drained:
                return None
            group, refused = claim_and_pull(self.scheduler, self.packer, clock=self._clock, on_actions=self._on_actions)
            if group is None:
                return WAIT
            if refused is not None:
                self.set_aside.append((group, refused))
                continue
            self.groups.append(group)
        unit = self._units.pop(0)
        self.micro_steps += unit
        return next(self._index), unit
