"""The training data plane on the controller: trajectory buffer, stream packing buffer, micro-step queue.

- `trajectory_buffer`: rollout groups (v_d, executions and their trees, rewards once ready, admitted
  trajectories); ready groups leave oldest policy version first, each once.
- `packing`: the stream packing buffer: pulls one ready group at a time, computes advantages,
  materializes admitted trajectories into token rows, packs them into micro-steps under a token budget
  (an execution that fits stays in one micro-step; a larger one is split over consecutive ones, never
  held back in part), sets aside groups that fail a check, and closes the batch's stream after its
  B-th group.
- `microstep`: `TokenRow` and `MicroStep`, the packed training input (flat tokens, row offsets, targets,
  behavior log-probs, per-execution A_i, L_i, batch slot and split flag, B * N, the engine's routing for replay).
- `queue`: `MicroStepQueue`, atomic disjoint claims by training cells.
- `claim_units`: `ClaimUnitAssembler`, a pull's micro-steps linked by shared split executions as one claim unit.

Pure: imports gyre.traj, gyre.rl (torch) and numpy; no IO, no torch.distributed, no HTTP. See docs/data.md.
"""

from gyre.data.claim_units import ClaimUnitAssembler
from gyre.data.microstep import MicroStep, TokenRow, build_microstep
from gyre.data.packing import StreamPackingBuffer, first_fit_decreasing, materialize_group
from gyre.data.queue import MicroStepQueue
from gyre.data.trajectory_buffer import RolloutGroup, TrajectoryBuffer

__all__ = [
    "ClaimUnitAssembler",
    "MicroStep",
    "MicroStepQueue",
    "RolloutGroup",
    "StreamPackingBuffer",
    "TokenRow",
    "TrajectoryBuffer",
    "build_microstep",
    "first_fit_decreasing",
    "materialize_group",
]
