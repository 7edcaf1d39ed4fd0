"""`tasks.held_out_dir` in `python -m gyre.train` (docs/runtime.md, "Tasks and the held-out evaluation"):

- a held-out task that is also a training task stops the run at start (exit 2, one line);
- a step per burst, `tasks.eval_every=1`: the held-out directory is evaluated on the run's engines at version 0
  (beside the first burst), at each publication and at the run's end (the final version streamed to the engines
  in rollout); each line says `"engines": true`. With one cell in one process, colocate, the engine is the run's
  only one: a move of the cell to training that finds an evaluation in flight waits for it (a transition's
  `held_out` phase), and at the end cell 0's engine is brought back (every cell trained the last step). With 4
  cells, elastic, engines leave an evaluation as their cells go to training (which ones depends on timing).

That held-out task directories are played through the run's harness and scored by their evaluators, greedily, and
never trained on, with several cells, is checked in a run that happens anyway: the sbatch job of `test_launch.py`
(`test_the_sbatch_script_runs_a_job_through_srun_that_plays_held_out_task_directories`, with `make_sets` below;
docs/testing.md, "Seventh round")."""

from __future__ import annotations

import json
import shutil

import pytest
from test_train_program import PAIRS, SMALL, finish, left_of, train

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


@pytest.mark.parametrize(
    ("shape", "steps"),
    [
        (["cluster=one_cell", "algo=colocate"], 2),  # its one engine: kept for the evaluation, brought back at the end
        (["algo=elastic"], 3),  # 4 cells in 4 processes: engines leave evaluations as their cells go to training
    ],
    ids=["one_cell_colocate", "four_cells_elastic"],
)
def test_held_out_task_directories_are_evaluated_on_the_rollout_engines_at_their_versions(tmp_path, shape, steps):
    train_tasks, held = make_sets(tmp_path)
    args = [*SMALL, *PAIRS, *shape, "algo.mu=1", f"steps={steps}", "logging.wandb=disabled"]
    args += [
        f"tasks.task_dir={tmp_path / 'train'}",
        f"tasks.held_out_dir={tmp_path / 'held'}",
        "tasks.num_held_out=0",  # all 3
        "tasks.eval_every=1",
        "harness.isolate_user=false",  # demo tasks from a directory are untrusted; pytest's tmp_path is mode 700
    ]
    run_dir = tmp_path / "run"
    process = train(args, run_dir)
    code, out, err = finish(process, 900)
    assert code == 0, err[-3000:]
    assert left_of(process) == []
    lines = [json.loads(line) for line in (run_dir / "held_out.jsonl").read_text().splitlines()]
    assert [line["version"] for line in lines] == list(range(steps + 1)), lines  # 0, each publication, the last
    for line in lines:
        assert line["engines"] is True and line["episodes"] == 3 and line["failed"] == 0, line
        assert 0 <= line["pass_rate"] <= line["mean_score"] <= 1
    for version in range(steps + 1):
        assert f"held-out: policy version {version} on the rollout engines: pass" in out, out[-3000:]
    log = (run_dir / "train.log").read_text()
    assert f"final version {steps} streamed to cell-" in log
    # A move to training that found the evaluation in flight on its engine alone waited for it (the engine kept).
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kept = [t for record in records for t in record["transitions"] if "held_out" in t["phases"]]
    assert all(t["to"] == "training" for t in kept), kept
    assert ("kept in rollout until it ends" in log) == bool(kept)
    trained_on = {json.loads(line)["task"] for line in (run_dir / "executions.jsonl").read_text().splitlines()}
    assert trained_on and trained_on <= {t.id for t in train_tasks} and trained_on.isdisjoint({t.id for t in held})
