"""A cell's engine at the two ends of its training role: the one correct order of the engine calls
(docs/runtime.md, "What happens at a transition"; the calls' contracts: `gyre.engine.protocol.Engine`).

- `leave_rollout(engine, drain_s=)`: the cell goes from rollout to training. `stop_accepting` (at once: the proxy's
  next call for this engine is refused and goes elsewhere), `drain(abort_after_s=drain_s)` (calls still in flight
  after `drain_s` seconds end as aborts with their partial output, so the wait is bounded), then `release_memory`
  (weights and KV; it needs the idle engine the drain left). The trainer's state is restored after it.
- `return_to_rollout(engine, weights, version=)`: the cell comes back at burst end with the core's publication.
  `resume_memory` (the engine's memory was released while the cell trained, and `update_weights` refuses released
  weights), `update_weights(weights, version=)`, then `resume_accepting`: the engine takes no request before it
  holds the published version. `Publish(version)` and the cell's `BeginTransition(ROLLOUT)` arrive in one action
  list; the controller runs this for the returning cell and `publish_to_engines` for the engines that stayed in
  rollout.
- `publish_to_engines(engines, weights, version=)`: whole weights handed to each engine (`Engine.update_weights`: in
  process, or over HTTP through `RemoteEngine`), concurrently; every engine checks names, shapes and the version
  before applying anything.
- `stream_to_engines(engines, pipe, start, version=)`: a publication by the weight stream
  (`gyre.trainer.weight_stream`): every engine opens an update (`begin_update`), `start()` starts the producer, each
  bucket from `pipe` goes to every engine at once (`load_bucket`) and its slot is returned before the next is taken,
  then `end_update`. An engine that fails is left out of the rest and its update aborted (`abort_update`: it stays
  not accepting); the stream still runs to its end (the core's ranks are inside its collectives), then the first
  failure is raised.
- `stream_checkpoint_to_engine(engine, path, version=, dtype=, bucket_bytes=)`: the same session from an HF-layout
  directory on disk (a policy directory), read in buckets.

Failures leave the engine not accepting: if `update_weights` refuses (an unknown name, a wrong shape, an older
version: `ValueError`, nothing applied), its error propagates with the memory resumed and the engine still not
accepting, so no request is ever served under weights that were not published. Calling the engine's methods in
another order raises as the protocol says (`EngineUnavailableError` from `update_weights` on released weights and
from `generate` while not accepting; `EngineBusyError` from `release_memory` with requests in flight).

The functions take any `Engine` (the native engine in process, a `RemoteEngine` behind the cell leader's endpoint);
they import no engine module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.config.checks import require_duration

if TYPE_CHECKING:
    import torch

    from gyre.engine.protocol import Engine
    from gyre.models.flat_weights import FlatWeights
    from gyre.trainer.weight_stream import BucketPipe

log = logging.getLogger(__name__)

__all__ = [
    "leave_rollout",
    "publish_to_engines",
    "return_to_rollout",
    "stream_checkpoint_to_engine",
    "stream_to_engines",
]


async def leave_rollout(engine: Engine, *, drain_s: float) -> dict[str, float]:
    """Stop accepting, drain (aborting what is still in flight after `drain_s` seconds), release the memory; the
    seconds of the `drain` and the `release`. `drain_s`: a finite number of seconds >= 0 (0 aborts every call in
    flight at the next step boundary)."""
    require_duration("drain_s", drain_s, allow_zero=True, note="a transition's wait is bounded")
    started = time.monotonic()
    engine.stop_accepting()
    await engine.drain(abort_after_s=drain_s)
    drained = time.monotonic()
    await engine.release_memory()
    return {"drain": drained - started, "release": time.monotonic() - drained}


async def return_to_rollout(engine: Engine, weights: FlatWeights, *, version: int) -> dict[str, float]:
    """Resume the memory, load `weights` as `version`, then accept: the engine serves the published version from
    its first request on; the seconds of the `resume` and of `load_weights`. A refused update raises with the engine
    resumed but not accepting."""
    started = time.monotonic()
    await engine.resume_memory()
    resumed = time.monotonic()
    await engine.update_weights(weights, version=version)
    engine.resume_accepting()
    return {"resume": resumed - started, "load_weights": time.monotonic() - resumed}


async def publish_to_engines(engines: Sequence[Engine], weights: FlatWeights, *, version: int) -> None:
    """`update_weights(weights, version=version)` on every engine at once; the first failure is raised after all
    finished (an engine that refused keeps its previous weights and version)."""
    results = await asyncio.gather(
        *(engine.update_weights(weights, version=version) for engine in engines), return_exceptions=True
    )
    for engine, result in zip(engines, results, strict=True):
        if isinstance(result, BaseException):
            raise RuntimeError(f"publishing version {version} to {engine!r} failed: {result}") from result


async def _abort(engines: Sequence[Engine]) -> None:
    for engine in engines:
        try:
            await engine.abort_update()
        except Exception as error:  # the engine is gone or refuses: it is not accepting either way
            log.warning("aborting the update of %r failed: %s", engine, error)


async def stream_to_engines(
    engines: Sequence[Engine],
    pipe: BucketPipe,
    start: Callable[[], asyncio.Future],
    *,
    version: int,
    timeout_s: float,
) -> dict[str, float]:
    """Publish `version` to `engines` by the weight stream (module docstring); the seconds it took to `open` the
    updates, `stream` the buckets and `end` the updates, and `bytes` sent (each bucket counted once)."""
    begun = time.monotonic()
    opened = await asyncio.gather(*(e.begin_update(version=version) for e in engines), return_exceptions=True)
    refused = [(e, r) for e, r in zip(engines, opened, strict=True) if isinstance(r, BaseException)]
    if refused:
        await _abort([e for e, r in zip(engines, opened, strict=True) if not isinstance(r, BaseException)])
        engine, error = refused[0]
        raise RuntimeError(f"publishing version {version} to {engine!r} failed: {error}") from error
    streaming = time.monotonic()
    failed: dict[int, BaseException] = {}
    sent = 0
    producing = start()
    try:
        while True:
            bucket = await asyncio.to_thread(pipe.get, timeout_s)
            if bucket is None:
                break
            live = [i for i in range(len(engines)) if i not in failed]
            loads = await asyncio.gather(*(engines[i].load_bucket(bucket) for i in live), return_exceptions=True)
            for i, result in zip(live, loads, strict=True):
                if isinstance(result, BaseException):
                    failed[i] = result
                    log.error("publishing version %d to %r failed: %s", version, engines[i], result)
            sent += bucket.buffer.numel()
            del bucket, loads
            pipe.release()
        await producing
    except BaseException as error:
        pipe.fail(error)
        with contextlib.suppress(BaseException):
            await producing
        await _abort(engines)
        raise
    streamed = time.monotonic()
    live = [i for i in range(len(engines)) if i not in failed]
    ends = await asyncio.gather(*(engines[i].end_update(version=version) for i in live), return_exceptions=True)
    failed |= {i: r for i, r in zip(live, ends, strict=True) if isinstance(r, BaseException)}
    if failed:
        await _abort([engines[i] for i in failed])
        i = min(failed)
        raise RuntimeError(f"publishing version {version} to {engines[i]!r} failed: {failed[i]}") from failed[i]
    ended = time.monotonic()
    return {"open": streaming - begun, "stream": streamed - streaming, "end": ended - streamed, "bytes": sent}


async def stream_checkpoint_to_engine(
    engine: Engine, path: Path, *, version: int, dtype: torch.dtype, bucket_bytes: int
) -> None:
    """Load the HF-layout directory `path` into `engine` as `version`, in buckets (module docstring)."""
    await engine.begin_update(version=version)
    try:
        from gyre.models.hf_weights import checkpoint_buckets

        buckets = checkpoint_buckets(Path(path), dtype=dtype, bucket_bytes=bucket_bytes)
        while (bucket := await asyncio.to_thread(next, buckets, None)) is not None:
            await engine.load_bucket(bucket)
        await engine.end_update(version=version)
    except BaseException:
        await _abort([engine])
        raise
