"""Config of a training run's checkpoints and of resuming one (docs/runtime.md, "Checkpoints and resume").

Checkpoints go under `<run dir>/checkpoints/step-<n>/`, each written beside its place and renamed into it once
complete; `resume` says where a run starts. Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.config.checks import require, require_int

RESUME_MODES = ("never", "auto")


@dataclass(kw_only=True)
class CheckpointConfig:
    """When a run writes its checkpoints and how many it keeps."""

    every_steps: int = 4
    """Write a checkpoint after every this many steps (and always after the last); 0: only after the last."""
    keep: int = 2
    """Complete checkpoints kept in the run directory (the oldest are removed once a newer one is complete); >= 1."""

    def __post_init__(self) -> None:
        require_int("checkpoint.every_steps", self.every_steps, ge=0)
        require_int("checkpoint.keep", self.keep, ge=1)


def check_resume(value: object) -> str:
    """`resume`: `never` (start afresh; a run directory that holds checkpoints is refused), `auto` (the latest
    complete checkpoint in the run directory, else afresh), or the path of one checkpoint directory."""
    require(
        isinstance(value, str) and bool(value),
        "resume",
        value,
        "'never', 'auto' (the latest complete checkpoint of the run directory) or a checkpoint directory's path",
    )
    return value
