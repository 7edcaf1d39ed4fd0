"""A node's harness host: the executions the controller places on this node, played here.

Role: with `harness.hosts=nodes` (docs/cluster.md, "Harness hosts on every node") the first rank of every node but
the controller's runs a `HarnessHost` on a thread of its own, beside its cell. The controller opens one WebSocket
per execution it places here (`GET /gyre/executions/{execution}`, the job's secret as a Bearer token) and sends the
execution: its task (by id, from the task set every rank holds), its key and the proxy's base URLs. The host plays
it with `run_episode`, in this node's sandbox (its workspace under the run directory, which every node shares), the
harness calling the proxy over the job's network, and sends back, in order: each outcome event of the execution
(`gyre.traj.outcome_events`: the controller applies them to the real group), `{"harness_end"}` once the harness has
ended, then `{"result"}` (status, reward, reason) and closes. A `{"cancel"}` from the controller, or its socket
closing (the controller stopped or died), cancels the execution: its harness and evaluation are stopped as
`run_episode` does on a cancel.

A node that dies takes its executions with it: the controller's lifeline sees its ranks end and ends the run
(`RankLost`), and a resumed run dispatches again every execution that was running at the checkpoint
(docs/runtime.md, "Checkpoints and resume").
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import orjson
from aiohttp import WSMsgType, web

from gyre import eventloop
from gyre.harness.episode import ProxyAccess, run_episode
from gyre.traj.outcome_events import MirrorGroup

log = logging.getLogger(__name__)

EXECUTIONS_PATH = "/gyre/executions/{execution}"
PROXY_CHECK_S = 10.0  # a proxy that takes no TCP connection within this is unreachable from here


class ProxyUnreachable(RuntimeError):
    """The proxy the controller named cannot be reached from this node."""


SPEC_TIMEOUT_S = 30.0  # the controller sends an execution's spec as the socket's first message


class HarnessHost:
    """Plays the executions sent to it (module docstring). `make_runner(task)`, `limits_of(task)`: the program's."""

    def __init__(
        self,
        *,
        tasks: list,
        make_runner: Callable[[Any], Any],
        sandbox,
        limits_of: Callable[[Any], Any],
        secret: str,
        host: str = "127.0.0.1",
    ) -> None:
        self.tasks = {task.id: task for task in tasks}
        self.make_runner, self.sandbox, self.limits_of = make_runner, sandbox, limits_of
        self.secret, self.host = secret, host
        self.running: dict[str, asyncio.Task] = {}
        self.app = web.Application()
        self.app.router.add_get(EXECUTIONS_PATH, self.handle)
        self._runner: web.AppRunner | None = None
        self._reached: set[str] = set()  # proxy URLs this node has reached
        self.url = ""

    async def start(self) -> str:
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.url = f"http://{self.host}:{self._runner.addresses[0][1]}"
        log.info("harness host serving at %s (%d tasks)", self.url, len(self.tasks))
        return self.url

    async def stop(self) -> None:
        for task in list(self.running.values()):
            task.cancel()
        if self.running:
            await asyncio.wait(list(self.running.values()), timeout=30)
        await asyncio.to_thread(self.sandbox.shutdown)  # a container sandbox: what is left of the run's
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _refusal(self, http: web.Request) -> web.Response | None:
        header = http.headers.get("Authorization", "")
        if not header.startswith("Bearer "):
            return web.json_response({"error": "the job's secret is required (Authorization: Bearer)"}, status=401)
        if not secrets.compare_digest(header[7:].encode("utf-8", "replace"), self.secret.encode()):
            return web.json_response({"error": "this is not the job's secret"}, status=403)
        return None

    async def handle(self, http: web.Request) -> web.StreamResponse:
        if (refusal := self._refusal(http)) is not None:
            return refusal
        execution = http.match_info["execution"]
        socket = web.WebSocketResponse(max_msg_size=1 << 20, heartbeat=None, compress=False)
        await socket.prepare(http)
        outbox: asyncio.Queue = asyncio.Queue()
        writer = asyncio.ensure_future(_write(socket, outbox))
        try:
            spec = await asyncio.wait_for(socket.receive(), SPEC_TIMEOUT_S)
            spec = orjson.loads(spec.data) if spec.type is WSMsgType.BINARY else None
            task = self.tasks.get(spec.get("task")) if isinstance(spec, dict) else None
            if task is None or execution in self.running:
                reason = "an execution of that id runs here" if task is not None else "no such task (or no spec)"
                outbox.put_nowait({"refused": reason})
                return socket
            cancel = asyncio.Event()
            watcher = asyncio.ensure_future(_watch(socket, cancel))
            episode = self.running[execution] = asyncio.ensure_future(self._play(execution, task, spec, cancel, outbox))
            try:
                outbox.put_nowait({"result": await episode})
            except Exception as error:  # a bug here, said to the controller (which ends the run with it)
                log.exception("execution %s: the harness host failed", execution)
                outbox.put_nowait({"refused": f"the harness host failed: {error!r}"})
            finally:
                watcher.cancel()
                self.running.pop(execution, None)
        except (TimeoutError, ValueError, orjson.JSONDecodeError) as error:
            outbox.put_nowait({"refused": f"no readable spec: {error!r}"})
        finally:
            outbox.put_nowait(None)
            await writer
            await socket.close()
        return socket

    async def _check_proxy(self, url: str) -> None:
        """The proxy at `url` takes a TCP connection from this node (once per URL), else a `ProxyUnreachable` that
        names the fix: every execution here would otherwise fail its first call."""
        if url in self._reached:
            return
        parts = urlsplit(url)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port), PROXY_CHECK_S)
        except (OSError, TimeoutError) as error:
            raise ProxyUnreachable(
                f"the proxy at {url} cannot be reached from this node ({error!r}): bind it where every node reaches "
                "it (proxy.host=0.0.0.0, or the controller's address)"
            ) from None
        writer.close()
        self._reached.add(url)

    async def _play(self, execution: str, task, spec: dict, cancel: asyncio.Event, outbox: asyncio.Queue) -> dict:
        await self._check_proxy(spec["anthropic_base_url"])
        mirror = MirrorGroup(execution, lambda event: outbox.put_nowait({"outcome": event}), time.monotonic)
        result = await run_episode(
            task,
            execution_id=execution,
            api_key=spec["key"],
            runner=self.make_runner(task),
            sandbox=self.sandbox,
            proxy=ProxyAccess(
                anthropic_base_url=spec["anthropic_base_url"],
                openai_base_url=spec["openai_base_url"],
                model=spec["model"],
            ),
            limits=self.limits_of(task),
            group=mirror,
            cancel_event=cancel,
            on_harness_end=lambda run: outbox.put_nowait({"harness_end": True}),
        )
        status = result.status.value if result.status is not None else None
        return {"status": status, "reward": result.reward, "reason": result.reason, "task": result.task_id}


async def _write(socket: web.WebSocketResponse, outbox: asyncio.Queue) -> None:
    """Send the outbox's messages in order until its None; a closed socket drops the rest (nobody listens)."""
    while (message := await outbox.get()) is not None:
        if not socket.closed:
            await socket.send_bytes(orjson.dumps(message))


async def _watch(socket: web.WebSocketResponse, cancel: asyncio.Event) -> None:
    """`{"cancel"}`, or the socket's end (the controller stopped or died), cancels the execution."""
    async for message in socket:
        if message.type is WSMsgType.BINARY:
            said = orjson.loads(message.data)
            if isinstance(said, dict) and said.get("cancel"):
                cancel.set()
    cancel.set()


class HarnessHostThread:
    """A `HarnessHost` on its own event loop in a daemon thread, beside a rank's cell loop."""

    def __init__(self, host_factory: Callable[[], HarnessHost]) -> None:
        self._factory = host_factory
        self._thread = eventloop.LoopThread("gyre-harness-host")
        self.host: HarnessHost | None = None

    def start(self, timeout_s: float = 60.0) -> str:
        self._thread.start(self._setup, what="the harness host", timeout_s=timeout_s)
        return self.host.url

    def _setup(self):
        self.host = self._factory()
        return self.host.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Cancel what still runs here (its harnesses stopped), stop serving, end the thread; what does not stop in
        `timeout_s` is said and left (a daemon thread: it ends with the process)."""
        if not self._thread.alive or self.host is None:
            return
        try:
            self._thread.call(self.host.stop(), timeout_s)
        except Exception as error:  # a timeout, or the stop's own error: the rank still closes its job
            log.error("the harness host did not stop cleanly: %r", error)
        self._thread.stop(timeout_s)
