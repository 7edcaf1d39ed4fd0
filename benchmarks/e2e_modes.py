"""Elastic vs Colocate vs Async end to end on the real program, and the simulator held against those runs.

Each mode is one `python -m gyre.train` on the same layout (4 cells x 1, C_e slots each), the same tasks (the demo
family with slow executions, `tasks.demo.work`: the NL2Repo shape in seconds, docs/tasks.md), the same seed and
step count, run one after another; at matched E[d] = 1.5: elastic (0.5, 3), colocate (0, 4), async (1.5, 1) with
half the cells training. From each run directory: wall time, step times, utilization, staleness, transitions by
kind with their phases, publications, weight pulls, reroutes and calls moved (with their KV or not), and the audit
of what the harnesses saw. Then the simulator runs the same config per mode with the costs measured in that run and
the run's own execution durations replayed in dispatch order (`workload=replay workload.replay_order=sequence`),
and the predicted totals and ratios are printed beside the measured ones (docs/simulator.md, "Calibrating from a
real run"). One PNG stacks the three role timelines.

The slow executions spend most of their time in their check command, so a transition rarely meets a model call in
flight. A fourth run (`--migration-steps`, 0 to skip) measures the calls a transition moves: the plain demo,
elastic with tau = 0 (satellites join steps in flight), counting the calls moved and those that continued on the
destination with their KV instead of recomputing their prefix.

    python benchmarks/e2e_modes.py [--steps 8] [--seed 0] [--cell-capacity 4] [--group-size 4] [--batch-groups 2]
        [--work-dir /tmp/gyre-e2e] [--modes elastic,colocate,async] [--migration-steps 8] [--reuse]
        [--context-words 0] [--separate-size 0] [--separate-capacity 0]
        [--out benchmarks/results/e2e_modes.json] [--png benchmarks/results/e2e_modes.png]

`--reuse` measures the run directories already in --work-dir instead of running them again.

The pool layout (`--separate-size 1 --migration-steps 0 --out benchmarks/results/e2e_modes_pool.json --png
benchmarks/results/e2e_modes_pool.png`): the same 4 cells plus a separate rollout pool of that many ranks serving
`--separate-capacity` executions (0: C_e, as the program reads it), in the three modes and in the simulator
(`cluster.separate_size`, `cluster.separate_capacity`: docs/runtime.md, "The separate rollout pool").

The long-row preset (`--context-words 1100 --migration-steps 0 --out benchmarks/results/e2e_modes_long_rows.json
--png benchmarks/results/e2e_modes_long_rows.png`): every call of the three modes' runs carries ~3,500 tokens of
notes (`tasks.demo.context_words`, docs/tasks.md "Long rows"), so training weighs as on real harness rows; checked:
training's share of colocate's wall time (>= 25%) and the satellites that joined elastic's steps in flight.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from report import emit

from gyre.config import TinyModelSpec
from gyre.obs.record import record_from_dict
from gyre.obs.timeline import Segment, write_stacked_timelines
from gyre.runtime.audit import audit_run
from gyre.runtime.controller.execution_log import read_executions
from gyre.sim.durations import budgeted_duration
from gyre.sim.presets import compose_sim_config
from gyre.sim.simulator import simulate
from gyre.tasks.demo.work import WORK_FILE, plan_work

MODES = {
    "elastic": ["algo=elastic"],  # (phi, mu) = (0.5, 3)
    "colocate": ["algo=colocate"],  # (0, 4)
    "async": ["algo=async", "algo.train_cells=2"],  # (1.5, 1), half the cells train throughout
}
TARGET_SPEEDUP = 1.3  # elastic vs each baseline, total wall time (the acceptance)
SIM_TOLERANCE = 0.15  # the simulator's predicted total vs the measured one
TINY_CONTEXT = TinyModelSpec().max_position_embeddings  # the default tiny model's context
TRAINING_SHARE_TARGET = 0.25  # the long-row preset: training's share of colocate's wall time (the paper's regime)


def pool_overrides(args: argparse.Namespace) -> list[str]:
    """The separate rollout pool of `--separate-size` ranks (none at 0), its C_s explicit: the program's default
    (C_e when 0) written out, so the simulator reads the same pool."""
    if args.separate_size == 0:
        return []
    return [
        f"cluster.separate_size={args.separate_size}",
        f"cluster.separate_capacity={args.separate_capacity or args.cell_capacity}",
    ]


def run_overrides(args: argparse.Namespace, mode: str) -> list[str]:
    return [
        *MODES[mode],
        *pool_overrides(args),
        "tasks.demo.work.enabled=true",
        f"cluster.cell_capacity={args.cell_capacity}",
        f"algo.group_size={args.group_size}",
        f"algo.batch_groups={args.batch_groups}",
        f"algo.tau_s={args.tau_s}",
        f"steps={args.steps}",
        f"seed={args.seed}",
        "tasks.eval_every=0",
        "logging.wandb=disabled",
        *(long_row_overrides(args.context_words) if args.context_words else []),
    ]


def long_row_overrides(context_words: int) -> list[str]:
    """The demo's calls with `context_words` words of notes after the system prompt (docs/tasks.md, "Long rows"):
    the proxy and the packer take the tiny model's whole context instead of the demo's 1,024 tokens."""
    return [
        f"tasks.demo.context_words={context_words}",
        "proxy.context_limit=0",  # the model's max_position_embeddings
        f"packing.max_tokens_per_microstep={TINY_CONTEXT}",
    ]


MIGRATION_OVERRIDES = ["algo=elastic", "algo.tau_s=0", "tasks.eval_every=0", "logging.wandb=disabled"]


def run_mode(args: argparse.Namespace, mode: str, run_dir: Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """One `python -m gyre.train` for `mode` into `run_dir` (nothing with --reuse: the run is there); its exit code
    and wall seconds. A non-empty `run_dir` or a failed run ends the benchmark with one line."""
    if args.reuse:
        return {"rc": None, "process_wall_s": None}
    if run_dir.exists() and any(run_dir.iterdir()):
        raise SystemExit(f"{run_dir} is not empty: remove it, or measure it with --reuse")
    overrides = run_overrides(args, mode) if overrides is None else overrides
    command = [sys.executable, "-m", "gyre.train", *overrides, f"hydra.run.dir={run_dir}"]
    print(f"[{mode}] {' '.join(command[1:])}", file=sys.stderr, flush=True)
    started = time.monotonic()
    with (run_dir.parent / f"{mode}.out").open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=args.timeout_s)
    wall = time.monotonic() - started
    print(f"[{mode}] rc {done.returncode} in {wall:.0f} s", file=sys.stderr, flush=True)
    if done.returncode != 0:
        raise SystemExit(f"[{mode}] gyre.train exited {done.returncode}: see {run_dir.parent / (mode + '.out')}")
    return {"rc": done.returncode, "process_wall_s": wall}


# -- what a run directory says ----------------------------------------------------------------------------------
def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def transitions_by_kind(records: list) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("training", "rollout"):
        moves = [t for r in records for t in r.transitions if t.to == kind]
        phases = sorted({name for t in moves for name in t.phases})
        out[f"to_{kind}"] = {
            "count": len(moves),
            "median_s": _median([t.duration_s for t in moves]),
            "max_s": max((t.duration_s for t in moves), default=None),
            "phases_median_s": {name: _median([t.phases[name] for t in moves if name in t.phases]) for name in phases},
        }
    return out


def core_training_s(trace: dict) -> float:
    """Seconds the core cell (lane 0) spent in the training role: in colocate, when every cell trains."""
    core = trace["lanes"][0]
    return sum(end - start for lane, start, end, state in trace["segments"] if lane == core and state == "training")


def measure(run_dir: Path, cell_capacity: int) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [record_from_dict(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trace = json.loads((run_dir / "timeline.json").read_text())
    training_s = core_training_s(trace)
    audit = audit_run(run_dir)
    proxy = audit["proxy"] or {}
    groups = sum(r.staleness_groups for r in records)
    steps = summary["step_times_s"]
    total = summary["total_time_s"]
    moved, migrated = proxy.get("rerouted", 0), proxy.get("kv_migrated", 0)
    return {
        "total_time_s": total,
        "step_times_s": steps,
        "core_training_s": training_s,
        "core_training_share": training_s / total if total else None,
        "train_tokens_per_step": _median([r.train_tokens for r in records]),
        "reward_mean": statistics.mean(r.reward_mean for r in records) if records else None,
        "cumulative_s": [r.wall_time_s for r in records],
        "utilization": summary["utilization"],
        "staleness": {k: summary["staleness"][k] for k in ("group_mean", "token_mean", "max", "warmup_steps")},
        "transitions": transitions_by_kind(records),
        "publications": {
            "count": len(trace["publications"]),
            "median_s": _median([p["duration_s"] for p in trace["publications"]]),
            "phases_median_s": {
                name: _median([p["phases"][name] for p in trace["publications"]])
                for name in ("weights", "policy_dir", "engines")
            }
            if trace["publications"]
            else {},
        },
        "weight_pulls": {
            "count": sum(len(r.weight_pulls_s) for r in records),
            "median_s": _median([s for r in records for s in r.weight_pulls_s]),
        },
        "joins_in_flight": sum(len(r.joined_cells) for r in records),
        "training_cells_per_step": [r.training_cells for r in records],
        "costs": {
            "group_train_s": sum(r.train_compute_s for r in records) / groups if groups else None,
            "update_s": _median([r.update_s for r in records if r.update_s is not None]),
        },
        "reroutes": summary["reroutes"],
        "calls_moved": {
            "moved": moved,
            "kv_migrated": migrated,
            "recomputed": moved - migrated,
            "continued_fraction": migrated / moved if moved else None,
        },
        "outcomes": summary["outcomes"],
        "role_time_s": summary.get("role_time_s"),  # each lane's seconds by role; the pool's: rollout only
        "pool": summary.get("pool")
        and {
            **summary["pool"],
            "executions": sum(x.engine == "pool" for x in read_executions(run_dir / "executions.jsonl")),
        },
        "audit": {
            k: audit[k]
            for k in ("executions", "ends", "retries", "api_errors", "calls_recorded", "duplicate_request_ids")
        }
        | {"proxy": proxy},
        "calls_recorded_once": audit["calls_recorded"] == proxy.get("recorded") and audit["duplicate_request_ids"] == 0,
        "harness_visible_errors": audit["retries"] + audit["api_errors"] + proxy.get("failed", 0),
        "cell_capacity": cell_capacity,
    }


# -- the simulator on the same config -----------------------------------------------------------------------------
def replay_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Every execution of the run as (query, duration_s, outcome), in dispatch order. An execution the run's end
    cut short is completed from its drawn plan (its task's `.work.json`, its name) and the run's median time
    outside the check command (harness start, model calls), so the replay holds what it would have taken."""
    lines = read_executions(run_dir / "executions.jsonl")
    tasks = run_dir / "tasks" / "train"
    works = {task: json.loads((tasks / task / "workspace" / WORK_FILE).read_text()) for task in {x.task for x in lines}}
    overheads = [
        (x.harness_end_s - x.start_s) - plan_work(works[x.task], x.execution).work_s
        for x in lines
        if x.outcome == "completed"
    ]
    overhead = statistics.median(overheads) if overheads else 0.0
    rows = []
    for x in sorted(lines, key=lambda x: x.execution):
        if x.outcome is not None:
            duration, outcome = x.end_s - x.start_s, x.outcome
        else:
            work, plan = works[x.task], plan_work(works[x.task], x.execution)
            duration, outcome = budgeted_duration(
                overhead + plan.work_s,
                plan.eval_s,
                0.0 if plan.outcome == "overall_timeout" else 1.0,
                harness_s=work["harness_timeout_s"],
                overall_s=work["overall_timeout_s"],
                overall_share=work["overall_timeout_share"],
            )
        rows.append({"query": f"g{x.group:06d}", "duration_s": round(duration, 4), "outcome": outcome})
    return rows


def simulate_mode(args: argparse.Namespace, mode: str, real: dict[str, Any], csv_path: Path, pooled: dict) -> dict:
    t = real["transitions"]
    costs = {
        "to_training_s": t["to_training"]["median_s"] or pooled["to_training_s"],
        "to_rollout_s": t["to_rollout"]["median_s"] or pooled["to_rollout_s"],
        "group_train_node_s": real["costs"]["group_train_s"],
        "update_s": real["costs"]["update_s"],
        "publish_s": real["publications"]["median_s"] or pooled["publish_s"],
        "join_s": real["weight_pulls"]["median_s"] or 0.0,
    }
    overrides = [
        *[o for o in MODES[mode] if o.startswith("algo")],
        "cluster=tiny",
        "cluster.num_cells=4",
        "cluster.cell_size=1",
        f"cluster.cell_capacity={args.cell_capacity}",
        *pool_overrides(args),
        "cluster.microsteps_per_group=1",
        *[f"cluster.{k}={v:.6g}" for k, v in costs.items()],
        "workload=replay",
        f"workload.replay_csv={csv_path}",
        "workload.replay_order=sequence",
        f"algo.group_size={args.group_size}",
        f"algo.batch_groups={args.batch_groups}",
        f"algo.tau_s={args.tau_s}",
        f"steps={args.steps}",
        f"seed={args.seed}",
        "timeline=false",
    ]
    summary, _ = simulate(compose_sim_config(overrides))
    return {
        "total_time_s": summary["total_time_s"],
        "step_times_s": summary["step_times_s"],
        "utilization": summary["utilization"],
        "staleness": {k: summary["staleness"][k] for k in ("group_mean", "token_mean", "max")},
        "costs": costs,
        "overrides": overrides,
    }


def layouts(args: argparse.Namespace, costs: dict, csv_path: Path, seeds: int = 3) -> list[dict]:
    """The simulator, with the elastic run's costs and durations (sampled), over the layouts this machine can run:
    C_e in {2, 4, 6, 8}, N in {2, 4, 8}, B in {2, 4} (8-32 concurrent executions). The training cost scales with N
    (measured per group of `--group-size`)."""
    rows = []
    per_execution = costs["group_train_node_s"] / args.group_size
    for capacity, size, batch in itertools.product((2, 4, 6, 8), (2, 4, 8), (2, 4)):
        if 2 * capacity < size:  # async's two rollout cells must hold a group
            continue
        totals = {}
        for mode in MODES:
            overrides = [
                *[o for o in MODES[mode] if o.startswith("algo")],
                "cluster=tiny",
                "cluster.num_cells=4",
                "cluster.cell_size=1",
                f"cluster.cell_capacity={capacity}",
                *pool_overrides(args),
                "cluster.microsteps_per_group=1",
                *[f"cluster.{k}={v:.6g}" for k, v in costs.items() if k != "group_train_node_s"],
                f"cluster.group_train_node_s={per_execution * size:.6g}",
                "workload=replay",
                f"workload.replay_csv={csv_path}",
                f"algo.group_size={size}",
                f"algo.batch_groups={batch}",
                f"algo.tau_s={args.tau_s}",
                f"steps={args.steps}",
                "timeline=false",
            ]
            totals[mode] = statistics.mean(
                simulate(compose_sim_config([*overrides, f"seed={seed}"]))[0]["total_time_s"] for seed in range(seeds)
            )
        rows.append(
            {
                "cell_capacity": capacity,
                "group_size": size,
                "batch_groups": batch,
                "total_time_s": totals,
                "elastic_vs_colocate": totals["colocate"] / totals["elastic"],
                "elastic_vs_async": totals["async"] / totals["elastic"],
            }
        )
    return rows


# -- the picture ---------------------------------------------------------------------------------------------------
def panel(mode: str, run_dir: Path, cell_capacity: int, total: float):
    """A mode's lanes, with rollout shaded by the share of the cell's slots running an execution."""
    trace = json.loads((run_dir / "timeline.json").read_text())
    segments = []
    for lane, start, end, state in trace["segments"]:
        if state != "rollout":
            segments.append(Segment(lane, start, end, state))
            continue
        loads = trace["loads"][trace["lanes"].index(lane)]
        points = [(t, n) for t, n in loads if start < t < end]
        before = [n for t, n in loads if t <= start]
        edges = [(start, before[-1] if before else 0), *points, (end, 0)]
        for (a, n), (b, _) in itertools.pairwise(edges):
            if b > a:
                segments.append(Segment(lane, a, b, "rollout", occupancy=min(1.0, n / cell_capacity)))
    return (f"{mode}: {total / 60:.1f} min", segments, trace["lanes"], trace["step_ends_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cell-capacity", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--batch-groups", type=int, default=2)
    parser.add_argument("--tau-s", type=float, default=0.5)
    parser.add_argument(
        "--context-words", type=int, default=0, help="tasks.demo.context_words of the three modes' runs (long rows)"
    )
    parser.add_argument("--separate-size", type=int, default=0, help="ranks of a separate rollout pool (0: none)")
    parser.add_argument(
        "--separate-capacity",
        type=int,
        default=0,
        help="C_s of the separate rollout pool (0: C_e, the program's default)",
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--migration-steps", type=int, default=8, help="steps of the plain-demo run (0: none)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/gyre-e2e"))
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--reuse", action="store_true", help="measure the runs already in --work-dir")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/e2e_modes.json"))
    parser.add_argument("--png", type=Path, default=Path("benchmarks/results/e2e_modes.png"))
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; expected among {sorted(MODES)}")
    args.work_dir.mkdir(parents=True, exist_ok=True)

    runs: dict[str, Any] = {}
    for mode in modes:
        run_dir = args.work_dir / mode
        process = run_mode(args, mode, run_dir)
        runs[mode] = {
            "process": process,
            "overrides": run_overrides(args, mode),
            **measure(run_dir, args.cell_capacity),
        }

    migration = None
    if args.migration_steps > 0:
        run_dir = args.work_dir / "migration"
        overrides = [*MIGRATION_OVERRIDES, f"steps={args.migration_steps}", f"seed={args.seed}"]
        process = run_mode(args, "migration", run_dir, overrides)
        measured = measure(run_dir, 8)
        migration = {
            "process": process,
            "overrides": overrides,
            "total_time_s": measured["total_time_s"],
            "joins_in_flight": measured["joins_in_flight"],
            "reroutes": measured["reroutes"],
            "calls_moved": measured["calls_moved"],
            "audit": measured["audit"],
            "calls_recorded_once": measured["calls_recorded_once"],
            "harness_visible_errors": measured["harness_visible_errors"],
        }
        moved = migration["calls_moved"]
        print(f"[migration] calls moved {moved['moved']}, with their KV {moved['kv_migrated']}", file=sys.stderr)

    seen = [runs[m]["transitions"] for m in modes]
    pooled = {
        "to_training_s": _median([t["to_training"]["median_s"] for t in seen if t["to_training"]["median_s"]]) or 0.0,
        "to_rollout_s": _median([t["to_rollout"]["median_s"] for t in seen if t["to_rollout"]["median_s"]]) or 0.0,
        "publish_s": _median(
            [runs[m]["publications"]["median_s"] for m in modes if runs[m]["publications"]["median_s"]]
        )
        or 0.0,
    }
    for mode in modes:
        rows = replay_rows(args.work_dir / mode)
        csv_path = args.work_dir / f"{mode}-durations.csv"
        with csv_path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["query", "duration_s", "outcome"])
            writer.writeheader()
            writer.writerows(rows)
        runs[mode]["durations"] = {
            "executions": len(rows),
            "mean_s": statistics.mean(r["duration_s"] for r in rows),
            "median_s": statistics.median(r["duration_s"] for r in rows),
            "max_s": max(r["duration_s"] for r in rows),
            "outcomes": dict(Counter(r["outcome"] for r in rows)),
        }
        sim = simulate_mode(args, mode, runs[mode], csv_path, pooled)
        runs[mode]["simulated"] = sim
        runs[mode]["sim_error"] = sim["total_time_s"] / runs[mode]["total_time_s"] - 1

    ratios: dict[str, Any] = {}
    if "elastic" in runs:
        for base in (m for m in modes if m != "elastic"):
            measured = runs[base]["total_time_s"] / runs["elastic"]["total_time_s"]
            predicted = runs[base]["simulated"]["total_time_s"] / runs["elastic"]["simulated"]["total_time_s"]
            ratios[f"elastic_vs_{base}"] = {"measured": measured, "simulated": predicted}
            runs[base]["cumulative_speedup_of_elastic"] = [
                b / e for e, b in zip(runs["elastic"]["cumulative_s"], runs[base]["cumulative_s"], strict=False)
            ]
    grid = []
    if "elastic" in runs and set(MODES) <= set(modes):
        grid = layouts(args, runs["elastic"]["simulated"]["costs"], args.work_dir / "elastic-durations.csv")
        best = max(grid, key=lambda r: r["elastic_vs_colocate"])
        print(
            f"layouts (simulated, {len(grid)}): elastic vs colocate "
            f"{min(r['elastic_vs_colocate'] for r in grid):.2f}-{best['elastic_vs_colocate']:.2f}x (best at C_e "
            f"{best['cell_capacity']}, N {best['group_size']}, B {best['batch_groups']}), vs async "
            f"{min(r['elastic_vs_async'] for r in grid):.2f}-{max(r['elastic_vs_async'] for r in grid):.2f}x"
        )
    order_measured = sorted(modes, key=lambda m: runs[m]["total_time_s"])
    order_simulated = sorted(modes, key=lambda m: runs[m]["simulated"]["total_time_s"])

    print(f"{'mode':<9} {'measured':>9} {'simulated':>10} {'error':>7}  util r/t/i         staleness g/t/max")
    for mode in modes:
        r = runs[mode]
        u, s = r["utilization"], r["staleness"]
        print(
            f"{mode:<9} {r['total_time_s']:>8.1f}s {r['simulated']['total_time_s']:>9.1f}s {r['sim_error']:>+7.1%}  "
            f"{u['rollout']:.2f}/{u['training']:.2f}/{u['idle']:.2f}    {s['group_mean']}/{s['token_mean']}/{s['max']}"
            f"  core training {r['core_training_share']:.1%} of the wall, joins in flight {r['joins_in_flight']}"
        )
    for name, ratio in ratios.items():
        print(f"{name}: measured {ratio['measured']:.3f}x, simulated {ratio['simulated']:.3f}x")
    print(f"order: measured {order_measured}, simulated {order_simulated}")

    if args.png:
        panels = [panel(m, args.work_dir / m, args.cell_capacity, runs[m]["total_time_s"]) for m in modes]
        pool = f" + pool of {args.separate_size}" if args.separate_size else ""
        title = (
            f"gyre.train, {args.steps} steps, 4 cells x C_e {args.cell_capacity}{pool}, N {args.group_size}, B "
            f"{args.batch_groups}, slow executions (NL2Repo shape / 400)"
        )
        write_stacked_timelines(args.png, panels, title=title)
    result = {
        "benchmark": "e2e_modes",
        "layout": {
            "num_cells": 4,
            "cell_size": 1,
            "cell_capacity": args.cell_capacity,
            "separate_size": args.separate_size,
            "separate_capacity": (args.separate_capacity or args.cell_capacity) if args.separate_size else 0,
        },
        "steps": args.steps,
        "seed": args.seed,
        "group_size": args.group_size,
        "batch_groups": args.batch_groups,
        "tau_s": args.tau_s,
        "context_words": args.context_words,
        "runs": runs,
        "migration_run": migration,
        "layouts_simulated": grid,
        "ratios": ratios,
        "order": {"measured": order_measured, "simulated": order_simulated, "same": order_measured == order_simulated},
        "checks": {
            "elastic_speedup_target": TARGET_SPEEDUP,
            "elastic_meets_target": all(r["measured"] >= TARGET_SPEEDUP for r in ratios.values()),
            "sim_within_tolerance": all(abs(runs[m]["sim_error"]) <= SIM_TOLERANCE for m in modes),
            "harness_visible_errors": sum(runs[m]["harness_visible_errors"] for m in modes)
            + (migration["harness_visible_errors"] if migration else 0),
            "calls_recorded_once": all(runs[m]["calls_recorded_once"] for m in modes)
            and (migration is None or migration["calls_recorded_once"]),
            "calls_moved": sum(runs[m]["calls_moved"]["moved"] for m in modes)
            + (migration["calls_moved"]["moved"] if migration else 0),
            "calls_moved_with_kv": sum(runs[m]["calls_moved"]["kv_migrated"] for m in modes)
            + (migration["calls_moved"]["kv_migrated"] if migration else 0),
            "colocate_training_share": runs["colocate"]["core_training_share"] if "colocate" in runs else None,
            "colocate_training_share_at_least": TRAINING_SHARE_TARGET,
            "elastic_joins_in_flight": runs["elastic"]["joins_in_flight"] if "elastic" in runs else None,
        },
        "png": str(args.png) if args.png else None,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
