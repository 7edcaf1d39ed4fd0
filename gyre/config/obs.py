"""Config of what a training run reports (`gyre.obs`): console progress, per-step metrics, W&B, the role timeline.

Where the files go is the run directory (`hydra.run.dir`); W&B is imported only in `gyre.obs`, and only when
`wandb` is not `disabled`. Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre.config.checks import require, require_bool, require_choice, require_duration

WANDB_MODES = ("offline", "online", "disabled")
WANDB_TAG_MAX_CHARS = 64  # wandb 0.31 refuses a tag outside 1..64 characters (wandb_settings.validate_run_tags)


@dataclass(kw_only=True)
class LoggingConfig:
    """Console progress, metrics.jsonl, Weights & Biases and role_timeline.png of one run."""

    progress_every_s: float = 10.0
    """Seconds between the console's live lines (the step running, executions, model calls in prefill and decoding,
    roles, waterlevel, ETA); every step's end prints its own line (reward, pass rate). 0: only at step ends."""
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
    wandb_group: str = ""
    """W&B group of the run (runs of one sweep or experiment shown together); empty: none."""
    wandb_tags: list[str] = field(default_factory=list)
    """W&B tags of the run: each 1 to 64 characters (W&B's limit) and without a comma (`wandb sync --replace-tags`
    and the WANDB_TAGS variable split on commas)."""
    timeline: bool = True
    """Write `<run dir>/role_timeline.png` (every cell's roles over time, from the run's trace) at the end."""

    def __post_init__(self) -> None:
        require_duration("logging.progress_every_s", self.progress_every_s, allow_zero=True, note="0 = step ends only")
        require_bool("logging.metrics_jsonl", self.metrics_jsonl)
        require_choice("logging.wandb", self.wandb, WANDB_MODES)
        for name in ("wandb_project", "wandb_entity", "wandb_name", "wandb_group"):
            require(isinstance(getattr(self, name), str), f"logging.{name}", getattr(self, name), "a string")
        if self.wandb != "disabled":
            require(
                bool(self.wandb_project) and "/" not in self.wandb_project,
                "logging.wandb_project",
                self.wandb_project,
                f"a project name without '/' while logging.wandb={self.wandb}",
            )
        require(
            isinstance(self.wandb_tags, list)
            and all(
                isinstance(t, str) and 1 <= len(t) <= WANDB_TAG_MAX_CHARS and "," not in t for t in self.wandb_tags
            ),
            "logging.wandb_tags",
            self.wandb_tags,
            f"a list of tags of 1 to {WANDB_TAG_MAX_CHARS} characters without ','",
        )
        require_bool("logging.timeline", self.timeline)
