"""How the job reads its launcher (gyre.runtime.launch): torchrun's and srun's variables, the fixed run directory
(the same after torchrun restarts the workers), and which GPU a rank takes (gyre.runtime.job.local_gpu)."""

from __future__ import annotations

import pytest

from gyre.runtime.launch import JobEnv, LaunchError, fixed_run_dir_overrides, job_env

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
    from gyre.runtime.job import local_gpu

    assert [local_gpu(r, 8) for r in range(8)] == list(range(8))  # torchrun: every rank sees the node's GPUs
    assert local_gpu(5, 1) == 0  # srun --gpus-per-task=1: each task sees its own as device 0
    for local_rank, visible in ((4, 4), (0, 0)):
        with pytest.raises(LaunchError, match=f"LOCAL_RANK={local_rank}: this rank sees {visible} GPUs"):
            local_gpu(local_rank, visible)
