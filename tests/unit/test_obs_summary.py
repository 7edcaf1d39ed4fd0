"""summary.json of a real run (gyre/obs/summary.py): the simulator's keys, its figures from per-step records."""

import json
import os

import pytest

from gyre.config import AlgoConfig, ClusterConfig, SimConfig, WorkloadConfig
from gyre.obs.record import StepRecord, TransitionRecord
from gyre.obs.summary import SUMMARY_FILE, build_summary, write_summary
from gyre.sched.staleness import warmup_steps
from gyre.sim.simulator import simulate

RUN = {"experiment": "demo", "mode": "elastic", "phi": 0.5, "mu": 2, "target_staleness": 1.0, "warmup_steps": 1}


def key_tree(value):
    """The nested key structure of a summary (values dropped)."""
    return {key: key_tree(item) for key, item in value.items()} if isinstance(value, dict) else None


def simulated():
    cfg = SimConfig(
        cluster=ClusterConfig(num_cells=3, cell_size=1, cell_capacity=8, group_train_node_s=300),
        workload=WorkloadConfig(median_s=1800, sigma=0.8, query_sigma=0.3, harness_timeout_s=3600,
                                overall_timeout_s=5400, overall_timeout_share=0.3, failure_rate=0.1),
        algo=AlgoConfig(group_size=4, batch_groups=2, oversample=2, mode="elastic", phi=0.5, mu=2),
        steps=6,
        timeline=False,
    )  # fmt: skip
    return simulate(cfg)


def records_of(sim) -> list[StepRecord]:
    """What a real run's controller would record per step, read off the simulator's scheduler and trace."""
    log, ends = sim.sched.staleness, sim.trace.step_ends_s
    records = []
    for step, end in enumerate(ends):
        picked = [(v, t) for s, v, t in zip(log.steps, log.values, log.tokens, strict=True) if s == step]
        tokens = sum(t for _, t in picked)
        begun = [(time, cell, role) for time, cell, role in sim.sched.transitions
                 if (step == 0 or time > ends[step - 1]) and (time <= end or step == len(ends) - 1)]  # fmt: skip
        records.append(
            StepRecord(
                step=step,
                wall_time_s=end,
                staleness_group_mean=sum(v for v, _ in picked) / len(picked) if picked else None,
                staleness_token_mean=sum(v * t for v, t in picked) / tokens if tokens else None,
                staleness_max=float(max(v for v, _ in picked)) if picked else None,
                staleness_groups=len(picked),
                staleness_tokens=float(tokens),
                transitions=tuple(
                    TransitionRecord(cell=c, to=r.value, start_s=time, duration_s=0.0) for time, c, r in begun
                ),
            )
        )
    return records


def test_same_keys_and_figures_as_the_simulator():
    summary, sim = simulated()
    spec = sim.spec
    built = build_summary(
        records_of(sim),
        experiment=summary["experiment"], mode=spec.mode, phi=sim.cfg.algo.phi, mu=sim.cfg.algo.mu,
        target_staleness=sim.cfg.algo.target_staleness,
        warmup_steps=warmup_steps(spec.mu, spec.extra_groups, spec.batch_groups),
        counters={"dispatched": sim.sched.d, "started": sim.sched.p, "finished": sim.sched.f},
        outcomes=dict(sim.sched.outcomes),
    )  # fmt: skip
    assert key_tree(built) == key_tree(summary)
    assert built["steps"] == summary["steps"] == 6
    assert built["step_times_s"] == pytest.approx(summary["step_times_s"])
    assert built["total_time_s"] == pytest.approx(summary["total_time_s"])
    for key in ("group_mean", "token_mean", "max", "group_mean_all_steps", "groups_counted", "warmup_steps"):
        assert built["staleness"][key] == pytest.approx(summary["staleness"][key]), key
    assert built["transitions"] == summary["transitions"]
    assert built["counters"] == summary["counters"] and built["outcomes"] == summary["outcomes"]
    assert built["utilization"] == {"rollout": None, "training": None, "idle": None}


def test_hand_computed_staleness_and_reroutes():
    records = [
        StepRecord(step=0, wall_time_s=10.0, staleness_group_mean=0.0, staleness_token_mean=0.0, staleness_max=0.0,
                   staleness_groups=2, staleness_tokens=100.0, reroutes=2, rerouted_executions=(5, 5)),
        StepRecord(step=1, wall_time_s=25.0, staleness_group_mean=1.0, staleness_token_mean=1.5, staleness_max=2.0,
                   staleness_groups=2, staleness_tokens=200.0, reroutes=1, rerouted_executions=(5,), burst=1),
        StepRecord(step=2, wall_time_s=45.0, staleness_group_mean=2.0, staleness_token_mean=2.0, staleness_max=2.0,
                   staleness_groups=1, staleness_tokens=600.0, burst=1),
    ]  # fmt: skip
    summary = build_summary(records, **RUN)
    assert summary["step_times_s"] == [10.0, 15.0, 20.0] and summary["total_time_h"] == 45.0 / 3600
    st = summary["staleness"]
    assert st["group_mean"] == pytest.approx((1.0 * 2 + 2.0 * 1) / 3)  # steps >= 1
    assert st["token_mean"] == pytest.approx((1.5 * 200 + 2.0 * 600) / 800)
    assert st["group_mean_all_steps"] == pytest.approx((0 + 2 + 2) / 5)
    assert st["max"] == 2.0 and st["groups_counted"] == 3 and st["target"] == 1.0
    # execution 5: 2 moves in burst 0, 1 in burst 1.
    assert summary["reroutes"] == {"total": 3, "executions": 1, "max_per_execution_in_a_burst": 2}
    assert summary["counters"] == {"dispatched": None, "started": None, "finished": None}
    assert summary["outcomes"] is None


def test_no_steps_and_no_groups_give_nulls_not_zeros():
    summary = build_summary([StepRecord(step=0, wall_time_s=3.0)], **RUN)
    st = summary["staleness"]
    assert st["group_mean"] is None and st["token_mean"] is None and st["max"] is None
    empty = build_summary([], **RUN)
    assert empty["steps"] == 0 and empty["total_time_s"] == 0.0 and empty["step_times_s"] == []


def test_bad_inputs():
    with pytest.raises(ValueError, match="expected steps in increasing order"):
        build_summary([StepRecord(step=1, wall_time_s=1.0), StepRecord(step=0, wall_time_s=2.0)], **RUN)
    with pytest.raises(ValueError, match=r"counters=.* expected keys dispatched, started, finished"):
        build_summary([], counters={"d": 1}, **RUN)


def test_write_is_atomic_strict_json(tmp_path):
    path = tmp_path / SUMMARY_FILE
    path.write_text('{"old": true}\n')
    write_summary(path, {"a": float("nan"), "b": [1.0, float("inf")]})
    assert json.loads(path.read_text()) == {"a": None, "b": [1.0, None]}
    assert os.listdir(tmp_path) == [SUMMARY_FILE]  # no temporary file left


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / SUMMARY_FILE
    path.write_text('{"old": true}\n')
    with pytest.raises(TypeError):
        write_summary(path, {"a": object()})
    assert json.loads(path.read_text()) == {"old": True}
    assert os.listdir(tmp_path) == [SUMMARY_FILE]
