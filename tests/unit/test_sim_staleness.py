"""Contract 1: under boundary dispatch the simulator's group-weighted mean staleness is phi + (mu - 1) / 2.

Drives the real scheduler through the simulator on a small cluster for 120 steps and compares the
steady-state mean (the first burst, while the dispatch queue fills, is left out) to Theorem A.1.
Continuous dispatch keeps (phi + mu) B groups outstanding and measures mu more (docs/scheduler.md).
"""

import itertools

import pytest

from gyre.config import AlgoConfig, ClusterConfig, SimConfig, WorkloadConfig
from gyre.sim.simulator import simulate

PHIS = (0.0, 0.5, 1.0, 1.5, 2.0)
MUS = (1, 2, 3, 4)


def small(mode: str = "elastic", dispatch: str = "boundary", **algo) -> SimConfig:
    return SimConfig(
        cluster=ClusterConfig(
            num_cells=4, cell_size=1, cell_capacity=16, group_train_node_s=600, microsteps_per_group=2
        ),
        workload=WorkloadConfig(median_s=3600, sigma=0.6, query_sigma=0.3),
        algo=AlgoConfig(mode=mode, dispatch=dispatch, group_size=4, batch_groups=4, **algo),
        steps=120,
        timeline=False,
    )


@pytest.mark.parametrize(("phi", "mu"), list(itertools.product(PHIS, MUS)))
def test_elastic_boundary_staleness_identity(phi, mu):
    summary, _ = simulate(small(phi=phi, mu=mu))
    staleness = summary["staleness"]
    assert abs(staleness["group_mean"] - (phi + (mu - 1) / 2)) <= 0.02, staleness
    assert staleness["max"] >= staleness["group_mean"]
    assert staleness["token_mean"] >= 0


@pytest.mark.parametrize("mu", MUS)
def test_colocate_is_phi_zero(mu):
    summary, _ = simulate(small(mode="colocate", phi=0.0, mu=mu))
    assert abs(summary["staleness"]["group_mean"] - (mu - 1) / 2) <= 0.05


@pytest.mark.parametrize("phi", PHIS)
def test_async_is_mu_one(phi):
    summary, _ = simulate(small(mode="async", phi=phi, mu=1, train_cells=2))
    assert abs(summary["staleness"]["group_mean"] - phi) <= 0.05


@pytest.mark.parametrize(("phi", "mu"), [(0.0, 1), (0.5, 3), (1.5, 2)])
def test_continuous_dispatch_adds_mu(phi, mu):
    boundary, _ = simulate(small(phi=phi, mu=mu))
    continuous, _ = simulate(small(phi=phi, mu=mu, dispatch="continuous"))
    gap = continuous["staleness"]["group_mean"] - boundary["staleness"]["group_mean"]
    assert abs(gap - mu) <= 0.1, (boundary["staleness"], continuous["staleness"])
