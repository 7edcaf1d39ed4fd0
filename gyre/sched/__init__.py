"""Pure scheduling policy (the stdlib; `gyre.config` only to build its spec): capacity ledger (Eq. 1), counters
d/p/f, boundary dispatch, waterlevel (Eq. 2), supply check, end of burst (Eq. 3), destination choice, staleness.

State and events in, actions out; no clock, no IO. Elastic, Colocate and Async share one interface.
"""

from gyre.sched.groups import GroupState
from gyre.sched.ledger import CapacityLedger
from gyre.sched.scheduler import Scheduler
from gyre.sched.spec import spec_from_config
from gyre.sched.staleness import StalenessLog, warmup_steps
from gyre.sched.types import (
    POOL,
    Action,
    BeginStep,
    BeginTransition,
    Cancel,
    Dispatch,
    Outcome,
    Publish,
    Reroute,
    Role,
    SchedSpec,
    Start,
    WakeAt,
)

__all__ = [
    "POOL",
    "Action",
    "BeginStep",
    "BeginTransition",
    "Cancel",
    "CapacityLedger",
    "Dispatch",
    "GroupState",
    "Outcome",
    "Publish",
    "Reroute",
    "Role",
    "SchedSpec",
    "Scheduler",
    "StalenessLog",
    "Start",
    "WakeAt",
    "spec_from_config",
    "warmup_steps",
]
