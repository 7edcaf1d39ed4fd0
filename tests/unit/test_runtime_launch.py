"""How the job reads its launcher (gyre.runtime.job.launch): torchrun's and srun's variables, the fixed run directory
(the same after torchrun restarts the workers), and which GPU a rank takes (gyre.distributed.backends.local_gpu)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre.runtime.job.launch import (
    FAILED_AT_FILE,
    JobEnv,
    LaunchError,
    _earliest_failure,
    fixed_run_dir_overrides,
    job_env,
)

TORCHRUN = {
    "RANK": "2",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "abc-123",
}
SRUN = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "MASTER_ADDR": "node01",
    "MASTER_PORT": "29400",
}


def test_a_plain_run_has_no_job():
    assert job_env({"PATH": "/bin"}) is None


def test_torchrun_and_srun_are_read_alike():
    assert job_env(TORCHRUN) == JobEnv(
        launcher="torchrun",
        rank=2,
        world_size=4,
        local_rank=2,
        master_addr="10.0.0.1",
        master_port=29500,
        job_id="abc-123",
    )
    job = job_env(SRUN)
    assert (job.launcher, job.rank, job.world_size, job.local_rank, job.job_id) == ("srun", 5, 8, 1, "slurm-4242.0")


@pytest.mark.parametrize(
    "env, message",
    [
        ({**TORCHRUN, "RANK": "x"}, "RANK='x'"),
        ({**TORCHRUN, "RANK": "4"}, "outside world size 4"),
        ({k: v for k, v in SRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR and MASTER_PORT must be set"),
    ],
)
def test_a_broken_launcher_environment_is_one_clear_error(env, message):
    with pytest.raises(LaunchError, match=message):
        job_env(env)


def test_the_run_dir_is_fixed_for_every_rank_unless_the_user_fixed_it():
    job = job_env(TORCHRUN)
    assert fixed_run_dir_overrides(["steps=3"], job, root="outputs/train") == [
        "steps=3",
        "hydra.run.dir=outputs/train/abc-123",
    ]
    fixed = ["hydra.run.dir=/data/run"]
    assert fixed_run_dir_overrides(fixed, job, root="outputs/train") == fixed
    assert fixed_run_dir_overrides(["steps=3"], None, root="outputs/train") == ["steps=3"]
    job_ids = {fixed_run_dir_overrides([], job_env({**TORCHRUN, "RANK": str(r)}), root="o")[0] for r in range(4)}
    assert job_ids == {"hydra.run.dir=o/abc-123"}  # the same directory on every rank
    restarted = job_env({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "1"})  # torchrun keeps the run id on a restart
    assert fixed_run_dir_overrides([], restarted, root="o") == ["hydra.run.dir=o/abc-123"]


def test_a_sweep_under_a_launcher_is_refused():
    with pytest.raises(LaunchError, match="cannot run under srun"):
        fixed_run_dir_overrides(["-m", "algo.phi=0,1"], job_env(SRUN), root="o")


def test_a_rank_takes_its_local_gpu_or_the_one_it_sees():
    from gyre.distributed.backends import BackendError, local_gpu

    assert [local_gpu(r, 8) for r in range(8)] == list(range(8))  # torchrun: every rank sees the node's GPUs
    assert local_gpu(5, 1) == 0  # srun --gpus-per-task=1: each task sees its own as device 0
    for local_rank, visible in ((4, 4), (0, 0)):
        with pytest.raises(BackendError, match=f"LOCAL_RANK={local_rank}: this rank sees {visible} GPUs"):
            local_gpu(local_rank, visible)  # open_job says it as a LaunchError (test_distributed_backends.py)


def test_the_earliest_stamped_failure_names_the_rank(tmp_path):
    """Torch's agent names the first exit it saw; a peer that failed because of the cause can be seen first."""

    def failed(rank: int, at_ns: int | None, message: str) -> Path:
        rank_dir = tmp_path / "attempt_0" / str(rank)
        rank_dir.mkdir(parents=True)
        (rank_dir / "error.json").write_text(json.dumps({"message": {"message": message, "extraInfo": {}}}))
        if at_ns is not None:
            (rank_dir / FAILED_AT_FILE).write_text(str(at_ns))
        return rank_dir / "error.json"

    peer = failed(0, 2_000, "RuntimeError: Connection closed by peer")
    failed(1, 1_000, "ValueError: the cause")
    failed(2, None, "unstamped")  # a worker that could not stamp is not preferred over stamped ones
    assert _earliest_failure(peer, 0, "RuntimeError: Connection closed by peer") == (1, "ValueError: the cause")
    assert _earliest_failure(tmp_path / "elsewhere" / "0" / "error.json", 3, "as torch said") == (3, "as torch said")
