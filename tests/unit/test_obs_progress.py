"""The console progress line (gyre/obs/progress.py): hand-computed lines."""

import math

import pytest

from gyre.obs.progress import eta_s, format_duration, format_progress
from gyre.obs.record import StepRecord


def test_full_line():
    record = StepRecord(
        step=3, wall_time_s=120.0, reward_mean=0.41234, pass_rate=0.375,
        roles=("training", "training", "rollout", "to_rollout"), waterlevel=0.834,
    )  # fmt: skip
    # 4 steps done in 120 s: 30 s a step, 6 steps left -> 180 s.
    assert format_progress(record, 10) == (
        "step 4/10 | reward 0.412 | pass 37.5% | roles TTRr | waterlevel 0.83 | elapsed 2m00s | ETA 3m00s"
    )


def test_between_step_ends_the_elapsed_time_sets_the_eta():
    record = StepRecord(step=0, wall_time_s=50.0, roles=("to_training", "rollout"))
    # 1 step done, 200 s elapsed now: 200 s a step, 2 left -> 400 s.
    line = format_progress(record, 3, elapsed_s=200.0)
    assert line == "step 1/3 | reward -- | pass -- | roles tR | waterlevel -- | elapsed 3m20s | ETA 6m40s"


def test_last_step_has_zero_eta_and_missing_metrics_print_dashes():
    record = StepRecord(step=4, wall_time_s=7300.0, reward_mean=math.nan)
    assert format_progress(record, 5).endswith("roles -- | waterlevel -- | elapsed 2h01m | ETA 0s")
    assert "reward --" in format_progress(record, 5)
    assert eta_s(record, 5) == 0.0


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "--"), (math.inf, "--"), (0, "0s"), (59.4, "59s"), (59.6, "1m00s"), (3599, "59m59s"), (3600, "1h00m")],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_bad_arguments():
    record = StepRecord(step=0, wall_time_s=10.0)
    with pytest.raises(ValueError, match="total_steps=0 is not allowed"):
        format_progress(record, 0)
    with pytest.raises(ValueError, match=r"elapsed_s=5\.0 is not allowed: expected seconds >= the record's"):
        format_progress(record, 2, elapsed_s=5.0)
