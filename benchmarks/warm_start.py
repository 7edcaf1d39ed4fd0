"""Warm start of the tiny default model: greedy success on held-out demo problems before and after, and its cost.

Trains `gyre.tasks.demo.warm_start` (default settings unless overridden) into a temporary directory with one torch
thread, then plays held-out problems (a different seed) greedily as harness + proxy would. Target: greedy success
in 20-60% (RL needs room above it, and a start it can find the tool from) after <= 5 CPU minutes of training.
Prints one JSON object (last line).

    python benchmarks/warm_start.py [--quick] [--out benchmarks/results/warm_start.json]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from report import emit

from gyre.config import WarmStartConfig
from gyre.models.tiny import tiny_model_dir
from gyre.tasks.demo import make_demo_problems
from gyre.tasks.demo.warm_start import evaluate_greedy, uses_tool_operator, warm_start

TARGET_LOW, TARGET_HIGH, TARGET_CPU_S = 0.20, 0.60, 300.0
HELD_OUT_SEED_OFFSET = 1_000_003  # held-out problems never share a seed with the demonstrations


def by_class(results, problems, operators: str) -> dict:
    classes: dict = {}
    for result, problem in zip(results, problems, strict=True):
        name = "tool_operator" if uses_tool_operator(problem, operators) else "other"
        entry = classes.setdefault(name, {"episodes": 0, "success": 0, "called_tool": 0})
        entry["episodes"] += 1
        entry["success"] += result.success
        entry["called_tool"] += result.called_tool
    for entry in classes.values():
        entry["success_rate"] = round(entry["success"] / entry["episodes"], 4)
        entry["tool_call_rate"] = round(entry["called_tool"] / entry["episodes"], 4)
    return classes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="20 steps, 32 held-out problems (a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: shared machines)")
    parser.add_argument("--eval-problems", type=int, default=300)
    parser.add_argument("--tool-fraction", type=float)
    parser.add_argument("--tool-operators")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--lr", type=float)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)

    config = WarmStartConfig()
    overrides = {
        "tool_fraction": args.tool_fraction,
        "tool_operators": args.tool_operators,
        "steps": args.steps,
        "lr": args.lr,
    }
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    eval_n = args.eval_problems
    if args.quick:
        config = replace(config, steps=20, warmup_steps=2, num_demos=512)
        eval_n = 32
    held_out = make_demo_problems(eval_n, args.seed + HELD_OUT_SEED_OFFSET, config.demo)

    base = tiny_model_dir()
    before = evaluate_greedy(base, held_out)
    with tempfile.TemporaryDirectory(prefix="gyre-warm-start-") as tmp:
        wall = time.perf_counter()
        cpu = time.process_time()
        out, meta = warm_start(Path(tmp) / "model", config, args.seed)
        build_cpu_s, build_wall_s = time.process_time() - cpu, time.perf_counter() - wall
        eval_wall = time.perf_counter()
        after = evaluate_greedy(out, held_out)
        eval_wall_s = time.perf_counter() - eval_wall
        sampled = evaluate_greedy(out, held_out, temperature=1.0, seed=args.seed)
    samples = [
        {"problem": r.problem_id, "success": r.success, "tool": r.called_tool, "answer": r.final_text[:40]}
        for r in after["results"][:8]
    ]
    success = after["success_rate"]
    emit(
        {
            "benchmark": "warm_start",
            "quick": args.quick,
            "seed": args.seed,
            "torch_threads": args.threads,
            "settings": config.key_fields(),
            "max_minutes": config.max_minutes,
            "held_out": {"problems": eval_n, "seed": args.seed + HELD_OUT_SEED_OFFSET},
            "before": {k: v for k, v in before.items() if k != "results"},
            "after": {k: v for k, v in after.items() if k != "results"},
            # Greedy and temperature-1 (RL's rollouts) rates on problems the demonstrations always solved with the
            # tool (`tool_operators`) and on the others (demonstrated with the tool `tool_fraction` of the time).
            "after_by_class": by_class(after["results"], held_out, config.tool_operators),
            "after_sampled_t1": {k: v for k, v in sampled.items() if k != "results"},
            "after_sampled_t1_by_class": by_class(sampled["results"], held_out, config.tool_operators),
            "train": {k: meta[k] for k in ("steps_done", "complete", "first_loss", "final_loss", "train_seconds")},
            "train_cpu_seconds": meta["train_cpu_seconds"],
            "build_cpu_seconds": round(build_cpu_s, 2),  # rendering the demonstrations + training + saving
            "build_wall_seconds": round(build_wall_s, 2),
            "eval_wall_seconds": round(eval_wall_s, 2),
            "samples_after": samples,
            "target": {"success_range": [TARGET_LOW, TARGET_HIGH], "max_cpu_seconds": TARGET_CPU_S},
            "target_met": TARGET_LOW <= success <= TARGET_HIGH and build_cpu_s <= TARGET_CPU_S,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
