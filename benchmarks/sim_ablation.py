"""The paper's scheduling ablation (Table 2) on the simulator: rows A0-E2, 12 steps each.

Runs every row of conf/experiment/ over several workload seeds with the same scheduler code that
drives real cells, and prints a table beside the paper's figures, then one JSON object (last line).
Free model parameters (cluster.group_train_node_s, cluster.publish_s) were calibrated on the
CALIBRATION rows only; every other row is a validation row, judged by its ratio vs E0.

    python benchmarks/sim_ablation.py [--seeds 5] [--out benchmarks/results/sim_ablation.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from report import emit

from gyre.sim.presets import TABLE2_ROWS, compose_sim_config
from gyre.sim.simulator import simulate

CALIBRATION = ("A0", "C0")  # fitted on their ratio vs E0; E0 is the reference
TOLERANCE = 0.15  # validation rows: |ratio - paper ratio| / paper ratio

# The paper's 12-step totals (hours), Table 2 (../shared/paper/table2_ablation.csv).
PAPER_HOURS = {
    "A0": 25.08, "A1": 27.01, "A2": 32.58, "A3": 22.18, "C0": 23.23, "C1": 22.56,
    "C2": 19.23, "C3": 20.69, "E0": 16.12, "E1": 17.87, "E2": 16.47,
}  # fmt: skip


# The paper's single-step effects quoted in the summary's ablation text: (from, to, paper to/from).
PAIRS = (
    ("A0", "A1"), ("A0", "A2"), ("A0", "A3"), ("C0", "C1"), ("C1", "C2"), ("C2", "C3"),
    ("C2", "E0"), ("E0", "E1"), ("E0", "E2"), ("A3", "E1"), ("C2", "E1"),
)  # fmt: skip


def run_rows(seeds: int, steps: int = 12) -> tuple[dict[str, list[float]], float, float]:
    """Hours per row per seed; wall seconds of all rows; wall seconds of all rows for seed 0 alone."""
    hours: dict[str, list[float]] = {row: [] for row in TABLE2_ROWS}
    configs = {
        (row, seed): compose_sim_config([f"experiment={row}", f"seed={seed}", f"steps={steps}", "timeline=false"])
        for row in TABLE2_ROWS
        for seed in range(seeds)
    }
    start = time.perf_counter()
    first_seed_s = 0.0
    for seed in range(seeds):
        seed_start = time.perf_counter()
        for row in TABLE2_ROWS:
            summary, _ = simulate(configs[row, seed])
            hours[row].append(summary["total_time_h"])
        if seed == 0:
            first_seed_s = time.perf_counter() - seed_start
    return hours, time.perf_counter() - start, first_seed_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="workload seeds per row (mean reported)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    args = parser.parse_args()

    paper = PAPER_HOURS
    hours, wall_s, one_seed_s = run_rows(args.seeds)
    mean = {row: statistics.fmean(v) for row, v in hours.items()}
    e0, paper_e0 = mean["E0"], paper["E0"]
    rows = {}
    print(
        f"{'row':4} {'role':11} {'sim h':>7} {'±sd':>5} {'vs E0':>6} | {'paper h':>7} {'vs E0':>6} | {'ratio err':>9}"
    )
    for row in TABLE2_ROWS:
        ratio, paper_ratio = mean[row] / e0, paper[row] / paper_e0
        err = (ratio - paper_ratio) / paper_ratio
        role = "reference" if row == "E0" else "calibration" if row in CALIBRATION else "validation"
        sd = statistics.stdev(hours[row]) if len(hours[row]) > 1 else 0.0
        rows[row] = {
            "role": role,
            "sim_hours": round(mean[row], 3),
            "sim_hours_sd": round(sd, 3),
            "sim_ratio_vs_E0": round(ratio, 3),
            "paper_hours": paper[row],
            "paper_ratio_vs_E0": round(paper_ratio, 3),
            "ratio_error": round(err, 4),
        }
        print(
            f"{row:4} {role:11} {mean[row]:7.2f} {sd:5.2f} {ratio:6.3f} | "
            f"{paper[row]:7.2f} {paper_ratio:6.3f} | {err:+9.1%}"
        )

    pairs = {}
    print(f"{'effect':9} {'sim':>7} {'paper':>7}   (to / from - 1, total hours)")
    for a, b in PAIRS:
        sim_effect, paper_effect = mean[b] / mean[a] - 1, paper[b] / paper[a] - 1
        pairs[f"{a}->{b}"] = {"sim": round(sim_effect, 4), "paper": round(paper_effect, 4)}
        print(f"{a}->{b:5} {sim_effect:+7.1%} {paper_effect:+7.1%}")

    validation = [r for r, v in rows.items() if v["role"] == "validation"]
    checks = {
        "E0_fastest": all(mean["E0"] <= mean[r] for r in TABLE2_ROWS),
        "E0<E2<E1<C2": mean["E0"] < mean["E2"] < mean["E1"] < mean["C2"],
        "validation_within_15pct": all(abs(rows[r]["ratio_error"]) <= TOLERANCE for r in validation),
        "max_validation_error": round(max(abs(rows[r]["ratio_error"]) for r in validation), 4),
        "all_rows_one_seed_wall_s": round(one_seed_s, 2),
        "under_60s": one_seed_s < 60.0,
    }
    print(
        f"checks: E0 fastest {checks['E0_fastest']}; E0<E2<E1<C2 {checks['E0<E2<E1<C2']}; validation within 15% "
        f"{checks['validation_within_15pct']} (max {checks['max_validation_error']:.1%}); 11 rows x 12 steps "
        f"{one_seed_s:.1f} s wall for one seed ({wall_s:.1f} s for {args.seeds} seeds)"
    )
    result = {
        "benchmark": "sim_ablation",
        "seeds": args.seeds,
        "steps": 12,
        "calibration_rows": list(CALIBRATION),
        "validation_rows": validation,
        "rows": rows,
        "pairwise_effects": pairs,
        "checks": checks,
        "wall_s": round(wall_s, 2),
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
