"""A separate rollout pool in the training program (docs/runtime.md, "The separate rollout pool"): `python -m
gyre.train` with 2 cells and `cluster.separate_size=1` (3 gloo worker processes: the cells' ranks, then the pool's)
runs a 2-step elastic run with a publication after each step (mu = 1) and exits 0. From the run's outputs: the pool
rank never trained (its lane in `summary.json`'s `role_time_s` and `timeline.json` is rollout throughout, its rank
says so in train.log), it served executions and calls (`executions.jsonl`, the record files' `engine`), among them
calls under a published version (the pool's engine received the publication), and every model call is recorded
exactly once (the proxy's counters vs the record files vs the harnesses' transcripts: `gyre.runtime.audit`).
The three modes were run by hand with the issue's command (docs/runtime.md, "The separate rollout pool")."""

from __future__ import annotations

import json

import pytest
from test_train_program import PAIRS, SMALL, finish, train, wait_until_gone

POOL_RUN = [
    *(o for o in SMALL if not o.startswith("algo.mu=")),
    *PAIRS,
    "algo.mu=1",  # a publication after every step: the pool's engine must take each one
    "cluster.num_cells=2",
    "cluster.separate_size=1",  # C_s = C_e (8) by default: the pool takes new executions first
    "steps=2",
    "tasks.eval_every=0",
    "logging.wandb=disabled",
    "logging.timeline=false",
]


@pytest.mark.slow  # a real run of 3 processes: ~25 s on 2 cores
def test_a_separate_rollout_pool_serves_calls_and_never_trains(tmp_path):
    from gyre.runtime.audit import audit_run
    from gyre.runtime.controller.execution_log import read_executions
    from gyre.traj.store import load_tree

    run_dir = tmp_path / "run"
    process = train(POOL_RUN, run_dir)
    code, out, err = finish(process, 600)
    assert code == 0, err[-3000:]
    assert wait_until_gone(process) == []
    assert json.loads(out.strip().splitlines()[-1])["end"] == "completed"

    summary = json.loads((run_dir / "summary.json").read_text())
    roles = summary["role_time_s"]
    assert list(roles) == ["cell 0 (core)", "cell 1", "pool"], roles
    trace = json.loads((run_dir / "timeline.json").read_text())
    assert set(roles["pool"]) == {"rollout"} and roles["pool"]["rollout"] == pytest.approx(trace["end_s"]), roles
    assert roles["cell 0 (core)"].get("training", 0) > 0, roles  # the cells did train
    pool = summary["pool"]
    assert pool["ranks"] == 1 and pool["capacity"] == 8 and pool["slot_utilization"] > 0, pool
    assert {state for lane, _, _, state in trace["segments"] if lane == "pool"} == {"rollout"}
    assert len(trace["loads"]) == 3 and max(n for _, n in trace["loads"][2]) > 0, trace["loads"]
    log = (run_dir / "train.log").read_text()
    assert "rank 2 (rollout pool): served, trained no step" in log
    assert "[rank 2] gyre.runtime.cell.worker" not in log  # the pool's rank ran no cell loop

    on_pool = [x for x in read_executions(run_dir / "executions.jsonl") if x.engine == "pool"]
    assert on_pool, "no execution started on the pool"
    calls = pool_calls = 0
    pool_versions = set()
    for path in sorted((run_dir / "records").glob("*.jsonl")):
        tree = load_tree(path)
        assert len({c.meta.request_id for c in tree.calls}) == len(tree.calls), path.name
        calls += len(tree.calls)
        for call in tree.calls:
            if call.meta.engine == "pool":
                pool_calls += 1
                pool_versions.add(call.meta.policy_version)
    assert pool_calls > 0 and max(pool_versions) >= 1, pool_versions  # served under a published version too
    audit = audit_run(run_dir)
    proxy = audit["proxy"]
    assert audit["calls_recorded"] == calls == proxy["recorded"] > 0, audit
    assert audit["duplicate_request_ids"] == audit["retries"] == audit["api_errors"] == 0, audit
    assert proxy["failed"] == proxy["refused"] == 0, proxy
    print(f"pool run: {calls} calls recorded, {pool_calls} on the pool (versions {sorted(pool_versions)}), {roles}")
