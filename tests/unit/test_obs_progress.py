"""The console progress lines (gyre/obs/progress.py): hand-computed lines."""

import math

import pytest

from gyre.obs.progress import LiveState, eta_s, format_duration, format_live, format_progress
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


def test_the_live_line_names_the_longest_prefill_and_takes_the_eta_of_the_last_step():
    state = LiveState(
        steps_done=1, roles=("training", "rollout"), waterlevel=0.0, executions=8, waiting=6, decoding=2,
        longest_wait_s=100.0, longest_wait_prompt_tokens=48042,
    )  # fmt: skip
    last = StepRecord(step=0, wall_time_s=60.0)
    # 1 step done in 60 s, 1 left: 60 s, of which the running step has had 50 s -> 10 s.
    assert format_live(state, 2, elapsed_s=110.0, last=last) == (
        "step 2/2 running | executions 8 | calls 6 awaiting a first token (longest 48,042 tokens, 1m40s), 2 decoding"
        " | roles TR | waterlevel 0.00 | elapsed 1m50s | ETA 10s"
    )
    assert format_live(state, 2, elapsed_s=200.0, last=last).endswith("ETA 0s")  # a step slower than the mean


def test_the_live_line_before_the_first_step_and_with_no_prefill():
    state = LiveState(steps_done=0, roles=(), waterlevel=None, executions=0, waiting=0, decoding=3)
    assert format_live(state, 16, elapsed_s=5.0) == (
        "step 1/16 running | executions 0 | calls 0 awaiting a first token, 3 decoding | roles -- | waterlevel --"
        " | elapsed 5s | ETA --"
    )
    done = LiveState(steps_done=16, roles=(), waterlevel=None, executions=0, waiting=0, decoding=0)
    assert format_live(done, 16, elapsed_s=5.0).startswith("step 16/16 running")  # the final step's last moments
    with pytest.raises(ValueError, match="total_steps=0 is not allowed"):
        format_live(state, 0, elapsed_s=1.0)
