"""Advantages and the policy loss (paper Eq. 5-6): tensors in, tensors out.

- `group_advantages(reward_BN, valid_BN, normalize_std=...)`: group-relative advantages of B groups of
  N raw executions; executions with no valid reward get 0 and stay out of the group statistics.
- `policy_loss(logp_T, behavior_logp_T, execution_T, advantage_E, num_executions, config)`: the
  execution-level loss (GSPO variant with token-level importance correction) over the target tokens of
  a packed batch, and a dict of detached metrics. `LossConfig` holds the caps and the clip interval.
  Optional `num_targets_E` / `seq_ratio_E` let one execution's targets span several micro-steps and cells;
  a split execution without `seq_ratio_E` is a ValueError unless `allow_partial_seq_ratio=True`.
- `sequence_ratio`, `sequence_clip_keep`: the pieces of Eq. 5 and the shared clipping mask, for
  monitoring and tests.
- `sequence_log_ratio_sums`, `finalize_sequence_ratio`: s_i (Eq. 5) of an execution split across
  micro-steps and cells, from additive per-part sums (the caller accumulates and all-reduces them).

Imports torch only: no torch.distributed, no IO. See docs/loss.md.
"""

from gyre.rl.advantages import group_advantages
from gyre.rl.loss import (
    LossConfig,
    finalize_sequence_ratio,
    policy_loss,
    sequence_clip_keep,
    sequence_log_ratio_sums,
    sequence_ratio,
)

__all__ = [
    "LossConfig",
    "finalize_sequence_ratio",
    "group_advantages",
    "policy_loss",
    "sequence_clip_keep",
    "sequence_log_ratio_sums",
    "sequence_ratio",
]
