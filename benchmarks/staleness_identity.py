"""Theorem A.1 on the simulator: measured group-weighted mean staleness vs phi + (mu - 1) / 2.

For every phi in {0, 0.5, 1, 1.5, 2} and mu in {1, 2, 3, 4}, boundary dispatch in elastic mode on a
small cluster for 120 steps; also token-weighted mean and max, and continuous dispatch beside it.
Prints a table, then one JSON object (last line).

    python benchmarks/staleness_identity.py [--steps 120] [--out benchmarks/results/staleness_identity.json]
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

from report import emit

from gyre.config import AlgoConfig, ClusterConfig, SimConfig, WorkloadConfig
from gyre.sim.simulator import simulate


def config(phi: float, mu: int, dispatch: str, steps: int) -> SimConfig:
    return SimConfig(
        cluster=ClusterConfig(
            num_cells=4, cell_size=1, cell_capacity=16, group_train_node_s=600, microsteps_per_group=2
        ),
        workload=WorkloadConfig(median_s=3600, sigma=0.6, query_sigma=0.3),
        algo=AlgoConfig(phi=phi, mu=mu, dispatch=dispatch, group_size=4, batch_groups=4),
        steps=steps,
        timeline=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    rows = []
    print(
        f"{'phi':>4} {'mu':>3} | {'target':>6} {'group':>6} {'err':>7} {'token':>6} {'max':>4} | "
        f"{'cont.':>6} {'c-b':>5}"
    )
    for phi, mu in itertools.product((0.0, 0.5, 1.0, 1.5, 2.0), (1, 2, 3, 4)):
        b, _ = simulate(config(phi, mu, "boundary", args.steps))
        c, _ = simulate(config(phi, mu, "continuous", args.steps))
        sb, sc = b["staleness"], c["staleness"]
        target = sb["target"]  # AlgoConfig.target_staleness: phi + (mu - 1) / 2
        row = {
            "phi": phi,
            "mu": mu,
            "target": target,
            "group_mean": round(sb["group_mean"], 4),
            "error": round(sb["group_mean"] - target, 4),
            "token_mean": round(sb["token_mean"], 4),
            "max": sb["max"],
            "continuous_group_mean": round(sc["group_mean"], 4),
        }
        rows.append(row)
        print(
            f"{phi:4.1f} {mu:3d} | {target:6.2f} {sb['group_mean']:6.3f} {row['error']:+7.4f} {sb['token_mean']:6.3f} "
            f"{sb['max']:4.0f} | {sc['group_mean']:6.3f} {sc['group_mean'] - sb['group_mean']:5.2f}"
        )
    worst = max(abs(r["error"]) for r in rows)
    print(f"max |group_mean - (phi + (mu-1)/2)| = {worst:.4f} over {len(rows)} settings")
    result = {
        "benchmark": "staleness_identity",
        "steps": args.steps,
        "rows": rows,
        "max_abs_error": worst,
        "within_0.05": worst <= 0.05,
        "wall_s": round(time.perf_counter() - start, 2),
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
