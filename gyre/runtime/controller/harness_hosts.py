"""The controller's side of the harness hosts: where each execution runs, and playing it there.

Role: with `harness.hosts=nodes` (docs/cluster.md, "Harness hosts on every node") the controller places each
execution it starts on the node with the fewest executions running (its own node counted too, lowest node first
among equals: the controller's), and plays a placed one through that node's `gyre.runtime.job.harness_host` over one
WebSocket: the spec out; the outcome events applied to the execution's real group as they come
(`gyre.traj.outcome_events.apply_event`), the harness's end reported, the result returned as an `EpisodeResult`; the
execution's cancel event sent on as `{"cancel"}`. A host that goes away mid-execution is a `HostLost` error, which
ends the run (its node's ranks are gone too: the lifeline says which).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import orjson

from gyre.harness.episode import EpisodeResult, ProxyAccess
from gyre.runtime.job.harness_host import EXECUTIONS_PATH
from gyre.traj.outcome_events import apply_event
from gyre.traj.outcomes import GroupOutcomes, Status

log = logging.getLogger(__name__)

CONTROLLER_NODE = 0


class HostLost(RuntimeError):
    """A harness host ended an execution's connection without its result, or refused it."""


class HarnessHosts:
    """The nodes' hosts by node index (1, 2, ...; node 0 is the controller's, which plays its executions itself)."""

    def __init__(
        self,
        urls: dict[int, str],
        *,
        secret: str,
        controller_host: str = "127.0.0.1",
        ranks: dict[int, int] | None = None,
    ) -> None:
        self.urls, self.secret, self.controller_host = dict(urls), secret, controller_host
        self.ranks = dict(ranks or {})  # node -> the rank that hosts it (named in errors)
        self.running: dict[int, int] = {CONTROLLER_NODE: 0, **dict.fromkeys(urls, 0)}
        self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    def place(self) -> int:
        """The node of a new execution: the fewest running there (the lowest node among equals); counted running."""
        node = min(self.running, key=lambda n: (self.running[n], n))
        self.running[node] += 1
        return node

    def ended(self, node: int) -> None:
        self.running[node] -= 1

    async def close(self) -> None:
        await self._client.close()

    def _name(self, node: int) -> str:
        rank = f"rank {self.ranks[node]}, " if node in self.ranks else ""
        return f"node {node}'s harness host ({rank}{self.urls[node]})"

    async def play(
        self,
        node: int,
        task,
        *,
        execution: str,
        key: str,
        access: ProxyAccess,
        group: GroupOutcomes,
        cancel_event: asyncio.Event,
        on_harness_end: Callable[[object], None],
    ) -> EpisodeResult:
        """Play `execution` of `task` on `node`'s host (module docstring)."""
        url = self.urls[node] + EXECUTIONS_PATH.format(execution=execution)
        headers = {"Authorization": f"Bearer {self.secret}"}
        try:
            socket = await self._client.ws_connect(
                url, headers=headers, max_msg_size=1 << 24, heartbeat=None, compress=0
            )
        except aiohttp.ClientError as error:
            raise HostLost(f"{self._name(node)} cannot be reached: {error!r}") from None
        spec = {
            "task": task.id,
            "key": key,
            "anthropic_base_url": reachable(access.anthropic_base_url, self.controller_host),
            "openai_base_url": reachable(access.openai_base_url, self.controller_host),
            "model": access.model,
        }
        cancelling = offset = None
        try:
            await socket.send_bytes(orjson.dumps(spec))
            cancelling = asyncio.ensure_future(_send_cancel(socket, cancel_event))
            async for message in socket:
                if message.type is not aiohttp.WSMsgType.BINARY:
                    break
                said = orjson.loads(message.data)
                if "outcome" in said:
                    event = said["outcome"]
                    if offset is None:  # one offset per execution: its deadline and its expiry on one clock
                        offset = time.monotonic() - event["at"]
                    if not apply_event(group, event, offset=offset):
                        log.info("execution %s: its %s came after it was settled: not applied", execution, event["op"])
                elif "harness_end" in said:
                    on_harness_end(None)
                elif "result" in said:
                    result = said["result"]
                    status = Status(result["status"]) if result["status"] is not None else None
                    return EpisodeResult(
                        execution_id=execution,
                        task_id=result["task"],
                        run=None,
                        status=status,
                        reward=result["reward"],
                        reason=result["reason"],
                    )
                elif "refused" in said:
                    raise HostLost(f"{self._name(node)} refused execution {execution}: {said['refused']}")
            raise HostLost(
                f"{self._name(node)} went away during execution {execution} (its rank ended, or its node is lost)"
            )
        finally:
            if cancelling is not None:
                cancelling.cancel()
            with contextlib.suppress(Exception):
                await socket.close()


def reachable(url: str, controller_host: str) -> str:
    """`url` as another node reaches it: a proxy bound to every interface (`proxy.host=0.0.0.0` or `::`) at the
    controller's address; any other host as it is (on one machine the loopback is everyone's)."""
    parts = urlsplit(url)
    if parts.hostname not in ("0.0.0.0", "::"):
        return url
    host = f"[{controller_host}]" if ":" in controller_host else controller_host
    return urlunsplit(parts._replace(netloc=f"{host}:{parts.port}"))


async def _send_cancel(socket, cancel_event: asyncio.Event) -> None:
    await cancel_event.wait()
    with contextlib.suppress(ConnectionError, aiohttp.ClientError, RuntimeError):
        await socket.send_bytes(orjson.dumps({"cancel": True}))
