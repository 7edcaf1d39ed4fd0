"""The proxy, and nothing else of the job, inside a container's own network namespace (docs/harness.md, "Container
network").

A container of `harness.container.network=proxy` has its own network namespace with only a loopback interface
(`--network none`; a task's `allow_internet` gives it a user-mode route out instead, which still has no way to
the host's loopback). The controller creates a listening socket on 127.0.0.1:<proxy port> INSIDE that namespace:
a short-lived thread enters it with setns(2) (which moves only the calling thread), creates the socket and ends;
the socket stays in the namespace it was made in. `Forwarder` accepts on it and copies bytes both ways to the
proxy's real address, from the host's namespace. So the harness reaches the proxy at the same URL as on the host,
and no other port of the job (torch.distributed stores, engine endpoints, Mooncake) exists in its namespace. No
process runs in the container for this, and nothing of the image is needed. Entering a namespace needs root.

`FORWARDS` is one event loop on its own thread for every forward of the process (every sandbox's: a held-out
evaluation makes a sandbox per version): the bytes of streamed responses never pass through the controller's own
loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import socket
import threading

__all__ = ["FORWARDS", "ForwardThread", "Forwarder", "listen_in_namespace"]

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000  # setns(2): the file descriptor is a network namespace
ENTER_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
CHUNK = 1 << 16
BACKLOG = 256


def listen_in_namespace(pid: int, port: int) -> socket.socket:
    """A non-blocking TCP socket listening on 127.0.0.1:`port` in the network namespace of host process `pid`."""
    made: dict[str, object] = {}

    def enter() -> None:  # this thread only: setns moves the calling thread, and the thread ends here
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns into the network namespace of pid {pid}: {os.strerror(errno)}")
            finally:
                os.close(fd)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen(BACKLOG)
                sock.setblocking(False)
            except OSError:
                sock.close()
                raise
            made["socket"] = sock
        except OSError as error:
            made["error"] = error

    thread = threading.Thread(target=enter, name=f"gyre-netns-{pid}", daemon=True)
    thread.start()
    thread.join(ENTER_TIMEOUT_S)
    if "socket" in made:
        return made["socket"]  # type: ignore[return-value]
    error = made.get("error")
    if isinstance(error, OSError):
        raise error
    raise OSError(f"entering the network namespace of pid {pid} took longer than {ENTER_TIMEOUT_S:g} s")


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close `writer` (an HTTP client that shuts its side down still gets its answer)."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()


class Forwarder:
    """Accepts on a listening socket and forwards each connection to `target` (host, port)."""

    def __init__(self, sock: socket.socket, target: tuple[str, int]) -> None:
        self.sock = sock
        self.target = target
        self.server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accepted, sock=self.sock)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            try:
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.target), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError) as error:
                log.warning("proxy forward to %s:%d: %s", *self.target, error)
                return
            try:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            finally:
                up_writer.close()
        finally:
            writer.close()
            self._connections.discard(task)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._connections):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._connections, return_exceptions=True)
        self.sock.close()


class ForwardThread:
    """One event loop on a daemon thread that serves every `Forwarder` of a sandbox; started at the first."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="gyre-proxy-forward", daemon=True).start()
                self._loop = loop
            return self._loop

    def forward(self, sock: socket.socket, target: tuple[str, int], timeout_s: float = 10.0) -> Forwarder:
        forwarder = Forwarder(sock, target)
        try:
            asyncio.run_coroutine_threadsafe(forwarder.start(), self._running_loop()).result(timeout_s)
        except BaseException:
            sock.close()
            raise
        return forwarder

    def close(self, forwarder: Forwarder, timeout_s: float = 10.0) -> None:
        if self._loop is None:
            return
        with contextlib.suppress(Exception):  # closing is best effort: the socket goes with the namespace anyway
            asyncio.run_coroutine_threadsafe(forwarder.close(), self._loop).result(timeout_s)


FORWARDS = ForwardThread()  # the process's one forward loop (module docstring)
