"""`tasks.held_out_dir` in `python -m gyre.train` (docs/runtime.md, "Tasks and the held-out evaluation"): held-out
task directories are played through the run's harness and scored by their evaluators, greedily, before the first
step and after the last, never trained on; a held-out task that is also a training task stops the run at start
(exit 2, one line). A real run: the warm-started tiny model, the builtin harness, 4 gloo worker processes."""

from __future__ import annotations

import json
import shutil

import pytest
from test_train_program import PAIRS, SMALL, finish, train, wait_until_gone

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


@pytest.mark.slow
def test_held_out_task_directories_are_played_through_the_harness_and_never_trained(tmp_path):
    train_tasks, held = make_sets(tmp_path)
    args = [
        *SMALL,
        *PAIRS,
        "steps=1",
        f"tasks.task_dir={tmp_path / 'train'}",
        f"tasks.held_out_dir={tmp_path / 'held'}",
        "tasks.num_held_out=0",  # all 3
        "tasks.eval_every=1",
        "harness.isolate_user=false",  # demo tasks from a directory are untrusted; pytest's tmp_path is mode 700
        "logging.wandb=disabled",
    ]
    run_dir = tmp_path / "run"
    process = train(args, run_dir)
    code, out, err = finish(process, 600)
    assert code == 0, err[-3000:]
    assert wait_until_gone(process) == []
    lines = [json.loads(line) for line in (run_dir / "held_out.jsonl").read_text().splitlines()]
    assert [line["version"] for line in lines] == [0, 1]
    for line in lines:
        assert line["episodes"] == 3 and line["failed"] == 0, line
        assert 0 <= line["pass_rate"] <= line["mean_score"] <= 1 and "tool_call_rate" not in line
    played = sorted(p.name for p in (run_dir / "held_out_executions" / "v0").iterdir() if p.is_dir())
    assert played == ["held-out-v0-0", "held-out-v0-1", "held-out-v0-2"], played
    trained_on = {json.loads(line)["task"] for line in (run_dir / "executions.jsonl").read_text().splitlines()}
    assert trained_on and trained_on <= {t.id for t in train_tasks}
    assert trained_on.isdisjoint({t.id for t in held})
    assert "held-out: policy version 1: pass" in out


def test_a_held_out_task_that_is_also_a_training_task_exits_2(tmp_path):
    train_tasks, _ = make_sets(tmp_path)
    shutil.copytree(train_tasks[0].task_dir, tmp_path / "held" / "dup")
    args = [f"tasks.task_dir={tmp_path / 'train'}", f"tasks.held_out_dir={tmp_path / 'held'}", "logging.wandb=disabled"]
    code, _, err = finish(train(args, tmp_path / "run"), 300)
    lines = [line for line in err.splitlines() if line.startswith("gyre.train:")]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert "tasks.held_out_dir" in lines[0] and "never trained on" in lines[0] and "Traceback" not in err
