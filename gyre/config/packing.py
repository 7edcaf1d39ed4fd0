"""Config of the stream packing buffer (`gyre.data.StreamPackingBuffer`): batch shape, micro-step budget, hold-back.

Paper notation in brackets; docs/data.md has the reasons behind each choice. Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.config.checks import require_bool, require_int, require_number


@dataclass(kw_only=True)
class PackingConfig:
    batch_groups: int
    """[B] groups per training step (>= 1)."""
    group_size: int
    """[N] executions per group (>= 1); every group taken must have this N. num_executions = B * N."""
    max_tokens_per_microstep: int
    """Token budget of one micro-step, rows included whole (>= 1); the longest admitted row must fit."""
    keep_executions_together: bool = True
    """True: all rows of an execution go into one micro-step when they fit the budget (s_i and the mask m_i
    then need no pre-pass); a larger execution is split over consecutive micro-steps, flagged in `split_E`.
    False: rows pack freely (fuller micro-steps; every execution over several is flagged in `split_E`)."""
    min_fill: float = 0.75
    """After a pull, emit only micro-steps holding >= min_fill * budget tokens; in [0, 1] (0: emit all)."""
    normalize_std: bool = False
    """Divide advantages by the group's reward std (+ std_eps); default mean-centred only."""
    std_eps: float = 1e-6
    """eps of the std normalization (> 0)."""

    def __post_init__(self) -> None:
        require_int("packing.batch_groups", self.batch_groups, ge=1, note="B")
        require_int("packing.group_size", self.group_size, ge=1, note="N")
        require_int("packing.max_tokens_per_microstep", self.max_tokens_per_microstep, ge=1)
        require_bool("packing.keep_executions_together", self.keep_executions_together)
        require_number("packing.min_fill", self.min_fill, ge=0, le=1)
        require_bool("packing.normalize_std", self.normalize_std)
        require_number("packing.std_eps", self.std_eps, gt=0)

    @property
    def num_executions(self) -> int:
        """B * N: the batch-mean denominator."""
        return self.batch_groups * self.group_size
