"""A plainly run job launches its own workers (gyre.runtime.job.launch.launch_workers), over real processes on CPU.

Every worker joins one gloo group from the environment the launcher set and all-reduces once. A worker that fails
ends the job at once with its rank and error named, and no worker process is left; Ctrl-C (SIGINT to the launching
process) ends the job within seconds, workers included. Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre.runtime.job.launch import WorkerFailed, launch_workers

HERE = Path(__file__).resolve()
WORKERS = 3


def all_reduce_worker(fail_rank: int, hold_s: float, pid_dir: str) -> int:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    dist.init_process_group("gloo")
    if rank == fail_rank:
        raise ValueError(f"rank {rank} fails on purpose")
    total = torch.ones(1)
    dist.all_reduce(total)  # a failing rank's peers wait here: the agent must stop them
    time.sleep(hold_s)
    dist.destroy_process_group()
    return int(total.item()) * 100 + rank


def alive(pid_dir: Path) -> list[int]:
    pids = [int(path.read_text()) for path in pid_dir.glob("*.pid")]
    living = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
        if state != "Z":
            living.append(pid)
    return living


def test_workers_run_and_return_by_rank(tmp_path):
    results = launch_workers(f"{HERE}:all_reduce_worker", [-1, 0.0, str(tmp_path)], WORKERS)
    assert results == {rank: WORKERS * 100 + rank for rank in range(WORKERS)}
    assert alive(tmp_path) == []


def test_a_failing_worker_ends_the_job_with_its_error_named(tmp_path):
    started = time.monotonic()
    with pytest.raises(WorkerFailed) as failed:
        launch_workers(f"{HERE}:all_reduce_worker", [1, 0.0, str(tmp_path)], WORKERS)
    assert failed.value.rank == 1 and "rank 1 fails on purpose" in failed.value.error
    assert time.monotonic() - started < 60  # not a gloo timeout (30 min by default)
    assert alive(tmp_path) == []


LAUNCHER = """
import sys
sys.path.insert(0, {here!r})
from gyre.runtime.job.launch import launch_workers
launch_workers({target!r}, [-1, 600.0, {pids!r}], {workers})
"""


def test_ctrl_c_ends_the_job_and_its_workers_within_seconds(tmp_path):
    code = LAUNCHER.format(
        here=str(HERE.parent), target=f"{HERE}:all_reduce_worker", pids=str(tmp_path), workers=WORKERS
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.pid"))) < WORKERS and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(list(tmp_path.glob("*.pid"))) == WORKERS, "the workers did not start"
        time.sleep(1.0)  # past the all-reduce: every worker is holding
        launcher.send_signal(signal.SIGINT)
        stopped = time.monotonic()
        launcher.wait(timeout=30)
        took = time.monotonic() - stopped
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    deadline = time.monotonic() + 10
    while alive(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert took < 10, f"{took:.1f} s from Ctrl-C to the launcher's exit"
    assert alive(tmp_path) == []
