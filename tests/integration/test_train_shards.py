"""Proxy shards in the training program (docs/proxy.md, "Shards"): `python -m gyre.train proxy.shards=2` serves every
model call from two shard processes, the controller deciding. A shard SIGKILLed mid-run ends the run with its error
(exit non-zero, train.log naming the shard and `ShardError`) and leaves no process behind. A whole run served by two
shards (both serve calls, every call recorded once, no harness error) is `test_harness_nodes.py`'s, on two torchrun
nodes."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from test_train_program import PAIRS, SMALL, finish, train, wait_until_gone

SHARDED_RUN = [
    *(o for o in SMALL if not o.startswith("algo.mu=")),
    *PAIRS,
    "algo.mu=1",  # a publication after every step: cells move between roles, executions are rerouted
    "cluster.num_cells=2",
    "proxy.shards=2",
    "steps=2",
    "tasks.eval_every=0",
    "logging.wandb=disabled",
    "logging.timeline=false",
]


@pytest.mark.slow  # a real run of 2 ranks and 2 shard processes, one killed mid-run: ~30 s on 2 cores
def test_a_proxy_shard_killed_mid_run_ends_the_run_with_its_error_and_leaves_nothing_behind(tmp_path):
    run_dir = tmp_path / "run"
    process = train([*SHARDED_RUN, "steps=4"], run_dir)
    log_path, pids = run_dir / "train.log", None
    try:
        deadline = time.monotonic() + 300
        while pids is None or not list((run_dir / "records").glob("*.jsonl")):
            assert process.poll() is None and time.monotonic() < deadline, "no shard served a call in time"
            text = log_path.read_text() if log_path.is_file() else ""
            found = re.search(r"proxy shards serving at .* \(pids (\d+), (\d+)\)", text)
            pids = None if found is None else [int(pid) for pid in found.groups()]
            time.sleep(0.1)
        os.kill(pids[1], signal.SIGKILL)
        code, out, _ = finish(process, 300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert code != 0, out[-2000:]
    log = log_path.read_text()
    assert re.search(r"proxy shard 1 \(\S+\) is gone: its control connection ended", log), log[-3000:]
    assert "the run failed: ShardError" in log, log[-3000:]
    assert wait_until_gone(process) == []
