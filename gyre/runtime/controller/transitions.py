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
- `publish_to_engines(engines, weights, version=)`: the core's publication (`gyre.trainer.publish.engine_weights`)
  handed to each engine that stayed in rollout (`Engine.update_weights`: in process, or over HTTP through
  `RemoteEngine`), concurrently; every engine checks names, shapes and the version before applying anything. One
  rank of the core publishes.

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
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gyre.config.checks import require_duration

if TYPE_CHECKING:
    from gyre.engine.protocol import Engine
    from gyre.models.flat_weights import FlatWeights

__all__ = ["leave_rollout", "publish_to_engines", "return_to_rollout"]


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
