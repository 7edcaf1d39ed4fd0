"""The demo family: the safe calculator, the seeded generator, and that a perfect agent scores 1.0."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre.config import DemoConfig
from gyre.tasks import load_tasks, prepare_workspace
from gyre.tasks.demo import (
    CALCULATOR_TOOL,
    CALCULATOR_TOOL_SPEC,
    SYSTEM_PROMPT,
    calculator,
    demo_episode,
    generate_demo_tasks,
    make_demo_problems,
    reference_notes,
)
from gyre.tasks.demo.calculator import CalculatorError, call, evaluate_expression
from gyre.tasks.demo.check import read_answer
from gyre.tasks.evaluate import evaluate
from gyre.traj.outcomes import Validity


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("2 * 3 ** 2", "18"),
        ("2 ** 3 ** 2", "512"),  # right-associative
        ("-2 ** 2", "-4"),  # ** binds tighter than unary minus, as in Python
        ("2 ** -1", "0.5"),
        ("10 - 4 - 3", "3"),  # left-associative
        ("7 / 2", "3.5"),
        ("8 / 2", "4"),  # exact division stays an integer
        ("7 // 2 + 7 % 2", "4"),
        ("  4275 * 3662 ", "15655050"),
        ("((((1))))", "1"),
        ("1.5 * 4", "6"),
    ],
)
def test_calculator_values(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("1 / 0", "error: division by zero"),
        ("5 // (3 - 3)", "error: division by zero"),
        ("0 ** -1", "error: division by zero"),
        ("9 ** 9 ** 9", "error: exponent too large"),
        ("2 ** 1000", "error: exponent too large"),
        ("10.0 ** 400", "error: result too large"),
        ("(1 + 2", "error: missing ')'"),
        ("1 +", "error: unexpected end"),
        ("__import__('os')", "error: unexpected character '_'"),
        ("2 3", "error: unexpected '3'"),
        ("", "error: empty expression"),
        ("(" * 40 + "1" + ")" * 40, "error: expression nested too deeply"),
        ("1" * 201, "error: expression too long"),
        ("(-8) ** 0.5", "error: result is not a real number"),
    ],
)
def test_calculator_refuses_with_error_text(expression: str, error: str) -> None:
    assert calculator(expression).startswith(error)


def test_calculator_is_fast_on_hostile_input() -> None:
    started = time.monotonic()
    for expression in ("9**9**9", "99999999**99999999", "9" * 100 + "*" + "9" * 100, "-" * 150 + "1"):
        assert calculator(expression).startswith("error:")
    assert time.monotonic() - started < 0.5
    with pytest.raises(CalculatorError):
        evaluate_expression(123)  # type: ignore[arg-type]


def test_generator_is_deterministic_and_knobs_apply() -> None:
    assert make_demo_problems(20, seed=3) == make_demo_problems(20, seed=3)
    assert make_demo_problems(20, seed=3) != make_demo_problems(20, seed=4)
    first = make_demo_problems(2, seed=0)  # pinned: the same on every machine and Python version
    assert [(p.expression, p.answer) for p in first] == [("7890 * 4", 31560), ("7634 - 588", 7046)]
    assert first[0].prompt == "What is 7890 * 4?"
    config = DemoConfig(num_operands=3, min_digits=2, max_digits=2, operators="*", parentheses=True)
    for p in make_demo_problems(50, seed=1, config=config):
        numbers = p.expression.replace("(", "").replace(")", "").split(" * ")
        assert len(numbers) == 3 and all(len(x) == 2 for x in numbers)
        assert p.answer == evaluate_expression(p.expression)
    assert any("(" in p.expression for p in make_demo_problems(50, seed=1, config=config))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_operands": 1}, "num_operands"),
        ({"min_digits": 3, "max_digits": 2}, "min_digits"),
        ({"operators": "/"}, "operators"),
        ({"prompt_template": "Compute."}, "prompt_template"),
        ({"answer_file": "../answer.txt"}, "answer_file"),
        ({"harness_timeout_s": 200.0}, "harness_timeout_s"),
    ],
)
def test_demo_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DemoConfig(**kwargs)


def test_perfect_agent_scores_one_and_wrong_agent_zero(tmp_path: Path) -> None:
    tasks = generate_demo_tasks(6, seed=0, out_dir=tmp_path / "tasks")
    problems = make_demo_problems(6, seed=0)
    loaded, errors = load_tasks(tmp_path / "tasks")
    assert errors == [] and [t.id for t in loaded] == [t.id for t in tasks] == [p.id for p in problems]
    for i, (task, problem) in enumerate(zip(tasks, problems, strict=True)):
        assert task.prompt == problem.prompt
        assert task.metadata["tools"] == [CALCULATOR_TOOL_SPEC]
        assert task.metadata["tools_impl"] == "gyre.tasks.demo.calculator:call"
        assert sorted(p.name for p in task.workspace_dir.iterdir()) == []  # the answer is only in hidden/
        ws = prepare_workspace(task, tmp_path / f"exec-{i}")
        # the scripted perfect agent: call the tool, write its value where the harness puts the final answer
        episode = demo_episode(problem)
        assert episode[2]["tool_calls"][0]["arguments"] == {"expression": problem.expression}
        (ws / task.metadata["final_answer_file"]).write_text(episode[-1]["content"])
        right = evaluate(task, ws)
        assert (right.validity, right.score) == (Validity.VALID, 1.0)
        (ws / "answer.txt").write_text(str(problem.answer + 1))
        wrong = evaluate(task, ws)
        assert (wrong.validity, wrong.score) == (Validity.VALID, 0.0)
        assert wrong.artifact != right.artifact
        (ws / "answer.txt").unlink()
        assert evaluate(task, ws).score == 0.0  # no answer: a valid zero


def test_answer_reading() -> None:
    assert read_answer("The result is 6713.") == 6713
    assert read_answer("4275 * 3662 = 15,655,050") == 15655050
    assert read_answer("-46\n") == -46
    assert read_answer("I don't know") is None


def test_generated_files_and_out_dir(tmp_path: Path) -> None:
    (task,) = generate_demo_tasks(1, seed=5, out_dir=tmp_path / "t", config=DemoConfig(answer_file="out.txt"))
    expected = json.loads((task.hidden_dir / "expected.json").read_text())
    assert expected == {"answer": str(make_demo_problems(1, 5)[0].answer), "answer_file": "out.txt"}
    assert task.metadata["final_answer_file"] == "out.txt"
    assert (task.harness_timeout_s, task.overall_timeout_s) == (60.0, 120.0)
    with pytest.raises(ValueError, match="absent or an empty"):
        generate_demo_tasks(1, seed=5, out_dir=tmp_path / "t")


def test_tool_forms_agree_and_plugin_call() -> None:
    # the chat-template form (what the tiny model's corpus shows) and the builtin harness's form are one tool
    function = CALCULATOR_TOOL["function"]
    assert (function["name"], function["description"], function["parameters"]) == (
        CALCULATOR_TOOL_SPEC["name"],
        CALCULATOR_TOOL_SPEC["description"],
        CALCULATOR_TOOL_SPEC["input_schema"],
    )
    corpus = Path(__file__).parents[2] / "gyre" / "models" / "corpus" / "tool_calls.txt"
    assert json.dumps(CALCULATOR_TOOL) in corpus.read_text()  # rendered exactly as the tokenizer saw it
    assert call("calculator", {"expression": "6 * 7"}, Path(".")) == "42"
    assert call("calculator", {}, None).startswith("error: missing argument")
    assert call("bash", {"command": "ls"}, None).startswith("error: unknown tool")


def test_a_harness_loading_the_calculator_tool_imports_no_evaluator_and_no_numpy():
    """The builtin harness imports `tools_impl` (`gyre.tasks.demo.calculator`) in every execution's process: the
    package's evaluators, `gyre.traj` and numpy stay out of it (~0.1 CPU s per execution, measured)."""
    probe = (
        "import sys, gyre.tasks.demo.calculator; "
        "print(sorted(m for m in sys.modules if m in ('numpy', 'gyre.traj', 'gyre.tasks.evaluate')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_context_words_put_fixed_true_notes_after_the_system_prompt(tmp_path):
    notes = reference_notes("demo-0-00003", 400)
    assert len(notes.split()) == 400 and notes.startswith("Notes: ")
    assert notes == reference_notes("demo-0-00003", 400) != reference_notes("demo-0-00004", 400)
    facts = notes.removeprefix("Notes: ").split(". ")[:-1]  # the last may be cut short
    for fact in facts:
        expression, value = fact.split(" = ")
        assert evaluate_expression(expression) == int(value), fact
    assert reference_notes("demo-0-00003", 0) == ""
    (plain,) = generate_demo_tasks(1, 0, tmp_path / "plain")
    (long,) = generate_demo_tasks(1, 0, tmp_path / "long", config=DemoConfig(context_words=400))
    assert plain.metadata["system_prompt"] == SYSTEM_PROMPT  # the default is the warm start's prompt, unchanged
    assert long.metadata["system_prompt"] == f"{SYSTEM_PROMPT}\n\n{reference_notes(long.id, 400)}"
    assert long.prompt == plain.prompt


@pytest.mark.parametrize("words", [-1, 1_000_001, True, 2.5])
def test_bad_context_words_are_refused(words):
    with pytest.raises(ValueError, match="context_words"):
        DemoConfig(context_words=words)
