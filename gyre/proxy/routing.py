"""Routing and transparent retry: which engine serves an execution, and finishing a call the engine dropped.

Role: the controller's scheduler decides where executions run (`RoutingTable.assign`, or `drop_engine` when a cell
leaves rollout); the proxy runs each call through `generate_routed`, which asks the table for the execution's
engine and hides every reroute from the harness. Two placement policies (`RoutingTable(placement=)`):

- `"least_loaded"` (`gyre.serve`, no scheduler): an execution goes to its assigned engine while that one accepts,
  else to the least-occupied accepting engine, which the table remembers;
- `"scheduler"` (the training runtime): the table never picks. A call goes to the engine the controller assigned,
  and while there is none or it does not accept (draining at a role transition), the call waits until the
  controller assigns one that does. The routes are exactly the scheduler's capacity ledger.

Under either policy:

- an engine that refuses the call (`EngineUnavailableError`: draining, memory released, endpoint gone) is skipped
  (least-loaded: another accepting engine; scheduler: the assigned one once it accepts, or the next assigned);
- a call the engine ends with `finish_reason="abort"` that the proxy did not ask for (a drain with a deadline, a
  KV export for migration) continues from where it stopped: the new request's context is the prompt plus every
  token produced so far, its budget what is left, so the harness sees one uninterrupted stream (no token twice,
  none missing) and the call is recorded once, with each token's own behavior log-prob. Least-loaded: on another
  accepting engine at once. Scheduler: on the engine of an `assign` made after the call went to the engine that
  dropped it, which is what orders a KV migration (`export_kv` on the source, `import_kv` on the destination,
  then `assign`: the continuation reaches the destination only once the KV is there; docs/proxy.md "Routing");
- a call whose engine cannot be reached (`EngineUnreachable`: the endpoint died, its connection was refused or
  reset mid-stream) continues the same way, from the tokens that reached the proxy (the engine's KV is gone: the
  next engine re-prefills the prompt plus those tokens). First the table probes the engine once (`/load`); if that
  fails too, the engine is lost (`mark_lost`): it leaves the table, so no call goes there again, and each
  execution routed to it is assigned to the least-loaded live engine (or where `on_engine_lost` reassigns it);
- when no engine accepts, the call waits (woken by `assign`, else polling) up to `wait_s`, then `NoEngineError`;
  at once when every engine of the table is lost (nothing is left to wait for).

`RoutingTable.calls_in_flight` lists the calls running through `generate_routed` with the engine each is on and
its request id there (the handle for `export_kv` and `abort`). The engines are anything implementing
`gyre.engine.protocol.Engine` (in-process `NativeEngine`, `RemoteEngine`). The table belongs to one event loop:
call it from that loop's thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from array import array
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gyre.engine.errors import EngineUnreachable, RemoteEngineError
from gyre.engine.protocol import Engine, EngineUnavailableError, GenerateRequest

log = logging.getLogger(__name__)

PLACEMENTS = ("least_loaded", "scheduler")
POLL_S = (
    0.05  # how often a waiting call looks again for an accepting engine (its execution's `assign` wakes it at once)
)
PROBE_TIMEOUT_S = 10.0  # an unreachable engine whose `/load` is not answered in this long is lost


class NoEngineError(RuntimeError):
    """No engine accepted the call within the wait (every engine draining, released or gone; under the scheduler's
    placement: none assigned that accepts)."""


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
    continuation_cached_tokens: int = 0  # context tokens the continuations did not prefill (imported KV, prefix reuse)
    failed_over: int = 0  # times the call's engine was unreachable (died mid-call) and the call went on elsewhere
    routed_experts: Any = field(default=None, compare=False)  # the last attempt's (it covers the request's whole
    # span from routed_experts_start: a continuation asks from the same start); None unless asked

    @property
    def attempts(self) -> int:
        """Engines that produced part of the call (1 = no reroute)."""
        return len(self.engines)


@dataclass(frozen=True)
class CallInFlight:
    """A call running through `generate_routed`, as the controller sees it (`RoutingTable.calls_in_flight`)."""

    call_id: str  # the call's own request id (the proxy's response id)
    execution: str
    engine: str | None  # the engine serving it now; None while it waits for one
    engine_request_id: str | None  # its request id on that engine (the handle for export_kv and abort); None waiting
    attempt: int  # 0 on its first engine, one more per continuation
    produced: int  # output tokens it had when this attempt started


@dataclass(frozen=True)
class EngineLost:
    """An engine the table counted lost (`RoutingTable.mark_lost`), and where its executions went."""

    engine: str
    reason: str  # what failed: the call's connection error and the probe's
    moved: Mapping[str, str]  # execution -> the live engine the table assigned it to (least loaded)
    unplaced: tuple[str, ...]  # executions routed to it for which no live engine accepted (their route is removed)


@dataclass(eq=False)
class _Waiters:
    """Calls of one execution waiting for its next `assign`."""

    assigned: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    count: int = 0


class RoutingTable:
    """Execution -> engine name, the engines by name, and the calls in flight. Owned by the controller; one loop.

    `placement="least_loaded"` (the default, `gyre.serve`) places an execution nobody assigned, or whose engine does
    not accept, on the least-occupied accepting engine; `placement="scheduler"` (the training runtime) only ever
    routes to the engine `assign` named, and calls wait for it (module docstring, docs/proxy.md "Routing").

    `on_engine_lost(event)` is called once per engine the table counts lost (`EngineLost`), on the table's loop,
    after the table moved that engine's executions to the least-loaded live engines (`event.moved`): the owner
    mirrors the moves into its own placement (the scheduler's ledger) or reassigns them with `assign` before it
    returns, which every waiting call then follows (they resume only after it returned). It must not raise."""

    def __init__(
        self,
        engines: Mapping[str, Engine] | None = None,
        *,
        placement: str = "least_loaded",
        on_engine_lost: Callable[[EngineLost], None] | None = None,
    ):
        if placement not in PLACEMENTS:
            raise ValueError(
                f"placement={placement!r} is not allowed: expected one of {list(PLACEMENTS)} (least_loaded: the table "
                "places executions itself; scheduler: only where `assign` says)"
            )
        self.placement = placement
        self._engines: dict[str, Engine] = dict(engines or {})
        self._routes: dict[str, str] = {}
        self._assignments: dict[str, int] = {}  # execution -> number of its latest assign (one counter per table)
        self._assign_numbers = itertools.count(1)
        self._waiters: dict[str, _Waiters] = {}
        self._calls: dict[str, dict[int, CallInFlight]] = {}  # execution -> call serial -> the call, oldest first
        self._call_serials = itertools.count()
        self.on_engine_lost = on_engine_lost
        self._lost: dict[str, EngineLost] = {}  # engines counted lost, in order, until added again
        self._probes: dict[str, asyncio.Task] = {}  # engine name -> its running probe (one per engine at a time)

    @property
    def engines(self) -> dict[str, Engine]:
        """The live engines (a lost one is not among them)."""
        return dict(self._engines)

    @property
    def lost_engines(self) -> dict[str, EngineLost]:
        """The engines counted lost (`mark_lost`) and not added again since, oldest first."""
        return dict(self._lost)

    def add_engine(self, name: str, engine: Engine) -> None:
        """Add (or replace) an engine; a lost engine's name added again is live again."""
        self._lost.pop(name, None)
        self._engines[name] = engine

    def drop_engine(self, name: str) -> None:
        """The engine leaves rollout: executions routed to it move on their next call (least-loaded: to another
        accepting engine; scheduler: to the engine their next `assign` names)."""
        self._engines.pop(name, None)
        for execution in [e for e, n in self._routes.items() if n == name]:
            del self._routes[execution]

    def assign(self, execution: str, name: str) -> None:
        """The scheduler's placement (`Start`) or reroute (`Reroute`) of an execution; wakes its waiting calls.

        An engine counted lost is never assigned: the execution goes to the least-loaded live engine instead (a
        warning: the owner's placement still names the dead engine), or, with none, its route is removed."""
        if name in self._lost:
            live = self._least_loaded({})
            log.warning("assign(%r, %r): that engine is lost; assigned to %s instead", execution, name, live)
            if live is None:
                self._routes.pop(execution, None)
                return
            name = live
        if name not in self._engines:
            raise KeyError(f"assign({execution!r}): unknown engine {name!r}; known: {sorted(self._engines)}")
        self._routes[execution] = name
        self._assignments[execution] = next(self._assign_numbers)
        waiters = self._waiters.pop(execution, None)
        if waiters is not None:
            waiters.assigned.set()

    def mark_lost(self, name: str, reason: str) -> EngineLost | None:
        """Count engine `name` lost (its endpoint died): it leaves the table (no call goes there again), each
        execution routed to it is assigned to the least-loaded live accepting engine (their waiting calls wake),
        then `on_engine_lost` hears of it. None if `name` is not a live engine of the table."""
        if name not in self._engines:
            return None
        del self._engines[name]
        moved: dict[str, str] = {}
        unplaced: list[str] = []
        added: dict[str, int] = {}  # executions this loss put on each engine, so they spread across equal engines
        for execution in [e for e, n in self._routes.items() if n == name]:
            destination = self._least_loaded(added)
            if destination is None:
                del self._routes[execution]
                unplaced.append(execution)
                continue
            added[destination] = added.get(destination, 0) + 1
            moved[execution] = destination
            self.assign(execution, destination)
        event = self._lost[name] = EngineLost(name, reason, moved, tuple(unplaced))
        log.warning(
            "engine %s lost (%s): %d executions moved, %d with no live engine", name, reason, len(moved), len(unplaced)
        )
        if self.on_engine_lost is not None:
            self.on_engine_lost(event)
        return event

    async def check_unreachable(self, name: str, engine: Engine, error: BaseException) -> bool:
        """A call could not reach `engine` (`EngineUnreachable`): probe it once (its `refresh_load`, bounded by
        `PROBE_TIMEOUT_S`; calls that fail on it meanwhile share the probe) and `mark_lost` it if that fails too.
        True if the engine is lost now. An engine that left the table or was replaced meanwhile is not probed."""
        if name in self._lost:
            return True
        if self._engines.get(name) is not engine:
            return False
        probe = self._probes.get(name)
        if probe is None:
            probe = self._probes[name] = asyncio.ensure_future(self._probe(name, engine, str(error)))
        await asyncio.shield(probe)  # a cancelled call (the harness left) leaves the probe to finish
        return name in self._lost

    async def _probe(self, name: str, engine: Engine, reason: str) -> None:
        try:
            refresh = getattr(engine, "refresh_load", None)  # an in-process engine has nothing to probe
            if refresh is not None:
                try:
                    await asyncio.wait_for(refresh(), PROBE_TIMEOUT_S)
                    return  # it answered: alive (the connection broke, not the engine)
                except EngineUnreachable as answer:
                    reason = f"{reason}; probe: {answer}"
                except TimeoutError:
                    reason = f"{reason}; probe: no answer to /load in {PROBE_TIMEOUT_S} s"
                except (EngineUnavailableError, RemoteEngineError, ValueError):
                    return  # it answered, with an error status: alive
            if self._engines.get(name) is engine:
                self.mark_lost(name, reason)
        finally:
            self._probes.pop(name, None)

    def route_of(self, execution: str) -> str | None:
        return self._routes.get(execution)

    def assignment(self, execution: str) -> int:
        """The number of the execution's latest `assign` (0: never assigned); a later `assign` has a larger one."""
        return self._assignments.get(execution, 0)

    def engine_for(self, execution: str, *, avoid: frozenset[str] = frozenset()) -> tuple[str, Engine] | None:
        """The execution's engine if it accepts (and is not in `avoid`), else: least-loaded placement, the
        least-loaded accepting one (remembered); scheduler placement, None (the table never picks). None if none."""
        name = self._routes.get(execution)
        if name is not None and name not in avoid and _accepting(self._engines.get(name)):
            return name, self._engines[name]
        if self.placement == "scheduler":
            return None
        candidates = [(n, e) for n, e in self._engines.items() if n not in avoid and _accepting(e)]
        if not candidates:
            return None
        name, engine = min(candidates, key=lambda item: (_occupancy(item[1]), item[0]))
        self._routes[execution] = name
        return name, engine

    async def wait_for_engine(
        self,
        execution: str,
        *,
        wait_s: float,
        avoid: frozenset[str] = frozenset(),
        assigned_after: int = -1,
    ) -> tuple[str, Engine]:
        """`engine_for` until an engine accepts, looking again at the execution's next `assign` or every `POLL_S`;
        after `wait_s` (and at least one look) `NoEngineError`.

        Least-loaded placement: an engine in `avoid` (it just failed the call) is taken only if no other accepts.
        Scheduler placement: only the engine of an `assign` numbered above `assigned_after` (a call its engine
        dropped waits for the controller's reassignment), and an engine in `avoid` only after one wait."""
        deadline = time.monotonic() + wait_s
        first = True
        while True:
            found = self._look(
                execution, avoid if first or self.placement != "scheduler" else frozenset(), assigned_after
            )
            if found is not None:
                return found
            if self._lost and not self._engines:
                raise NoEngineError(
                    f"no engine left for a call of execution {execution!r}: every engine of the table is lost "
                    f"(unreachable: {', '.join(self._lost)})"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoEngineError(self._no_engine_message(execution, wait_s))
            await self._until_assigned(execution, timeout_s=min(POLL_S, remaining))
            first = False

    def calls_in_flight(self, *, execution: str | None = None, engine: str | None = None) -> tuple[CallInFlight, ...]:
        """The calls running through `generate_routed` now: of `execution`, on `engine`, or all (each execution's
        oldest first). A snapshot: by the time it is used a call may have ended (`export_kv` raises `KeyError`)."""
        if execution is not None:
            calls = list(self._calls.get(execution, {}).values())
        else:
            calls = [call for by_serial in self._calls.values() for call in by_serial.values()]
        if engine is not None:
            calls = [call for call in calls if call.engine == engine]
        return tuple(calls)

    def _look(self, execution: str, avoid: frozenset[str], assigned_after: int) -> tuple[str, Engine] | None:
        if self.placement == "scheduler":
            if self.assignment(execution) <= assigned_after:
                return None
            return self.engine_for(execution, avoid=avoid)
        found = self.engine_for(execution, avoid=avoid)
        if found is None and avoid:
            found = self.engine_for(execution)  # an engine that failed before may be back
        return found

    async def _until_assigned(self, execution: str, *, timeout_s: float) -> None:
        """Return at the execution's next `assign`, or after `timeout_s`."""
        waiters = self._waiters.get(execution)
        if waiters is None:
            waiters = self._waiters[execution] = _Waiters()
        waiters.count += 1
        try:
            await asyncio.wait_for(waiters.assigned.wait(), timeout_s)
        except TimeoutError:
            pass
        finally:
            waiters.count -= 1
            if waiters.count == 0 and self._waiters.get(execution) is waiters:
                del self._waiters[execution]

    def _least_loaded(self, added: Mapping[str, int]) -> str | None:
        """The live accepting engine of the least occupancy, counting `added` more executions on each; ties by
        name. None if none accepts."""
        candidates = [(n, e) for n, e in self._engines.items() if _accepting(e)]
        if not candidates:
            return None

        def occupancy(item: tuple[str, Engine]) -> tuple[float, str]:
            load = item[1].load()
            return (load.running + load.queued + added.get(item[0], 0)) / max(1, load.capacity), item[0]

        return min(candidates, key=occupancy)[0]

    def _no_engine_message(self, execution: str, wait_s: float) -> str:
        message = f"no engine accepted a call of execution {execution!r} within {wait_s} s"
        if self.placement == "scheduler":
            route = self._routes.get(execution)
            message += (
                f" (placement 'scheduler': the call waits for the controller to assign it an accepting engine; "
                f"assigned: {route if route is not None else 'none'})"
            )
        return message

    def _open_call(self, request: GenerateRequest) -> int:
        serial = next(self._call_serials)
        self._track(serial, CallInFlight(request.request_id, request.execution_id, None, None, 0, 0))
        return serial

    def _track(self, serial: int, call: CallInFlight) -> None:
        self._calls.setdefault(call.execution, {})[serial] = call

    def _close_call(self, execution: str, serial: int) -> None:
        by_serial = self._calls.get(execution)
        if by_serial is not None:
            by_serial.pop(serial, None)
            if not by_serial:
                del self._calls[execution]


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

    The call is listed in `table.calls_in_flight` from its start to its end. Closing the iterator early aborts the
    call on its current engine (the harness went away). Errors in the request itself (`ValueError`) propagate on
    the first attempt: they would fail on any engine.
    """
    started = time.monotonic()
    execution = request.execution_id
    produced: list[int] = []
    budget = request.params.max_new_tokens
    engines: list[str] = []
    avoid: set[str] = set()
    dropped_at = -1  # scheduler placement: the assignment the call was on when its engine dropped it
    cached = 0  # prompt tokens whose KV the first engine reused (its final chunk says)
    continuation_cached = 0
    failed_over = 0  # times its engine was unreachable
    first_token_s = None
    serial = table._open_call(request)
    try:
        for attempt in range(max_attempts):
            name, engine = await table.wait_for_engine(
                execution, wait_s=wait_s, avoid=frozenset(avoid), assigned_after=dropped_at
            )
            assignment = table.assignment(execution)
            sub = request if not produced and attempt == 0 else _continuation(request, produced, attempt)
            table._track(
                serial, CallInFlight(request.request_id, execution, name, sub.request_id, attempt, len(produced))
            )
            before, finish, unreachable, routed = len(produced), None, None, None
            try:
                async for chunk in engine.generate_stream(sub):
                    if chunk.token_ids:
                        if first_token_s is None:
                            first_token_s = time.monotonic() - started
                        produced.extend(chunk.token_ids)
                        yield RoutedTokens(chunk.token_ids, chunk.logprobs, chunk.policy_version, name)
                    finish = chunk.finish_reason
                    if finish is not None:
                        routed = chunk.routed_experts
                        if attempt == 0:
                            cached = chunk.cached_tokens or 0
                        else:
                            continuation_cached += chunk.cached_tokens or 0
            except EngineUnreachable as error:
                finish, unreachable = None, error  # its endpoint died, or the connection to it broke
            except EngineUnavailableError:
                finish = None  # refused the call (draining, memory released)
            table._track(serial, CallInFlight(request.request_id, execution, None, None, attempt, len(produced)))
            if unreachable is not None:
                # the engine is lost unless a probe reaches it; the call goes on from the tokens received, on the
                # engine its execution is assigned to now (the loss assigned it to a live one)
                failed_over += 1
                await table.check_unreachable(name, engine, unreachable)
            if len(produced) > before and name not in engines:
                engines.append(name)
            if finish is None or (finish == "abort" and len(produced) < budget):
                # refused, or dropped (drain deadline, migration): continue elsewhere from the tokens so far
                avoid = avoid | {name} if finish is None else {name}
                if finish == "abort" and table.placement == "scheduler":
                    dropped_at = assignment  # continue where the controller reassigns it (after any KV import)
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
                continuation_cached_tokens=continuation_cached,
                failed_over=failed_over,
                routed_experts=routed,
            )
            return
        raise NoEngineError(f"call {request.request_id!r} was dropped by engines {max_attempts} times; giving up")
    finally:
        table._close_call(execution, serial)
