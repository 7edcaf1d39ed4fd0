"""Group-relative advantages: the rewards of one group's N raw executions in, one advantage each out.

A_i = r_i - mean(r) over the group (mean-centred), optionally divided by std(r) + eps. Batched over B
groups: reward_BN [B, N] in, advantage_BN [B, N] out, in the reward's dtype (computed in float64).

Executions excluded from training (the paper's "no valid reward": an evaluation still pending when the
execution's time budget ran out) are marked False in `valid_BN`. Choices, written down:
- an excluded execution gets advantage 0 and does not enter its group's mean or std; its reward may be
  anything, NaN included (a natural "no reward" marker). A valid zero score is a valid reward and counts.
- the std is the population std of the valid rewards (divide by the number of valid members, not one
  less): a group with one valid member has std 0 and advantage 0 instead of a NaN.
- a group whose valid rewards are all equal has advantage exactly 0, with or without std normalization
  (set, not computed: rounding in the mean would otherwise leave ~1e-17, which eps would blow up).
- an excluded execution still counts in the loss's batch denominator (`num_executions` = B * N raw
  executions); with advantage 0 it adds zero loss and zero gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["group_advantages"]


def group_advantages(
    reward_BN: Tensor,
    valid_BN: Tensor | None = None,
    *,
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """A_i = (r_i - mean of the group's valid rewards) [/ (std + eps)]; 0 where valid_BN is False.

    reward_BN: floating [B, N], one row per group. valid_BN: bool [B, N], None for all valid.
    normalize_std: divide by the population std of the group's valid rewards plus `eps` (> 0).
    """
    if not isinstance(reward_BN, Tensor) or not reward_BN.is_floating_point():
        got = reward_BN.dtype if isinstance(reward_BN, Tensor) else type(reward_BN).__name__
        raise ValueError(f"reward_BN must be a floating-point tensor, got {got}")
    if reward_BN.dim() != 2:
        raise ValueError(f"reward_BN must be 2-D [B groups, N executions], got shape {tuple(reward_BN.shape)}")
    if reward_BN.shape[1] == 0:
        raise ValueError("reward_BN must have at least one execution per group (N >= 1), got shape (B, 0)")
    if valid_BN is None:
        valid_BN = torch.ones_like(reward_BN, dtype=torch.bool)
    if not isinstance(valid_BN, Tensor) or valid_BN.dtype != torch.bool:
        got = valid_BN.dtype if isinstance(valid_BN, Tensor) else type(valid_BN).__name__
        raise ValueError(f"valid_BN must be a bool tensor, got {got}")
    if valid_BN.shape != reward_BN.shape:
        raise ValueError(
            f"valid_BN must have the shape of reward_BN {tuple(reward_BN.shape)}, got {tuple(valid_BN.shape)}"
        )
    if valid_BN.device != reward_BN.device:
        raise ValueError(f"valid_BN is on {valid_BN.device}, reward_BN on {reward_BN.device}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps={eps!r} is not allowed: expected a finite number > 0")
    bad = valid_BN & ~torch.isfinite(reward_BN)
    if bool(bad.any()):
        where = torch.nonzero(bad)[:5].tolist()
        raise ValueError(f"reward_BN has non-finite rewards marked valid at [group, execution] {where}")

    valid = valid_BN.to(torch.float64)
    reward = torch.where(valid_BN, reward_BN.detach().to(torch.float64), 0.0)  # excluded: out of every sum
    count_B1 = valid.sum(dim=1, keepdim=True)
    mean_B1 = reward.sum(dim=1, keepdim=True) / count_B1.clamp(min=1)
    hi_B1 = torch.where(valid_BN, reward, -math.inf).amax(dim=1, keepdim=True)
    lo_B1 = torch.where(valid_BN, reward, math.inf).amin(dim=1, keepdim=True)
    informative = valid * (hi_B1 > lo_B1)  # 0 for excluded executions and for groups with one reward value
    centred = (reward - mean_B1) * informative
    if normalize_std:
        var_B1 = (centred * centred).sum(dim=1, keepdim=True) / count_B1.clamp(min=1)  # population variance
        centred = centred / (var_B1.sqrt() + eps)
    return centred.to(reward_BN.dtype)
