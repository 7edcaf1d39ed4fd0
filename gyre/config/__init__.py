"""Dataclass configs, one per component, registered in Hydra's ConfigStore by `register_configs`.

Every config a run composes lives here, checked in `__post_init__` with the one kit of `gyre.config.checks`
(messages `{field}={value!r} is not allowed: expected {allowed}`). docs/configuration.md lists every field.
Pure: imports the standard library only (and hydra inside `register_configs`).
"""

from gyre.config.algo import AlgoConfig
from gyre.config.checkpoint import CheckpointConfig
from gyre.config.checks import ConfigError
from gyre.config.cluster import ClusterConfig
from gyre.config.demo import DemoConfig
from gyre.config.engine import EngineConfig, EngineServeConfig
from gyre.config.harness import AgentConfig, ExecutionLimits, HarnessConfig, ResourceLimits
from gyre.config.loss import LossConfig
from gyre.config.model import ModelConfig, TinyModelSpec
from gyre.config.obs import LoggingConfig
from gyre.config.packing import PackingConfig
from gyre.config.proxy import ProxyConfig, SamplingConfig
from gyre.config.publication import PublicationConfig
from gyre.config.recipe import RecipeConfig
from gyre.config.serve import ServeConfig
from gyre.config.sim import SimConfig, async_train_cells
from gyre.config.tasks import TasksConfig
from gyre.config.train import TrainConfig, check_context_limit, layout_fields
from gyre.config.trainer import MooncakeConfig, TrainerConfig
from gyre.config.warm_start import WarmStartConfig
from gyre.config.workload import WorkloadConfig

__all__ = [
    "AgentConfig",
    "AlgoConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "DemoConfig",
    "EngineConfig",
    "EngineServeConfig",
    "ExecutionLimits",
    "HarnessConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "MooncakeConfig",
    "PackingConfig",
    "ProxyConfig",
    "PublicationConfig",
    "RecipeConfig",
    "ResourceLimits",
    "SamplingConfig",
    "ServeConfig",
    "SimConfig",
    "TasksConfig",
    "TinyModelSpec",
    "TrainConfig",
    "TrainerConfig",
    "WarmStartConfig",
    "WorkloadConfig",
    "async_train_cells",
    "check_context_limit",
    "layout_fields",
    "register_configs",
]


def register_configs() -> None:
    """Register the schemas so conf/*.yaml files extend them (`defaults: [base_cluster]`, ...).

    Root configs of the apps by name (`base_sim`, `base_serve`, `base_engine_serve`, `base_train`); component
    configs in the group named like the field that holds them (`cluster/base_cluster`, `engine/base_engine`, ...)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_sim", node=SimConfig)
    cs.store(name="base_serve", node=ServeConfig)
    cs.store(name="base_engine_serve", node=EngineServeConfig)
    cs.store(name="base_train", node=TrainConfig)
    cs.store(group="cluster", name="base_cluster", node=ClusterConfig)
    cs.store(group="workload", name="base_workload", node=WorkloadConfig)
    cs.store(group="algo", name="base_algo", node=AlgoConfig)
    cs.store(group="loss", name="base_loss", node=LossConfig)
    cs.store(group="proxy", name="base_proxy", node=ProxyConfig)
    cs.store(group="sampling", name="base_sampling", node=SamplingConfig)
    cs.store(group="engine", name="base_engine", node=EngineConfig)
    cs.store(group="packing", name="base_packing", node=PackingConfig)
    cs.store(group="limits", name="base_limits", node=ExecutionLimits)
    cs.store(group="resources", name="base_resources", node=ResourceLimits)
    cs.store(group="builtin_agent", name="base_builtin_agent", node=AgentConfig)
    cs.store(group="warm_start", name="base_warm_start", node=WarmStartConfig)
    cs.store(group="demo", name="base_demo", node=DemoConfig)
    cs.store(group="tiny_model", name="base_tiny_model", node=TinyModelSpec)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="trainer", name="base_trainer", node=TrainerConfig)
    cs.store(group="mooncake", name="base_mooncake", node=MooncakeConfig)
    cs.store(group="harness", name="base_harness", node=HarnessConfig)
    cs.store(group="tasks", name="base_tasks", node=TasksConfig)
    cs.store(group="recipe", name="base_recipe", node=RecipeConfig)
    cs.store(group="logging", name="base_logging", node=LoggingConfig)
    cs.store(group="checkpoint", name="base_checkpoint", node=CheckpointConfig)
    cs.store(group="publication", name="base_publication", node=PublicationConfig)
