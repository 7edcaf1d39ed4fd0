"""The bundled demo task family: integer arithmetic a tiny model solves by calling a calculator tool.

docs/warm-start.md ("The prototype"): a ~2M-parameter model guesses products of
4-digit numbers badly and learns, under RL, to hand them to a tool. Each task asks "What is 4275 * 3662?";
the builtin harness offers the `calculator` tool (`metadata.tools` is its `--tools` file, `metadata.tools_impl`
its `--tools-impl`) and the final assistant message must end up in `answer.txt` in the workspace
(`metadata.final_answer_file`); the hidden check (`gyre.tasks.demo.check:score_answer`, inline python
evaluator) compares the last integer there with `hidden/expected.json`. A perfect episode:

    user:       What is 4275 * 3662?
    assistant:  <tool_call>{"name": "calculator", "arguments": {"expression": "4275 * 3662"}}</tool_call>
    tool:       15655050
    assistant:  15655050

`make_demo_problems(n, seed, config)` is pure and deterministic; `generate_demo_tasks(n, seed, out_dir)`
writes task directories (task.toml, empty workspace/, hidden/expected.json) and loads them back. With
`config.work.enabled` the executions are slow (`gyre.tasks.demo.work`, docs/tasks.md "Slow executions").
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gyre.config.demo import DEMO_OPERATORS, DemoConfig
from gyre.tasks.demo.calculator import CALCULATOR_TOOL, CALCULATOR_TOOL_SPEC, calculator, evaluate_expression
from gyre.tasks.demo.check import EXPECTED_FILE
from gyre.tasks.demo.work import CHECK_COMMAND, WORK_FILE, task_work
from gyre.tasks.spec import TASK_FILE, Task, load_task, write_task_toml

__all__ = [
    "CALCULATOR_TOOL",
    "CALCULATOR_TOOL_SPEC",
    "DemoProblem",
    "calculator",
    "demo_episode",
    "generate_demo_tasks",
    "make_demo_problems",
    "reference_notes",
]

EVALUATOR = "gyre.tasks.demo.work:score_after_evaluation"  # the slow executions' evaluator
SYSTEM_PROMPT = "You are a careful assistant. Use the calculator for arithmetic."  # as in the tiny model's corpus
DEMO_MAX_TURNS = 3  # model calls of a demo episode at most (metadata.max_turns)


@dataclass(frozen=True, kw_only=True)
class DemoProblem:
    id: str
    expression: str  # e.g. "4275 * 3662"
    answer: int
    prompt: str


def _operand(rng: random.Random, config: DemoConfig) -> int:
    digits = rng.randint(config.min_digits, config.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def make_demo_problems(n: int, seed: int, config: DemoConfig | None = None) -> list[DemoProblem]:
    """`n` problems, the same for the same (n, seed, config) on any machine (`random.Random(seed)`)."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n: expected an int >= 0, got {n!r}")
    config = config or DemoConfig()
    rng = random.Random(seed)
    problems = []
    for i in range(n):
        numbers = [str(_operand(rng, config)) for _ in range(config.num_operands)]
        ops = [rng.choice(config.operators) for _ in range(config.num_operands - 1)]
        if config.parentheses and config.num_operands >= 3 and rng.random() < 0.5:
            numbers[0] = f"({numbers[0]} {ops[0]} {numbers.pop(1)})"
            ops.pop(0)
        expression = numbers[0] + "".join(f" {op} {x}" for op, x in zip(ops, numbers[1:], strict=True))
        answer = evaluate_expression(expression)
        assert isinstance(answer, int), expression  # +, -, * on ints
        problems.append(
            DemoProblem(
                id=f"{config.id_prefix}-{seed}-{i:05d}",
                expression=expression,
                answer=answer,
                prompt=config.prompt_template.format(expression=expression),
            )
        )
    return problems


def reference_notes(task_id: str, words: int) -> str:
    """`words` whitespace-separated words of arithmetic facts ("Notes: 412 * 7 = 2884. ..."), the same for the same
    task id on any machine (`random.Random(task_id)`): what `DemoConfig.context_words` puts after the system
    prompt. The facts are true, and none is the task's own problem but by chance."""
    if words <= 0:
        return ""
    rng = random.Random(task_id)
    out = ["Notes:"]
    while len(out) < words:
        a, op, b = rng.randint(0, 999), rng.choice(DEMO_OPERATORS), rng.randint(0, 999)
        out += [str(a), op, str(b), "=", f"{evaluate_expression(f'{a} {op} {b}')}."]
    return " ".join(out[:words])


def system_prompt(problem: DemoProblem, config: DemoConfig) -> str:
    """The demo's system prompt, followed by the task's reference notes when `config.context_words` > 0."""
    notes = reference_notes(problem.id, config.context_words)
    return f"{SYSTEM_PROMPT}\n\n{notes}" if notes else SYSTEM_PROMPT


def _metadata(problem: DemoProblem, config: DemoConfig) -> dict[str, Any]:
    return {
        "family": "demo.arithmetic",
        "expression": problem.expression,  # also in the prompt; the answer is only in hidden/
        "system_prompt": system_prompt(problem, config),
        # The builtin harness's task tools: json.dump(tools) is its --tools file, tools_impl its --tools-impl.
        "tools": [CALCULATOR_TOOL_SPEC],
        "tools_impl": "gyre.tasks.demo.calculator:call",
        "final_answer_file": config.answer_file,
        "only_task_tools": True,  # the builtin harness offers the calculator only: short prompts for a tiny model
        # An episode needs 2 model calls (the tool call, the answer); the builtin harness caps its turns at this,
        # as the greedy held-out player does (gyre.runtime.controller.held_out): a wandering episode costs no more.
        "max_turns": DEMO_MAX_TURNS,
        "difficulty": {
            k: v
            for k, v in asdict(config).items()
            if k in ("num_operands", "min_digits", "max_digits", "operators", "parentheses")
        },
    }


def generate_demo_tasks(n: int, seed: int, out_dir: str | Path, *, config: DemoConfig | None = None) -> list[Task]:
    """Write `n` demo task directories under `out_dir` (absent or empty) and return them loaded."""
    config = config or DemoConfig()
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"out_dir {out_dir} must be absent or an empty directory")
    tasks = []
    work = config.work
    for problem in make_demo_problems(n, seed, config):
        task_dir = out_dir / problem.id
        (task_dir / "workspace").mkdir(parents=True)
        (task_dir / "hidden").mkdir()
        expected = {"answer": str(problem.answer), "answer_file": config.answer_file}
        (task_dir / "hidden" / EXPECTED_FILE).write_text(json.dumps(expected) + "\n", encoding="utf-8")
        evaluator = {
            "kind": "python",
            "function": "gyre.tasks.demo.check:score_answer",
            "isolation": "inline",  # our own bounded check: no child process per episode
            "timeout_s": 10.0,
        }
        timeouts = {"harness_s": config.harness_timeout_s, "overall_s": config.overall_timeout_s}
        metadata = _metadata(problem, config)
        if work.enabled:  # slow executions (gyre.tasks.demo.work): a check command, a slow evaluation in a process
            shape = task_work(work, seed, problem.id)
            (task_dir / "workspace" / WORK_FILE).write_text(json.dumps(shape) + "\n", encoding="utf-8")
            # The overall budget ends a stuck evaluation, never the evaluator's own timeout (which would retry it).
            timeout = 3 * work.overall_timeout_s
            evaluator = {**evaluator, "function": EVALUATOR, "isolation": "subprocess", "timeout_s": timeout}
            timeouts = {"harness_s": work.harness_timeout_s, "overall_s": work.overall_timeout_s}
            metadata["check_command"] = CHECK_COMMAND
        write_task_toml(
            task_dir / TASK_FILE,
            {
                "id": problem.id,
                "prompt": problem.prompt,
                "evaluator": evaluator,
                "timeouts": timeouts,
                "metadata": metadata,
            },
        )
        tasks.append(load_task(task_dir))
    return tasks


def demo_episode(problem: DemoProblem) -> list[dict[str, Any]]:
    """The messages of a perfect episode (for warm-start demonstrations): call the tool, answer with its value."""
    value = calculator(problem.expression)
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": problem.prompt},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "calculator", "arguments": {"expression": problem.expression}}],
        },
        {"role": "tool", "content": value},
        {"role": "assistant", "content": value},
    ]
