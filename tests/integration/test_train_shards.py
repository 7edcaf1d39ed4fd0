"""Proxy shards in the training program (docs/proxy.md, "Shards"): `python -m gyre.train proxy.shards=2` serves every
model call from two shard processes, the controller deciding. A 2-cell elastic run of 2 steps with a publication
after each (cells leave rollout for training and come back, so executions are rerouted with their calls in flight,
on their shards) exits 0, leaves no process behind (the shards included), and from its outputs: both shards served
executions (train.log names each shard's URL; each execution's harness transcript names the base URL it was given),
every model call is recorded exactly once, no harness saw an API error (`gyre.runtime.audit`: the proxy's counters,
added over the shards, against the record files and transcripts), and the controller's progress line heard the
shards' calls."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from test_train_program import PAIRS, SMALL, finish, train, wait_until_gone

SHARDED_RUN = [
    *(o for o in SMALL if not o.startswith("algo.mu=")),
    *PAIRS,
    "algo.mu=1",  # a publication after every step: cells move between roles, executions are rerouted
    "cluster.num_cells=2",
    "proxy.shards=2",
    "steps=2",
    "tasks.eval_every=0",
    "logging.wandb=disabled",
    "logging.timeline=false",
]


@pytest.mark.slow  # a real run of 2 ranks and 2 shard processes: ~30 s on 2 cores
def test_two_proxy_shards_serve_a_run_and_record_every_call_once(tmp_path):
    from gyre.runtime.audit import audit_run
    from gyre.traj.store import load_tree

    run_dir = tmp_path / "run"
    process = train(SHARDED_RUN, run_dir)
    code, out, err = finish(process, 600)
    assert code == 0, err[-3000:]
    assert wait_until_gone(process) == []  # the shards stopped with the run
    assert json.loads(out.strip().splitlines()[-1])["end"] == "completed"

    log = (run_dir / "train.log").read_text()
    urls = re.search(r"proxy shards serving at (\S+), (\S+)", log)
    assert urls is not None, log[-3000:]
    served = {
        int(i): (int(e), int(c)) for i, e, c in re.findall(r"proxy shard (\d+): (\d+) executions, (\d+) calls", log)
    }
    assert set(served) == {0, 1} and all(e > 0 and c > 0 for e, c in served.values()), served  # both served
    calls = 0
    for path in sorted((run_dir / "records").glob("*.jsonl")):
        tree = load_tree(path)
        assert len({c.meta.request_id for c in tree.calls}) == len(tree.calls), path.name
        calls += len(tree.calls)
    audit = audit_run(run_dir)
    proxy = audit["proxy"]
    assert audit["calls_recorded"] == calls == proxy["recorded"] == sum(c for _, c in served.values()) > 0, audit
    assert audit["duplicate_request_ids"] == audit["retries"] == audit["api_errors"] == 0, audit
    assert proxy["failed"] == proxy["refused"] == 0, proxy
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all(r["train_tokens"] > 0 for r in steps)
    moves = {k: sum(r[k] for r in steps) for k in ("reroutes", "calls_rerouted", "kv_migrations", "calls_reprefilled")}
    print(f"sharded run: {calls} calls recorded, by shard (executions, calls) {served}; {moves}")


@pytest.mark.slow  # a real run of 2 ranks and 2 shard processes, one killed mid-run: ~30 s on 2 cores
def test_a_proxy_shard_killed_mid_run_ends_the_run_with_its_error_and_leaves_nothing_behind(tmp_path):
    run_dir = tmp_path / "run"
    process = train([*SHARDED_RUN, "steps=4"], run_dir)
    log_path, pids = run_dir / "train.log", None
    try:
        deadline = time.monotonic() + 300
        while pids is None or not list((run_dir / "records").glob("*.jsonl")):
            assert process.poll() is None and time.monotonic() < deadline, "no shard served a call in time"
            text = log_path.read_text() if log_path.is_file() else ""
            found = re.search(r"proxy shards serving at .* \(pids (\d+), (\d+)\)", text)
            pids = None if found is None else [int(pid) for pid in found.groups()]
            time.sleep(0.1)
        os.kill(pids[1], signal.SIGKILL)
        code, out, _ = finish(process, 300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert code != 0, out[-2000:]
    log = log_path.read_text()
    assert re.search(r"proxy shard 1 \(\S+\) is gone: its control connection ended", log), log[-3000:]
    assert "the run failed: ShardError" in log, log[-3000:]
    assert wait_until_gone(process) == []
