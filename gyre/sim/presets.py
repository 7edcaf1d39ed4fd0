"""Compose a `SimConfig` from the repository's conf/ tree in-process (benchmarks, tests, notebooks).

The same YAML the `python -m gyre.sim` app reads, without starting a Hydra job per run.
"""

from __future__ import annotations

from collections.abc import Sequence

from gyre.config import SimConfig, register_configs
from gyre.config.hydra_errors import CONF_DIR

TABLE2_ROWS = ("A0", "A1", "A2", "A3", "C0", "C1", "C2", "C3", "E0", "E1", "E2")


def compose_sim_config(overrides: Sequence[str] = ()) -> SimConfig:
    """The checked SimConfig for these Hydra overrides (e.g. ["experiment=E0", "seed=3"])."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="sim", overrides=list(overrides))
    return OmegaConf.to_object(cfg)
