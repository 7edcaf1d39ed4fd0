"""How a raw execution duration meets the two budgets (docs/simulator.md, "The model"): pure, stdlib only.

One rule for the simulator's sampled executions (`gyre.sim.workload.DurationModel`) and for the real slow
executions of the demo family (`gyre.tasks.demo.work`), so both carry the same workload shape: an execution that
would run past the harness budget ends at it and is still scored (its evaluation follows), a share of those
instead exhausts the overall budget and is discarded, and one whose evaluation would end past the overall budget
is discarded too.
"""

from __future__ import annotations

COMPLETED, HARNESS_TIMEOUT, OVERALL_TIMEOUT = "completed", "harness_timeout", "overall_timeout"


def budgeted_duration(
    raw_s: float, eval_s: float, overall_u: float, *, harness_s: float, overall_s: float, overall_share: float
) -> tuple[float, str]:
    """(duration in seconds, outcome) of an execution of raw duration `raw_s` followed by an evaluation of
    `eval_s`; `overall_u` is a uniform draw in [0, 1) deciding whether an over-budget execution exhausts the overall
    budget. A budget of 0 is none."""
    if harness_s and raw_s >= harness_s:
        if overall_u < overall_share:
            return overall_s, OVERALL_TIMEOUT
        return harness_s + eval_s, HARNESS_TIMEOUT
    if overall_s and raw_s + eval_s >= overall_s:
        return overall_s, OVERALL_TIMEOUT
    return raw_s + eval_s, COMPLETED
