"""The controller's side of the proxy shards: start them, place executions on them, send them its decisions.

Role: with `proxy.shards = N` (docs/proxy.md, "Shards") the controller serves no model call itself. It starts N
`gyre.proxy.shard` processes, places each execution on the shard with the fewest open executions (the harness gets
that shard's URL and a key the controller made), and sends each shard, over one control connection, the
executions' opening, assignments, reroutes and closing, in the order it decides them. Each shard reports every
call's start, first token and end, mirrored here into `in_flight` (progress lines), and each engine it counted lost
(`on_engine_lost`). `stats()` adds the shards' counters (`gyre.proxy.stats.merged`).

A shard that dies or drops its control connection fails its pending and later commands (`ShardError`), is said at
ERROR and resolves `lost`: its executions cannot be served anymore, and the controller ends the run with that
error (`gyre.runtime.controller.proxy_front.ShardedFront.watch`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import orjson

from gyre.proxy.in_flight import InFlight
from gyre.proxy.reroute import Rerouted
from gyre.proxy.shard import CONTROL_PATH, ShardSpec
from gyre.proxy.stats import merged

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a shard loads the chat template and connects its engines in a few seconds
STOP_TIMEOUT_S = 30.0  # beyond `proxy.shutdown_grace_s`: a shard closing its sessions; then it is killed


class ShardError(RuntimeError):
    """A shard refused a command (its error kind and message), or is gone."""


@dataclass(frozen=True)
class EngineLostOnShard:
    """A shard counted an engine lost (`gyre.proxy.routing.EngineLost`, as that shard saw it)."""

    shard: int
    engine: str
    reason: str
    moved: dict[str, str]
    unplaced: tuple[str, ...]


@dataclass(eq=False)
class _Shard:
    index: int
    process: subprocess.Popen
    url: str = ""
    client: aiohttp.ClientSession | None = None
    socket: aiohttp.ClientWebSocketResponse | None = None
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    tasks: list[asyncio.Task] = field(default_factory=list)
    open_executions: set[str] = field(default_factory=set)
    placed: int = 0  # executions placed on it in all
    gone: str | None = None  # why it can take no command anymore


class ProxyShards:
    """N running shards (module docstring). `start` them; `stop` them once."""

    def __init__(self, shards: list[_Shard]) -> None:
        self._shards = shards
        self.shard_of: dict[str, int] = {}  # execution -> its shard, kept after it closed
        self.in_flight = InFlight()
        self.on_engine_lost: Callable[[EngineLostOnShard], None] | None = None
        self._ids = itertools.count(1)
        self._stopping = False
        self._grace_s = 0.0  # the shards' `proxy.shutdown_grace_s`: their stop may take that long beyond its own
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()  # its ShardError: a shard is gone
        self.final_stats: dict | None = None  # after `stop`: the shards' last counters, added

    @classmethod
    async def start(cls, specs: list[ShardSpec], *, start_timeout_s: float = START_TIMEOUT_S) -> ProxyShards:
        """Start a shard per spec and connect to each; the shards started are stopped if one fails to start."""
        shards = [_Shard(spec.index, _spawn(spec)) for spec in specs]
        self = cls(shards)
        self._grace_s = max(spec.proxy.shutdown_grace_s for spec in specs)
        try:
            ready = await asyncio.gather(*(_ready_line(shard, start_timeout_s) for shard in shards))
            for shard, line in zip(shards, ready, strict=True):
                shard.url = line["url"]
                await self._connect(shard, specs[shard.index].admin_key)
        except BaseException:
            await self.stop()
            raise
        log.info("proxy shards serving at %s (pids %s)", ", ".join(self.urls), ", ".join(map(str, self.pids)))
        return self

    @property
    def urls(self) -> list[str]:
        return [shard.url for shard in self._shards]

    @property
    def pids(self) -> list[int]:
        return [shard.process.pid for shard in self._shards]

    def place(self, execution: str) -> int:
        """The shard a new execution goes to: the one with the fewest open executions (the lowest index of equals)."""
        live = [shard for shard in self._shards if shard.gone is None] or self._shards
        shard = min(live, key=lambda s: (len(s.open_executions), s.index))
        shard.open_executions.add(execution)
        shard.placed += 1
        self.shard_of[execution] = shard.index
        return shard.index

    def url_of(self, execution: str) -> str:
        return self._shards[self.shard_of[execution]].url

    # ------------------------------------------------------------------ the commands (sent in call order)

    def open(self, execution: str, key: str, engine: str) -> asyncio.Future:
        """Open `execution` with `key` on its shard (`place` it first), routed to `engine`; done once the shard
        took it (the harness may call from then on)."""
        return self._send(self.shard_of[execution], "open", execution=execution, key=key, engine=engine)

    async def reroute(self, execution: str, engine: str, *, migrate_kv: bool = True) -> Rerouted:
        """`gyre.proxy.reroute.reroute_execution` on the execution's shard."""
        moved = await self._send(
            self.shard_of[execution], "reroute", execution=execution, engine=engine, migrate_kv=migrate_kv
        )
        return Rerouted(execution, engine, tuple(moved["migrated"]), tuple(moved["restarted"]))

    def close(self, execution: str, *, wait_s: float) -> asyncio.Future:
        """Close `execution` (its key stops working at once); done with `{"in_flight", "final"}` once its calls in
        flight ended and its record file is final (`final`), or after `wait_s` (not `final`)."""
        index = self.shard_of[execution]
        self._shards[index].open_executions.discard(execution)
        return self._send(index, "close", execution=execution, wait_s=wait_s)

    async def stats(self) -> dict:
        """The shards' counters added (`ProxyServer.stats`, `gyre.proxy.stats.merged`)."""
        live = [shard.index for shard in self._shards if shard.gone is None]
        return merged(await asyncio.gather(*(self._send(index, "stats") for index in live)))

    async def stop(self) -> None:
        """End every shard: its stdin closed, it stops serving (calls in flight get `proxy.shutdown_grace_s`),
        closes its sessions, says its final counters (`final_stats`, added) and exits; killed if it has not after
        `STOP_TIMEOUT_S` beyond the grace. Once."""
        if self._stopping:
            return
        self._stopping = True
        for shard in self._shards:  # the control connections first: a shard's server waits for open sockets
            for task in shard.tasks:
                task.cancel()
            if shard.socket is not None:
                await shard.socket.close()
        for shard in self._shards:
            if shard.process.stdin is not None and not shard.process.stdin.closed:
                shard.process.stdin.close()
        timeout_s = STOP_TIMEOUT_S + self._grace_s
        finals = await asyncio.gather(*(asyncio.to_thread(_reap, s.process, timeout_s) for s in self._shards))
        for shard, final in zip(self._shards, finals, strict=True):
            recorded = "?" if final is None else sum(e["recorded"] for e in final["executions"].values())
            log.info("proxy shard %d: %d executions, %s calls recorded", shard.index, shard.placed, recorded)
        self.final_stats = merged([final for final in finals if final is not None])
        for shard in self._shards:
            self._gone(shard, "stopped")
            if shard.client is not None:
                await shard.client.close()

    # ------------------------------------------------------------------ the connection

    def _send(self, index: int, op: str, **args) -> asyncio.Future:
        shard = self._shards[index]
        future = asyncio.get_running_loop().create_future()
        if shard.gone is not None:
            future.set_exception(ShardError(f"proxy shard {index} ({shard.url}) is gone: {shard.gone}"))
            future.add_done_callback(_seen)
            return future
        command_id = next(self._ids)
        shard.pending[command_id] = future
        future.add_done_callback(_seen)  # a reply nobody awaits (a close while the run stops) is not an error
        command = {"id": command_id, "op": op, "args": args}
        if "execution" in args:
            command["execution"] = args["execution"]  # the shard keeps one execution's commands in order
        shard.outbox.put_nowait(orjson.dumps(command))
        return future

    async def _connect(self, shard: _Shard, admin_key: str) -> None:
        shard.client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        shard.socket = await shard.client.ws_connect(
            shard.url + CONTROL_PATH, headers={"x-api-key": admin_key}, max_msg_size=0, heartbeat=None, compress=0
        )
        shard.tasks = [
            asyncio.ensure_future(self._write(shard)),
            asyncio.ensure_future(self._read(shard)),
        ]

    async def _write(self, shard: _Shard) -> None:
        try:
            while True:
                await shard.socket.send_bytes(await shard.outbox.get())
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as error:
            self._gone(shard, f"its control connection failed ({error!r})")

    async def _read(self, shard: _Shard) -> None:
        kind = "closed"
        try:
            async for message in shard.socket:
                if message.type is not aiohttp.WSMsgType.BINARY:
                    kind = message.type.name
                    break
                self._received(shard, orjson.loads(message.data))
        except Exception as error:  # a message this side cannot take: the shard is as good as gone
            log.exception("proxy shard %d: a message from it could not be handled", shard.index)
            kind = f"a message could not be handled: {error!r}"
        finally:
            self._gone(shard, f"its control connection ended ({kind}; exit code {shard.process.poll()})")

    def _received(self, shard: _Shard, message: dict) -> None:
        if "id" in message:
            future = shard.pending.pop(message["id"], None)
            if future is None or future.done():
                return
            if message["ok"]:
                future.set_result(message.get("result"))
            else:
                future.set_exception(ShardError(f"proxy shard {shard.index}: {message['kind']}: {message['error']}"))
            return
        event = message.get("event")
        if event == "call":
            now = time.monotonic()
            phase = message["phase"]
            if phase == "start":
                call, execution, tokens = message["call"], message["execution"], message["tokens"]
                self.in_flight.add(call, execution=execution, prompt_tokens=tokens, now=now)
            elif phase == "first":
                self.in_flight.first_token(message["call"], now)
            else:
                self.in_flight.remove(message["call"])
        elif event == "engine_lost" and self.on_engine_lost is not None:
            self.on_engine_lost(
                EngineLostOnShard(
                    shard.index, message["engine"], message["reason"], message["moved"], tuple(message["unplaced"])
                )
            )

    def _gone(self, shard: _Shard, why: str) -> None:
        if shard.gone is not None:
            return
        shard.gone = why
        if not self._stopping:
            log.error("proxy shard %d (%s) is gone: %s", shard.index, shard.url, why)
            if not self.lost.done():
                self.lost.set_result(ShardError(f"proxy shard {shard.index} ({shard.url}) is gone: {why}"))
        for future in shard.pending.values():
            if not future.done():
                future.set_exception(ShardError(f"proxy shard {shard.index} ({shard.url}) is gone: {why}"))
        shard.pending.clear()


def _seen(future: asyncio.Future) -> None:
    """Mark a command's error as seen: whoever awaits the future still gets it."""
    if not future.cancelled():
        future.exception()


def _spawn(spec: ShardSpec) -> subprocess.Popen:
    """The shard's process, its spec written to its stdin (kept open: the shard's lifeline). A session of its own,
    so a terminal's Ctrl-C reaches only the controller, which stops the shards in order."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gyre.proxy.shard"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    process.stdin.write(spec.to_json() + b"\n")
    process.stdin.flush()
    return process


async def _ready_line(shard: _Shard, timeout_s: float) -> dict:
    """The shard's `{"url", "pid"}` line; `ShardError` if it exits or says nothing within `timeout_s`."""
    reading = asyncio.ensure_future(asyncio.to_thread(shard.process.stdout.readline))
    done, _ = await asyncio.wait([reading], timeout=timeout_s)
    if not done:
        shard.process.kill()  # ends the read
        await reading
        raise ShardError(f"proxy shard {shard.index} did not start within {timeout_s:g} s (killed)")
    line = reading.result()
    if not line:
        code = await asyncio.to_thread(shard.process.wait)
        raise ShardError(f"proxy shard {shard.index} exited with code {code} before serving (its log: stderr)")
    return orjson.loads(line)


def _reap(process: subprocess.Popen, timeout_s: float) -> dict | None:
    """Wait for a stopping shard's exit (killed after `timeout_s`); its final counters, if it said them."""
    final = None
    timer = threading.Timer(timeout_s, _kill, args=(process, timeout_s))
    timer.start()
    try:
        for line in process.stdout:  # ends when the shard exits (or is killed)
            try:
                said = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(said, dict) and "stats" in said:
                final = said["stats"]
        process.wait()
    finally:
        timer.cancel()
    return final


def _kill(process: subprocess.Popen, timeout_s: float) -> None:
    log.error("proxy shard (pid %d) did not stop within %g s: killed", process.pid, timeout_s)
    process.kill()
