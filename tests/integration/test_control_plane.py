"""The control plane reaches ranks that sit in a collective: 4 real gloo processes on CPU.

Ranks 1-3 enter a barrier that rank 0 (the controller) joins only after publishing its decisions; each rank's
listener thread still receives every decision, in order, exactly once, before the barrier releases them.
"""

from __future__ import annotations

import time
from pathlib import Path

from gyre.distributed.local import run_local, shared_store

HERE = Path(__file__).resolve()
DECISIONS = 12


def control_worker(rank: int, world_size: int) -> dict:
    import datetime

    import torch.distributed as dist

    from gyre.distributed.control import STOP, ControlListener, ControlPublisher

    def make_store():
        return dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=60))

    server, store_port = shared_store()  # rank 0's server (kept alive below), a client elsewhere
    listener = ControlListener(make_store)
    dist.barrier()  # everyone is listening
    if rank == 0:
        publisher = ControlPublisher(make_store())
        for i in range(DECISIONS - 1):
            publisher.publish("role", cell=1 + i % 3, to="training" if i % 2 == 0 else "rollout")
            time.sleep(0.02)
        publisher.publish(STOP)
        time.sleep(1.0)  # 100 times a listener's check interval: every rank has read the log by now
    # Ranks 1-3 have been blocked here since the first barrier: whatever they hold now came during the collective.
    dist.barrier()
    finished = not listener.running
    got = [[d.seq, d.kind] for d in listener.drain()]
    listener.close()
    del server
    return {"finished_during_the_barrier": finished, "decisions": got}


def test_every_rank_gets_every_decision_while_the_others_wait_in_a_collective():
    results = run_local(f"{HERE}:control_worker", 4, timeout_s=120)
    expected = [[i, "role"] for i in range(DECISIONS - 1)] + [[DECISIONS - 1, "stop"]]
    assert results == [{"finished_during_the_barrier": True, "decisions": expected}] * 4
