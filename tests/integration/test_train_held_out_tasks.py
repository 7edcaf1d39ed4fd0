"""`tasks.held_out_dir` in `python -m gyre.train` (docs/runtime.md, "Tasks and the held-out evaluation"): a held-out
task that is also a training task stops the run at start (exit 2, one line).

That held-out task directories are played through the run's harness and scored by their evaluators, greedily, before
the first step and after the last, and never trained on, is checked in a run that happens anyway: the sbatch job of
`test_launch.py` (`test_the_sbatch_script_runs_a_job_through_srun_that_plays_held_out_task_directories`, with
`make_sets` below; docs/testing.md, "Seventh round")."""

from __future__ import annotations

import shutil

import pytest
from test_train_program import finish, train

from gyre.config.demo import DemoConfig
from gyre.tasks.demo import generate_demo_tasks

pytestmark = pytest.mark.warm_start


def make_sets(tmp_path):
    demo = DemoConfig(max_digits=1)
    train_tasks = generate_demo_tasks(16, 0, tmp_path / "train", config=demo)
    held = generate_demo_tasks(8, 7, tmp_path / "held_all", config=demo)
    trained = {t.prompt for t in train_tasks}
    (tmp_path / "held").mkdir()
    kept = [t for t in held if t.prompt not in trained][:3]
    for task in kept:
        shutil.copytree(task.task_dir, tmp_path / "held" / task.task_dir.name)
    return train_tasks, kept


def test_a_held_out_task_that_is_also_a_training_task_exits_2(tmp_path):
    train_tasks, _ = make_sets(tmp_path)
    shutil.copytree(train_tasks[0].task_dir, tmp_path / "held" / "dup")
    args = [f"tasks.task_dir={tmp_path / 'train'}", f"tasks.held_out_dir={tmp_path / 'held'}", "logging.wandb=disabled"]
    code, _, err = finish(train(args, tmp_path / "run"), 300)
    lines = [line for line in err.splitlines() if line.startswith("gyre.train:")]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert "tasks.held_out_dir" in lines[0] and "never trained on" in lines[0] and "Traceback" not in err
