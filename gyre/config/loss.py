"""The policy loss's thresholds (Eq. 5-6): token-ratio cap, sequence clip interval, token-loss cap.

Lives with the other configs (pure, stdlib only) so it can be registered in Hydra's ConfigStore
without importing torch; `gyre.rl.policy_loss` takes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.config.checks import require_number


@dataclass(kw_only=True)
class LossConfig:
    token_ratio_cap: float = 5.0
    """Cap on the token importance weight: w_u = sg(min(rho_u, cap)) (> 0; paper: 5)."""
    seq_clip_low: float = 0.995
    """An execution with A_i < 0 and s_i < seq_clip_low is masked (m_i = 0); in [0, 1) (paper: 0.995)."""
    seq_clip_high: float = 1.005
    """An execution with A_i > 0 and s_i > seq_clip_high is masked (m_i = 0); > 1 (paper: 1.005)."""
    token_loss_cap: float = 100.0
    """Cap on the token loss: l_u = min(cap, raw_u); where it binds the token's gradient is 0 (> 0; paper: 100)."""

    def __post_init__(self) -> None:
        require_number("loss.token_ratio_cap", self.token_ratio_cap, gt=0)
        require_number("loss.seq_clip_low", self.seq_clip_low, ge=0, lt=1)
        require_number("loss.seq_clip_high", self.seq_clip_high, gt=1)
        require_number("loss.token_loss_cap", self.token_loss_cap, gt=0)
