"""Staleness of consumed groups: the paper's group-weighted mean, plus token-weighted mean and max.

A group's staleness is d = v_t - v_d: v_d the policy version published when it was admitted, v_t the
trainer version right before the step that consumes it. Theorem A.1: under boundary dispatch the
steady-state group-weighted mean is phi + (mu - 1) / 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def warmup_steps(mu: int, extra_groups: int, batch_groups: int) -> int:
    """Steps before boundary dispatch reaches its steady state (Theorem A.1 holds after them).

    The initial (phi + mu) B groups all carry version 0; the version-0 groups beyond the first burst's
    mu B take ceil(phi) more bursts to drain, so mu * max(1, ceil(phi)) steps are warm-up.
    """
    return mu * max(1, math.ceil(extra_groups / batch_groups))


@dataclass
class StalenessLog:
    """Records every consumed group; summaries may skip the warm-up steps of the first burst."""

    steps: list[int] = field(default_factory=list)
    values: list[int] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)

    def record(self, step: int, staleness: int, tokens: float) -> None:
        assert staleness >= 0, staleness
        self.steps.append(step)
        self.values.append(staleness)
        self.tokens.append(tokens)

    def withdraw(self, step: int, staleness: int, tokens: float) -> None:
        """Take back one record (a claimed group that was not trained); records are interchangeable for the
        summaries, so the last equal one goes."""
        for k in range(len(self.steps) - 1, -1, -1):
            if (self.steps[k], self.values[k], self.tokens[k]) == (step, staleness, tokens):
                del self.steps[k], self.values[k], self.tokens[k]
                return
        raise AssertionError(f"no staleness record {(step, staleness, tokens)} to withdraw")

    def summary(self, skip_steps: int = 0) -> dict[str, float]:
        """Group-weighted mean, token-weighted mean and max over groups consumed at step >= skip_steps."""
        picked = [(v, t) for s, v, t in zip(self.steps, self.values, self.tokens, strict=True) if s >= skip_steps]
        if not picked:
            return {"group_mean": float("nan"), "token_mean": float("nan"), "max": float("nan"), "groups": 0}
        total_tokens = sum(t for _, t in picked)
        token_mean = sum(v * t for v, t in picked) / total_tokens if total_tokens > 0 else float("nan")
        return {
            "group_mean": sum(v for v, _ in picked) / len(picked),
            "token_mean": token_mean,
            "max": float(max(v for v, _ in picked)),
            "groups": len(picked),
        }
