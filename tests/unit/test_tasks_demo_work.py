"""The demo family's slow executions: the same workload shape as the simulator's preset, drawn per execution."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict

import numpy as np
import pytest

from gyre.config import DemoConfig
from gyre.config.checks import ConfigError
from gyre.config.demo import WORK_TIME_SCALE, DemoWorkConfig
from gyre.sim.presets import compose_sim_config
from gyre.sim.workload import DurationModel
from gyre.tasks.demo import generate_demo_tasks
from gyre.tasks.demo.work import PLAN_FILE, WORK_FILE, plan_work, score_after_evaluation, task_work


def test_the_defaults_are_the_nl2repo_preset_in_seconds():
    preset = compose_sim_config(["workload=nl2repo_122b"]).workload
    work = DemoWorkConfig()
    for name in ("median_s", "harness_timeout_s", "overall_timeout_s", "eval_s"):
        assert getattr(work, name) == pytest.approx(getattr(preset, name) / WORK_TIME_SCALE), name
    for name in ("sigma", "query_sigma", "overall_timeout_share"):
        assert getattr(work, name) == getattr(preset, name), name


def _plans(config: DemoWorkConfig, tasks: int, per_task: int):
    for t in range(tasks):
        work = task_work(config, seed=0, task_id=f"demo-0-{t:05d}")
        yield [plan_work(work, f"g{t:06d}-e{t * per_task + i:07d}") for i in range(per_task)]


def test_executions_draw_the_simulators_shape_and_the_same_durations_every_time():
    config = DemoWorkConfig(enabled=True)
    groups = list(_plans(config, tasks=2000, per_task=8))
    assert groups[:3] == list(_plans(config, tasks=3, per_task=8))  # deterministic per (seed, task, execution)
    real = [p for g in groups for p in g]
    preset = compose_sim_config(["workload=nl2repo_122b"]).workload
    scaled = {k: v / WORK_TIME_SCALE for k, v in asdict(preset).items() if k.endswith("_s")}
    model = DurationModel(type(preset)(**{**asdict(preset), **scaled}), seed=0)
    simulated = [p for _ in range(2000) for p in model.sample_group(8)]
    for kind in ("harness_timeout", "overall_timeout"):
        share_real = sum(p.outcome == kind for p in real) / len(real)
        share_sim = sum(p.outcome.value == kind for p in simulated) / len(simulated)
        assert share_real == pytest.approx(share_sim, abs=0.012), kind
    median_raw = float(np.median([p.work_s for p in real]))
    assert median_raw == pytest.approx(config.median_s, rel=0.05)
    # A group shares its task's factor: durations correlate within a group as the query factor says.
    logs = np.log([[p.work_s for p in g] for g in groups])
    within = float(np.mean(np.var(logs, axis=1, ddof=1)))
    assert within == pytest.approx(config.sigma**2, rel=0.1)
    assert float(np.var(logs.mean(axis=1))) == pytest.approx(config.query_sigma**2 + config.sigma**2 / 8, rel=0.15)


def test_slow_tasks_carry_the_check_command_the_budgets_and_a_subprocess_evaluator(tmp_path):
    work = DemoWorkConfig(enabled=True, median_s=2.0, harness_timeout_s=4.0, overall_timeout_s=5.0)
    (task,) = generate_demo_tasks(1, seed=3, out_dir=tmp_path / "tasks", config=DemoConfig(work=work))
    assert task.metadata["check_command"] == "{python} -m gyre.tasks.demo.work"
    assert (task.harness_timeout_s, task.overall_timeout_s) == (4.0, 5.0)
    assert task.evaluator.isolation == "subprocess" and task.evaluator.timeout_s == 15.0
    shape = json.loads((task.workspace_dir / WORK_FILE).read_text())
    assert shape["seed"] == 3 and shape["task"] == task.id and shape["task_factor"] > 0
    (plain,) = generate_demo_tasks(1, seed=3, out_dir=tmp_path / "plain")
    assert "check_command" not in plain.metadata and not (plain.workspace_dir / WORK_FILE).exists()


@pytest.mark.parametrize(
    ("field", "value"),
    [("median_s", 0.0), ("sigma", -1.0), ("overall_timeout_s", 10.0), ("overall_timeout_share", 2.0), ("eval_s", -1)],
)
def test_bad_work_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"tasks.demo.work.{field}"):
        DemoWorkConfig(**{field: value}, harness_timeout_s=20.0)


def test_the_check_command_writes_its_plan_then_sleeps_and_the_evaluator_waits_its_evaluation(tmp_path):
    work = {**task_work(DemoWorkConfig(median_s=0.6, sigma=0.0, query_sigma=0.0, eval_s=0.3), 0, "t"), "task": "t"}
    (tmp_path / WORK_FILE).write_text(json.dumps(work))
    env = {**os.environ, "GYRE_EXECUTION_ID": "g000000-e0000001"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gyre.tasks.demo.work"], cwd=tmp_path, env=env, capture_output=True)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started >= 0.6
    plan = json.loads((tmp_path / PLAN_FILE).read_text())
    assert plan == asdict(plan_work(work, "g000000-e0000001"))
    assert plan["outcome"] == "completed" and math.isclose(plan["work_s"], 0.6)
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "expected.json").write_text(json.dumps({"answer": "42", "answer_file": "answer.txt"}))
    (tmp_path / "answer.txt").write_text("42")
    started = time.monotonic()
    assert score_after_evaluation(tmp_path, hidden) == 1.0
    assert time.monotonic() - started >= plan["eval_s"] * 0.99
    no_env = subprocess.run(
        [sys.executable, "-m", "gyre.tasks.demo.work"],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "GYRE_EXECUTION_ID"},
        capture_output=True,
        text=True,
    )
    assert no_env.returncode == 2 and "GYRE_EXECUTION_ID" in no_env.stderr


def test_the_harness_time_before_the_check_counts_towards_the_drawn_duration(tmp_path):
    work = task_work(DemoWorkConfig(median_s=3.0, sigma=0.0, query_sigma=0.0), 0, "t")
    (tmp_path / WORK_FILE).write_text(json.dumps(work))
    env = {**os.environ, "GYRE_EXECUTION_ID": "g000000-e0000001", "GYRE_HARNESS_STARTED": repr(time.time() - 2.5)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gyre.tasks.demo.work"], cwd=tmp_path, env=env, capture_output=True)
    waited = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert 0.4 <= waited < 2.0  # 3 s drawn, 2.5 s of them already spent by the harness (plus start-up)
