"""The periodic greedy evaluation on held-out problems: the learning curve a run is judged by (docs/runtime.md,
"Tasks and the held-out evaluation").

`HeldOutEvaluator.evaluate(policy, version=, wall_time_s=)` takes the policy now (a copy of a `DecoderLM`'s
weights, or a checkpoint directory to load) and returns an awaitable that plays every held-out problem greedily
(temperature 0) with its own native engine on a worker thread (`gyre.tasks.demo.warm_start.evaluate_greedy_model`,
the evaluation the warm start reports, so the curve's first point is the warm start's pass rate), then appends one
line to `<run dir>/held_out.jsonl` and prints one console line. Evaluations run one at a time, in the order asked.

A line: `{"version": v, "wall_time_s": t, "pass_rate": p, "tool_call_rate": q, "episodes": n, "seconds": s}`,
`version` the policy version (0: the starting policy; v: after v optimizer steps), flushed and fsynced.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from gyre.tasks.demo import DEMO_MAX_TURNS, DemoProblem

__all__ = ["HELD_OUT_FILE", "HeldOutEvaluator"]

HELD_OUT_FILE = "held_out.jsonl"
MAX_NEW_TOKENS = 64  # as the warm start's report (evaluate_greedy's defaults): the curve starts at its figure
MAX_CALLS = DEMO_MAX_TURNS  # as the builtin harness plays a demo task (its metadata.max_turns)


class HeldOutEvaluator:
    """Greedy pass rate of policies on `problems`, one JSON line each in `out_path`."""

    def __init__(
        self,
        problems: Sequence[DemoProblem],
        template,
        *,
        out_path: Path,
        max_running: int = 32,
        echo: Callable[[str], None] = print,
    ) -> None:
        if not problems:
            raise ValueError("HeldOutEvaluator needs at least one held-out problem")
        self.problems, self.template, self.out_path = list(problems), template, Path(out_path)
        self.max_running, self.echo = max_running, echo
        self.results: list[dict] = []
        self._lock = asyncio.Lock()

    def evaluate(self, policy, *, version: int, wall_time_s: float) -> Awaitable[dict]:
        """Snapshot `policy` (a model, copied now; or a checkpoint directory) and evaluate it (module docstring)."""
        snapshot = policy if isinstance(policy, (str, Path)) else copy.deepcopy(policy).to("cpu").eval()
        return self._run(snapshot, version, wall_time_s)

    async def _run(self, policy, version: int, wall_time_s: float) -> dict:
        async with self._lock:
            started = time.monotonic()
            report = await asyncio.to_thread(self._play, policy)
            line = {
                "version": version,
                "wall_time_s": round(wall_time_s, 3),
                "pass_rate": report["success_rate"],
                "tool_call_rate": report["tool_call_rate"],
                "episodes": report["episodes"],
                "seconds": round(time.monotonic() - started, 3),
            }
            with open(self.out_path, "a", encoding="utf-8") as out:
                out.write(json.dumps(line) + "\n")
                out.flush()
                os.fsync(out.fileno())
            self.results.append(line)
            self.echo(
                f"held-out: policy version {version}: pass {100 * line['pass_rate']:.1f}% "
                f"(tool calls {100 * line['tool_call_rate']:.1f}%, {line['episodes']} problems, {line['seconds']:.1f}s)"
            )
            return line

    def _play(self, policy) -> dict:
        from gyre.tasks.demo.warm_start import evaluate_greedy_model

        if isinstance(policy, (str, Path)):
            from gyre.models.hf_weights import load_pretrained

            policy = load_pretrained(policy)
        return evaluate_greedy_model(
            policy,
            self.template,
            self.problems,
            max_new_tokens=MAX_NEW_TOKENS,
            max_calls=MAX_CALLS,
            max_running=self.max_running,
        )
