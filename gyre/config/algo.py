"""The RL schedule: scheduling mode, staleness knobs (phi, mu), group and batch sizes, supply check.

Paper notation in brackets. Staleness under boundary dispatch is E[d] = phi + (mu - 1) / 2
(Theorem A.1): Async in the paper's comparisons is (E[d], 1), Colocate (0, 2 E[d] + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.config.checks import require, require_bool, require_choice, require_duration, require_int, require_number

MODES = ("elastic", "colocate", "async")
DISPATCH = ("boundary", "continuous")


@dataclass(kw_only=True)
class AlgoConfig:
    mode: str = "elastic"
    """elastic: cells move one at a time by the waterlevel rule; colocate: the whole pool switches
    together; async: a static split of `train_cells` training cells and the rest rolling out."""
    phi: float = 0.5
    """[phi] extra dispatch in units of B groups (>= 0); phi * B must be a whole number of groups."""
    mu: int = 3
    """[mu] training steps per burst, i.e. between two weight publications (>= 1)."""
    group_size: int = 16
    """[N] executions per rollout group (one query)."""
    batch_groups: int = 32
    """[B] groups per training step."""
    oversample: int = 0
    """Extra executions dispatched per group; the surplus is cancelled once N have closed."""
    rho_min: float = 0.25
    """[rho_min] supply check: ready unclaimed groups (capped by what the batch still needs)
    must stay >= rho_min * B, in (0, 1]."""
    tau_s: float = 60.0
    """[tau] seconds the supply check must hold continuously before a transition starts."""
    j_max: int = 5
    """[J_max] trajectories admitted per execution."""
    dispatch: str = "boundary"
    """boundary: (phi + mu) N B at start, mu N B after each publication; continuous: one group
    dispatched for every group consumed, keeping (phi + mu) B groups outstanding."""
    streaming: bool = True
    """True: training cells claim micro-steps as groups become ready. False: the trainer waits until
    the burst's data (mu B ready groups) is present before its first update, as a global shuffle
    across the burst's minibatches needs; with mu = 1 that is the classic wait for a full batch."""
    train_cells: int = 0
    """Async only: cells in the training role (0: half of the cells, at least one)."""

    def __post_init__(self) -> None:
        require_choice("algo.mode", self.mode, MODES)
        require_choice("algo.dispatch", self.dispatch, DISPATCH)
        require_number("algo.phi", self.phi, ge=0)
        require_int("algo.mu", self.mu, ge=1)
        require_int("algo.group_size", self.group_size, ge=1, note="N")
        require_int("algo.batch_groups", self.batch_groups, ge=1, note="B")
        require_int("algo.oversample", self.oversample, ge=0)
        require_number("algo.rho_min", self.rho_min, gt=0, le=1)
        require_duration("algo.tau_s", self.tau_s, allow_zero=True)
        require_int("algo.j_max", self.j_max, ge=1)
        require_bool("algo.streaming", self.streaming)
        require_int("algo.train_cells", self.train_cells, ge=0)
        extra = self.phi * self.batch_groups
        require(
            abs(extra - round(extra)) < 1e-9,
            "algo.phi",
            self.phi,
            f"a value with phi * B a whole number of groups (B = {self.batch_groups}, phi * B = {extra:g})",
        )
        if self.mode == "colocate":
            require(self.phi == 0, "algo.phi", self.phi, "0 in colocate mode (no extra dispatch)")

    @property
    def extra_groups(self) -> int:
        """phi * B, the groups dispatched beyond one burst's need."""
        return round(self.phi * self.batch_groups)

    @property
    def executions_per_group(self) -> int:
        return self.group_size + self.oversample

    @property
    def target_staleness(self) -> float:
        """E[d] = phi + (mu - 1) / 2 under boundary dispatch (Theorem A.1)."""
        return self.phi + (self.mu - 1) / 2
