"""Every rank's lifeline to rank 0: a TCP connection that carries nothing and closes when the rank's process ends.

A rank that dies (SIGKILL, a crash, the OOM killer) could leave rank 0 waiting on a store key, an engine that no
longer answers or an ack, while the launcher that saw the death (torchrun on another node, srun on its node) knows
only its own ranks. The kernel closes a dead process's sockets, so rank 0 reads the end of that rank's lifeline at
once and ends the run with `RankLost` naming the rank (docs/cluster.md, "A rank that dies").

- Rank 0: `LifelineServer(host)` listens on a free port before the job's addresses are broadcast, then
  `accept(world_size)` takes one connection from every other rank, each opening with its rank (4 bytes).
- Every other rank: `connect_lifeline(host, port, rank)`, kept open as long as the process lives (`Job.lifeline`).
- Rank 0's controller: `await watch_lifelines(lines)` raises `RankLost` at the first lifeline that ends; the
  controller cancels the watch before it tells the ranks to stop, so a run's normal end is no loss.
- A run that ends with another error first asks `rank_lost_behind(error, watch)`: a dead rank's engine endpoint
  refuses the next call at once (a drain, a weight update), and that error can reach the loop before the rank's
  lifeline is read. The run then ends with `RankLost` naming the rank, and the first error is one line in the log.

TCP keepalive (Linux: first probe after 10 s idle, every 5 s, 3 probes) also ends a lifeline to a host that vanished
without closing its connections (a node powered off) within about 25 s.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections.abc import Mapping

__all__ = ["LifelineServer", "RankLost", "connect_lifeline", "rank_lost_behind", "watch_lifelines"]

log = logging.getLogger(__name__)

HANDSHAKE = struct.Struct("!I")  # the connecting rank
KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}
# How long after the run's error a lifeline may still end and be named instead: the kernel closes a dead process's
# sockets together, so this covers the loop's turn to read the end, and a lifeline from another host.
LOSS_GRACE_S = 2.0


class RankLost(RuntimeError):
    """A rank of the job ended while the run went on (its lifeline to rank 0 closed)."""

    def __init__(self, rank: int, how: str):
        super().__init__(
            f"rank {rank} ended during the run ({how}); the launcher of that rank's node (torchrun, srun) names the "
            "cause: exit code or signal"
        )
        self.rank = rank


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE.items():
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class LifelineServer:
    """Rank 0's end: a listening socket on `host`, then one accepted connection per other rank."""

    def __init__(self, host: str, backlog: int = 128) -> None:
        self.sock = socket.create_server((host, 0), backlog=backlog)
        self.port = self.sock.getsockname()[1]

    def accept(self, world_size: int, timeout_s: float) -> dict[int, socket.socket]:
        """The lifelines of ranks 1 .. world_size - 1 by rank; TimeoutError when one did not connect in time."""
        lines: dict[int, socket.socket] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(lines) < world_size - 1:
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                conn, _ = self.sock.accept()
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                (rank,) = HANDSHAKE.unpack(_read_exactly(conn, HANDSHAKE.size))
                assert 0 < rank < world_size and rank not in lines, (rank, sorted(lines))
                conn.settimeout(None)
                _keepalive(conn)
                lines[rank] = conn
        except TimeoutError:
            missing = sorted(set(range(1, world_size)) - set(lines))
            raise TimeoutError(
                f"ranks {missing} did not connect their lifeline to rank 0 in {timeout_s:.0f} s"
            ) from None
        finally:
            self.sock.close()
        return lines


def _read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("a lifeline closed during its handshake")
        data += chunk
    return data


def connect_lifeline(host: str, port: int, rank: int, timeout_s: float = 60.0) -> socket.socket:
    """This rank's lifeline to rank 0 (keep it open until the process ends)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.sendall(HANDSHAKE.pack(rank))
    sock.settimeout(None)
    _keepalive(sock)
    return sock


async def watch_lifelines(lines: Mapping[int, socket.socket]) -> None:
    """Wait until a lifeline ends, then raise `RankLost` for its rank (the first to end)."""
    loop = asyncio.get_running_loop()

    async def until_closed(rank: int, sock: socket.socket) -> tuple[int, str]:
        sock.setblocking(False)
        try:
            data = await loop.sock_recv(sock, 1)
        except OSError as error:
            return rank, f"its connection to rank 0 failed: {error}"
        return rank, "its connection to rank 0 closed" if not data else "it sent on its lifeline"

    waits = [asyncio.ensure_future(until_closed(rank, sock)) for rank, sock in sorted(lines.items())]
    if not waits:
        await asyncio.Event().wait()  # a job of one rank: nothing to lose
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    rank, how = min(task.result() for task in done)
    raise RankLost(rank, how)


async def rank_lost_behind(error: BaseException, watch: asyncio.Future, grace_s: float = LOSS_GRACE_S) -> BaseException:
    """`error`, or the `RankLost` that `watch` (a `watch_lifelines` task) raises within `grace_s`: the run's error was
    then the rank's death seen from another side first (its engine's endpoint refused a call), and the run ends
    naming the rank."""
    done, _ = await asyncio.wait({watch}, timeout=grace_s)
    if watch in done and not watch.cancelled() and isinstance(watch.exception(), RankLost):
        lost = watch.exception()
        log.info("%r came from the loss of rank %d", error, lost.rank)
        return lost
    return error
