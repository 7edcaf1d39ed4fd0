"""A proxy shard: one process serving the model calls of the executions its controller places on it.

Role: with `proxy.shards = N` the training controller starts N of these (`gyre.proxy.shards.ProxyShards`) instead of
serving calls on its own event loop (docs/proxy.md, "Shards"). A shard is a whole proxy (`ProxyServer`: dialects,
TITO prompt building, routing with transparent retry, the execution's tree and record file) for a disjoint set of
executions; the controller keeps the ledger and every decision and sends them over one control connection:

- in (commands, each answered by id): `open` (an execution with the key the controller made, placed on an engine),
  `reroute` (the calls in flight move with their KV, on this shard: `gyre.proxy.reroute`), `close`
  (answered once the execution's calls in flight have ended and its record file is final, or after `wait_s`),
  `stats`;
- out (events): each call's start, first token and end (the controller's progress line), each engine this shard
  counted lost.

Commands of one execution run in the order they arrived; those of different executions run concurrently, so a
`close` waiting for a slow call holds no other execution's `open`. The shard reads its `ShardSpec` as one JSON line
on stdin, answers one JSON line `{"url", "pid"}` on stdout when it serves, and stops when stdin ends (its
controller stopped or died): calls in flight get `proxy.shutdown_grace_s`, then every session is closed and its
final counters are the last line, `{"stats"}`. It runs in
a session of its own, so a terminal's Ctrl-C reaches the controller, which stops it in order.

Run: `python -m gyre.proxy.shard` (by `ProxyShards`, not by hand).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import WSMsgType, web

from gyre.config.proxy import ProxyConfig, SamplingConfig
from gyre.obs.logging import setup_logging
from gyre.proxy.in_flight import InFlight
from gyre.proxy.reroute import reroute_execution

log = logging.getLogger(__name__)

CONTROL_PATH = "/gyre/control"
CLOSE_POLL_S = 0.01


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """What a shard process needs, JSON-able (`to_json` / `from_json`)."""

    index: int
    proxy: ProxyConfig
    model_dir: str
    records_dir: str | None
    engines: dict[str, str]  # routing name -> engine endpoint URL
    engine_secret: str | None  # the job's secret, for the engine endpoints
    admin_key: str  # the control connection's key (and the shard's admin routes')
    log_file: str | None = None  # appended to beside stderr (the run's train.log)

    def to_json(self) -> bytes:
        return orjson.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> ShardSpec:
        fields = orjson.loads(raw)
        proxy = dict(fields.pop("proxy"))
        proxy["sampling"] = SamplingConfig(**proxy["sampling"])
        return cls(proxy=ProxyConfig(**proxy), **fields)


class ReportingInFlight(InFlight):
    """`InFlight` that also reports each call's start, first token and end to the controller."""

    def __init__(self, emit: Callable[[dict], None]) -> None:
        super().__init__()
        self._emit = emit

    def add(self, call_id: str, *, execution: str, prompt_tokens: int, now: float) -> None:
        super().add(call_id, execution=execution, prompt_tokens=prompt_tokens, now=now)
        self._emit(
            {"event": "call", "phase": "start", "call": call_id, "execution": execution, "tokens": prompt_tokens}
        )

    def first_token(self, call_id: str, now: float) -> None:
        known = self._calls.get(call_id)
        if known is not None and known.first_token_s is None:
            self._emit({"event": "call", "phase": "first", "call": call_id})
        super().first_token(call_id, now)

    def remove(self, call_id: str) -> None:
        if call_id in self._calls:
            self._emit({"event": "call", "phase": "end", "call": call_id})
        super().remove(call_id)


class ShardControl:
    """The control connection's commands, on the shard's event loop (module docstring)."""

    def __init__(self, server, registry, table) -> None:
        self.server, self.registry, self.table = server, registry, table
        self._socket: web.WebSocketResponse | None = None
        self._tails: dict[str, asyncio.Future] = {}  # execution -> its latest command (the next one waits for it)
        self._tasks: set[asyncio.Task] = set()
        table.on_engine_lost = self._engine_lost
        server.in_flight = ReportingInFlight(self.emit)

    def emit(self, message: dict) -> None:
        """Send an event (dropped when no controller is connected: nobody listens)."""
        socket = self._socket
        if socket is not None and not socket.closed:
            task = asyncio.ensure_future(socket.send_bytes(orjson.dumps(message)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _engine_lost(self, event) -> None:
        self.emit(
            {
                "event": "engine_lost",
                "engine": event.engine,
                "reason": event.reason,
                "moved": event.moved,
                "unplaced": list(event.unplaced),
            }
        )

    async def handle(self, http: web.Request) -> web.StreamResponse:
        if (refusal := self.server.admin_refusal(http)) is not None:
            return refusal
        socket = web.WebSocketResponse(max_msg_size=0, heartbeat=None, compress=False)  # small frames, in order
        await socket.prepare(http)
        if self._socket is not None and not self._socket.closed:
            await socket.close(message=b"a controller is connected already")
            return socket
        self._socket = socket
        async for message in socket:
            if message.type is not WSMsgType.BINARY and message.type is not WSMsgType.TEXT:
                break
            try:
                command = orjson.loads(message.data)
            except orjson.JSONDecodeError:
                command = None
            if not isinstance(command, dict):
                log.error("a control message that is not a JSON object was ignored")
                continue
            execution = command.get("execution")
            previous = self._tails.get(execution) if execution is not None else None
            task = asyncio.ensure_future(self._run(command, previous))
            if execution is not None:
                self._tails[execution] = task
                task.add_done_callback(lambda done, e=execution: self._forget(e, done))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return socket

    def _forget(self, execution: str, done: asyncio.Future) -> None:
        if self._tails.get(execution) is done:
            del self._tails[execution]

    async def _run(self, command: dict, previous: Awaitable | None) -> None:
        if previous is not None:
            await asyncio.wait([previous])  # its outcome was answered already
        reply: dict[str, Any] = {"id": command.get("id")}
        try:
            reply["result"] = await getattr(self, "op_" + str(command.get("op")))(**command.get("args", {}))
            reply["ok"] = True
        except Exception as error:  # answered to the controller, which raises it there
            reply.update(ok=False, kind=type(error).__name__, error=str(error))
        socket = self._socket
        if socket is not None and not socket.closed:
            await socket.send_bytes(orjson.dumps(reply))

    # ------------------------------------------------------------------ the commands

    async def op_open(self, execution: str, key: str, engine: str) -> None:
        self.registry.issue(execution, key=key)
        self.table.assign(execution, engine)

    async def op_reroute(self, execution: str, engine: str, migrate_kv: bool = True) -> dict:
        moved = await reroute_execution(self.table, execution, engine, migrate_kv=migrate_kv)
        return {"migrated": list(moved.migrated), "restarted": list(moved.restarted)}

    async def op_close(self, execution: str, wait_s: float) -> dict:
        session = self.registry.by_execution(execution)
        if session is None:
            return {"in_flight": 0, "final": True}
        in_flight = self.registry.close(execution)
        deadline = time.monotonic() + wait_s
        while session.writer is not None and time.monotonic() < deadline:
            await asyncio.sleep(CLOSE_POLL_S)
        return {"in_flight": in_flight, "final": session.writer is None}

    async def op_stats(self) -> dict:
        return self.server.stats()


async def serve(spec: ShardSpec, stop: asyncio.Event, announce: Callable[[dict], None]) -> None:
    """Serve `spec` until `stop` is set; `announce({"url", "pid"})` once serving, `announce({"stats"})` at the end."""
    from gyre.engine.remote import RemoteEngine
    from gyre.proxy.routing import RoutingTable
    from gyre.proxy.start import start_proxy

    table = RoutingTable(placement="scheduler")  # routes only where the controller assigns
    engines = []
    proxy = registry = None
    try:
        for name, url in spec.engines.items():
            engines.append(await RemoteEngine.connect(url, secret=spec.engine_secret))
            table.add_engine(name, engines[-1])
        config = spec.proxy
        if config.port:
            config = dataclasses.replace(config, port=config.port + spec.index)
        proxy, registry = await start_proxy(
            config,
            model_dir=spec.model_dir,
            table=table,
            records_dir=spec.records_dir,
            admin_key=spec.admin_key,
            before_start=lambda server, registry: _add_control(server, registry, table),
        )
        announce({"url": proxy.url, "pid": os.getpid()})
        await stop.wait()
    finally:
        if proxy is not None:
            await proxy.stop()
        if registry is not None:
            registry.close_all()
        for engine in engines:
            await engine.close()
        if proxy is not None:
            announce({"stats": proxy.stats()})  # the final counters, hung-up calls of the shutdown included


def _add_control(server, registry, table) -> None:
    control = ShardControl(server, registry, table)
    server.app.router.add_get(CONTROL_PATH, control.handle)


def _read_line(fd: int) -> bytes:
    """One line from `fd`, read unbuffered (nothing past it is taken from the lifeline)."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    return bytes(line)


async def _main() -> None:
    line = await asyncio.to_thread(_read_line, 0)
    spec = ShardSpec.from_json(line)
    setup_logging(level=logging.INFO, log_file=spec.log_file, label=f"proxy shard {spec.index}")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def lifeline() -> None:  # stdin ends when the controller closes it or dies
        while os.read(0, 1 << 16):  # the raw descriptor: a daemon thread must hold no buffered reader's lock
            pass
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=lifeline, name="lifeline", daemon=True).start()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def announce(ready: dict) -> None:
        sys.stdout.buffer.write(orjson.dumps(ready) + b"\n")
        sys.stdout.buffer.flush()

    await serve(spec, stop, announce)


def main() -> int:
    try:
        asyncio.run(_main())
    except (OSError, ValueError, RuntimeError) as error:  # a model directory or engine it cannot use: said once
        log.error("proxy shard stopped: %s: %s", type(error).__name__, error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
