"""Routing and transparent retry: which engine serves an execution, and finishing a call the engine dropped.

Role: the controller's scheduler decides where executions run (`RoutingTable.assign`, or `drop_engine` when a cell
leaves rollout); the proxy asks `RoutingTable.engine_for` per call and runs each call through `generate_routed`,
which hides every reroute from the harness:

- an engine that refuses the call (`EngineUnavailableError`: draining, memory released, endpoint gone) is skipped
  and the call goes to another accepting engine;
- a call the engine ends with `finish_reason="abort"` that the proxy did not ask for (a drain with a deadline, a
  KV export for migration) continues on another engine from where it stopped: the new request's context is the
  prompt plus every token produced so far, its budget what is left, so the harness sees one uninterrupted stream
  (no token twice, none missing) and the call is recorded once, with each token's own behavior log-prob;
- when no engine accepts, the call waits (polling) up to `wait_s` before failing with `NoEngineError`.

The engines are anything implementing `gyre.engine.protocol.Engine` (in-process `NativeEngine`, `RemoteEngine`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from array import array
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from gyre.engine.protocol import Engine, EngineUnavailableError, GenerateRequest

POLL_S = 0.05  # how often a waiting call looks for an accepting engine


class NoEngineError(RuntimeError):
    """No engine accepted the call within the wait (every engine draining, released or gone)."""


@dataclass(frozen=True)
class RoutedTokens:
    """New output tokens of a routed call, with the engine and weights version that produced them."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_version: int
    engine: str


@dataclass(frozen=True)
class RoutedFinish:
    """How a routed call ended: the engine's finish reason ("stop" | "length" | "abort" if the caller aborted)."""

    finish_reason: str
    cached_tokens: int  # of the first attempt (KV reuse on the engine that started it)
    engines: tuple[str, ...]  # engines that produced part of it, in order
    first_token_s: float | None  # seconds from the call's start to its first token
    total_s: float

    @property
    def attempts(self) -> int:
        """Engines that produced part of the call (1 = no reroute)."""
        return len(self.engines)


class RoutingTable:
    """Execution -> engine name, plus the engines by name. Owned by the controller; not thread-safe (one loop)."""

    def __init__(self, engines: Mapping[str, Engine] | None = None):
        self._engines: dict[str, Engine] = dict(engines or {})
        self._routes: dict[str, str] = {}

    @property
    def engines(self) -> dict[str, Engine]:
        return dict(self._engines)

    def add_engine(self, name: str, engine: Engine) -> None:
        self._engines[name] = engine

    def drop_engine(self, name: str) -> None:
        """The engine leaves rollout: executions routed to it move on their next call."""
        self._engines.pop(name, None)
        for execution in [e for e, n in self._routes.items() if n == name]:
            del self._routes[execution]

    def assign(self, execution: str, name: str) -> None:
        """The scheduler's placement (or reroute) of an execution."""
        if name not in self._engines:
            raise KeyError(f"assign({execution!r}): unknown engine {name!r}; known: {sorted(self._engines)}")
        self._routes[execution] = name

    def route_of(self, execution: str) -> str | None:
        return self._routes.get(execution)

    def engine_for(self, execution: str, *, avoid: frozenset[str] = frozenset()) -> tuple[str, Engine] | None:
        """The execution's engine if it accepts, else the least-loaded accepting one (remembered); None if none."""
        name = self._routes.get(execution)
        if name is not None and name not in avoid and _accepting(self._engines.get(name)):
            return name, self._engines[name]
        candidates = [(n, e) for n, e in self._engines.items() if n not in avoid and _accepting(e)]
        if not candidates:
            return None
        name, engine = min(candidates, key=lambda item: (_occupancy(item[1]), item[0]))
        self._routes[execution] = name
        return name, engine

    async def wait_for_engine(self, execution: str, *, wait_s: float, avoid: frozenset[str] = frozenset()):
        """`engine_for`, polling until one accepts; after `wait_s` (and at least one look) `NoEngineError`."""
        deadline = time.monotonic() + wait_s
        while True:
            found = self.engine_for(execution, avoid=avoid)
            if found is None and avoid:
                found = self.engine_for(execution)  # an engine that failed before may be back
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                raise NoEngineError(f"no engine accepted a call of execution {execution!r} within {wait_s} s")
            await asyncio.sleep(POLL_S)


def _continuation(request: GenerateRequest, produced: list[int], attempt: int) -> GenerateRequest:
    """The call resumed elsewhere: its prompt plus the tokens produced so far, the rest of its budget."""
    return dataclasses.replace(
        request,
        request_id=f"{request.request_id}~{attempt}",
        input_ids=request.input_ids + array("i", produced),
        params=dataclasses.replace(request.params, max_new_tokens=request.params.max_new_tokens - len(produced)),
    )


def _accepting(engine: Engine | None) -> bool:
    if engine is None:
        return False
    load = engine.load()
    return load.accepting and not load.memory_released


def _occupancy(engine: Engine) -> float:
    load = engine.load()
    return (load.running + load.queued) / max(1, load.capacity)


async def generate_routed(
    table: RoutingTable,
    request: GenerateRequest,
    *,
    wait_s: float = 600.0,
    max_attempts: int = 16,
) -> AsyncIterator[RoutedTokens | RoutedFinish]:
    """Run `request` to its end across engines; yields `RoutedTokens` as they come, then one `RoutedFinish`.

    Closing the iterator early aborts the call on its current engine (the harness went away). Errors in the
    request itself (`ValueError`) propagate on the first attempt: they would fail on any engine.
    """
    started = time.monotonic()
    produced: list[int] = []
    budget = request.params.max_new_tokens
    engines: list[str] = []
    avoid: set[str] = set()
    cached = 0  # prompt tokens whose KV the first engine reused (its final chunk says)
    first_token_s = None
    for attempt in range(max_attempts):
        name, engine = await table.wait_for_engine(request.execution_id, wait_s=wait_s, avoid=frozenset(avoid))
        sub = request if not produced and attempt == 0 else _continuation(request, produced, attempt)
        before, finish = len(produced), None
        try:
            async for chunk in engine.generate_stream(sub):
                if chunk.token_ids:
                    if first_token_s is None:
                        first_token_s = time.monotonic() - started
                    produced.extend(chunk.token_ids)
                    yield RoutedTokens(chunk.token_ids, chunk.logprobs, chunk.policy_version, name)
                finish = chunk.finish_reason
                if finish is not None and attempt == 0:
                    cached = chunk.cached_tokens or 0
        except EngineUnavailableError:
            finish = None  # refused the call, or its endpoint went away mid-stream
        if len(produced) > before and name not in engines:
            engines.append(name)
        if finish is None or (finish == "abort" and len(produced) < budget):
            # refused, or dropped (drain deadline, migration): continue elsewhere from the tokens so far
            avoid = avoid | {name} if finish is None else {name}
            continue
        if finish == "abort":
            finish = "length"  # dropped exactly at its budget: nothing was lost
        if name not in engines:
            engines.append(name)
        yield RoutedFinish(
            finish_reason=finish,
            cached_tokens=cached,
            engines=tuple(engines),
            first_token_s=first_token_s,
            total_s=time.monotonic() - started,
        )
        return
    raise NoEngineError(f"call {request.request_id!r} was dropped by engines {max_attempts} times; giving up")
