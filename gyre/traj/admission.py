"""Admission of trajectories by role priority (Eq. 4 and the procedure after it).

Being written: this module will hold the admission procedure. The record type below is the
contract between admission and the stream packing buffer (`gyre/data`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class AdmittedTrajectory:
    """One admitted trajectory: the root-to-leaf path of `leaf` in `execution`'s tree.

    `targets` is a boolean mask over the tokens of `TrajectoryTree.path_tokens(leaf).ids`, frozen to
    the engine-sampled tokens that were still unmasked when this trajectory was drawn; the targets of
    one execution's trajectories are disjoint. `role` is the leaf's class ("main", "main-summary",
    "sub-agent", "sub-agent-summary").
    """

    execution: str
    leaf: int
    role: str
    targets: np.ndarray  # bool, one entry per path token

    @property
    def num_targets(self) -> int:
        return int(self.targets.sum())
