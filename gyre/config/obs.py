"""Config of what a training run reports (`gyre.obs`): console progress, per-step metrics, W&B, the role timeline.

Where the files go is the run directory (`hydra.run.dir`); W&B is imported only in `gyre.obs`, and only when
`wandb` is not `disabled`. Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.config.checks import require, require_bool, require_choice, require_duration

WANDB_MODES = ("offline", "online", "disabled")


@dataclass(kw_only=True)
class LoggingConfig:
    """Console progress, metrics.jsonl, Weights & Biases and role_timeline.png of one run."""

    progress_every_s: float = 10.0
    """Seconds between console progress lines (step, reward, pass rate, roles, waterlevel, ETA); a line is also
    printed at every step's end. 0: only at step ends."""
    metrics_jsonl: bool = True
    """Write one JSON line of metrics per step to `<run dir>/metrics.jsonl`."""
    wandb: str = "offline"
    """offline: a local W&B run under `<run dir>/wandb` (sync later with `wandb sync`); online: log to the W&B
    server (needs a login); disabled: no W&B at all."""
    wandb_project: str = "gyre"
    """W&B project of the run (offline and online)."""
    wandb_entity: str = ""
    """W&B entity (user or team); empty: the account's default."""
    wandb_name: str = ""
    """W&B run name; empty: the run directory's name."""
    timeline: bool = True
    """Write `<run dir>/role_timeline.png` (every cell's roles over time, from the run's trace) at the end."""

    def __post_init__(self) -> None:
        require_duration("logging.progress_every_s", self.progress_every_s, allow_zero=True, note="0 = step ends only")
        require_bool("logging.metrics_jsonl", self.metrics_jsonl)
        require_choice("logging.wandb", self.wandb, WANDB_MODES)
        for name in ("wandb_project", "wandb_entity", "wandb_name"):
            require(isinstance(getattr(self, name), str), f"logging.{name}", getattr(self, name), "a string")
        if self.wandb != "disabled":
            require(
                bool(self.wandb_project) and "/" not in self.wandb_project,
                "logging.wandb_project",
                self.wandb_project,
                f"a project name without '/' while logging.wandb={self.wandb}",
            )
        require_bool("logging.timeline", self.timeline)
