"""The console progress line of a training run: step, reward, pass rate, roles, waterlevel, ETA.

Role
    `format_progress` turns the latest `gyre.obs.record.StepRecord` into one line for the console (the runtime
    logs it at every step's end and every `logging.progress_every_s`; docs/runtime.md, "Outputs"). Pure: no IO,
    no clock (the caller passes the elapsed time).

Contract
    * The line reads `step 4/10 | reward 0.412 | pass 37.5% | roles TTRR | waterlevel 0.83 | elapsed 2m00s |
      ETA 3m00s`; a metric the record lacks prints as `--`.
    * Roles are one letter per cell, by cell index: R rollout, T training, t to training, r to rollout.
    * ETA = remaining steps x the mean step time so far (elapsed / steps done), where steps done = `step + 1`
      (steps count from 0) and elapsed defaults to the record's `wall_time_s`; 0 once the last step is done.
"""

from __future__ import annotations

import math

from gyre.config.checks import is_int
from gyre.obs.record import StepRecord

__all__ = ["ROLE_LETTERS", "format_duration", "format_progress"]

ROLE_LETTERS = {"rollout": "R", "training": "T", "to_training": "t", "to_rollout": "r"}


def format_duration(seconds: float | None) -> str:
    """`37s`, `4m12s`, `1h02m`; `--` for None or a non-finite value. Seconds are rounded to the nearest whole."""
    if seconds is None or not math.isfinite(seconds):
        return "--"
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def eta_s(record: StepRecord, total_steps: int, elapsed_s: float | None = None) -> float:
    """Seconds left: remaining steps x mean step time so far (module docstring)."""
    done = record.step + 1
    elapsed = record.wall_time_s if elapsed_s is None else elapsed_s
    return max(0, total_steps - done) * elapsed / done


def format_progress(record: StepRecord, total_steps: int, *, elapsed_s: float | None = None) -> str:
    """The progress line after `record` of a run of `total_steps` steps; `elapsed_s`: seconds since the run's start
    now (a line between step ends), the record's `wall_time_s` when None."""
    if not is_int(total_steps) or total_steps < 1:
        raise ValueError(f"format_progress total_steps={total_steps!r} is not allowed: expected an integer >= 1")
    if elapsed_s is not None and not (math.isfinite(elapsed_s) and elapsed_s >= record.wall_time_s):
        raise ValueError(
            f"format_progress elapsed_s={elapsed_s!r} is not allowed: expected seconds >= the record's wall_time_s "
            f"({record.wall_time_s})"
        )
    elapsed = record.wall_time_s if elapsed_s is None else elapsed_s
    roles = "".join(ROLE_LETTERS[role] for role in record.roles) or "--"
    parts = [
        f"step {record.step + 1}/{total_steps}",
        f"reward {_number(record.reward_mean, '.3f')}",
        f"pass {_percent(record.pass_rate)}",
        f"roles {roles}",
        f"waterlevel {_number(record.waterlevel, '.2f')}",
        f"elapsed {format_duration(elapsed)}",
        f"ETA {format_duration(eta_s(record, total_steps, elapsed))}",
    ]
    return " | ".join(parts)


def _number(value: float | None, spec: str) -> str:
    return "--" if value is None or not math.isfinite(value) else format(value, spec)


def _percent(value: float | None) -> str:
    return "--" if value is None or not math.isfinite(value) else f"{100 * value:.1f}%"
