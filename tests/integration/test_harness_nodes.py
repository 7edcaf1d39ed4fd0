"""Harness hosts on every node (docs/cluster.md, "Harness hosts on every node"): a job of two torchrun "nodes" on this
machine (`launch/torchrun.sh` twice, one rank each) with `harness.hosts=nodes` and two proxy shards
(`proxy.shards=2`, docs/proxy.md "Shards": node 1's harnesses call them too).

- Node 1's rank SIGKILLed mid-run while it plays executions: the job ends within 30 s on both nodes, torchrun's
  summary on node 1 names the rank and the signal, rank 0 one line naming the rank (`RankLost`), and nothing is
  left (node 1's harnesses end with their rank); both nodes launched again with `resume=auto` resume from the last
  checkpoint,
  dispatch again the executions that were running at it, and finish: both nodes played executions
  (`executions.jsonl` says which node played each), both shards served calls, every model call is recorded once
  and no harness saw an API error (`gyre.runtime.audit`), and no process is left.
- The two-node launch itself (what `test_launch.py`'s two-node smoke checked, folded in here: docs/testing.md,
  "Seventh round"): the first launch's c10d rendezvous, groups across nodes and steps (it reaches a checkpoint with
  node 1's executions played), and the second's end: both nodes exit 0, exactly one printed the run's end line
  (completed, every step, the run directory), metrics.jsonl has a line a step and summary.json the steps.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from test_launch import DEATH_BOUND_S, Nodes, assert_names_rank_killed, end_line

pytestmark = pytest.mark.warm_start  # tests/conftest.py: ordered after the modules that do not need it


def executions_by_node(run_dir) -> dict[int, int]:
    from gyre.runtime.controller.execution_log import read_executions

    counts: dict[int, int] = {}
    for line in read_executions(run_dir / "executions.jsonl"):
        counts[line.node] = counts.get(line.node, 0) + 1
    return counts


def audit_clean(run_dir) -> dict:
    from gyre.runtime.audit import audit_run
    from gyre.traj.store import load_tree

    calls = 0
    for path in sorted((run_dir / "records").glob("*.jsonl")):
        tree = load_tree(path)
        assert len({c.meta.request_id for c in tree.calls}) == len(tree.calls), path.name
        calls += len(tree.calls)
    audit = audit_run(run_dir)
    assert audit["calls_recorded"] == calls > 0, audit
    assert audit["duplicate_request_ids"] == audit["retries"] == audit["api_errors"] == 0, audit
    return audit


@pytest.mark.slow  # two torchrun nodes twice (killed, then resumed): ~2-3 min on 2 cores
def test_node_1_killed_mid_run_ends_the_job_and_the_resumed_run_dispatches_its_executions_again(tmp_path):
    from test_train_program import PAIRS, SMALL, pid_of_rank
    from test_train_resume import checkpoints, in_flight, state_of

    steps = 3
    # Groups of 2 (PAIRS): what is checked is a node's death, the re-dispatch across the resume and where executions
    # ran, not what a step learns; every step still trains two groups, half the harness processes.
    args = [
        *SMALL,
        *PAIRS,
        f"steps={steps}",
        "tasks.eval_every=0",
        "tasks.demo.work.enabled=true",  # slow executions: steps end while some still run
        "algo.phi=1.0",
        "checkpoint.every_steps=1",
        "checkpoint.keep=10",
        "cluster.num_cells=2",
        "harness.hosts=nodes",
        "proxy.shards=2",  # node 1's harnesses call the proxy's shards too
        "logging.wandb=disabled",
    ]
    run_dir = tmp_path / "run"
    (tmp_path / "first").mkdir()
    first = Nodes(tmp_path / "first", args, nnodes=2, nproc=1, env={"RUN_DIR": str(run_dir)})
    try:
        chosen, deadline = None, time.monotonic() + 600
        while chosen is None:
            assert time.monotonic() < deadline and all(p.poll() is None for p in first.processes), first.output(0)
            for path in checkpoints(run_dir):
                running, _ = in_flight(state_of(path))
                played = executions_by_node(run_dir) if (run_dir / "executions.jsonl").is_file() else {}
                if running and played.get(1, 0) > 0 and state_of(path)["scheduler"]["trainer_version"] < steps:
                    chosen = path
            time.sleep(0.1)
        os.kill(pid_of_rank(first.marker, 1, run_dir), signal.SIGKILL)  # node 1's rank: its torchrun agent fails
        killed = time.monotonic()
        codes = first.wait(DEATH_BOUND_S + 30)
        ended_s = time.monotonic() - killed
        text = "\n".join(out + err for out, err in (first.output(node) for node in (0, 1)))
    finally:
        left = first.close()
    assert ended_s < DEATH_BOUND_S and all(code not in (None, 0) for code in codes), (codes, ended_s, text[-3000:])
    assert_names_rank_killed(text, 1)  # torchrun's summary on node 1
    lines = [line for line in text.splitlines() if line.startswith("gyre.train:")]
    # rank 0's one line: its lifeline saw rank 1 end (RankLost), or a socket to node 1's host ended first (HostLost)
    assert len(lines) == 1 and re.search(r"run error: (RankLost: rank 1 ended|HostLost: .*\(rank 1, )", lines[0]), lines
    assert left == [], left  # node 1's harnesses ended with its rank (their parent-death signal)
    before = checkpoints(run_dir)[-1]
    saved = state_of(before)
    running, _ = in_flight(saved)

    (tmp_path / "again").mkdir()
    again = Nodes(tmp_path / "again", [*args, "resume=auto"], nnodes=2, nproc=1, env={"RUN_DIR": str(run_dir)})
    try:
        codes = again.wait(900)
        outputs = [again.output(node) for node in (0, 1)]
        assert codes == [0, 0], [err[-3000:] for _, err in outputs]
    finally:
        left = again.close()
    assert left == []
    ends = [end for end in (end_line(out) for out, _ in outputs) if end is not None]
    assert len(ends) == 1 and ends[0]["end"] == "completed" and ends[0]["steps"] == steps, outputs  # rank 0's node
    assert ends[0]["run_dir"] == str(run_dir)
    metrics = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics == list(range(steps)), metrics
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps
    assert f"resuming from {before}" in outputs[0][0]
    final = state_of(checkpoints(run_dir)[-1])
    reruns = {int(e): k for e, k in final["reruns"].items()}
    assert running and {e for e, k in reruns.items() if k >= 1} >= running, (running, reruns)  # dispatched again
    placed = executions_by_node(run_dir)
    assert placed.get(0, 0) > 0 and placed.get(1, 0) > 0, placed  # both nodes played executions
    served = re.findall(r"proxy shard (\d+): (\d+) executions, (\d+) calls", (run_dir / "train.log").read_text())
    assert sorted(i for i, _, _ in served[-2:]) == ["0", "1"] and all(int(c) > 0 for _, _, c in served[-2:]), served
    audit = audit_clean(run_dir)
    assert audit["proxy"]["failed"] == audit["proxy"]["refused"] == 0, audit  # the resumed run's counters
    log = (run_dir / "train.log").read_text()
    assert "is gone" not in log and "never retrieved" not in log, log[-3000:]  # both runs stopped their shards cleanly
    print(f"killed node 1 after {before.name}: {len(running)} executions dispatched again; by node {placed}")
