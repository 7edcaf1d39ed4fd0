"""Dataclass configs, one per component, registered in Hydra's ConfigStore by `register_configs`.

Pure: imports the standard library only (and hydra inside `register_configs`).
"""

from gyre.config.algo import AlgoConfig
from gyre.config.checks import ConfigError
from gyre.config.cluster import ClusterConfig
from gyre.config.loss import LossConfig
from gyre.config.proxy import ProxyConfig, SamplingConfig
from gyre.config.serve import EngineConfig, ServeConfig
from gyre.config.sim import SimConfig, async_train_cells
from gyre.config.workload import WorkloadConfig

__all__ = [
    "AlgoConfig",
    "ClusterConfig",
    "ConfigError",
    "EngineConfig",
    "LossConfig",
    "ProxyConfig",
    "SamplingConfig",
    "ServeConfig",
    "SimConfig",
    "WorkloadConfig",
    "async_train_cells",
    "register_configs",
]


def register_configs() -> None:
    """Register the schemas so conf/*.yaml files extend them (`defaults: [base_cluster]`, ...)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_sim", node=SimConfig)
    cs.store(name="base_serve", node=ServeConfig)
    cs.store(group="cluster", name="base_cluster", node=ClusterConfig)
    cs.store(group="workload", name="base_workload", node=WorkloadConfig)
    cs.store(group="algo", name="base_algo", node=AlgoConfig)
    cs.store(group="loss", name="base_loss", node=LossConfig)
