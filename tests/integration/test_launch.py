"""The launchers of `launch/` run the real program (docs/cluster.md): `launch/torchrun.sh` as two nodes on this
machine, and a rank that dies ends the job, under torchrun and in a plainly launched run.

- Two torchrun "nodes" (`launch/torchrun.sh` twice: NNODES=2, NPROC_PER_NODE=1, NODE_RANK 0 and 1, c10d
  rendezvous on 127.0.0.1) of 2 cells: `test_harness_nodes.py` starts such a job (one rank a node: the rendezvous,
  the ranks' groups and the run across nodes are the same with two, measured; each rank under torchrun is a fresh
  interpreter, ~5 CPU s of imports), kills node 1's rank, and launches both nodes again to finish the run: both
  exit 0, the run directory has a line of metrics per step and the summary, one of them printed the run's end, no
  process is left (what the two-node smoke of this module checked before: docs/testing.md, "Seventh round").
- A satellite SIGKILLed mid-step under torchrun with MAX_RESTARTS=1: torchrun restarts the job, which comes back
  to the same run directory, named by its RDZV_ID (one directory, both attempts' starts in its train.log),
  resumes from its checkpoint and finishes.
- A rank SIGKILLed mid-run (a satellite) ends the job within 30 s, and the output names the rank and the signal:
  in a plainly launched run (rank 2; `python -m gyre.train`, one line `gyre.train: run error: rank 2 failed:
  Signal 9 (SIGKILL) ...`, exit 3); under two torchrun nodes (rank 1, the other node's) in
  `test_harness_nodes.py`, which then resumes the job.
- `launch/slurm.sbatch` with stand-ins for srun and scontrol runs a 2-task job through gyre's srun path, in the
  run directory of the job's id; its tasks come from directories, and its held-out task directories are played on
  the rollout engines before the first step and after the last, never trained on (the run of
  `test_train_held_out_tasks.py`, folded in).

Processes are real and started in sessions of their own; torchrun's workers start sessions of their own too, so
every process that carries the test's marker (or runs in its run directory) is killed by PID at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_train_program import PAIRS, SMALL, left_of, pid_of_rank, train

from gyre.distributed.local import HOST, free_port

pytestmark = pytest.mark.warm_start  # tests/conftest.py: ordered after the modules that do not need it
ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_SH = ROOT / "launch" / "torchrun.sh"
DEATH_BOUND_S = 30.0  # a rank's death ends the job within this


class Nodes:
    """`launch/torchrun.sh` started once per node of one job on this machine, with the same RDZV_ID."""

    def __init__(self, tmp_path: Path, args: list[str], *, nnodes: int, nproc: int, env: dict | None = None):
        self.marker, self.run_dir = uuid.uuid4().hex, tmp_path / "run"
        self.rdzv_id = f"test-{self.marker[:8]}"
        base = {
            **os.environ,
            "PYTHON": sys.executable,
            "PYTHONUNBUFFERED": "1",
            "GYRE_TEST_RUN": self.marker,
            "NNODES": str(nnodes),
            "NPROC_PER_NODE": str(nproc),
            "MASTER_ADDR": HOST,
            "MASTER_PORT": str(free_port()),
            "RDZV_ID": self.rdzv_id,
            **(env or {}),
        }
        self.cwd = tmp_path
        self.processes, self.files = [], []
        for node in range(nnodes):
            out, err = (open(tmp_path / f"node{node}.{kind}", "w+") for kind in ("out", "err"))  # noqa: SIM115
            self.files += [out, err]
            process = subprocess.Popen(
                ["bash", str(TORCHRUN_SH), *args],
                cwd=tmp_path,
                env={**base, "NODE_RANK": str(node)},
                stdout=out,
                stderr=err,
                text=True,
                start_new_session=True,
            )
            process.out, process.err = out, err
            self.processes.append(process)
            if node == 0:
                time.sleep(1.0)  # node 0 hosts the rendezvous store (is_host=true): let it bind first

    def wait(self, timeout_s: float) -> list[int]:
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        return [process.poll() for process in self.processes]

    def output(self, node: int) -> tuple[str, str]:
        process = self.processes[node]
        process.out.seek(0)
        process.err.seek(0)
        return process.out.read(), process.err.read()

    def left(self) -> list[str]:
        return left_of(SimpleNamespace(marker=self.marker, run_dir=self.run_dir))

    def close(self) -> list[str]:
        """Kill what is still alive (torchrun by its process group, its workers and harnesses by PID); what was
        left before that."""
        left = self.left()
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        kill_by_pid(self.left())
        for file in self.files:
            file.close()
        return left


def end_line(out: str) -> dict | None:
    """The run's last stdout line (`{"end", "steps", ...}`), printed by rank 0's node only."""
    lines = out.strip().splitlines()
    try:
        end = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    return end if isinstance(end, dict) and "end" in end else None


def kill_by_pid(entries: list[str]) -> None:
    for entry in entries:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(entry.split(":", 1)[0]), signal.SIGKILL)


def wait_for_rollouts(run_dir: Path, alive, timeout_s: float) -> None:
    """Until the proxy has recorded a model call (the job is mid-run: every rank up, harnesses calling the cells'
    engines). Earlier than the first step, which only adds a step's worth of waiting: what dies is a rank of a
    running job either way."""
    records = run_dir / "records"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        if records.is_dir() and any(path.stat().st_size > 0 for path in records.glob("*.jsonl")):
            return
        time.sleep(0.2)
    raise AssertionError(f"no model call recorded in {timeout_s} s (alive: {alive()})")


def assert_names_rank_killed(text: str, rank: int) -> None:
    """torchrun's summary of the failure: `rank : 1 (local_rank: 0)` ... `Signal 9 (SIGKILL) received by PID n`."""
    assert re.search(rf"rank\s+: {rank} \(local_rank: \d+\)", text), text[-3000:]
    assert "Signal 9 (SIGKILL) received by PID" in text, text[-3000:]


@pytest.mark.slow
def test_a_rank_killed_in_a_plainly_launched_run_ends_it_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    process = train([*SMALL, *PAIRS, "steps=50", "tasks.eval_every=0", "logging.wandb=disabled"], run_dir)
    try:
        wait_for_rollouts(run_dir, lambda: process.poll() is None, 600)
        time.sleep(1.0)
        os.kill(pid_of_rank(process.marker, 2, run_dir), signal.SIGKILL)
        killed = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.communicate(timeout=DEATH_BOUND_S + 30)
        ended_s = time.monotonic() - killed
        code = process.poll()
        process.stderr_file.seek(0)
        err = process.stderr_file.read()
        left = left_of(process)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
        kill_by_pid(left_of(process))
        process.stderr_file.close()
    lines = [line for line in err.splitlines() if line.startswith("gyre.train:")]
    print(f"plain run, rank 2 SIGKILLed: exit {code} after {ended_s:.1f} s: {lines}")
    assert code == 3 and ended_s < DEATH_BOUND_S, (code, ended_s, err[-3000:])
    assert len(lines) == 1 and "run error: rank 2 failed" in lines[0] and "Signal 9 (SIGKILL)" in lines[0], lines
    # Torch's agent logs the worker's exit with its own traceback (its ProcessExitedException); gyre prints none.
    assert [line for line in err.splitlines() if "Traceback" in line and "torch/distributed/elastic" not in line] == []
    assert left == [] or wait_gone(process) == []


def wait_gone(process, timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := left_of(process)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


FAKE_SRUN = """#!/usr/bin/env bash
# srun on one machine, for the test: SLURM_NTASKS copies of the command, task i with SLURM_PROCID=i
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_STEP_ID=0 "$@" &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = '#!/usr/bin/env bash\n[[ "$1 $2" == "show hostnames" ]] && echo 127.0.0.1\n'


@pytest.mark.slow
def test_the_sbatch_script_runs_a_job_through_srun_that_plays_held_out_task_directories(tmp_path):
    """launch/slurm.sbatch with stand-ins for srun and scontrol: 2 tasks, gyre's srun path (SLURM_PROCID, the
    process group over tcp://MASTER_ADDR:MASTER_PORT), the run directory of the job's id.

    The job's tasks come from directories (`tasks.task_dir`, and `tasks.held_out_dir`: docs/runtime.md, "Tasks and
    the held-out evaluation"): the held-out task directories are played through the run's harness on its rollout
    engines and scored by their evaluators, greedily, before the first step and after the last, and never trained
    on. Folded in from `test_train_held_out_tasks.py`, whose own run it was (docs/testing.md, "Seventh round"): the
    held-out path is rank 0's, the same under any launcher."""
    from test_train_held_out_tasks import make_sets

    train_tasks, held = make_sets(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    marker = uuid.uuid4().hex
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "PYTHONUNBUFFERED": "1",
        "GYRE_TEST_RUN": marker,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NTASKS": "2",
        "MASTER_PORT": str(free_port()),
    }
    args = [*SMALL, *PAIRS, "cluster.num_cells=2", "steps=1", "logging.wandb=disabled"]
    args += [
        f"tasks.task_dir={tmp_path / 'train'}",
        f"tasks.held_out_dir={tmp_path / 'held'}",
        "tasks.num_held_out=0",  # all 3
        "tasks.eval_every=1",
        "harness.isolate_user=false",  # demo tasks from a directory are untrusted; pytest's tmp_path is mode 700
    ]
    run_dir = tmp_path / "outputs" / "train" / "slurm-4242"
    process = subprocess.Popen(
        ["bash", str(ROOT / "launch" / "slurm.sbatch"), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
        left = left_of(SimpleNamespace(marker=marker, run_dir=run_dir))
        kill_by_pid(left)
    assert process.returncode == 0, out[-3000:]
    assert "gyre: job 4242 (restart 0): 2 tasks, rendezvous 127.0.0.1:" in out, out[-3000:]
    ends = [json.loads(line) for line in out.splitlines() if line.startswith('{"end"')]
    assert len(ends) == 1 and ends[0]["end"] == "completed", out[-3000:]
    assert Path(ends[0]["run_dir"]) == run_dir.resolve()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1
    assert left == []
    # The held-out task directories: played before the first step and after the last, scored, never trained on.
    lines = [json.loads(line) for line in (run_dir / "held_out.jsonl").read_text().splitlines()]
    assert [line["version"] for line in lines] == [0, 1]
    for line in lines:
        assert line["episodes"] == 3 and line["failed"] == 0 and line["engines"] is True, line
        assert 0 <= line["pass_rate"] <= line["mean_score"] <= 1 and "tool_call_rate" not in line
    played = sorted(p.name for p in (run_dir / "held_out_executions" / "v0").iterdir() if p.is_dir())
    assert played == ["held-out-v0-0", "held-out-v0-1", "held-out-v0-2"], played
    trained_on = {json.loads(line)["task"] for line in (run_dir / "executions.jsonl").read_text().splitlines()}
    assert trained_on and trained_on <= {t.id for t in train_tasks}
    assert trained_on.isdisjoint({t.id for t in held})
    assert "held-out: policy version 1 on the rollout engines: pass" in out, out[-3000:]


def wait_for_a_satellite_training(run_dir: Path, alive, timeout_s: float) -> tuple[int, int]:
    """Until, after the first checkpoint, a satellite joins a step in flight (rank 0's train.log line `step s: cell c
    joins after n units`) or goes to training for the burst in flight (`cell c to training: ...`, c > 0); its cell
    and the number of steps done then. Which of the two comes first depends on timing (on a loaded machine a
    satellite's trainer may be ready only after the steps it could have joined): either way it is a satellite
    of the burst in flight, mid-step or about to claim its micro-steps."""
    log, deadline = run_dir / "train.log", time.monotonic() + timeout_s
    first = re.compile(r"checkpoint \S+/step-000001 written")
    event = re.compile(r"step \d+: cell (\d+) joins after \d+ units|cell ([1-9]\d*) to training:")
    while time.monotonic() < deadline and alive():
        text = log.read_text() if log.is_file() else ""
        checkpointed = first.search(text)
        if checkpointed and (match := event.search(text, checkpointed.end())):
            return int(match.group(1) or match.group(2)), len(re.findall(r"checkpoint \S+/step-\d+ written", text))
        time.sleep(0.05)
    raise AssertionError(f"no satellite trained after the first checkpoint (alive: {alive()}, {timeout_s} s)")


@pytest.mark.slow
def test_a_satellite_killed_mid_step_under_torchrun_max_restarts_resumes_and_finishes(tmp_path):
    args = [*SMALL, *PAIRS, "cluster.num_cells=2", "steps=6", "tasks.eval_every=0", "logging.wandb=disabled"]
    args.append("checkpoint.every_steps=1")  # the core and one satellite: each torchrun attempt starts 2 interpreters
    # No RUN_DIR: the run directory is the one torchrun.sh names by RDZV_ID, and torchrun's restart comes back to it.
    nodes = Nodes(tmp_path, args, nnodes=1, nproc=2, env={"MAX_RESTARTS": "1"})
    run_dir = nodes.run_dir = tmp_path / "outputs" / "train" / nodes.rdzv_id  # left(): harnesses run in it
    try:
        alive = lambda: nodes.processes[0].poll() is None  # noqa: E731
        cell, step = wait_for_a_satellite_training(run_dir, alive, 600)
        os.kill(pid_of_rank(nodes.marker, cell, run_dir), signal.SIGKILL)  # native cells: cell c is rank c
        killed = time.monotonic()
        log = run_dir / "train.log"
        lost_s = restarted_s = None
        named = re.compile(rf"failed \(exitcode: -9\) local_rank: {cell} |RankLost: rank {cell} ended")
        while restarted_s is None and time.monotonic() < killed + 120:
            text = log.read_text()
            if lost_s is None and named.search(text + nodes.output(0)[1]):
                lost_s = time.monotonic() - killed  # the first attempt ends, naming the rank: torchrun or rank 0
            if "resuming from" in nodes.output(0)[0]:
                restarted_s = time.monotonic() - killed  # torchrun's second attempt resumes (rank 0's stdout)
            time.sleep(0.1)
        codes = nodes.wait(600)
        out, err = nodes.output(0)
        left = nodes.close()
    finally:
        nodes.close()
    text = log.read_text()
    print(f"cell {cell} SIGKILLed in step {step}: named after {lost_s} s, resumed after {restarted_s} s; rc {codes}")
    assert lost_s is not None and lost_s < DEATH_BOUND_S, (lost_s, err[-3000:])
    assert restarted_s is not None, text[-3000:]
    assert codes == [0], (codes, out[-2000:], err[-3000:])
    assert end_line(out)["steps"] == 6
    resumed = re.findall(r"resuming from \S+/step-(\d+) \(step (\d+) of 6\)", out)
    assert resumed and int(resumed[-1][1]) >= 1, resumed
    metrics = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics == list(range(6)), metrics
    assert left == []
    # The restarted job came back to its run directory: one directory, named by RDZV_ID, holding both attempts.
    runs = list((tmp_path / "outputs" / "train").iterdir())
    assert [run.name for run in runs] == [nodes.rdzv_id], runs
    starts = [line for line in text.splitlines() if "training -> " in line]
    assert len(starts) == 2 and all(line.endswith(f"outputs/train/{nodes.rdzv_id}") for line in starts), starts
