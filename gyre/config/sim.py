"""Root config of the simulator app (`python -m gyre.sim`) and its cross-section checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre.config.algo import AlgoConfig
from gyre.config.checks import require, require_bool, require_int, require_number
from gyre.config.cluster import ClusterConfig
from gyre.config.workload import WorkloadConfig


@dataclass(kw_only=True)
class SimConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    experiment: str = ""
    """Label of the experiment preset (e.g. E0), empty when none was chosen."""
    steps: int = 12
    """Training steps to simulate."""
    seed: int = 0
    """Seed of the workload's random durations."""
    timeline: bool = True
    """Write role_timeline.png into the run directory."""
    max_sim_hours: float = 10_000.0
    """Stop with an error if simulated time passes this (a config that can never finish)."""

    def __post_init__(self) -> None:
        require_int("steps", self.steps, ge=1)
        require_number("max_sim_hours", self.max_sim_hours, gt=0)
        require_int("seed", self.seed, ge=0)
        require_bool("timeline", self.timeline)
        check_capacity(self.cluster, self.algo)


def async_train_cells(cluster: ClusterConfig, algo: AlgoConfig) -> int:
    """Training cells of the static Async split (algo.train_cells, or half the cells by default)."""
    return algo.train_cells or max(1, cluster.num_cells // 2)


def check_capacity(cluster: ClusterConfig, algo: AlgoConfig) -> None:
    """Stop a config whose rollout side cannot run one group, or whose split leaves no side."""
    n = algo.executions_per_group
    if algo.mode == "async":
        train = async_train_cells(cluster, algo)
        require(
            train < cluster.num_cells or cluster.separate_capacity > 0,
            "algo.train_cells",
            train,
            f"fewer than cluster.num_cells ({cluster.num_cells}) unless a separate pool rolls out",
        )
        rollout = cluster.separate_capacity + (cluster.num_cells - train) * cluster.cell_capacity
        require(
            rollout >= n,
            "cluster.cell_capacity",
            cluster.cell_capacity,
            f"rollout capacity of the async split ({rollout}) >= one group of {n} executions",
        )
    else:
        require(
            algo.train_cells == 0,
            "algo.train_cells",
            algo.train_cells,
            "0 outside async mode (elastic and colocate move cells themselves)",
        )
        rollout = cluster.total_rollout_capacity
        require(
            rollout >= n,
            "cluster.cell_capacity",
            cluster.cell_capacity,
            f"total rollout capacity C_s + K * C_e ({rollout}) >= one group of {n} executions",
        )
