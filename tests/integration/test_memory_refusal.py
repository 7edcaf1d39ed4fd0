"""A layout that cannot fit is refused before anything starts (docs/training.md, "The memory plan"), by both ways a
run is launched: `python -m gyre.train` plainly (the launching process refuses; no worker is started) and under
torchrun (every rank refuses on its own before its process group exists: no rendezvous of groups, no store, no
trainer). Each refusal is one line naming the setting that makes it fit, exit 2, within seconds; the run directory
keeps only the config and the log, and a later run in it plans as a fresh one.

The budget is the planned peak of the job less 3%, so the plan's first remedy makes it fit (the tiny model at
random init; no warm start, no task is played).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from gyre.config import TrainConfig
from gyre.distributed.local import HOST, free_port

REFUSED_WITHIN_S = 60.0  # interpreter start, Hydra, the config and torch's import; nothing else


def composed(overrides: list[str]) -> TrainConfig:
    """The run's config as `python -m gyre.train` composes it from conf/train.yaml."""
    from hydra import compose, initialize_config_dir

    from gyre.config import register_configs
    from gyre.config.hydra_errors import CONF_DIR, to_config

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return to_config(compose(config_name="train", overrides=overrides), TrainConfig)


def tight_budget_gib(overrides: list[str]) -> float:
    """`cluster.device_memory_gib` 3% short of the job's worst rank, with the headroom counted."""
    from gyre.runtime.job.plan import starting_model_config
    from gyre.trainer.memory_plan import GIB, memory_inputs, memory_plan

    cfg = composed(overrides)
    plan = memory_plan(memory_inputs(cfg, starting_model_config(cfg)))
    return round(0.97 * plan.worst().peak(plan.inputs.device) / (1 - cfg.cluster.memory_headroom) / GIB, 4)


def assert_refused(stderr: str, ranks: int) -> None:
    """One refusal line from each of `ranks` ranks, at most, and at least one: under torchrun the first rank to exit
    makes torchrun SIGTERM the others, which may not have printed theirs yet."""
    lines = [line for line in stderr.splitlines() if line.startswith("gyre.train:")]
    assert 1 <= len(lines) <= ranks, stderr[-3000:]
    for line in lines:
        assert line.startswith("gyre.train: config error: rank 0 (core, cell leader, controller) needs"), line
        assert ": set " in line and "GiB" in line, line
    assert "Traceback" not in "\n".join(lines)


def assert_nothing_began(run_dir: Path) -> None:
    log = (run_dir / "train.log").read_text()
    assert "job ready" not in log and "starting" not in log, log[-2000:]
    left = sorted(path.name for path in run_dir.iterdir())
    assert set(left) <= {"config.yaml", "train.log", ".hydra"}, left


OVERRIDES = ["model.init=random", "cluster.num_cells=2", "cluster.cell_size=1"]


def test_a_plain_launch_refuses_before_any_worker_starts(tmp_path):
    run_dir = tmp_path / "run"
    args = [*OVERRIDES, f"cluster.device_memory_gib={tight_budget_gib(OVERRIDES)}"]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "gyre.train", *args, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr[-3000:]
    assert elapsed < REFUSED_WITHIN_S, (elapsed, done.stderr)
    assert_refused(done.stderr, 1)
    assert done.stderr.splitlines()[-1].startswith("gyre.train: config error:") and "memory plan" not in done.stderr
    assert "worker processes" not in done.stdout
    assert_nothing_began(run_dir)
    # a later run in the same directory: planned afresh (nothing to resume, nothing in the way)
    from gyre.recipes.demo import DemoRecipe
    from gyre.runtime.job.plan import build_plan, plan_layout

    later = composed(OVERRIDES)
    plan = build_plan(later, DemoRecipe(), run_dir, layout=plan_layout(later, 2), echo=lambda line: None)
    assert plan.checkpoint is None and plan.world_size == 2


def test_every_rank_under_torchrun_refuses_before_its_process_group(tmp_path):
    budget = tight_budget_gib(OVERRIDES)
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{HOST}:{free_port()}",
        "-m",
        "gyre.train",
        *OVERRIDES,
        f"cluster.device_memory_gib={budget}",
        f"hydra.run.dir={run_dir}",
    ]
    started = time.monotonic()
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    elapsed = time.monotonic() - started
    assert done.returncode != 0 and elapsed < 2 * REFUSED_WITHIN_S, (elapsed, done.stderr[-3000:])
    assert_refused(done.stderr, 2)  # each rank's own line (one may be cut off by torchrun's SIGTERM)
    assert done.stderr.count("exitcode  : 2") + done.stderr.count("exitcode : 2") >= 1, done.stderr[-3000:]
    assert_nothing_began(run_dir)
