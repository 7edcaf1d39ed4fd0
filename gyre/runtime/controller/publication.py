"""The core's publications as the controller runs them (docs/runtime.md, "Publication").

`Publication.publish(version)` (the scheduler's `Publish`):
0. a held-out evaluation in flight ends first (`held_out_wait`): it is pinned to the version its engines hold
   (`gyre.runtime.controller.held_out_engines`);
1. the staying engines (in rollout, and the separate pool's) get the core's weights as `version` by the weight
   stream (`gyre.trainer.weight_stream`): every engine opens an update (`begin_update`), the core's ranks stream the
   weights in buckets of whole HF tensors, rank 0 hands each bucket to every engine at once (`load_bucket`) while the
   next one is assembled, then `end_update`. No rank holds the whole model: its shards and at most two buckets;
2. the cells coming back from training in the same burst end (`join`, from `Cells.to_rollout` once their memory is
   resumed) get a second stream of the same weights: the scheduler begins no step while it publishes, so the core's
   weights are still `version`;
3. if due (`publication.policy_every`), the policy directory: the core's stage leaders write their stages' buckets
   as part files in the background while rollouts go on, rank 0 finishes the directory
   (`gyre.runtime.job.policy_dir`). The core's next step starts after the writers' work on the core's threads. If
   due (`tasks.eval_every`), the held-out evaluation of `version` on the engines of 1 and 2; then
   `publish_finished`.

`stream_final(engines, version)`: the same stream, the scheduler not told (the run's last version, for its final
held-out evaluation).

A cell that comes back inside a burst (no publication in flight: a cell sent back mid-step to make room) loads the
last publication from its policy directory (`policies/v<version>`, streamed from the files in buckets), waiting for
its write if it is still going (so `publication.policy_every` other than 1 is refused where that can happen:
`gyre.config.train.check_policy_every`). Before any publication a returning cell serves the weights it started
with.

A failed engine update stops the run: the engine was left out of the rest of the stream, its update aborted, and
it never accepts a call under weights that were not published (`gyre.engine.protocol.Engine.abort_update`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gyre.runtime.cell.stream import STREAM, PolicyParts, policy_key, stage_leaders
from gyre.runtime.controller.parts import wait_for_keys
from gyre.runtime.controller.transitions import stream_to_engines
from gyre.runtime.ids import engine_name
from gyre.runtime.job.policy_dir import POLICIES_DIR, finish_policy, stage_policy
from gyre.trainer.weight_stream import BucketPipe, stream_weights

if TYPE_CHECKING:
    from gyre.runtime.controller.loop import Controller

log = logging.getLogger(__name__)

__all__ = ["Publication"]

BUCKET_TIMEOUT_S = 600.0  # the next bucket of a stream comes within this (a collective stuck behind a dead rank)
POLICY_TIMEOUT_S = 3600.0  # every stage leader's policy parts are on disk within this


class Publication:
    """The last publication, the one in flight, the cells joining it and the policy directories being written."""

    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.version: int | None = None  # the last complete publication's version
        self.in_flight: asyncio.Task | None = None
        self._joining: dict[int, tuple[asyncio.Future, asyncio.Future]] = {}  # cell -> (engine ready, loaded)
        self._accepting = False  # whether the publication in flight still takes returning cells
        self._taken: dict[int, tuple[asyncio.Future, asyncio.Future]] = {}  # the cells its second stream serves
        self.policy_writes: dict[int, asyncio.Task] = {}  # version -> its policy directory's write
        self.count = 0  # publications complete

    # -- the scheduler's Publish -------------------------------------------------------------------------
    def publish(self, version: int) -> None:
        self._accepting = True
        self.in_flight = self.ctl.spawn(self._publish(version))

    async def join(self, cell: int, engine) -> None:
        """A cell coming back to rollout, its engine's memory resumed: load the publication in flight, the last one
        (module docstring), or nothing before any."""
        futures = self._joining.get(cell) or self._taken.get(cell)
        if futures is None and self._accepting and self.in_flight is not None and not self.in_flight.done():
            futures = self._joining[cell] = (asyncio.Future(), asyncio.Future())
        if futures is not None:
            ready, loaded = futures
            ready.set_result(engine)
            await loaded
            return
        if self.in_flight is not None and not self.in_flight.done():
            await asyncio.shield(self.in_flight)
        if self.version is None:
            return  # before any publication: the weights it started with
        await self._from_policy_dir(engine, self.version)

    def expect(self, cell: int) -> None:
        """A cell begins its way back while a publication is in flight: the publication waits for it (`join`)."""
        if self.in_flight is not None and not self.in_flight.done() and self._accepting:
            self._joining.setdefault(cell, (asyncio.Future(), asyncio.Future()))

    def joining_failed(self, cell: int, error: BaseException) -> None:
        """A returning cell failed before its engine was ready: the publication stops waiting for it."""
        futures = self._joining.get(cell) or self._taken.get(cell)
        if futures is not None and not futures[0].done():
            futures[0].set_exception(error)

    # -- the stream -----------------------------------------------------------------------------------------
    def _stream_args(self, dtype: str) -> dict:
        return {"dtype": dtype, "bucket_bytes": self.ctl.cfg.publication.bucket_bytes}

    async def _stream(self, engines: list, version: int) -> dict[str, float]:
        """The core's weights to `engines` as `version` (collective over the core: its other ranks are told)."""
        ctl = self.ctl
        fields = {**self._stream_args(ctl.cfg.engine.dtype), "forward": True}
        pipe = BucketPipe(slots=2)

        def start():
            if ctl.parts.job.layout.cell_size > 1:
                ctl.control.publish(STREAM, **fields)
            produce = functools.partial(
                stream_weights,
                ctl.cells.trainer,
                ctl.parts.model_config,
                dtype=getattr(torch, fields["dtype"]),
                bucket_bytes=fields["bucket_bytes"],
                sink=pipe,
                forward=True,
            )
            return ctl.trainer_thread.submit(produce)

        return await stream_to_engines(engines, pipe, start, version=version, timeout_s=BUCKET_TIMEOUT_S)

    async def _publish(self, version: int) -> None:
        try:
            await self._publish_to_all(version)
        except BaseException as error:
            for _, loaded in [*self._taken.values(), *self._joining.values()]:
                if not loaded.done():
                    loaded.set_exception(RuntimeError(f"the publication of version {version} failed: {error}"))
            raise
        finally:
            self._accepting = False
            self._taken = {}

    async def _publish_to_all(self, version: int) -> None:
        ctl = self.ctl
        begun = ctl.now()
        evaluation = ctl.held_out_engines
        if evaluation is not None:  # the held-out evaluation in flight is pinned to the engines' version: it ends first
            await evaluation.settled()
        waited = ctl.now()
        staying = ctl.cells.rollout_engines()  # with the separate pool's: it never leaves rollout
        streamed_to = list(staying.values())
        phases = {f"staying_{k}": v for k, v in (await self._stream(streamed_to, version) if staying else {}).items()}
        streamed = ctl.now()
        self._accepting = False
        self._taken, self._joining = self._joining, {}
        returning = {engine_name(cell): await ready for cell, (ready, _) in self._taken.items()}
        ready = ctl.now()
        if returning:
            phases |= {f"returning_{k}": v for k, v in (await self._stream(list(returning.values()), version)).items()}
        for _, loaded in self._taken.values():
            loaded.set_result(None)
        self.version = version
        self.count += 1
        phases |= {
            "held_out_wait": waited - begun,
            "staying": streamed - waited,
            "returning_wait": ready - streamed,
            "returning": ctl.now() - ready,
        }
        ctl.trace.publication(begun, ctl.now() - begun, version, phases)
        log.info(
            "published version %d: %d staying engines in %.2fs, %d returning in %.2fs%s",
            version,
            len(staying),
            streamed - waited,
            len(returning),
            ctl.now() - ready,
            f" (after the held-out evaluation's end: {waited - begun:.2f}s)" if waited - begun >= 0.01 else "",
        )
        every = ctl.cfg.publication.policy_every
        if every and self.count % every == 0:
            self.write_policy(version)  # its stream is ordered before any later step on every core rank
        if evaluation is not None and evaluation.due(version, ctl.sched.published_version):
            # before publish_finished: a cell the scheduler sends to training in its answer leaves the evaluation
            evaluation.start(version, {**staying, **returning}, wall_time_s=ctl.now(), spawn=ctl.spawn)
        ctl.apply(ctl.sched.publish_finished(ctl.now()))

    async def stream_final(self, engines: list, version: int) -> dict[str, float]:
        """The core's weights now to `engines` as `version`, by the same stream as a publication, the scheduler not
        told: the run's last version, after its last step, for its final held-out evaluation
        (`gyre.runtime.controller.held_out_engines.evaluate_final`)."""
        return await self._stream(engines, version)

    # -- the policy directory ------------------------------------------------------------------------------
    def write_policy(self, version: int) -> asyncio.Task:
        """Write the core's weights now as policy `version` (module docstring, 3): the stream is submitted at once
        (before any later work of the core); the returned task finishes the directory."""
        ctl = self.ctl
        if version in self.policy_writes:
            return self.policy_writes[version]
        dtype = ctl.cfg.trainer.dtype
        staging = stage_policy(ctl.run_dir, version)
        layout = ctl.parts.job.layout
        leaders = stage_leaders(layout.cell_size, ctl.cfg.trainer.pipeline_parallel_size)
        fields = {**self._stream_args(dtype), "forward": False, "policy": {"staging": str(staging), "version": version}}
        if layout.cell_size > 1:
            ctl.control.publish(STREAM, **fields)
        parts = PolicyParts(staging, writer=0)
        produce = functools.partial(
            stream_weights,
            ctl.cells.trainer,
            ctl.parts.model_config,
            dtype=getattr(torch, dtype),
            bucket_bytes=fields["bucket_bytes"],
            sink=parts,
            forward=False,
        )
        own = ctl.trainer_thread.submit(produce)
        task = ctl.spawn(self._finish_policy(version, staging, own, parts, [r for r in leaders if r]))
        self.policy_writes[version] = task
        for old in [v for v, t in self.policy_writes.items() if t.done() and v < version]:
            del self.policy_writes[old]
        return task

    async def _finish_policy(self, version: int, staging: Path, own, parts: PolicyParts, others: list[int]) -> Path:
        ctl = self.ctl
        begun = ctl.now()
        await own
        weight_map = dict(parts.weight_map)
        if others:
            keys = [policy_key(version, rank) for rank in others]
            job = ctl.parts.job

            def read() -> list[dict]:
                client = job.store()
                what = f"policy {version}'s parts were written by the stage leaders"
                wait_for_keys(client, keys, timeout_s=POLICY_TIMEOUT_S, stopping=lambda: ctl.stopping, what=what)
                maps = [json.loads(client.get(key)) for key in keys]
                for key in keys:
                    client.delete_key(key)
                return maps

            for part in await asyncio.to_thread(read):
                weight_map.update(part)
        path = await asyncio.to_thread(
            finish_policy,
            staging,
            weight_map=weight_map,
            config=ctl.parts.model_config,
            dtype=getattr(torch, ctl.cfg.trainer.dtype),
            source_dir=ctl.parts.model_dir,
            version=version,
            keep=ctl.cfg.publication.policy_keep,
        )
        log.info("policy %d written in %.2fs: %s", version, ctl.now() - begun, path)
        return path

    async def policy_dir(self, version: int) -> Path | None:
        """Policy `version`'s directory once written (waiting for a write in progress), None if it is not on disk."""
        writing = self.policy_writes.get(version)
        if writing is not None:
            return await asyncio.shield(writing)
        path = Path(self.ctl.run_dir) / POLICIES_DIR / f"v{version}"
        return path if path.is_dir() else None

    async def _from_policy_dir(self, engine, version: int) -> None:
        from gyre.runtime.controller.transitions import stream_checkpoint_to_engine

        path = await self.policy_dir(version)
        if path is None:
            raise RuntimeError(
                f"a cell returns to rollout inside a burst and needs policy version {version}, which is not on disk "
                f"(publication.policy_every={self.ctl.cfg.publication.policy_every}): set publication.policy_every=1"
            )
        await stream_checkpoint_to_engine(
            engine,
            path,
            version=version,
            dtype=getattr(torch, self.ctl.cfg.engine.dtype),
            bucket_bytes=self.ctl.cfg.publication.bucket_bytes,
        )
