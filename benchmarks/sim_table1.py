"""The simulator against the paper's Table 1: every row's cumulative speedups of gyre over Async and Colocate.

Rows (../shared/paper/table1_speedups.csv, the summary's Table 1): DeepSWE and TerminalBench at E[d] = 1 and 1.5
(24 steps, presets `experiment=T1_<workload>_ed<E[d]>_<method>`), and NL2RepoBench on Qwen 3.8 2.4T (48 steps,
`experiment=T1_nl2repo2p4t_<method>`). What each row can be held to:

- **2.4T (validation)**: its durations are fitted to the two statistics the paper states for that run (61.1% of
  queries over 4 h, 38.2% of the longest executions ending in an overall timeout; `--fit`), its layout is the
  paper's, every cost is the 122B calibration (docs/simulator.md): nothing is fitted on a speedup.
- **DeepSWE, TerminalBench (not validated)**: the paper gives no duration statistics for them, so their presets
  reuse the 122B NL2RepoBench duration model, and both workloads give the same numbers. They are printed as
  measured, beside the paper's, and are not a check of anything.

    python benchmarks/sim_table1.py [--seeds 3] [--out benchmarks/results/sim_table1.json]
    python benchmarks/sim_table1.py --fit        # refit the 2.4T duration model (prints the parameters)
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import numpy as np
from report import emit

from gyre.sim.presets import compose_sim_config
from gyre.sim.simulator import simulate

TOLERANCE = 0.15
# (workload, E[d]) -> (steps, paper speedup vs Async, vs Colocate); preset stem.
ROWS = {
    ("deepswe", "1"): ("T1_deepswe_ed1", 24, 1.569, 1.610),
    ("deepswe", "1.5"): ("T1_deepswe_ed1p5", 24, 1.572, 1.824),
    ("terminalbench", "1"): ("T1_terminalbench_ed1", 24, 1.383, 1.809),
    ("terminalbench", "1.5"): ("T1_terminalbench_ed1p5", 24, 1.430, 1.849),
    ("nl2repo 2.4T", "1.5"): ("T1_nl2repo2p4t", 48, 1.78, 1.21),
}
VALIDATED = {("nl2repo 2.4T", "1.5")}
PAPER_2P4T_HOURS = {"gyre": 75.42, "async": 134.55, "colocate": 91.47}
STATS_2P4T = {"queries_over_4h": 0.611, "longest_overall_timeout": 0.382}


def fit_2p4t(groups: int = 20000) -> dict:
    """Grid search median, harness budget and overall share against the two 2.4T statistics (common random numbers;
    sigma 0.3 and query_sigma 0.4 from nl2repo_122b, the overall budget one hour after the harness budget)."""
    rng = np.random.default_rng(0)
    zq, ze = rng.standard_normal(groups), rng.standard_normal((groups, 16))
    uo, ev = rng.random((groups, 16)), rng.exponential(300.0, (groups, 16))
    best = None
    for share, median, harness in itertools.product(
        (0.1222, 0.2, 0.3, 0.4), np.arange(6000, 16001, 250), np.arange(12600, 25201, 900)
    ):
        raw = median * np.exp(0.4 * zq)[:, None] * np.exp(0.3 * ze)
        over = raw >= harness
        ot = over & (uo < share)
        d = np.where(ot, harness + 3600, np.where(over, harness + ev, raw + ev))
        ot |= ~over & (raw + ev >= harness + 3600)
        longest = d.argmax(1)
        got = {
            "queries_over_4h": float((d.max(1) > 4 * 3600).mean()),
            "longest_overall_timeout": float(ot[np.arange(groups), longest].mean()),
        }
        err = max(abs(got[k] - v) / v for k, v in STATS_2P4T.items())
        if best is None or err < best[0]:
            best = (err, {"median_s": float(median), "harness_timeout_s": float(harness), "share": share}, got)
    return {"max_relative_error": best[0], "params": best[1], "measured": best[2], "targets": STATS_2P4T}


def row_hours(stem: str, method: str, steps: int, seed: int) -> float:
    cfg = compose_sim_config([f"experiment={stem}_{method}", f"steps={steps}", f"seed={seed}", "timeline=false"])
    summary, _ = simulate(cfg)
    return summary["total_time_h"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--fit", action="store_true", help="refit the 2.4T duration model and print it")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.fit:
        emit({"benchmark": "sim_table1_fit", **fit_2p4t()}, args.out)
        return
    started = time.perf_counter()
    rows = []
    print(f"{'workload':<14} {'E[d]':>4} {'steps':>5} {'vs Async':>17} {'vs Colocate':>17}  role")
    for (workload, ed), (stem, steps, paper_async, paper_colocate) in ROWS.items():
        hours = {
            method: [row_hours(stem, method, steps, seed) for seed in range(args.seeds)]
            for method in ("gyre", "async", "colocate")
        }
        mean = {method: statistics.mean(values) for method, values in hours.items()}
        vs_async, vs_colocate = mean["async"] / mean["gyre"], mean["colocate"] / mean["gyre"]
        validated = (workload, ed) in VALIDATED
        row = {
            "workload": workload,
            "target_staleness": float(ed),
            "steps": steps,
            "preset": stem,
            "role": "validation (durations fitted on the paper's statistics only)"
            if validated
            else "not validated (no duration statistics in the paper: the 122B model reused)",
            "hours": mean,
            "hours_per_seed": hours,
            "speedup_vs_async": {"sim": vs_async, "paper": paper_async, "error": vs_async / paper_async - 1},
            "speedup_vs_colocate": {
                "sim": vs_colocate,
                "paper": paper_colocate,
                "error": vs_colocate / paper_colocate - 1,
            },
        }
        if validated:
            row["within_tolerance"] = all(
                abs(row[k]["error"]) <= TOLERANCE for k in ("speedup_vs_async", "speedup_vs_colocate")
            )
            row["paper_hours"] = PAPER_2P4T_HOURS
        rows.append(row)
        a, c = row["speedup_vs_async"], row["speedup_vs_colocate"]
        print(
            f"{workload:<14} {ed:>4} {steps:>5} {a['sim']:>6.3f} ({a['paper']:.3f}, {a['error']:+.1%})"
            f" {c['sim']:>6.3f} ({c['paper']:.3f}, {c['error']:+.1%})  {'validation' if validated else 'not validated'}"
        )
    big = next(r for r in rows if r["workload"] == "nl2repo 2.4T")
    print(
        "2.4T hours (sim vs paper): "
        + ", ".join(f"{m} {big['hours'][m]:.1f} vs {PAPER_2P4T_HOURS[m]:.2f}" for m in PAPER_2P4T_HOURS)
    )
    emit(
        {
            "benchmark": "sim_table1",
            "seeds": args.seeds,
            "tolerance": TOLERANCE,
            "rows": rows,
            "validated_within_tolerance": all(r.get("within_tolerance", True) for r in rows),
            "wall_s": time.perf_counter() - started,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
