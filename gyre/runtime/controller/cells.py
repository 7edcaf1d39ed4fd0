"""The controller's cell transitions and publication (docs/runtime.md, "What happens at a transition").

- `BeginTransition(c, TRAINING)`: the cell's engine stops accepting at once, the `Reroute`s of the same action list
  move its executions with their calls in flight (`gyre.proxy.reroute`), then `leave_rollout` (drain, release); the
  core builds its trainer once on the trainer thread, a satellite is told over the control plane and acks;
  `transition_finished`; a satellite the scheduler lets into the step in flight is admitted to the step's board.
- `Publish(v)`: the core's weights streamed to the engines as version v, then the policy directory in the background
  (`gyre.runtime.controller.publication`).
- `BeginTransition(c, ROLLOUT)`: the cell is told, its engine's memory resumed, then it loads the publication of the
  same burst end (or the last one: `Publication.join`) and accepts only once it holds it; `transition_finished`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING

import torch

from gyre.distributed.control import STOP
from gyre.models.decoder import DecoderLM
from gyre.models.flat_weights import FlatWeights
from gyre.obs.record import TransitionRecord
from gyre.runtime.cell.trainers import GATHER, policy_model
from gyre.runtime.controller.parts import wait_for_keys
from gyre.runtime.controller.publication import Publication
from gyre.runtime.controller.transitions import leave_rollout
from gyre.runtime.ids import engine_name
from gyre.runtime.job.spmd import ack_key
from gyre.sched import POOL, Reroute, Role
from gyre.trainer.publish import engine_weights

if TYPE_CHECKING:
    from gyre.runtime.controller.loop import Controller

log = logging.getLogger(__name__)

__all__ = ["Cells"]

DRAIN_S = 30.0  # a cell leaving rollout aborts what is still in flight after this (the aborted calls are recorded)
ACK_TIMEOUT_S = 300.0  # a satellite applies a role decision within this (it loads its trainer the first time)


class Cells:
    """The cells' roles as the controller moves them, the core's trainer and the last publication."""

    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.transition_begun: dict[int, tuple[float, Role]] = {}
        self.reroutes: dict[int, list[asyncio.Task]] = {}  # source cell -> its executions' moves in flight
        self.trainer = None  # the core's trainer (rank 0's), built at the core's first move to training
        self.publication = Publication(ctl)

    # -- the scheduler's actions --------------------------------------------------------------------------
    def begin(self, cell: int, to: Role) -> None:
        """`BeginTransition`: to training, the engine stops accepting at once (no new call starts there)."""
        ctl = self.ctl
        self.transition_begun[cell] = (ctl.now(), to)
        ctl.trace.role(ctl.now(), cell, "to_training" if to is Role.TRAINING else "to_rollout")
        if to is Role.TRAINING:
            ctl.parts.engines[cell].stop_accepting()
            if ctl.held_out_engines is not None:  # it leaves the held-out evaluation in flight (or is kept for it)
                ctl.held_out_engines.leaving(engine_name(cell))
            ctl.spawn(self.to_training(cell))
        else:
            self.publication.expect(cell)
            ctl.spawn(self.to_rollout(cell))

    def reroute(self, action: Reroute) -> None:
        """`Reroute`: an execution moves off a cell that leaves rollout (the cell's drain waits for it)."""
        self.reroutes.setdefault(action.source, []).append(self.ctl.spawn(self._move(action)))

    def publish(self, version: int) -> None:
        """`Publish`: the returning cells of the same action list join it (`to_rollout`)."""
        self.publication.publish(version)

    async def initial_roles(self) -> None:
        """Cells the schedule starts in the training role (async mode's static split) never serve: their engines
        stop accepting and release their memory, the core builds its trainer, a satellite is told and acks."""
        ctl = self.ctl
        for cell, role in enumerate(ctl.sched.roles):
            if role is not Role.TRAINING:
                continue
            ctl.trace.role(ctl.now(), cell, "training")
            ctl.parts.engines[cell].stop_accepting()
            await leave_rollout(ctl.parts.engines[cell], drain_s=0.0)
            await self.tell_training(cell)

    def rollout_engines(self) -> dict[str, object]:
        """The engines in rollout now (the cells in the rollout role, not moving, and the separate pool's), by routing
        name."""
        ctl = self.ctl
        roles = enumerate(ctl.sched.roles)
        engines = {engine_name(c): ctl.parts.engines[c] for c, role in roles if role is Role.ROLLOUT}
        if POOL in ctl.parts.engines:  # the separate rollout pool never leaves rollout
            engines[engine_name(POOL)] = ctl.parts.engines[POOL]
        return engines

    def release(self, reason: str) -> None:
        """The `stop` decision with the run's end: every satellite leaves its loop and stops its engine."""
        self.ctl.control.publish(STOP, reason=reason)

    # -- a transition's steps -----------------------------------------------------------------------------
    async def _move(self, action: Reroute) -> None:
        ctl = self.ctl
        moved = await ctl.parts.proxy.reroute(ctl.episodes.name(action.execution), engine_name(action.destination))
        ctl.book.reroutes.append(action.execution)
        ctl.book.calls_rerouted += moved.calls
        ctl.book.kv_migrations += len(moved.migrated)
        ctl.book.calls_reprefilled += len(moved.restarted)

    async def to_training(self, cell: int) -> None:
        ctl = self.ctl
        begun = ctl.now()
        moves = self.reroutes.pop(cell, [])
        await asyncio.gather(*moves)  # its executions moved before the drain
        moved = ctl.now()
        phases = {"reroute": moved - begun}
        if ctl.held_out_engines is not None:  # its engine kept for the held-out evaluation in flight, if the last one
            held = await ctl.held_out_engines.hold(engine_name(cell), ctl.parts.engines[cell])
            if held > 0:
                phases["held_out"] = held
        leaving = ctl.now()
        phases |= await leave_rollout(ctl.parts.engines[cell], drain_s=DRAIN_S)
        released = ctl.now()
        await self.tell_training(cell)
        phases["restore"] = ctl.now() - released
        log.info(
            "cell %d to training: %d executions rerouted in %.2fs, drained and released in %.2fs, trainer ready in "
            "%.2fs",
            cell,
            len(moves),
            moved - begun,
            released - leaving,
            phases["restore"],
        )
        self._ends(cell, phases)

    async def to_rollout(self, cell: int) -> None:
        ctl = self.ctl
        begun = ctl.now()
        engine = ctl.parts.engines[cell]
        try:
            if self.has_other_ranks(cell):
                seq = ctl.control.publish("role", cell=cell, to="rollout")
                # With a step in flight (a cell leaving it mid-step to make room for a replacement, or a joiner sent
                # back before it was admitted) the cell's ranks are inside the step, or waiting for its admission,
                # until it ends: they apply the decision then; the engine side below needs nothing of them.
                if ctl.steps.pump is None:
                    await self.acked(seq, cell)
            phases = {"ranks": ctl.now() - begun}
            resumed = ctl.now()
            await engine.resume_memory()
            phases["resume"] = ctl.now() - resumed
        except BaseException as error:
            self.publication.joining_failed(cell, error)
            raise
        loading = ctl.now()
        await self.publication.join(cell, engine)  # the engine accepts only once it holds the published version
        engine.resume_accepting()
        phases["load_weights"] = ctl.now() - loading
        self._ends(cell, phases)

    def _ends(self, cell: int, phases: dict[str, float] | None = None) -> None:
        """A transition ended: its record, `transition_finished`, and a satellite joining the step in flight."""
        ctl = self.ctl
        start_s, to = self.transition_begun.pop(cell)
        ctl.book.transitions.append(
            TransitionRecord(
                cell=cell, to=to.value, start_s=start_s, duration_s=ctl.now() - start_s, phases=phases or {}
            )
        )
        ctl.trace.role(ctl.now(), cell, to.value)
        ctl.apply(ctl.sched.transition_finished(ctl.now(), cell))
        if to is Role.TRAINING:
            ctl.steps.admit(cell)

    async def tell_training(self, cell: int) -> None:
        """The cell's ranks take the training role: the core builds its trainer once on the trainer thread; every
        other rank of the cell (a satellite's, the core's other ranks in a cell of several) is told and acks."""
        ctl = self.ctl
        if cell == 0 and self.trainer is None:
            building = ctl.trainer_thread.submit(ctl.parts.make_trainer)
            if ctl.parts.job.layout.cell_size > 1:  # the core's other ranks build their shards meanwhile
                await self.acked(ctl.control.publish("role", cell=0, to="training"), 0)
            self.trainer = await building
        elif self.has_other_ranks(cell):
            seq = ctl.control.publish("role", cell=cell, to="training")
            if not ctl.steps.has_member(cell):
                await self.acked(seq, cell)

    def has_other_ranks(self, cell: int) -> bool:
        """The cell has ranks besides rank 0 (the controller), which must be told of its role decisions."""
        return cell != 0 or self.ctl.parts.job.layout.cell_size > 1

    async def acked(self, seq: int, cell: int) -> None:
        """Every rank of `cell` but this one (rank 0, the controller) applied control decision `seq`."""
        ctl = self.ctl
        layout = ctl.parts.job.layout
        keys = [ack_key(seq, rank) for rank in range(cell * layout.cell_size, (cell + 1) * layout.cell_size) if rank]
        if not keys:
            return
        job = ctl.parts.job

        def wait() -> None:  # a client of its own (dropped when it returns: TCPStore has no close)
            what = f"cell {cell} applied control decision {seq}"
            wait_for_keys(job.store(), keys, timeout_s=ACK_TIMEOUT_S, stopping=lambda: ctl.stopping, what=what)

        await asyncio.to_thread(wait)

    # -- the core's whole model (the held-out evaluation, checkpoints) ---------------------------------------
    async def core_weights(self) -> FlatWeights:
        """The core's whole weights now, in HF names and the engines' dtype (`engine.dtype`: a bf16 trainer's
        weights serve fp32 engines, cast once here): on the trainer thread after the work submitted before; a
        Megatron core gathers its shards, its other ranks told with a `gather` decision (gyre.runtime.cell.trainers)."""
        ctl = self.ctl
        if ctl.parts.job.layout.cell_size > 1:
            ctl.control.publish(GATHER)
        gather = functools.partial(engine_weights, dtype=getattr(torch, ctl.cfg.engine.dtype))
        return await ctl.trainer_thread.submit(gather, self.trainer, ctl.parts.model_config)

    def as_model(self, weights: FlatWeights | None) -> DecoderLM:
        """The core's model as a `DecoderLM`: a native trainer's own module, else one made of `weights`."""
        if isinstance(self.trainer.model, DecoderLM):
            return self.trainer.model
        return policy_model(weights, self.ctl.parts.model_config)

    async def core_model(self) -> DecoderLM:
        """The core's model now as a `DecoderLM` (for the held-out evaluation and the policy directory); a native
        trainer's needs no copy of its weights."""
        native = isinstance(self.trainer.model, DecoderLM)
        return self.as_model(None if native else await self.core_weights())

    def engine_lost(self, event) -> None:
        """The proxy counted a cell's engine lost (its endpoint gone: docs/proxy.md, "An engine that dies"): its
        calls went on on live engines and the table moved its executions. Said once; the scheduler still counts the
        cell (a dead endpoint is almost always a dead rank, whose lifeline ends the run: docs/runtime.md,
        "An engine endpoint that dies")."""
        log.error(
            "engine %s lost (%s): %d executions moved to live engines, %d had none; the scheduler still counts it",
            event.engine,
            event.reason,
            len(event.moved),
            len(event.unplaced),
        )
