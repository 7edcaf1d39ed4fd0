"""The proxy as the controller sees it: one front over the proxy on its own loop, or over proxy shards.

Role: the controller opens each execution on an engine, reroutes it, closes it when its harness ends and reads its
trajectory tree, through `LocalFront` (`proxy.shards = 0`: the proxy serves on the controller's event loop, the
tree is the live session's) or `ShardedFront` (`proxy.shards = N`: `gyre.proxy.shards`, the tree read back from
the execution's record file once its shard closed it). docs/proxy.md, "Shards"; docs/runtime.md, "The controller".

Contract (both fronts)
- `open(execution, engine)` -> `Opened`: the harness's key and base URLs at once; `await opened.ready` before the
  harness calls (a shard has taken the key).
- `close(execution)` returns at once (the harness ended: its key stops working); `await closed(execution)` returns
  once the execution's calls in flight have ended and its tree is final, or after `CLOSE_WAIT_S`.
- `tree(execution)`: after `closed`, the execution's tree (None for an execution this front never opened).
- `watch()` raises once the proxy can serve no more (a shard died), which ends the run.
- `reroute`, `in_flight`, `stats()`, `stop()`, `on_engine_lost` as `gyre.proxy.reroute`, `gyre.proxy.in_flight`,
  `ProxyServer.stats`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.harness.episode import ProxyAccess
from gyre.proxy.reroute import Rerouted, reroute_execution
from gyre.proxy.sessions import new_key
from gyre.traj.store import load_tree

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 60.0  # a closed execution's call still in flight (a hung-up harness's) gets this long to be recorded


@dataclass(frozen=True)
class Opened:
    key: str
    access: ProxyAccess
    ready: asyncio.Future


def _access(url: str, model: str) -> ProxyAccess:
    return ProxyAccess(anthropic_base_url=url, openai_base_url=url + "/v1", model=model)


def _done() -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


class LocalFront:
    """The proxy on the controller's event loop (`gyre.proxy.start.start_proxy`)."""

    def __init__(self, proxy, registry, table, *, model: str) -> None:
        self.proxy, self.registry, self.table = proxy, registry, table
        self.access = _access(proxy.url, model)
        self._sessions: dict[str, Any] = {}

    @property
    def in_flight(self):
        return self.proxy.in_flight

    @property
    def on_engine_lost(self):
        return self.table.on_engine_lost

    @on_engine_lost.setter
    def on_engine_lost(self, callback) -> None:
        self.table.on_engine_lost = callback

    def open(self, execution: str, engine: str) -> Opened:
        session = self._sessions[execution] = self.registry.issue(execution)
        self.table.assign(execution, engine)
        return Opened(session.key, self.access, _done())

    def close(self, execution: str) -> None:
        self.registry.close(execution)

    async def closed(self, execution: str) -> None:
        """The live tree takes a call still in flight when it ends: nothing to wait for."""

    async def watch(self) -> None:
        """Returns never: the proxy lives as long as the controller's loop."""
        await asyncio.Event().wait()

    def tree(self, execution: str):
        session = self._sessions.get(execution)
        return None if session is None else session.tree

    async def reroute(self, execution: str, engine: str) -> Rerouted:
        return await reroute_execution(self.table, execution, engine)

    async def stats(self) -> dict:
        return self.proxy.stats()

    async def stop(self) -> None:
        await self.proxy.stop()
        self.registry.close_all()


class ShardedFront:
    """Proxy shards (`gyre.proxy.shards.ProxyShards`), their record files under `records_dir`."""

    def __init__(self, shards, records_dir: Path, *, model: str) -> None:
        self.shards, self.records_dir, self.model = shards, Path(records_dir), model
        self._closing: dict[str, asyncio.Future] = {}
        self._trees: dict[str, Any] = {}

    @property
    def in_flight(self):
        return self.shards.in_flight

    @property
    def on_engine_lost(self):
        return self.shards.on_engine_lost

    @on_engine_lost.setter
    def on_engine_lost(self, callback) -> None:
        self.shards.on_engine_lost = callback

    def open(self, execution: str, engine: str) -> Opened:
        key = new_key()
        self.shards.place(execution)
        ready = self.shards.open(execution, key, engine)
        return Opened(key, _access(self.shards.url_of(execution), self.model), ready)

    def close(self, execution: str) -> None:
        if execution not in self._closing:
            self._closing[execution] = self.shards.close(execution, wait_s=CLOSE_WAIT_S)

    async def closed(self, execution: str) -> None:
        self.close(execution)
        try:
            answer = await self._closing[execution]
        except Exception as error:  # the shard is gone (said there): the record file is what it wrote
            log.warning("execution %s: its shard did not close it (%s); its record file as written", execution, error)
            answer = {"final": False}
        if not answer["final"]:
            log.warning("execution %s: a call still in flight after %g s is not in its tree", execution, CLOSE_WAIT_S)
        path = self.records_dir / f"{execution}.jsonl"
        if path.is_file():
            tree = await asyncio.to_thread(load_tree, path)
            tree.close()
            self._trees[execution] = tree

    def tree(self, execution: str):
        return self._trees.get(execution)

    async def watch(self) -> None:
        """Raises `ShardError` once a shard is gone while the run goes on: its executions have no proxy anymore."""
        raise await self.shards.lost

    async def reroute(self, execution: str, engine: str) -> Rerouted:
        return await self.shards.reroute(execution, engine)

    async def stats(self) -> dict:
        """The shards' counters; after `stop`, their final ones."""
        final = self.shards.final_stats
        return final if final is not None else await self.shards.stats()

    async def stop(self) -> None:
        await self.shards.stop()
