"""Config checks: a bad value stops with a message naming the field, the value and what is allowed."""

import pytest

from gyre.config import AlgoConfig, ClusterConfig, ConfigError, SimConfig


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: ClusterConfig(num_cells=0), "cluster.num_cells=0"),
        (lambda: ClusterConfig(cell_capacity=0), "cluster.cell_capacity=0"),
        (lambda: AlgoConfig(rho_min=0.0), "algo.rho_min=0.0"),
        (lambda: AlgoConfig(rho_min=1.5), "algo.rho_min=1.5"),
        (lambda: AlgoConfig(phi=-0.5), "algo.phi=-0.5"),
        (lambda: AlgoConfig(mu=0), "algo.mu=0"),
        (lambda: AlgoConfig(mode="colocate", phi=0.5), "algo.phi=0.5"),
        (lambda: AlgoConfig(phi=0.3, batch_groups=5), "algo.phi=0.3"),
        (lambda: SimConfig(cluster=ClusterConfig(num_cells=1, cell_capacity=8)), "cluster.cell_capacity=8"),
        (lambda: AlgoConfig(tau_s=float("inf")), "algo.tau_s=inf"),
        (lambda: ClusterConfig(publish_s=float("inf")), "cluster.publish_s=inf"),
        (lambda: SimConfig(max_sim_hours=float("inf")), "max_sim_hours=inf"),
        (lambda: SimConfig(seed=-1), "seed=-1"),
    ],
)
def test_bad_value_names_field_value_and_allowed(build, field):
    with pytest.raises(ConfigError) as info:
        build()
    assert field in str(info.value)
    assert "expected" in str(info.value)


def test_defaults_are_valid_and_target_staleness():
    cfg = SimConfig()
    assert cfg.algo.target_staleness == cfg.algo.phi + (cfg.algo.mu - 1) / 2
