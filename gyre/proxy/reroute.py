"""The controller's side of a reroute: move an execution, with its calls in flight, to another engine.

Role: at a role transition the scheduler reroutes the executions of the cell leaving rollout
(`gyre.sched.types.Reroute`); the controller carries each one out with `reroute_execution`, on the event loop that
owns the routing table. The order is what makes the move invisible to the harness and keeps the routing table
equal to the scheduler's ledger (docs/proxy.md "Routing"):

1. (the caller, once per cell) `source.stop_accepting()`: no new call of the execution starts on the source;
2. for each call of the execution in flight on another engine (`RoutingTable.calls_in_flight`): `export_kv` on
   its engine (the request ends there with finish "abort"; under the scheduler placement the call then waits for
   a reassignment), `import_kv` on the destination, `release_export` on the source. Where the engine has no KV
   export (SGLang, `ScriptedEngine`: `NotImplementedError`) or the request is not running (queued, or just
   ended: `KeyError`), `abort` instead: the call re-prefills its context on the destination;
3. `RoutingTable.assign(execution, destination)`, last: it wakes the waiting calls, which continue on the
   destination from the tokens produced so far, after their KV is there.

Then (the caller) `await source.drain(abort_after_s=...)` as a backstop: a call that reached the source's
endpoint between the listing and `stop_accepting` taking effect is aborted there and follows the assignment too.
Under `placement="least_loaded"` step 2's dropped calls would continue at once on any accepting engine, before the
import; this protocol needs `placement="scheduler"`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gyre.engine.protocol import EngineUnavailableError
from gyre.proxy.routing import RoutingTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rerouted:
    """What `reroute_execution` did, by the calls' request ids on their source engines."""

    execution: str
    destination: str
    migrated: tuple[str, ...]  # KV exported and imported on the destination: the continuation prefills ~nothing
    restarted: tuple[str, ...]  # aborted (no KV export, not running, or the import failed): re-prefilled there

    @property
    def calls(self) -> int:
        return len(self.migrated) + len(self.restarted)


async def reroute_execution(
    table: RoutingTable, execution: str, destination: str, *, migrate_kv: bool = True
) -> Rerouted:
    """Move `execution` to `destination` with its calls in flight (module docstring: steps 2 and 3).

    `migrate_kv=False` aborts every call instead of exporting (re-prefill on the destination). An unknown
    destination is a `KeyError` before anything moved; a placement other than "scheduler" a `ValueError`."""
    if table.placement != "scheduler":
        raise ValueError(
            f"reroute_execution: the table's placement is {table.placement!r}: moving calls in flight in order "
            "needs placement='scheduler' (a least-loaded table resubmits a dropped call before the KV import)"
        )
    engines = table.engines
    if destination not in engines:
        raise KeyError(f"reroute_execution({execution!r}): unknown engine {destination!r}; known: {sorted(engines)}")
    target = engines[destination]
    migrated: list[str] = []
    restarted: list[str] = []
    for call in table.calls_in_flight(execution=execution):
        source = engines.get(call.engine) if call.engine is not None else None
        if source is None or call.engine == destination or call.engine_request_id is None:
            continue  # waiting for an engine, already there, or its engine left the table (its stream ends)
        request_id = call.engine_request_id
        export = None
        if migrate_kv:
            try:
                export = await source.export_kv(request_id)
            except (KeyError, NotImplementedError, EngineUnavailableError) as error:
                log.debug("execution %s: %s not exported from %s (%s)", execution, request_id, call.engine, error)
        if export is None:
            if source.abort(request_id):
                restarted.append(request_id)
            continue
        try:
            await target.import_kv(export)
            migrated.append(request_id)
        except (ValueError, EngineUnavailableError) as error:  # layout, version or free KV; destination gone
            log.warning("execution %s: KV of %s not imported on %s (%s)", execution, request_id, destination, error)
            restarted.append(request_id)
        finally:
            source.release_export(request_id)
    table.assign(execution, destination)
    return Rerouted(execution, destination, tuple(migrated), tuple(restarted))
