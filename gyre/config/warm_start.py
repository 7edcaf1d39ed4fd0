"""Config of the demo family's supervised warm start (`warm_start` of the tiny default model): the demonstration
mix and the optimizer. Defaults are tuned in docs/warm-start.md. Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gyre.config.checks import require, require_int, require_number
from gyre.config.demo import DEMO_OPERATORS, DemoConfig


@dataclass(kw_only=True)
class WarmStartConfig:
    """Demonstration mix and optimizer of the warm start (defaults: the prototype, tuned in docs/warm-start.md)."""

    # Which demonstrations show the rewarded behavior (call the calculator, answer with its value); the others answer
    # directly with the exact value, which the tiny model cannot learn beyond the easiest problems (its guesses).
    tool_operators: str = "*"
    """Problems using any of these operators (a subset of '+-*') are always demonstrated with the tool."""
    tool_fraction: float = 0.10
    """Of the other problems, the fraction demonstrated with the tool (in [0, 1]): what RL can find."""
    num_demos: int = 4096
    """Pool of rendered demonstrations; batches are drawn from it with replacement."""
    steps: int = 400
    """Optimizer steps."""
    batch_size: int = 64
    """Episodes per step."""
    lr: float = 1e-3
    """Peak AdamW learning rate (> 0; prototype: 1e-3; >= 2e-4 is too high for RL, fine here)."""
    warmup_steps: int = 20
    """Linear warm-up, then cosine decay to lr * min_lr_ratio."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr`, in [0, 1]."""
    weight_decay: float = 0.0
    """AdamW weight decay (>= 0)."""
    grad_clip: float = 1.0
    """Global grad-norm clip (> 0)."""
    demo: DemoConfig = field(default_factory=DemoConfig)
    """The problems demonstrated."""
    max_minutes: float = 5.0
    """Wall-clock budget of the training loop (> 0; not part of the cache key)."""

    def __post_init__(self) -> None:
        require(
            isinstance(self.tool_operators, str) and all(op in DEMO_OPERATORS for op in self.tool_operators),
            "WarmStartConfig.tool_operators",
            self.tool_operators,
            f"a subset of {DEMO_OPERATORS!r}",
        )
        require_number("WarmStartConfig.tool_fraction", self.tool_fraction, ge=0, le=1)
        for name in ("num_demos", "steps", "batch_size"):
            require_int(f"WarmStartConfig.{name}", getattr(self, name), ge=1)
        require_int("WarmStartConfig.warmup_steps", self.warmup_steps, ge=0)
        require_number("WarmStartConfig.lr", self.lr, gt=0)
        require_number("WarmStartConfig.min_lr_ratio", self.min_lr_ratio, ge=0, le=1)
        require_number("WarmStartConfig.weight_decay", self.weight_decay, ge=0)
        require_number("WarmStartConfig.grad_clip", self.grad_clip, gt=0)
        require_number("WarmStartConfig.max_minutes", self.max_minutes, gt=0)

    def key_fields(self) -> dict[str, Any]:
        """What determines the trained weights (everything but the time budget)."""
        fields = asdict(self)
        fields.pop("max_minutes")
        fields["demo"].pop("work", None)  # the slow executions' check command shapes no demonstration
        return fields
