"""`spec_from_config(cluster, algo)`: one mapping from config to the scheduler's spec (gyre/sched/spec.py)."""

import dataclasses

import pytest

from gyre.config import AlgoConfig, ClusterConfig, ConfigError
from gyre.sched import SchedSpec, spec_from_config


def test_elastic_defaults_map_field_by_field():
    cluster = ClusterConfig(num_cells=3, cell_size=1, cell_capacity=8, separate_capacity=4, separate_size=1)
    algo = AlgoConfig(group_size=4, batch_groups=2, oversample=1, phi=1.5, mu=2, rho_min=0.5, tau_s=30.0)
    assert spec_from_config(cluster, algo) == SchedSpec(
        num_cells=3,
        cell_capacity=8,
        separate_capacity=4,
        group_size=4,
        oversample=1,
        batch_groups=2,
        extra_groups=3,  # phi B = 1.5 * 2
        mu=2,
        rho_min=0.5,
        tau_s=30.0,
        mode="elastic",
        continuous_dispatch=False,
        streaming=True,
        train_cells=0,
    )


def test_async_split_defaults_to_half_the_cells_and_continuous_dispatch_maps():
    cluster = ClusterConfig(num_cells=5, cell_size=1, cell_capacity=8)
    spec = spec_from_config(cluster, AlgoConfig(mode="async", group_size=4, batch_groups=2, dispatch="continuous"))
    assert (spec.mode, spec.train_cells, spec.continuous_dispatch) == ("async", 2, True)
    spec = spec_from_config(cluster, AlgoConfig(mode="async", group_size=4, batch_groups=2, train_cells=4))
    assert spec.train_cells == 4


def test_a_split_whose_rollout_side_cannot_run_one_group_is_refused_naming_the_field():
    cluster = ClusterConfig(num_cells=2, cell_size=1, cell_capacity=8)
    with pytest.raises(ConfigError, match=r"algo\.train_cells"):
        spec_from_config(cluster, AlgoConfig(mode="async", group_size=4, batch_groups=2, train_cells=2))
    with pytest.raises(ConfigError, match=r"cluster\.cell_capacity"):
        spec_from_config(cluster, AlgoConfig(group_size=16, oversample=1, batch_groups=2))


def test_buffer_verdicts_is_the_drivers_keyword_and_defaults_to_the_simulators_implied_verdicts():
    cluster = ClusterConfig(num_cells=1, cell_size=1, cell_capacity=8)
    algo = AlgoConfig(mode="colocate", group_size=4, batch_groups=2, phi=0.0)
    assert spec_from_config(cluster, algo).buffer_verdicts is False
    runtime = spec_from_config(cluster, algo, buffer_verdicts=True)
    assert runtime.buffer_verdicts is True
    assert dataclasses.replace(runtime, buffer_verdicts=False) == spec_from_config(cluster, algo)
