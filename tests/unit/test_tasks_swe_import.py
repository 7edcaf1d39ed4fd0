"""SWE-style rows -> task directories (`gyre.tasks.swe_import`, `python -m gyre.tasks import-swe`; docs/tasks.md,
"Importing SWE-style rows"): the 3-row JSONL of tests/data/swe becomes tasks that `load_tasks` accepts and whose
evaluator gives pytest's partial credit on the snapshot as it is and full credit on a fixed one (real pytest runs);
a malformed row is refused with its row number and field, and nothing is written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.tasks.evaluate import evaluate
from gyre.tasks.spec import load_tasks
from gyre.tasks.swe_import import SweImportError, import_rows, read_rows
from gyre.traj.outcomes import Validity

DATA = Path(__file__).resolve().parents[1] / "data" / "swe"
IDS = ["acme__calc-1", "acme__stack-3", "acme__textutils-7"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gyre.tasks", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_the_cli_imports_three_rows_into_tasks_that_load(tmp_path):
    done = run_cli("import-swe", str(DATA / "rows.jsonl"), str(tmp_path / "tasks"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"imported 3 tasks into {tmp_path / 'tasks'}"
    tasks, errors = load_tasks(tmp_path / "tasks")
    assert errors == [] and [t.id for t in tasks] == IDS
    calc = tasks[0]
    assert calc.prompt.startswith("add(2, 3) returns -1") and (calc.task_dir / "workspace" / "calc.py").is_file()
    assert calc.evaluator.hidden_dest == "tests" and calc.metadata["fail_to_pass"] == 1
    assert not any(p.name.startswith(".") for p in (tmp_path / "tasks").iterdir())  # no partial directory left
    again = run_cli("import-swe", str(DATA / "rows.jsonl"), str(tmp_path / "tasks"))
    assert again.returncode == 2 and "exist already" in again.stderr and "--overwrite" in again.stderr
    assert run_cli("import-swe", str(DATA / "rows.jsonl"), str(tmp_path / "tasks"), "--overwrite").returncode == 0


STACK_FIX = "if not self.items:\n            raise IndexError('pop from empty stack')\n        return self.items.pop()"


@pytest.mark.parametrize(
    ("task_id", "name", "old", "new", "before"),
    [
        ("acme__calc-1", "calc.py", "return a - b\n\n\ndef sub", "return a + b\n\n\ndef sub", 0.5),
        ("acme__stack-3", "stack.py", "return self.items.pop(0)", STACK_FIX, 0.0),
        ("acme__textutils-7", "textutils.py", "raise NotImplementedError", "return 'wrong'", 1 / 3),
    ],
)
def test_the_evaluator_gives_partial_credit_and_full_credit_once_fixed(tmp_path, task_id, name, old, new, before):
    import_rows(read_rows(DATA / "rows.jsonl"), tmp_path / "tasks")
    (task,) = [t for t in load_tasks(tmp_path / "tasks")[0] if t.id == task_id]
    workspace = tmp_path / "work"
    shutil.copytree(task.task_dir / "workspace", workspace)
    result = evaluate(task, workspace)
    assert result.validity is Validity.VALID and result.score == pytest.approx(before), result
    (workspace / name).write_text((workspace / name).read_text().replace(old, new))
    if task_id == "acme__textutils-7":  # a wrong fix: still 1/3; then a right one
        assert evaluate(task, workspace).score == pytest.approx(1 / 3)
        fix = "import re\n    return '-'.join(re.findall(r'[a-z0-9]+', text.lower()))"
        (workspace / name).write_text((workspace / name).read_text().replace("return 'wrong'", fix))
    assert evaluate(task, workspace).score == 1.0


def test_hidden_tests_are_restored_over_the_agents_edits(tmp_path):
    import_rows(read_rows(DATA / "rows.jsonl"), tmp_path / "tasks")
    (task,) = [t for t in load_tasks(tmp_path / "tasks")[0] if t.id == "acme__calc-1"]
    workspace = tmp_path / "work"
    shutil.copytree(task.task_dir / "workspace", workspace)
    (workspace / "tests" / "test_calc.py").write_text("def test_add():\n    pass\n\n\ndef test_sub():\n    pass\n")
    assert evaluate(task, workspace).score == 0.5  # the hidden copy ran, not the edited one


def write_rows(tmp_path: Path, rows: list) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    (tmp_path / "snap").mkdir(exist_ok=True)
    return path


GOOD = {"instance_id": "ok-1", "repo_snapshot": "snap", "problem_statement": "fix it", "FAIL_TO_PASS": ["t.py::a"]}


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ("{not json", "<row>"),
        ("[1, 2]", "<row>"),
        ({**GOOD, "instance_id": "../escape"}, "instance_id"),
        ({**GOOD, "instance_id": "ok-0"}, "instance_id"),  # not a duplicate: a control (row 3 is then valid)
        ({k: v for k, v in GOOD.items() if k != "problem_statement"}, "problem_statement"),
        ({**GOOD, "repo_snapshot": "missing"}, "repo_snapshot"),
        ({**GOOD, "FAIL_TO_PASS": []}, "FAIL_TO_PASS"),
        ({**GOOD, "FAIL_TO_PASS": "not a list"}, "FAIL_TO_PASS"),
        ({**GOOD, "FAIL_TO_PASS": ["--rootdir=/"]}, "FAIL_TO_PASS"),
        ({**GOOD, "FAIL_TO_PASS": ["../outside.py::t"]}, "FAIL_TO_PASS"),
        ({**GOOD, "PASS_TO_PASS": [1]}, "PASS_TO_PASS"),
        ({**GOOD, "hidden_dest": "tests"}, "hidden_dest"),  # without hidden_tests
        ({**GOOD, "timeout_s": True}, "timeout_s"),
        ({**GOOD, "promblem": "typo"}, "promblem"),
    ],
)
def test_a_malformed_row_is_refused_with_its_row_number_and_field(tmp_path, bad, field):
    path = write_rows(tmp_path, [{**GOOD, "instance_id": "ok-0"}, "", bad])
    if field == "instance_id" and bad["instance_id"] == "ok-0":
        with pytest.raises(SweImportError, match=r"row 3: field 'instance_id': 'ok-0' again \(first on row 1\)"):
            read_rows(path)
        return
    with pytest.raises(SweImportError) as error:
        read_rows(path)
    (problem,) = error.value.problems
    assert problem.startswith(f"{path} row 3: field {field!r}:"), problem


def test_the_cli_refuses_a_bad_file_with_one_line_per_row_and_writes_nothing(tmp_path):
    path = write_rows(tmp_path, [GOOD, {**GOOD, "instance_id": "ok-2", "FAIL_TO_PASS": None}, "{"])
    done = run_cli("import-swe", str(path), str(tmp_path / "out"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert [line.split(": field ")[0].rsplit(" ", 1)[-1] for line in lines] == ["2", "3"]
    assert "'FAIL_TO_PASS': missing" in lines[0] and "'<row>': not JSON" in lines[1]
    assert not (tmp_path / "out").exists()
    assert run_cli("import-swe", str(tmp_path / "absent.jsonl"), str(tmp_path / "out")).returncode == 2
