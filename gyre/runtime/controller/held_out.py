"""The periodic greedy evaluation on held-out problems: the learning curve a run is judged by (docs/runtime.md,
"Tasks and the held-out evaluation").

Two evaluators write one curve, `<run dir>/held_out.jsonl` (`HeldOutLog`):
- `HeldOutEvaluator` (a recipe's own held-out set with a player, `gyre.runtime.recipe.HeldOutSet.play`: the demo
  recipe's, whose player is the evaluation its warm start reports, so the curve's first point is the warm start's
  pass rate). `evaluate(policy, version=, wall_time_s=)` takes the policy now (a copy of a `DecoderLM`'s weights,
  or a checkpoint directory to load) and returns an awaitable that plays every held-out problem greedily
  (temperature 0) on a worker thread, in process; evaluations run one at a time, in the order asked.
- `gyre.runtime.controller.held_out_engines.PinnedEvaluation` (a `tasks.held_out_dir`): played through the harness
  by the run's rollout engines, pinned to one policy version.

A line: `{"version": v, "wall_time_s": t, "pass_rate": p, "tool_call_rate": q, "episodes": n, "seconds": s}`
(`tool_call_rate` from the demo's player; a held-out task directory's has `mean_score` and `failed` instead, and
`"engines": true`: played by the rollout engines), `version` the policy version (0: the starting policy; v: after v
optimizer steps), flushed and fsynced; one console line each.
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

__all__ = ["HELD_OUT_FILE", "HeldOutEvaluator", "HeldOutLog"]

HELD_OUT_FILE = "held_out.jsonl"
OPTIONAL_KEYS = ("mean_score", "tool_call_rate", "failed")  # a player's report may hold them: kept in the line


class HeldOutLog:
    """The curve: one line per evaluation in `out_path` (module docstring), one console line each, and the lines so
    far in `results` (a resumed run's kept lines first)."""

    def __init__(self, out_path: Path, *, echo: Callable[[str], None] = print, results: list[dict] | None = None):
        self.out_path, self.echo = Path(out_path), echo
        self.results: list[dict] = list(results or [])

    def append(self, report: dict, *, version: int, wall_time_s: float, seconds: float, engines: bool) -> dict:
        """Write the line of a player's `report` (`episodes`, `success_rate`, the `OPTIONAL_KEYS` it has) and say it."""
        line = {
            "version": version,
            "wall_time_s": round(wall_time_s, 3),
            "pass_rate": report["success_rate"],
            **{key: report[key] for key in OPTIONAL_KEYS if key in report},
            "episodes": report["episodes"],
            "seconds": round(seconds, 3),
        }
        if engines:
            line["engines"] = True
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
        where = " on the rollout engines" if engines else ""
        self.echo(f"held-out: policy version {version}{where}: pass {100 * line['pass_rate']:.1f}% ({', '.join(said)})")
        return line


class HeldOutEvaluator:
    """Greedy pass rate of policies on a recipe's held-out set with its player, in process (module docstring)."""

    def __init__(self, held_out: HeldOutSet, template, *, out: HeldOutLog) -> None:
        if held_out.size < 1:
            raise ValueError("HeldOutEvaluator needs at least one held-out problem")
        if held_out.play is None:
            raise ValueError("HeldOutEvaluator needs a held-out set with a player (a recipe's own held-out set)")
        self.held_out, self.template, self.out = held_out, template, out
        self._lock = asyncio.Lock()

    @property
    def results(self) -> list[dict]:
        return self.out.results

    def evaluate(self, policy, *, version: int, wall_time_s: float) -> Awaitable[dict]:
        """Snapshot `policy` (a model, copied now; or a checkpoint directory) and evaluate it (module docstring)."""
        snapshot = policy if isinstance(policy, (str, Path)) else copy.deepcopy(policy).to("cpu").eval()
        return self._run(snapshot, version, wall_time_s)

    async def _run(self, policy, version: int, wall_time_s: float) -> dict:
        async with self._lock:
            started = time.monotonic()
            report = await asyncio.to_thread(self._play, policy, version)
            seconds = time.monotonic() - started
            return self.out.append(report, version=version, wall_time_s=wall_time_s, seconds=seconds, engines=False)

    def _play(self, policy, version: int) -> dict:
        if isinstance(policy, (str, Path)):
            from gyre.models.hf_weights import load_pretrained

            policy = load_pretrained(policy)
        return self.held_out.play(policy, self.template, version=version)
