"""The simulator app as a user runs it: `python -m gyre.sim [overrides]` in a real subprocess.

Each run is small (the `tiny` cluster, 4 x 4 executions per step, 3 steps) and has a timeout. Outputs
go under pytest's tmp_path via `hydra.run.dir` / `hydra.sweep.dir`, never into the repository.
The last test checks, in-process, the role-timeline segments the app builds from a trace.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.config import AlgoConfig, ClusterConfig, SimConfig, WorkloadConfig
from gyre.sched import POOL
from gyre.sim.simulator import simulate
from gyre.sim.timeline import timeline_segments

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TIMEOUT_S = 120
TINY = ["cluster=tiny", "algo.group_size=4", "algo.batch_groups=4", "steps=3", "workload=lognormal"]


def run_sim(*overrides: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    return subprocess.run(
        [sys.executable, "-m", "gyre.sim", *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def last_json_line(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def assert_summary_shape(summary: dict) -> None:
    assert {"total_time_s", "steps", "step_times_s", "staleness", "utilization"} <= summary.keys()
    assert {"group_mean", "token_mean", "max"} <= summary["staleness"].keys()
    assert {"rollout", "training", "idle"} <= summary["utilization"].keys()
    assert summary["steps"] == len(summary["step_times_s"])
    assert summary["total_time_s"] > 0


def test_run_prints_summary_line_and_writes_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_sim(*TINY, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # logs go to stderr; stdout is the summary alone
    summary = last_json_line(proc.stdout)
    assert_summary_shape(summary)
    assert summary["steps"] == 3
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    config = (run_dir / "config.yaml").read_text()
    assert "num_cells: 4" in config and "group_size: 4" in config
    assert (run_dir / "role_timeline.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "done: 3 steps" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_timeline_false_skips_the_picture(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_sim(*TINY, "timeline=false", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "summary.json").is_file()
    assert not (run_dir / "role_timeline.png").exists()


def test_multirun_sweep_writes_one_run_dir_per_job(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_sim("-m", *TINY, "algo.phi=0,0.5", "algo.mu=1,3", f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summaries = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/summary.json"))]
    assert len(summaries) == 4
    assert {(s["phi"], s["mu"]) for s in summaries} == {(0.0, 1), (0.0, 3), (0.5, 1), (0.5, 3)}
    for summary in summaries:
        assert_summary_shape(summary)
    assert last_json_line(proc.stdout) in summaries


def test_experiment_group_applies_preset_and_labels_run(tmp_path):
    presets = tmp_path / "extra_conf" / "experiment"
    presets.mkdir(parents=True)
    (presets / "probe.yaml").write_text("# @package _global_\nalgo: {phi: 1.0, mu: 2}\n")
    proc = run_sim(
        *TINY,
        "experiment=probe",
        f"hydra.searchpath=[file://{presets.parent}]",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    summary = last_json_line(proc.stdout)
    assert (summary["experiment"], summary["phi"], summary["mu"]) == ("probe", 1.0, 2)


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["cluster.num_cells=0"], "cluster.num_cells=0"),
        (["cluster.cell_capacity=0"], "cluster.cell_capacity=0"),
        (["algo.rho_min=0"], "algo.rho_min=0.0"),
        (["algo.rho_min=1.5"], "algo.rho_min=1.5"),
        (["algo.phi=-1"], "algo.phi=-1.0"),
        (["algo.mu=0"], "algo.mu=0"),
        (["cluster.cell_capacity=1", "cluster.num_cells=1"], "cluster.cell_capacity=1"),
        (["cluster.num_cells=abc"], "cluster.num_cells='abc'"),
        (["algo.streaming=maybe"], "algo.streaming='maybe'"),
        (["+algo.phii=1"], "algo.phii=1"),
        (["cluster=nope"], "cluster='nope'"),
        (["seed=-1"], "seed=-1"),
        (["algo.tau_s=inf"], "algo.tau_s=inf"),
    ],
)
def test_bad_config_exits_2_with_one_line(tmp_path, overrides, names):
    proc = run_sim(*TINY, *overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gyre.sim: config error: "), lines[0]
    assert names in lines[0] and "expected" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert not (tmp_path / "run" / "summary.json").exists()


def test_unwritable_run_dir_exits_2_with_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = run_sim(*TINY, f"hydra.run.dir={blocker / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("gyre.sim: config error: cannot write the run directory"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_replay_csv_drives_the_durations(tmp_path):
    csv = tmp_path / "durations.csv"
    rows = [("600", "ok"), ("900", "ok"), ("1200", "harness_timeout"), ("300", "failed"), ("750", "ok")]
    csv.write_text("duration_s,outcome\n" + "".join(f"{d},{o}\n" for d, o in rows))
    run_dir = tmp_path / "run"
    proc = run_sim(*TINY, "workload=replay", f"workload.replay_csv={csv}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = last_json_line(proc.stdout)
    assert_summary_shape(summary)
    assert set(summary["outcomes"]) <= {"completed", "harness_timeout", "failed"}
    assert summary["outcomes"].get("completed", 0) > 0
    assert (run_dir / "summary.json").is_file()


@pytest.mark.parametrize("path", ["missing.csv", None])
def test_replay_without_a_csv_exits_2(tmp_path, path):
    overrides = ["workload=replay"] + ([f"workload.replay_csv={tmp_path / path}"] if path else [])
    proc = run_sim(*TINY, *overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gyre.sim: config error: workload.replay_csv="), lines[0]
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_run_that_cannot_finish_exits_3(tmp_path):
    proc = run_sim(*TINY, "max_sim_hours=0.001", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gyre.sim: simulation error: ") and "max_sim_hours" in last, last
    assert "Traceback" not in proc.stderr


def test_timeline_segments_tile_each_lane_and_keep_the_work():
    cluster = ClusterConfig(num_cells=4, cell_size=1, cell_capacity=8, separate_capacity=8, separate_size=1)
    cfg = SimConfig(
        cluster=cluster,
        workload=WorkloadConfig(median_s=600.0),
        algo=AlgoConfig(group_size=4, batch_groups=4),
        steps=4,
    )
    _, sim = simulate(cfg)
    segments, lanes = timeline_segments(sim)
    assert lanes == ["cell 0 (core)", "cell 1", "cell 2", "cell 3", "pool"]
    for lane in lanes:
        mine = sorted((s for s in segments if s.lane == lane), key=lambda s: (s.start_s, s.end_s))
        assert mine[0].start_s == 0.0 and mine[-1].end_s == pytest.approx(sim.now)
        for before, after in itertools.pairwise(mine):
            assert after.start_s == pytest.approx(before.end_s)  # no gap, no overlap
    for cell, state in enumerate(sim.cells):  # training pieces are exactly the micro-step compute
        computed = sum(s.end_s - s.start_s for s in segments if s.lane == lanes[cell] and s.state == "training")
        assert computed == pytest.approx(state.busy_s)
    pool_slot_s = sum(s.occupancy * 8 * (s.end_s - s.start_s) for s in segments if s.lane == "pool")
    assert pool_slot_s == pytest.approx(_slot_seconds(sim.trace.load_changes[POOL], sim.now))


def _slot_seconds(changes, end_s):
    """Plain left-Riemann sum of a step function of (time, load) changes up to end_s."""
    total = 0.0
    for (t0, load), (t1, _) in zip(changes, [*changes[1:], (end_s, 0)], strict=True):
        total += load * (min(t1, end_s) - t0)
    return total
