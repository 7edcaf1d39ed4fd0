"""The duration model: outcomes follow the configured budgets; the paper preset matches its statistics."""

import numpy as np
import pytest

from gyre.config import ConfigError, WorkloadConfig
from gyre.sched import Outcome
from gyre.sim.presets import compose_sim_config
from gyre.sim.workload import DurationModel, read_replay_csv


def test_harness_ceiling_and_overall_budget():
    cfg = WorkloadConfig(
        median_s=1000, sigma=1.0, query_sigma=0.0, harness_timeout_s=1500, overall_timeout_s=3000,
        overall_timeout_share=0.5, eval_s=0.0,
    )  # fmt: skip
    plans = [p for _ in range(200) for p in DurationModel(cfg, seed=1).sample_group(8)]
    for p in plans:
        if p.outcome is Outcome.COMPLETED:
            assert p.duration_s < 1500
        elif p.outcome is Outcome.HARNESS_TIMEOUT:
            assert p.duration_s == 1500  # the ceiling, scored (eval_s = 0)
        else:
            assert p.outcome is Outcome.OVERALL_TIMEOUT and p.duration_s == 3000
        assert p.tokens == pytest.approx(p.duration_s * cfg.tokens_per_s)
    over = [p for p in plans if p.outcome is not Outcome.COMPLETED]
    share = sum(p.outcome is Outcome.OVERALL_TIMEOUT for p in over) / len(over)
    assert 0.35 < share < 0.65


def test_same_seed_same_durations():
    cfg = WorkloadConfig()
    a = [p.duration_s for p in DurationModel(cfg, seed=7).sample_group(16)]
    b = [p.duration_s for p in DurationModel(cfg, seed=7).sample_group(16)]
    assert a == b


def test_paper_preset_matches_paper_statistics():
    cfg = compose_sim_config(["workload=nl2repo_122b"]).workload
    model = DurationModel(cfg, seed=0)
    groups = [model.sample_group(16) for _ in range(3000)]
    durations = np.array([[p.duration_s for p in g] for g in groups])
    outcomes = [p.outcome for g in groups for p in g]
    longest = durations.max(axis=1)
    assert durations.mean() / 3600 == pytest.approx(1.93, rel=0.05)
    assert longest.mean() / 3600 == pytest.approx(2.96, rel=0.05)
    assert (longest > 4 * 3600).mean() == pytest.approx(0.0951, rel=0.2)
    assert outcomes.count(Outcome.HARNESS_TIMEOUT) / len(outcomes) == pytest.approx(0.0625, rel=0.15)
    assert outcomes.count(Outcome.OVERALL_TIMEOUT) / len(outcomes) == pytest.approx(0.0087, rel=0.3)


def test_replay_csv_groups_by_query(tmp_path):
    path = tmp_path / "durations.csv"
    path.write_text("query,duration_s,outcome\na,100,ok\na,200,harness_timeout\nb,5000,overall_timeout\n")
    assert read_replay_csv(str(path)) == [
        [(100.0, Outcome.COMPLETED), (200.0, Outcome.HARNESS_TIMEOUT)],
        [(5000.0, Outcome.OVERALL_TIMEOUT)],
    ]
    model = DurationModel(WorkloadConfig(distribution="replay", replay_csv=str(path)), seed=0)
    for _ in range(20):
        group = model.sample_group(4)
        assert len({p.duration_s >= 5000 for p in group}) == 1  # one query per group


@pytest.mark.parametrize(
    ("text", "needle"),
    [("seconds\n1\n", "duration_s column"), ("duration_s\n-1\n", "line 2"), ("duration_s,outcome\n1,maybe\n", "maybe")],
)
def test_replay_csv_errors_name_the_problem(tmp_path, text, needle):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        read_replay_csv(str(path))


def test_replay_csv_missing_file():
    with pytest.raises(ConfigError, match="existing CSV"):
        read_replay_csv("/nonexistent/durations.csv")
