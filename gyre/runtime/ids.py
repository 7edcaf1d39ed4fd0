"""The scheduler's integer ids <-> the string ids of the rest of the system (docs/runtime.md, "Ids").

The scheduler (`gyre.sched`) numbers executions 0, 1, 2, ... (execution `e` belongs to group
`e // executions_per_group`) and engines `POOL` (-1) and cells `0..K-1`. The proxy's sessions, the record files
(`<records_dir>/<execution>.jsonl`), `GroupOutcomes`, the trajectory trees and the trajectory buffer name an
execution by a string, and the routing table names an engine by a string. One mapping, pure and reversible:

- execution `e` of group `g` -> `"g{g:06d}-e{e:07d}"` (sorts like the integers, names its group for a reader, and
  is a valid execution id: `gyre.proxy.sessions.check_execution_id`); run again after a resume (a harness cannot
  be resumed: docs/runtime.md, "Checkpoints and resume"), its k-th rerun is `"g{g:06d}-e{e:07d}-r{k}"`, so that no
  session, record file or workspace of the instance that was lost is reused;
- cell `c` -> `"cell-{c}"`, `POOL` -> `"pool"`.

Groups keep the scheduler's integer ids everywhere (the trajectory buffer's group ids are ints). Pure: the stdlib
and gyre.config's checks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gyre.config.checks import is_int

POOL_ENGINE = -1  # gyre.sched.POOL
POOL_NAME = "pool"

_EXECUTION = re.compile(r"g(\d{6,})-e(\d{7,})(?:-r([1-9]\d*))?")
_CELL = re.compile(r"cell-(0|[1-9]\d*)")

__all__ = ["POOL_NAME", "ExecutionIds", "engine_id", "engine_name"]


def engine_name(engine: int) -> str:
    """The routing table's name of scheduler engine `engine` (a cell index, or POOL)."""
    if not is_int(engine) or engine < POOL_ENGINE:
        raise ValueError(f"engine={engine!r} is not allowed: expected a cell index >= 0 or POOL (-1)")
    return POOL_NAME if engine == POOL_ENGINE else f"cell-{engine}"


def engine_id(name: str) -> int:
    """The scheduler's engine id of routing-table name `name` (inverse of `engine_name`)."""
    if name == POOL_NAME:
        return POOL_ENGINE
    match = _CELL.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(f"engine name {name!r} is not allowed: expected 'cell-<index>' or {POOL_NAME!r}")
    return int(match.group(1))


@dataclass(frozen=True)
class ExecutionIds:
    """Execution ids of one run: `executions_per_group` is the scheduler's N + oversample."""

    executions_per_group: int

    def __post_init__(self) -> None:
        per = self.executions_per_group
        if not is_int(per) or per < 1:
            raise ValueError(f"executions_per_group={per!r} is not allowed: expected an integer >= 1 (N + oversample)")

    def group_of(self, execution: int) -> int:
        """The group of scheduler execution `execution` (the scheduler's own rule)."""
        return execution // self.executions_per_group

    def name(self, execution: int, rerun: int = 0) -> str:
        """The string id of scheduler execution `execution` (its `rerun`-th rerun after a resume, 0: the first
        instance): session, record file, outcomes, tree, buffer."""
        if not is_int(execution) or execution < 0:
            raise ValueError(f"execution={execution!r} is not allowed: expected an integer >= 0")
        if not is_int(rerun) or rerun < 0:
            raise ValueError(f"rerun={rerun!r} is not allowed: expected an integer >= 0")
        base = f"g{self.group_of(execution):06d}-e{execution:07d}"
        return f"{base}-r{rerun}" if rerun else base

    def execution(self, name: str) -> int:
        """The scheduler execution named `name` (inverse of `name`); ValueError for a name it never gave."""
        match = _EXECUTION.fullmatch(name) if isinstance(name, str) else None
        if match is None or self.group_of(int(match.group(2))) != int(match.group(1)):
            raise ValueError(
                f"execution name {name!r} is not one of this run's: expected 'g<group:06d>-e<execution:07d>' with "
                f"group = execution // {self.executions_per_group}"
            )
        return int(match.group(2))

    def executions(self, group: int) -> range:
        """The scheduler executions of `group`, in order (the N + oversample the scheduler dispatched)."""
        if not is_int(group) or group < 0:
            raise ValueError(f"group={group!r} is not allowed: expected an integer >= 0")
        per = self.executions_per_group
        return range(group * per, (group + 1) * per)

    def names(self, group: int) -> list[str]:
        """The string ids of `group`'s executions, in order (`GroupOutcomes`, `TrajectoryBuffer.add_group`)."""
        return [self.name(e) for e in self.executions(group)]
