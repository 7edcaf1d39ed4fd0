"""Discrete-event cluster simulator that drives the real `gyre.sched.Scheduler` with simulated time.

- `gyre.sim.simulator`: the event loop, its trace, and the run summary (`simulate(cfg)`).
- `gyre.sim.workload`: execution durations and outcomes sampled from a `WorkloadConfig`.
- `gyre.sim.app`: the Hydra app behind `python -m gyre.sim` (run directory, summary line, role timeline).

Importing the package imports none of them, so `gyre.sim.simulator` stays free of Hydra.
"""
