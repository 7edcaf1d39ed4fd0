"""The task format: loading, validation errors that name the task and the field, load_tasks, workspaces."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre.tasks.spec import (
    CommandEvaluatorSpec,
    PythonEvaluatorSpec,
    TaskError,
    load_task,
    load_tasks,
    prepare_workspace,
    write_task_toml,
)

GOOD = """\
id = "fix-add"
prompt = "Make the tests pass."

[evaluator]
kind = "command"
command = "{python} -m pytest -q {hidden}"
timeout_s = 30

[timeouts]
harness_s = 600
overall_s = 900

[metadata]
source = "unit"
"""


def make_task(root: Path, toml: str = GOOD, *, name: str = "t", workspace: bool = True, hidden: bool = True) -> Path:
    task_dir = root / name
    task_dir.mkdir(parents=True)
    (task_dir / "task.toml").write_text(toml)
    if workspace:
        (task_dir / "workspace").mkdir()
        (task_dir / "workspace" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    if hidden:
        (task_dir / "hidden").mkdir()
        (task_dir / "hidden" / "test_calc.py").write_text("def test_x():\n    assert True\n")
    return task_dir


def test_load_good_task(tmp_path: Path) -> None:
    task = load_task(make_task(tmp_path))
    assert task.id == "fix-add"
    assert task.prompt == "Make the tests pass."
    assert task.workspace_dir == (tmp_path / "t" / "workspace").resolve()
    assert task.hidden_dir == (tmp_path / "t" / "hidden").resolve()
    assert task.evaluator == CommandEvaluatorSpec(argv=("{python}", "-m", "pytest", "-q", "{hidden}"), timeout_s=30.0)
    assert (task.harness_timeout_s, task.overall_timeout_s) == (600.0, 900.0)
    assert task.metadata == {"source": "unit"}


def test_prompt_file_and_python_evaluator(tmp_path: Path) -> None:
    toml = 'id = "p"\nprompt_file = "PROMPT.md"\n[evaluator]\nkind = "python"\nfunction = "json.decoder:score"\n'
    task_dir = make_task(tmp_path, toml, hidden=False)
    (task_dir / "PROMPT.md").write_text("Do the thing.\n")
    task = load_task(task_dir)
    assert task.prompt == "Do the thing.\n"
    assert task.hidden_dir is None
    assert task.evaluator == PythonEvaluatorSpec(function="json.decoder:score")


@pytest.mark.parametrize(
    ("toml", "field", "words"),
    [
        ('id = "x"\nprompt = "p"\n[evaluator\n', None, "malformed TOML"),
        ('prompt = "p"\n[evaluator]\nkind = "python"\nfunction = "json:loads"\n', "id", "missing"),
        ('id = "bad id!"\nprompt = "p"\n[evaluator]\nkind = "python"\nfunction = "json:loads"\n', "id", "letters"),
        ('id = "x"\npromt = "p"\n[evaluator]\nkind = "python"\nfunction = "json:loads"\n', "promt", "unknown field"),
        ('id = "x"\n[evaluator]\nkind = "python"\nfunction = "json:loads"\n', "prompt", "exactly one"),
        (
            'id = "x"\nprompt = "p"\nprompt_file = "f"\n[evaluator]\nkind = "python"\nfunction = "json:loads"\n',
            "prompt",
            "",
        ),
        ('id = "x"\nprompt = "  "\n[evaluator]\nkind = "python"\nfunction = "json:loads"\n', "prompt", "empty"),
        (
            'id = "x"\nprompt_file = "nope.md"\n[evaluator]\nkind = "python"\nfunction = "json:loads"\n',
            "prompt_file",
            "exist",
        ),
        (
            'id = "x"\nprompt_file = "../up.md"\n[evaluator]\nkind = "python"\nfunction = "json:loads"\n',
            "prompt_file",
            "leaves",
        ),
        ('id = "x"\nprompt = "p"\n', "evaluator", "missing"),
        ('id = "x"\nprompt = "p"\n[evaluator]\nkind = "shell"\n', "evaluator.kind", "'command' or 'python'"),
        ('id = "x"\nprompt = "p"\n[evaluator]\nkind = "python"\n', "evaluator.function", "missing"),
        ('id = "x"\nprompt = "p"\n[evaluator]\nkind = "python"\nfunction = "m.f"\n', "evaluator.function", "module"),
        (
            'id = "x"\nprompt = "p"\n[evaluator]\nkind = "python"\nfunction = "json:loads"\nisolation = "vm"\n',
            "evaluator.isolation",
            "subprocess",
        ),
        ('id = "x"\nprompt = "p"\n[evaluator]\nkind = "command"\n', "evaluator.command", "missing"),
        (
            'id = "x"\nprompt = "p"\n[evaluator]\nkind = "command"\ncommand = "pytst -q"\n',
            "evaluator.command",
            "not found on PATH",
        ),
        (
            'id = "x"\nprompt = "p"\n[evaluator]\nkind = "python"\nfunction = "no_such_checker:f"\n',
            "evaluator.function",
            "neither installed nor beside",
        ),
        ('id = "x"\nprompt = "p"\n[evaluator]\nkind = "command"\ncommand = []\n', "evaluator.command", "non-empty"),
        (
            'id = "x"\nprompt = "p"\n[evaluator]\nkind = "command"\ncommand = "{python}"\nscore = "xml"\n',
            "evaluator.score",
            "pytest",
        ),
        (
            'id = "x"\nprompt = "p"\n[evaluator]\nkind = "command"\ncommand = "{python}"\ntimeout_s = -1\n',
            "evaluator.timeout_s",
            "positive",
        ),
        (
            'id = "x"\nprompt = "p"\n[evaluator]\nkind = "command"\ncommand = "{python}"\ntimeout_s = true\n',
            "evaluator.timeout_s",
            "positive",
        ),
        (
            'id = "x"\nprompt = "p"\n[evaluator]\nkind = "command"\ncommand = "{python}"\nhidden_dest = "../x"\n',
            "evaluator.hidden_dest",
            "relative",
        ),
        (
            'id = "x"\nprompt = "p"\n[evaluator]\nkind = "python"\nfunction = "json:loads"\n'
            "[timeouts]\nharness_s = 10\noverall_s = 5\n",
            "timeouts.overall_s",
            "shorter",
        ),
        (
            'id = "x"\nprompt = "p"\nworkspace = "ws"\n[evaluator]\nkind = "python"\nfunction = "json:loads"\n',
            "workspace",
            "does not exist",
        ),
        (
            'id = "x"\nprompt = "p"\nhidden = "tests"\n[evaluator]\nkind = "python"\nfunction = "json:loads"\n',
            "hidden",
            "does not exist",
        ),
        (
            'id = "x"\nprompt = "p"\nhidden = "workspace"\n[evaluator]\nkind = "python"\nfunction = "json:loads"\n',
            "hidden",
            "contain each other",
        ),
    ],
)
def test_user_mistakes_name_the_task_and_field(tmp_path: Path, toml: str, field: str | None, words: str) -> None:
    task_dir = make_task(tmp_path, toml)
    with pytest.raises(TaskError) as info:
        load_task(task_dir)
    error = info.value
    assert isinstance(error, ValueError)
    assert error.field == field
    assert words in str(error)
    assert ("'x'" in str(error)) or ("'t'" in str(error))  # the task, by id once known, else by directory
    if field:
        assert repr(field) in str(error)


def test_missing_workspace_template_and_task_file(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"field 'workspace': template directory .* does not exist"):
        load_task(make_task(tmp_path, workspace=False))
    with pytest.raises(TaskError, match=r"no task\.toml"):
        load_task(tmp_path)


def test_command_with_hidden_placeholder_needs_hidden(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"evaluator\.command.*no hidden/"):
        load_task(make_task(tmp_path, hidden=False))


def test_load_tasks_reports_every_bad_task_and_keeps_the_good(tmp_path: Path) -> None:
    make_task(tmp_path, name="a-good")
    make_task(tmp_path, 'id = "broken"\nprompt = "p"\n', name="b-bad")
    make_task(tmp_path, "not toml [", name="c-bad")
    make_task(tmp_path, GOOD.replace("fix-add", "other"), name="d-good")
    make_task(tmp_path, GOOD, name="e-dup")
    (tmp_path / "a-good" / "workspace" / "task.toml").write_text("not a task: part of a workspace template")
    tasks, errors = load_tasks(tmp_path)
    assert [t.id for t in tasks] == ["fix-add", "other"]
    assert [(e.task, e.field) for e in errors] == [("broken", "evaluator"), ("c-bad", None), ("fix-add", "id")]
    assert "duplicate id" in str(errors[2])
    single, none = load_tasks(tmp_path / "a-good")  # a task directory itself
    assert [t.id for t in single] == ["fix-add"] and none == []
    with pytest.raises(ValueError, match="not a directory"):
        load_tasks(tmp_path / "missing")


def test_prepare_workspace_copies_template_never_hidden(tmp_path: Path) -> None:
    task = load_task(make_task(tmp_path))
    ws = prepare_workspace(task, tmp_path / "exec-1")
    assert sorted(p.name for p in ws.iterdir()) == ["calc.py"]
    (ws / "calc.py").write_text("changed")
    assert (task.workspace_dir / "calc.py").read_text().startswith("def add")  # the template is untouched
    with pytest.raises(ValueError, match="absent or an empty"):
        prepare_workspace(task, ws)


def test_write_task_toml_round_trips(tmp_path: Path) -> None:
    data = {
        "id": "w",
        "prompt": 'Say "hi"\nand \\ go',
        "evaluator": {"kind": "python", "function": "json:loads", "timeout_s": 1.5},
        "metadata": {"tools": [{"type": "function", "function": {"name": "c", "ok": True}}], "a b": [1, 2]},
    }
    (tmp_path / "w" / "workspace").mkdir(parents=True)
    write_task_toml(tmp_path / "w" / "task.toml", data)
    task = load_task(tmp_path / "w")
    assert task.prompt == data["prompt"]
    assert task.metadata == data["metadata"]
    assert list(task.metadata["tools"][0]["function"]) == ["name", "ok"]  # key order kept (rendered tool JSON)


def test_tasks_import_no_heavy_packages() -> None:
    import subprocess
    import sys

    probe = (
        "import sys, gyre.tasks, gyre.tasks.demo, gyre.tasks.demo.calculator\n"
        "print(sorted(m for m in ('torch', 'aiohttp', 'httpx', 'jinja2', 'tokenizers', 'hydra', 'omegaconf') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
