"""Tasks: the task format and loader (`spec`), evaluators with partial scoring (`evaluate`), the bundled demo
family (`demo`). See docs/tasks.md. Stdlib only, plus the pure `gyre.traj.outcomes` types; the exception is the
demo family's supervised warm start of the tiny model (`demo.warm_start`, CLI `python -m gyre.tasks.demo`), which
imports the proxy's rendering, the model and the engine, and which nothing here imports."""

from gyre.tasks.evaluate import EvaluationResult, evaluate, evaluated_state, to_evaluation, workspace_digest
from gyre.tasks.spec import (
    CommandEvaluatorSpec,
    PythonEvaluatorSpec,
    Task,
    TaskError,
    load_task,
    load_tasks,
    prepare_workspace,
)

__all__ = [
    "CommandEvaluatorSpec",
    "EvaluationResult",
    "PythonEvaluatorSpec",
    "Task",
    "TaskError",
    "evaluate",
    "evaluated_state",
    "load_task",
    "load_tasks",
    "prepare_workspace",
    "to_evaluation",
    "workspace_digest",
]
