"""gyre.runtime.job.lifeline: rank 0 takes one lifeline per other rank and names the first whose lifeline ends (what
the kernel does to a dead process's sockets: they close), and nothing ends while every rank lives."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gyre.distributed.local import HOST
from gyre.runtime.job.lifeline import LifelineServer, RankLost, connect_lifeline, rank_lost_behind, watch_lifelines


def connected(world_size: int):
    server = LifelineServer(HOST)
    ends = {}

    def connect(rank: int) -> None:
        ends[rank] = connect_lifeline(HOST, server.port, rank)

    threads = [threading.Thread(target=connect, args=(rank,)) for rank in range(world_size - 1, 0, -1)]
    for thread in threads:
        thread.start()
    lines = server.accept(world_size, timeout_s=10)
    for thread in threads:
        thread.join()
    return lines, ends


def test_the_first_rank_whose_lifeline_ends_is_named():
    lines, ends = connected(4)
    assert sorted(lines) == [1, 2, 3]

    async def main() -> None:
        watch = asyncio.ensure_future(watch_lifelines(lines))
        await asyncio.sleep(0.2)
        assert not watch.done()  # every rank alive: nothing to say
        ends[2].close()
        with pytest.raises(RankLost, match=r"^rank 2 ended during the run \(its connection to rank 0 closed\)"):
            await asyncio.wait_for(watch, 5)

    asyncio.run(main())
    for sock in (*lines.values(), *ends.values()):
        sock.close()


def test_a_rank_that_never_connects_is_named_after_the_timeout():
    server = LifelineServer(HOST)
    first = connect_lifeline(HOST, server.port, 1)
    with pytest.raises(TimeoutError, match=r"ranks \[2\] did not connect their lifeline"):
        server.accept(3, timeout_s=0.3)
    first.close()


def test_an_error_that_a_ranks_death_caused_first_is_named_as_that_ranks_loss():
    """A dead rank's engine endpoint refuses the next call (here the error) before its lifeline is read: the run's
    error becomes `RankLost` naming the rank; with every lifeline open, the error stays, after the grace."""
    lines, ends = connected(3)
    refused = ConnectionRefusedError("the engine endpoint of cell 2 refused a drain")

    async def main() -> None:
        watch = asyncio.ensure_future(watch_lifelines(lines))
        await asyncio.sleep(0.05)
        assert await rank_lost_behind(refused, watch, grace_s=0.2) is refused  # every rank alive
        asyncio.get_running_loop().call_later(0.1, ends[2].close)  # the lifeline ends just after the error
        lost = await rank_lost_behind(refused, watch, grace_s=5.0)
        assert isinstance(lost, RankLost) and lost.rank == 2

    asyncio.run(main())
    for end in ends.values():
        end.close()
