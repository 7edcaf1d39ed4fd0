"""The proxy's own counters of the calls it served: per route, per dialect, per execution (docs/proxy.md, "Counters").

Role: `gyre.proxy.server` bumps a route's `RouteCounters` as a call goes (a few integer increments per call, cheap
enough for the hot path: docs/proxy.md, "Performance"), and `ProxyServer.stats()` / `GET /gyre/stats` read them as
one JSON-able dict. Pure: no IO, no HTTP.

Contract, per route (each model-call and token-counting route of each dialect):
- `requests`: every request the route received.
- `admitted`: calls that passed admission (key, body, dialect, model, prompt built) and went to the engines.
- exactly one outcome per request once it has ended: `answered` (a 2xx; for a stream, its end event was sent),
  `refused[kind]` (a 4xx `ApiError`, by kind), `failed[kind]` (a 5xx, by kind, also when a stream ended with the
  dialect's error event; `unhandled` for an exception the proxy did not expect, which aiohttp answers with a 500),
  `hung_up` (the client went away, or the proxy stopped, before the call was answered). So `requests` minus the sum
  of the outcomes is the number of requests still running.
- `rerouted`: admitted calls that ran on more than one engine (`RoutedFinish.attempts > 1`); `kv_migrated`: those
  whose continuations reused imported KV (`RoutedFinish.continuation_cached_tokens > 0`); `failed_over`: those
  whose engine became unreachable mid-call and that went on on another engine (`RoutedFinish.failed_over > 0`).
- `recorded`: calls written to their execution's tree and record file (once each, hung-up calls included).
Per execution (`SessionRegistry.calls_recorded`, open and closed executions of the run): the calls recorded.
Per engine the routing table counted lost (`RoutingTable.lost_engines`): why, and how many executions it moved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gyre.proxy.conversation import ApiError

# The integer counters of a route, in the order `as_dict` writes them.
COUNTS = ("requests", "admitted", "answered", "hung_up", "rerouted", "kv_migrated", "failed_over", "recorded")


class RouteCounters:
    """The counters of one route (module docstring). Plain attributes: the server increments them in place."""

    __slots__ = ("route", "dialect", *COUNTS, "refused", "failed")

    def __init__(self, route: str, dialect: str):
        self.route, self.dialect = route, dialect
        self.requests = self.admitted = self.answered = self.hung_up = 0
        self.rerouted = self.kv_migrated = self.failed_over = self.recorded = 0
        self.refused: dict[str, int] = {}  # ApiError kind -> 4xx answers
        self.failed: dict[str, int] = {}  # ApiError kind (or "unhandled") -> 5xx answers and in-stream errors

    def ended_with(self, error: ApiError) -> None:
        """The request was answered with `error` (a 4xx is refused, a 5xx failed)."""
        table = self.failed if error.status >= 500 else self.refused
        table[error.kind] = table.get(error.kind, 0) + 1

    def ended_unhandled(self) -> None:
        self.failed["unhandled"] = self.failed.get("unhandled", 0) + 1

    def finished(self, attempts: int, continuation_cached_tokens: int, failed_over: int = 0) -> None:
        """An admitted call's routed run ended (`RoutedFinish`): count a reroute, a KV migration, a failover."""
        if attempts > 1:
            self.rerouted += 1
        if continuation_cached_tokens > 0:
            self.kv_migrated += 1
        if failed_over > 0:
            self.failed_over += 1

    def as_dict(self) -> dict[str, Any]:
        counts: dict[str, Any] = {name: getattr(self, name) for name in COUNTS}
        counts["refused"] = dict(self.refused)
        counts["failed"] = dict(self.failed)
        return counts


def _empty() -> dict[str, Any]:
    return {**dict.fromkeys(COUNTS, 0), "refused": {}, "failed": {}}


def _add(total: dict[str, Any], counts: Mapping[str, Any]) -> None:
    for name in COUNTS:
        total[name] += counts[name]
    for table in ("refused", "failed"):
        for kind, n in counts[table].items():
            total[table][kind] = total[table].get(kind, 0) + n


class ProxyStats:
    """The counters of every counted route of one server."""

    def __init__(self) -> None:
        self.routes: dict[str, RouteCounters] = {}

    def route(self, route: str, dialect: str) -> RouteCounters:
        """The counters of `route` (made once, at the server's start-up)."""
        if route in self.routes:
            raise ValueError(f"route {route!r} is counted already (dialect {self.routes[route].dialect!r})")
        counters = self.routes[route] = RouteCounters(route, dialect)
        return counters

    def snapshot(
        self, calls_recorded: Mapping[str, int], engines_lost: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """`{"routes": {route: counts}, "dialects": {dialect: counts}, "total": counts, "executions": {execution:
        {"recorded": n}}, "engines_lost": {engine: {"reason", "moved", "unplaced"}}}`, counts as in
        `RouteCounters.as_dict`, from `calls_recorded` (execution -> calls) and `engines_lost` (engine name ->
        `gyre.proxy.routing.EngineLost`, or anything with its `reason`, `moved` and `unplaced`)."""
        routes = {route: counters.as_dict() for route, counters in self.routes.items()}
        dialects: dict[str, dict[str, Any]] = {}
        total = _empty()
        for counters in self.routes.values():
            counts = routes[counters.route]
            _add(dialects.setdefault(counters.dialect, _empty()), counts)
            _add(total, counts)
        executions = {execution: {"recorded": n} for execution, n in calls_recorded.items()}
        lost = {
            name: {"reason": event.reason, "moved": len(event.moved), "unplaced": len(event.unplaced)}
            for name, event in (engines_lost or {}).items()
        }
        return {"routes": routes, "dialects": dialects, "total": total, "executions": executions, "engines_lost": lost}


def outcomes(counts: Mapping[str, Any]) -> int:
    """The requests of `counts` (one route's, a dialect's or the total) that have ended, whatever their outcome."""
    return counts["answered"] + counts["hung_up"] + sum(counts["refused"].values()) + sum(counts["failed"].values())


def merged(snapshots: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One snapshot of several servers' (`ProxyStats.snapshot`: the proxy shards of one run, docs/proxy.md,
    "Shards"): counts added route by route, dialect by dialect and in total; executions joined (each lives on one
    shard); an engine lost on several shards once, its moved and unplaced executions added."""
    routes: dict[str, dict[str, Any]] = {}
    dialects: dict[str, dict[str, Any]] = {}
    total = _empty()
    executions: dict[str, Any] = {}
    lost: dict[str, dict[str, Any]] = {}
    for snapshot in snapshots:
        for route, counts in snapshot["routes"].items():
            _add(routes.setdefault(route, _empty()), counts)
        for dialect, counts in snapshot["dialects"].items():
            _add(dialects.setdefault(dialect, _empty()), counts)
        _add(total, snapshot["total"])
        executions.update(snapshot["executions"])
        for name, event in snapshot["engines_lost"].items():
            seen = lost.setdefault(name, {"reason": event["reason"], "moved": 0, "unplaced": 0})
            seen["moved"] += event["moved"]
            seen["unplaced"] += event["unplaced"]
    return {"routes": routes, "dialects": dialects, "total": total, "executions": executions, "engines_lost": lost}
