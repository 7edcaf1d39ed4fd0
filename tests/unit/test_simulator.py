"""The simulator carries out every kind of scheduler action and keeps its books consistent."""

import pytest

from gyre.config import AlgoConfig, ClusterConfig, SimConfig, WorkloadConfig
from gyre.sim.simulator import simulate

MODES = [
    {"mode": "elastic", "phi": 0.5, "mu": 2},
    {"mode": "colocate", "phi": 0.0, "mu": 2},
    {"mode": "async", "phi": 1.0, "mu": 1, "train_cells": 1},
]


@pytest.mark.parametrize("algo", MODES, ids=lambda a: a["mode"])
@pytest.mark.parametrize("separate_capacity", [0, 6])
def test_oversampling_failures_and_timeouts_keep_counters_consistent(algo, separate_capacity):
    cfg = SimConfig(
        cluster=ClusterConfig(
            num_cells=3, cell_size=1, cell_capacity=8, separate_capacity=separate_capacity,
            separate_size=1 if separate_capacity else 0, group_train_node_s=300,
        ),
        workload=WorkloadConfig(
            median_s=1800, sigma=0.8, query_sigma=0.3, harness_timeout_s=3600, overall_timeout_s=5400,
            overall_timeout_share=0.3, failure_rate=0.1,
        ),
        algo=AlgoConfig(group_size=4, batch_groups=2, oversample=2, **algo),
        steps=8,
        timeline=False,
    )  # fmt: skip
    summary, sim = simulate(cfg)
    assert summary["steps"] == 8
    counters = summary["counters"]
    assert counters["dispatched"] >= counters["started"] >= counters["finished"]
    assert sum(summary["outcomes"].values()) == counters["finished"]
    assert summary["outcomes"].get("cancelled", 0) > 0  # surplus under oversampling
    assert sim.sched.running == len(sim._running) == sim.sched.ledger.running
    util = summary["utilization"]
    assert util["rollout"] + util["training"] + util["idle"] == pytest.approx(1.0)
    assert all(t > 0 for t in summary["step_times_s"])


def test_separate_pool_serves_first():
    cfg = SimConfig(
        cluster=ClusterConfig(num_cells=2, cell_size=1, cell_capacity=4, separate_capacity=4, separate_size=1),
        workload=WorkloadConfig(median_s=600, sigma=0.2, query_sigma=0.0),
        algo=AlgoConfig(group_size=4, batch_groups=1, phi=1.0, mu=1),
        steps=1,
        timeline=False,
    )
    _, sim = simulate(cfg)
    loads = sim.trace.load_changes
    # 8 executions at t = 0: the pool first, then the cells in reverse index order.
    assert loads[-1][0] == (0.0, 4)
    assert loads[1][0] == (0.0, 4)
    assert not loads[0] or loads[0][0][0] > 0.0
