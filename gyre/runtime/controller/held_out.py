"""The periodic greedy evaluation on held-out problems: the learning curve a run is judged by (docs/runtime.md,
"Tasks and the held-out evaluation").

`HeldOutEvaluator.evaluate(policy, version=, wall_time_s=)` takes the policy now (a copy of a `DecoderLM`'s
weights, or a checkpoint directory to load) and returns an awaitable that plays every held-out problem greedily
(temperature 0) on a worker thread with the recipe's player (`gyre.runtime.recipe.HeldOutSet.play`; the demo
recipe's is the evaluation its warm start reports, so the curve's first point is the warm start's pass rate), then
appends one line to `<run dir>/held_out.jsonl` and prints one console line. Evaluations run one at a time, in the
order asked.

A line: `{"version": v, "wall_time_s": t, "pass_rate": p, "tool_call_rate": q, "episodes": n, "seconds": s}`
(`tool_call_rate` from the demo's player; a held-out task directory's has `mean_score` and `failed` instead),
`version` the policy version (0: the starting policy; v: after v optimizer steps), flushed and fsynced.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from gyre.runtime.recipe import HeldOutSet

__all__ = ["HELD_OUT_FILE", "HeldOutEvaluator"]

HELD_OUT_FILE = "held_out.jsonl"
OPTIONAL_KEYS = ("mean_score", "tool_call_rate", "failed")  # a player's report may hold them: kept in the line


class HeldOutEvaluator:
    """Greedy pass rate of policies on a recipe's held-out set, one JSON line each in `out_path`."""

    def __init__(self, held_out: HeldOutSet, template, *, out_path: Path, echo: Callable[[str], None] = print) -> None:
        if held_out.size < 1:
            raise ValueError("HeldOutEvaluator needs at least one held-out problem")
        self.held_out, self.template, self.out_path, self.echo = held_out, template, Path(out_path), echo
        self.results: list[dict] = []
        self._lock = asyncio.Lock()

    def evaluate(self, policy, *, version: int, wall_time_s: float) -> Awaitable[dict]:
        """Snapshot `policy` (a model, copied now; or a checkpoint directory) and evaluate it (module docstring)."""
        snapshot = policy if isinstance(policy, (str, Path)) else copy.deepcopy(policy).to("cpu").eval()
        return self._run(snapshot, version, wall_time_s)

    async def _run(self, policy, version: int, wall_time_s: float) -> dict:
        async with self._lock:
            started = time.monotonic()
            report = await asyncio.to_thread(self._play, policy, version)
            line = {
                "version": version,
                "wall_time_s": round(wall_time_s, 3),
                "pass_rate": report["success_rate"],
                **{key: report[key] for key in OPTIONAL_KEYS if key in report},
                "episodes": report["episodes"],
                "seconds": round(time.monotonic() - started, 3),
            }
            with open(self.out_path, "a", encoding="utf-8") as out:
                out.write(json.dumps(line) + "\n")
                out.flush()
                os.fsync(out.fileno())
            self.results.append(line)
            said = [f"{line['episodes']} problems", f"{line['seconds']:.1f}s"]
            if "tool_call_rate" in line:
                said.insert(0, f"tool calls {100 * line['tool_call_rate']:.1f}%")
            if "mean_score" in line:
                said.insert(0, f"mean score {line['mean_score']:.2f}")
            if line.get("failed"):
                said.insert(0, f"{line['failed']} without a valid score")
            self.echo(f"held-out: policy version {version}: pass {100 * line['pass_rate']:.1f}% ({', '.join(said)})")
            return line

    def _play(self, policy, version: int) -> dict:
        if isinstance(policy, (str, Path)):
            from gyre.models.hf_weights import load_pretrained

            policy = load_pretrained(policy)
        return self.held_out.play(policy, self.template, version=version)
