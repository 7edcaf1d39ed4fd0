"""The real run's trace: cells' loads integrated for the node-time utilization, and its plain-data form."""

from __future__ import annotations

import json

import pytest

from gyre.runtime.controller.execution_log import ExecutionLine, ExecutionLog, read_executions
from gyre.runtime.controller.trace import RoleTrace


def test_loads_integrate_to_slot_seconds_and_the_trace_round_trips_as_json():
    trace = RoleTrace(2)
    trace.sample(0.0, 3, 8, [2, 1])
    trace.sample(1.0, 3, 8, [2, 1])  # unchanged: nothing kept
    trace.sample(2.0, 2, 8, [1, 1])
    trace.sample(2.0, 1, 8, [0, 1])  # the same instant: the last value holds
    trace.role(3.0, 0, "to_training")
    trace.step_end(5.0)
    assert trace.loads == [[(0.0, 2), (2.0, 0)], [(0.0, 1)]]
    assert trace.slot_seconds(6.0) == pytest.approx([2 * 2, 1 * 6])
    assert trace.slot_seconds(1.0) == pytest.approx([2, 1])
    assert trace.role_time_s(6.0) == {"cell 0 (core)": {"rollout": 3, "to_training": 3}, "cell 1": {"rollout": 6}}
    data = json.loads(json.dumps(trace.to_dict(6.0)))
    assert data["lanes"] == trace.lanes() and data["step_ends_s"] == [5.0] and data["end_s"] == 6.0
    assert data["loads"] == [[[0.0, 2], [2.0, 0]], [[0.0, 1]]]
    assert [(lane, state) for lane, _, _, state in data["segments"]] == [
        (trace.lanes()[0], "rollout"),
        (trace.lanes()[0], "to_training"),
        (trace.lanes()[1], "rollout"),
    ]


def test_the_execution_log_appends_lines_and_skips_a_torn_last_one(tmp_path):
    path = tmp_path / "executions.jsonl"
    log = ExecutionLog(path)
    first = ExecutionLine(execution="g000000-e0000000", group=0, task="t", engine="cell-3", start_s=0.5)
    first.harness_end_s, first.end_s, first.outcome, first.status, first.reward = 2.0, 2.5, "completed", "valid", 1.0
    log.write(first)
    log.write(ExecutionLine(execution="g000000-e0000001", group=0, task="t", engine="cell-2", start_s=0.6))
    log.close()
    log.write(first)  # after close: nothing
    with path.open("a") as f:
        f.write('{"execution": "g0000')  # a crash mid-line
    lines = read_executions(path)
    assert lines[0] == first and lines[1].outcome is None and len(lines) == 2


def test_a_failing_write_is_logged_once_and_the_run_goes_on(tmp_path, caplog):
    log = ExecutionLog(tmp_path / "executions.jsonl")

    class Full:
        def write(self, _):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    log._file = Full()
    line = ExecutionLine(execution="g000000-e0000000", group=0, task="t", engine="cell-0", start_s=0.0)
    log.write(line)
    log.write(line)
    errors = [r for r in caplog.records if "No space left" in r.getMessage()]
    assert len(errors) == 1


def test_a_separate_pool_is_a_last_lane_always_in_rollout_with_its_own_load():
    trace = RoleTrace(2, pool=True)
    assert trace.lanes() == ["cell 0 (core)", "cell 1", "pool"]
    trace.sample(0.0, 4, 12, [1, 0, 3])  # the cells' loads, then the pool's
    trace.role(1.0, 0, "to_training")
    trace.role(2.0, 0, "training")
    trace.sample(4.0, 1, 8, [0, 0, 1])
    with pytest.raises(ValueError, match="the pool's role never changes"):
        trace.role(5.0, 2, "training")
    assert trace.slot_seconds(6.0) == pytest.approx([4, 0, 3 * 4 + 1 * 2])
    assert trace.role_time_s(6.0) == {  # exact: whole seconds
        "cell 0 (core)": {"rollout": 1, "to_training": 1, "training": 4},
        "cell 1": {"rollout": 6},
        "pool": {"rollout": 6},
    }
    assert [lane for lane, *_ in trace.to_dict(6.0)["segments"]].count("pool") == 1
