"""The console progress line of a training run: step, reward, pass rate, roles, waterlevel, ETA.

Role
    `format_progress` turns the latest `gyre.obs.record.StepRecord` into one line for the console (the runtime
    logs it at every step's end); `format_live` says what runs now, between step ends (every
    `logging.progress_every_s`: executions, the model calls awaiting a first token and decoding, the call that has
    waited longest for its first token; docs/runtime.md, "Outputs"). Pure: no IO, no clock (the caller passes
    the elapsed time).

Contract
    * The line reads `step 4/10 | reward 0.412 | pass 37.5% | roles TTRR | waterlevel 0.83 | elapsed 2m00s |
      ETA 3m00s`; a metric the record lacks prints as `--`.
    * Roles are one letter per cell, by cell index: R rollout, T training, t to training, r to rollout.
    * ETA = remaining steps x the mean step time so far (elapsed / steps done), where steps done = `step + 1`
      (steps count from 0) and elapsed defaults to the record's `wall_time_s`; 0 once the last step is done.
    * The live line reads `step 2/10 running | executions 8 | calls 6 awaiting a first token (longest 48,042
      tokens, 1m40s), 2 decoding | roles TR | waterlevel 0.83 | elapsed 4m10s | ETA 3m00s`: the step in progress
      (counted from 1), the executions running, the calls waiting for their first token (queued or in prefill) and
      the longest such wait with its prompt length (left out when none waits), the calls past it. ETA: the steps
      left times the mean time of the finished ones, less the time the running step has had so far (`--` before
      the first step ends; never below 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gyre.config.checks import is_int
from gyre.obs.record import StepRecord

__all__ = ["ROLE_LETTERS", "LiveState", "format_duration", "format_live", "format_progress"]

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
    parts = [
        f"step {record.step + 1}/{total_steps}",
        f"reward {_number(record.reward_mean, '.3f')}",
        f"pass {_percent(record.pass_rate)}",
        *_state_parts(record.roles, record.waterlevel, elapsed, eta_s(record, total_steps, elapsed)),
    ]
    return " | ".join(parts)


def _state_parts(roles: tuple[str, ...], waterlevel: float | None, elapsed_s: float, eta: float | None) -> list[str]:
    """The tail both lines share: roles, waterlevel, elapsed, ETA."""
    return [
        f"roles {''.join(ROLE_LETTERS[role] for role in roles) or '--'}",
        f"waterlevel {_number(waterlevel, '.2f')}",
        f"elapsed {format_duration(elapsed_s)}",
        f"ETA {format_duration(eta)}",
    ]


@dataclass(frozen=True)
class LiveState:
    """What runs now (the module docstring's live line)."""

    steps_done: int
    roles: tuple[str, ...]
    waterlevel: float | None
    executions: int  # running now
    waiting: int  # model calls waiting for their first token
    decoding: int  # model calls past their first token
    longest_wait_s: float = 0.0  # of the call waiting longest for its first token
    longest_wait_prompt_tokens: int = 0  # that call's prompt length


def format_live(state: LiveState, total_steps: int, *, elapsed_s: float, last: StepRecord | None = None) -> str:
    """The live line (module docstring); `last`: the last finished step's record, for the ETA."""
    if not is_int(total_steps) or total_steps < 1:
        raise ValueError(f"format_live total_steps={total_steps!r} is not allowed: expected an integer >= 1")
    calls = f"calls {state.waiting} awaiting a first token"
    if state.waiting:
        calls += f" (longest {state.longest_wait_prompt_tokens:,} tokens, {format_duration(state.longest_wait_s)})"
    calls += f", {state.decoding} decoding"
    eta = None
    if last is not None:
        into_step = max(0.0, elapsed_s - last.wall_time_s)
        eta = max(0.0, eta_s(last, total_steps) - into_step)
    parts = [
        f"step {min(state.steps_done + 1, total_steps)}/{total_steps} running",
        f"executions {state.executions}",
        calls,
        *_state_parts(state.roles, state.waterlevel, elapsed_s, eta),
    ]
    return " | ".join(parts)


def _number(value: float | None, spec: str) -> str:
    return "--" if value is None or not math.isfinite(value) else format(value, spec)


def _percent(value: float | None) -> str:
    return "--" if value is None or not math.isfinite(value) else f"{100 * value:.1f}%"
