"""The scheduler's spec from a run's config: `spec_from_config(cluster, algo, buffer_verdicts=) -> SchedSpec`.

The one mapping from the user's config (`gyre/config`: `ClusterConfig`, `AlgoConfig`) to the numbers the
policy runs on, shared by every driver: the simulator (`gyre/sim`) and the runtime's controller, which has
no `SimConfig`. Pure: it reads two config dataclasses and returns a frozen `SchedSpec`; the config's own
checks (docs/configuration.md) have already run when the dataclasses were built, and the cross-section
capacity check runs here again so no driver can get a spec whose rollout side cannot run one group.
"""

from __future__ import annotations

from gyre.config.algo import AlgoConfig
from gyre.config.cluster import ClusterConfig
from gyre.config.sim import async_train_cells, check_capacity
from gyre.sched.types import SchedSpec


def spec_from_config(cluster: ClusterConfig, algo: AlgoConfig, *, buffer_verdicts: bool = False) -> SchedSpec:
    """The `SchedSpec` of a cluster and an RL schedule (docs/scheduler.md, "Interface").

    `buffer_verdicts`: the driver reports the buffers' verdict on every closed group (`group_accepted` /
    `group_rejected`): True for the runtime's controller, False (a group is accepted when its executions
    close) for the simulator. A driver's property, not the user's, so it is not a config field.

    Raises `ConfigError` (a ValueError) when the rollout side of the split cannot run one group.
    """
    check_capacity(cluster, algo)
    return SchedSpec(
        num_cells=cluster.num_cells,
        cell_capacity=cluster.cell_capacity,
        separate_capacity=cluster.separate_capacity,
        group_size=algo.group_size,
        oversample=algo.oversample,
        batch_groups=algo.batch_groups,
        extra_groups=algo.extra_groups,
        mu=algo.mu,
        rho_min=algo.rho_min,
        tau_s=algo.tau_s,
        mode=algo.mode,
        continuous_dispatch=algo.dispatch == "continuous",
        streaming=algo.streaming,
        train_cells=async_train_cells(cluster, algo) if algo.mode == "async" else 0,
        buffer_verdicts=buffer_verdicts,
    )
