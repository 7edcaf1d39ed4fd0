"""Metric sinks: JSONL (durable lines), memory, the fan-out, W&B's numbers (the W&B run: test_obs_wandb.py)."""

import json
import os
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

from gyre.config.obs import LoggingConfig
from gyre.obs.record import StepRecord, TransitionRecord
from gyre.obs.sinks import (
    METRICS_FILE,
    JsonlSink,
    MemorySink,
    MetricsLogger,
    MetricsSinkError,
    MetricsWriteError,
    build_metrics_logger,
    wandb_numbers,
)


def record(step: int, **changes) -> StepRecord:
    return StepRecord(step=step, wall_time_s=10.0 * (step + 1), reward_mean=0.1 * step, **changes)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_line_is_on_disk_when_write_returns(tmp_path):
    path = tmp_path / METRICS_FILE
    sink = JsonlSink(path)
    sink.write(record(0))
    assert lines(path) == [record(0).to_dict()]  # read by another handle before close: flushed
    sink.write(record(1, loss={"loss": float("nan")}))
    assert [line["step"] for line in lines(path)] == [0, 1] and lines(path)[1]["loss/loss"] is None
    sink.close()
    sink.close()  # idempotent


def test_jsonl_appends_and_cuts_a_partial_last_line(tmp_path):
    path = tmp_path / METRICS_FILE
    with closing(JsonlSink(path)) as sink:
        sink.write(record(0))
        sink.write(record(1))
    with open(path, "a") as file:
        file.write('{"step": 2, "wall_ti')  # a crash mid-line
    with closing(JsonlSink(path)) as sink:
        sink.write(record(2))
    assert [line["step"] for line in lines(path)] == [0, 1, 2]


def test_jsonl_failed_write_raises_naming_file_and_step_then_refuses():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full to make a write fail")
    sink = JsonlSink("/dev/full")
    with pytest.raises(MetricsWriteError, match=r"/dev/full: could not write the metrics of step 0: .*No space"):
        sink.write(record(0))
    with pytest.raises(MetricsWriteError, match="step 1 lost"):
        sink.write(record(1))
    sink.close()


def test_jsonl_unopenable_path_is_a_clear_error(tmp_path):
    with pytest.raises(MetricsSinkError, match="cannot open the metrics file"):
        JsonlSink(tmp_path / "missing" / METRICS_FILE)


def test_logger_fans_out_in_order_and_checks_steps(tmp_path):
    first, second = MemorySink(), MemorySink()
    logger = MetricsLogger([first, second])
    assert logger.memory is first
    logger.write(record(0))
    logger.write(record(2))
    assert first.records == second.records == [record(0), record(2)]
    with pytest.raises(ValueError, match="step=2 is not allowed: expected a step after 2"):
        logger.write(record(2))
    with pytest.raises(TypeError, match="expected a StepRecord"):
        logger.write(record(3).to_dict())
    with pytest.raises(TypeError, match="expected write"):
        MetricsLogger([object()])


def test_logger_closes_every_sink_and_raises_the_first_failure():
    class FailingClose(MemorySink):
        def close(self):
            super().close()
            raise OSError("disk gone")

    failing, last = FailingClose(), MemorySink()
    with pytest.raises(OSError, match="disk gone"):
        MetricsLogger([failing, last]).close()
    assert failing.closed and last.closed


def test_build_disabled_wandb_writes_jsonl_and_never_imports_wandb(tmp_path):
    """In a fresh interpreter: `logging.wandb=disabled` builds memory + JSONL and leaves wandb unimported."""
    code = (
        "import sys\n"
        "from gyre.config.obs import LoggingConfig\n"
        "from gyre.obs.record import StepRecord\n"
        "from gyre.obs.sinks import build_metrics_logger, JsonlSink, MemorySink\n"
        f"logger = build_metrics_logger(LoggingConfig(wandb='disabled'), {str(tmp_path / 'run')!r})\n"
        "assert [type(s) for s in logger.sinks] == [MemorySink, JsonlSink], logger.sinks\n"
        "logger.write(StepRecord(step=0, wall_time_s=1.0)); logger.close()\n"
        "assert 'wandb' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert [line["step"] for line in lines(tmp_path / "run" / METRICS_FILE)] == [0]


def test_build_without_jsonl(tmp_path):
    logger = build_metrics_logger(LoggingConfig(wandb="disabled", metrics_jsonl=False), tmp_path)
    assert [type(s) for s in logger.sinks] == [MemorySink]
    assert not (tmp_path / METRICS_FILE).exists()


def test_wandb_numbers_flattens_roles_and_transitions():
    rec = record(
        1,
        roles=("training", "rollout", "rollout"),
        transitions=(
            TransitionRecord(cell=0, to="training", start_s=1.0, duration_s=2.0),
            TransitionRecord(cell=1, to="training", start_s=3.0, duration_s=5.0),
        ),
        grad_norm=0.5,
        loss={"loss": 0.25},
    )
    numbers = wandb_numbers(rec)
    assert numbers["roles/rollout"] == 2 and numbers["roles/training"] == 1
    assert numbers["transitions/count"] == 2 and numbers["transitions/duration_s_total"] == 7.0
    assert numbers["transitions/duration_s_max"] == 5.0
    assert numbers["grad_norm"] == 0.5 and numbers["loss/loss"] == 0.25 and numbers["reward_mean"] == 0.1
    assert "step" not in numbers and "pass_rate" not in numbers  # the step is W&B's step; None is dropped
    assert all(isinstance(v, int | float) for v in numbers.values())
