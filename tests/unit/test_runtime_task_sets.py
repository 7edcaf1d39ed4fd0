"""A run's task directory (`gyre.runtime.task_sets.load_task_dir`): a task that does not load is reported once, naming
its file, and skipped; it never stops the run unless no task is left (issue 29, deliverable 6)."""

from __future__ import annotations

import logging

import pytest
from test_tasks_spec import GOOD, make_task

from gyre.runtime.task_sets import TaskSetError, load_task_dir


def load(directory):
    return load_task_dir("tasks.task_dir", str(directory))


def test_a_bad_task_is_reported_once_with_its_file_and_the_run_goes_on(tmp_path, caplog):
    make_task(tmp_path / "tasks", name="a-good")
    make_task(tmp_path / "tasks", "not toml [", name="b-bad")
    make_task(tmp_path / "tasks", GOOD.replace("fix-add", "other"), name="c-good")
    caplog.set_level(logging.WARNING, logger="gyre.runtime.task_sets")
    tasks = load(tmp_path / "tasks")
    assert [task.id for task in tasks] == ["fix-add", "other"]
    (record,) = caplog.records
    assert "tasks.task_dir: skipped task 'b-bad'" in record.getMessage()
    assert str(tmp_path / "tasks" / "b-bad") in record.getMessage()


def test_no_task_that_loads_is_one_line_naming_the_first_refusal(tmp_path):
    make_task(tmp_path / "tasks", "not toml [", name="b-bad")
    with pytest.raises(TaskSetError, match=r"no task loads \(1 refused; the first: task 'b-bad'"):
        load(tmp_path / "tasks")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskSetError, match="holds no task directory"):
        load(tmp_path / "empty")
    with pytest.raises(TaskSetError, match="not a directory"):
        load(tmp_path / "missing")
