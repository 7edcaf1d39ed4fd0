"""`executions.jsonl`: one line per execution of a run, when its episode ends (docs/runtime.md, "Outputs").

What the simulator replays (`workload=replay`, docs/simulator.md "Calibrating from a real run") and what a user
reads to see where an execution's time went: when it started and on which engine, when its harness ended (its
slot freed), when its evaluation closed it, and how (the scheduler's outcome, the outcome's status and reward).
Times are seconds from the run's start, the controller's clock. Each line is flushed as it is written. A write
that fails (a full disk) is logged once and the file is left as it is: the run goes on without it (the training
data is in the record files and the trajectory buffer, never here).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

__all__ = ["EXECUTIONS_FILE", "ExecutionLine", "ExecutionLog", "read_executions"]

EXECUTIONS_FILE = "executions.jsonl"
log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ExecutionLine:
    execution: str  # the run's name of it (`gyre.runtime.ids`: g<group>-e<execution>)
    group: int
    task: str
    engine: str  # where it started (`cell-<c>`); reroutes are in metrics.jsonl
    start_s: float
    harness_end_s: float | None = None  # None: its harness never ended (the run stopped it)
    end_s: float | None = None  # the episode's end (evaluation done, or the execution cancelled)
    outcome: str | None = None  # the scheduler's (completed, harness_timeout, overall_timeout, failed); None: cancelled
    status: str | None = None  # the outcome's status (valid, placeholder, excluded, cancelled)
    reward: float | None = None
    node: int = 0  # the node that played it (`harness.hosts=nodes`; 0: the controller's)


class ExecutionLog:
    """Appends `ExecutionLine`s to `<run dir>/executions.jsonl`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = path.open("a", encoding="utf-8")

    def write(self, line: ExecutionLine) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(asdict(line), allow_nan=False) + "\n")
            self._file.flush()
        except (OSError, ValueError) as error:
            log.error("%s: not written from %s on (%s); the run goes on", self.path, line.execution, error)
            self.close()

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError as error:  # the flush of a full disk
                log.error("%s: %s", self.path, error)


def read_executions(path: Path) -> list[ExecutionLine]:
    """The lines of an `executions.jsonl` (a line cut by a crash is skipped)."""
    lines = []
    for text in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            lines.append(ExecutionLine(**json.loads(text)))
        except (json.JSONDecodeError, TypeError):
            continue
    return lines
