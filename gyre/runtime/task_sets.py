"""Loading a directory of training tasks (docs/runtime.md, "Tasks and the held-out evaluation"; the task format:
docs/tasks.md). A recipe (`gyre.runtime.recipe`) makes a run's `TaskSets`, with this for `tasks.task_dir`.

Contract: `load_task_dir` raises `TaskSetError` (a ValueError, one line naming the field) for a task directory that
is missing, empty or holds no task that loads; a task that does not load (a bad task.toml, a duplicate id) is
logged once as a warning naming its file and skipped.
"""

from __future__ import annotations

import logging
from pathlib import Path

from gyre.tasks.spec import TASK_FILE, Task, load_tasks

log = logging.getLogger(__name__)

__all__ = ["TRAIN_DIR", "TaskSetError", "load_task_dir"]

TRAIN_DIR = "tasks/train"  # under the run directory: a recipe's generated or copied training tasks


class TaskSetError(ValueError):
    """The configured tasks cannot be loaded (one line naming the field and what is wrong)."""


def load_task_dir(field: str, directory: str | Path) -> list[Task]:
    """The tasks under `directory` (`gyre.tasks.spec.load_tasks`). A task that cannot be loaded (a bad task.toml, a
    duplicate id) is logged once as a warning naming its file and skipped: it never stops the run, unless no task
    is left."""
    root, directory = Path(directory), str(directory)
    if not root.is_dir():
        raise TaskSetError(f"{field}={directory!r}: not a directory (expected a directory of task directories)")
    try:
        tasks, errors = load_tasks(root)
    except OSError as error:
        raise TaskSetError(f"{field}={directory!r}: cannot be read: {error}") from None
    for error in errors:
        log.warning("%s: skipped %s", field, error)
    if not tasks:
        if errors:
            raise TaskSetError(f"{field}={directory!r}: no task loads ({len(errors)} refused; the first: {errors[0]})")
        raise TaskSetError(f"{field}={directory!r}: holds no task directory (none has a {TASK_FILE}; docs/tasks.md)")
    return tasks
