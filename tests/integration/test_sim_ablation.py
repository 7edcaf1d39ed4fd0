"""The paper's scheduling ablation on the simulator, through the same conf/experiment presets.

Orders only (the figures are benchmarks/sim_ablation.py's): E0 is the fastest row and
E0 < E2 < E1 < C2 in total time, as in the paper's Table 2, averaged over three workload seeds.
"""

import statistics

from gyre.sim.presets import TABLE2_ROWS, compose_sim_config
from gyre.sim.simulator import simulate


def test_table2_orders():
    hours = {}
    for row in TABLE2_ROWS:
        runs = [simulate(compose_sim_config([f"experiment={row}", f"seed={s}", "timeline=false"]))[0] for s in range(3)]
        assert all(r["steps"] == 12 for r in runs)
        hours[row] = statistics.fmean(r["total_time_h"] for r in runs)
    assert min(hours, key=hours.get) == "E0", hours
    assert hours["E0"] < hours["E2"] < hours["E1"] < hours["C2"], hours
