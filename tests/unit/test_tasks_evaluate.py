"""Evaluators: command (pytest, fraction, float) and python (subprocess, inline) on a copy of the preserved
workspace; evaluator failure is not a score; partial scoring; the mapping onto gyre.traj.outcomes."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from gyre.tasks.evaluate import evaluate, evaluated_state, parse_score, to_evaluation, workspace_digest
from gyre.tasks.spec import load_task, prepare_workspace
from gyre.traj.outcomes import CloseKind, ExecutionOutcomes, Status, Validity

HIDDEN_TESTS = textwrap.dedent(
    """\
    from calc import add, sub, mul, div

    def test_add():
        assert add(2, 3) == 5

    def test_sub():
        assert sub(5, 3) == 2

    def test_mul():
        assert mul(2, 3) == 6

    def test_div():
        assert div(6, 3) == 2
    """
)
STUB = "def add(a, b):\n    raise NotImplementedError\n\nsub = mul = div = add\n"


def make_task(root: Path, evaluator: str, *, hidden: dict[str, str] | None = None) -> Path:
    task_dir = root / "task"
    (task_dir / "workspace").mkdir(parents=True)
    (task_dir / "workspace" / "calc.py").write_text(STUB)
    (task_dir / "hidden").mkdir()
    for name, text in (hidden or {"test_calc.py": HIDDEN_TESTS}).items():
        (task_dir / "hidden" / name).write_text(text)
    (task_dir / "task.toml").write_text(f'id = "calc"\nprompt = "Implement calc.py."\n[evaluator]\n{evaluator}\n')
    return task_dir


PYTEST = 'kind = "command"\ncommand = ["{python}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "{hidden}"]\n'


@pytest.fixture
def pytest_task(tmp_path: Path):
    return load_task(make_task(tmp_path, PYTEST + "timeout_s = 60"))


def test_partial_scoring_after_harness_timeout(pytest_task, tmp_path: Path) -> None:
    # The harness implemented two of four functions and then ran out of time: the preserved workspace is
    # scored like any other, 2 of 4 hidden tests passing -> 0.5, valid.
    ws = prepare_workspace(pytest_task, tmp_path / "exec")
    (ws / "calc.py").write_text(
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\nmul = div = None\n"
    )
    result = evaluate(pytest_task, ws)
    assert result.validity is Validity.VALID and result.valid
    assert result.score == 0.5
    assert result.detail == "2/4 passed"
    assert result.evaluator == "command:pytest"
    # the outcomes model takes it as the designated reward of a HARNESS_TIMEOUT close
    outcomes = ExecutionOutcomes(7, deadline=100.0)
    outcomes.close(CloseKind.HARNESS_TIMEOUT, now=10.0, final_state=evaluated_state(7, ws))
    outcomes.record(to_evaluation(result, execution=7, attempt=1, created_at=11.0))
    assert outcomes.status is Status.VALID and outcomes.reward == 0.5


def test_hidden_tests_never_reach_the_preserved_workspace(pytest_task, tmp_path: Path) -> None:
    ws = prepare_workspace(pytest_task, tmp_path / "exec")
    before = workspace_digest(ws)
    result = evaluate(pytest_task, ws)
    assert result.valid and result.score == 0.0  # a valid zero: the stub fails every test
    assert sorted(p.name for p in ws.iterdir()) == ["calc.py"]  # no hidden file, no __pycache__
    assert workspace_digest(ws) == before == result.artifact


def test_hidden_dest_overlays_tests_into_the_copy(tmp_path: Path) -> None:
    evaluator = 'kind = "command"\ncommand = "{python} -m pytest -q -p no:cacheprovider tests"\nhidden_dest = "tests"'
    task = load_task(make_task(tmp_path, evaluator))
    ws = prepare_workspace(task, tmp_path / "exec")
    (ws / "calc.py").write_text("add = lambda a, b: a + b\nsub = mul = div = None\n")
    result = evaluate(task, ws)
    assert (result.validity, result.score) == (Validity.VALID, 0.25)
    assert not (ws / "tests").exists()


def test_artifact_hash_changes_with_the_workspace(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "a.txt").write_text("1")
    first = workspace_digest(ws)
    assert workspace_digest(ws) == first
    (ws / "a.txt").write_text("2")
    second = workspace_digest(ws)
    (ws / "sub" / "b.txt").write_text("")
    third = workspace_digest(ws)
    (ws / "sub" / "b.txt").rename(ws / "sub" / "c.txt")
    fourth = workspace_digest(ws)
    assert len({first, second, third, fourth}) == 4
    assert first.startswith("sha256:")
    with pytest.raises(ValueError, match="not a directory"):
        workspace_digest(tmp_path / "missing")


def test_evaluator_timeout_is_pending_not_a_score(tmp_path: Path) -> None:
    slow = "import time\n\ndef test_slow():\n    time.sleep(60)\n"
    task = load_task(make_task(tmp_path, PYTEST + "timeout_s = 1.5", hidden={"test_slow.py": slow}))
    ws = prepare_workspace(task, tmp_path / "exec")
    result = evaluate(task, ws)
    assert result.validity is Validity.PENDING and not result.valid and result.score == 0.0
    assert "timed out after 1.5 s" in result.detail
    assert result.duration_s < 30


@pytest.mark.parametrize(
    ("command", "detail"),
    [
        ('["{python}", "-c", "raise SystemExit(3)"]\nscore = "float"', "exited with status 3"),
        ('["{python}", "-c", "print(\'no score here\')"]\nscore = "float"', "unreadable"),
        ('["/nonexistent/evaluator"]', "could not start"),
        ('["{python}", "-m", "pytest", "-q", "{hidden}/test_none.py"]', "exited with status 4"),
    ],
)
def test_evaluator_crash_is_failed_not_a_score(tmp_path: Path, command: str, detail: str) -> None:
    task = load_task(make_task(tmp_path, f'kind = "command"\ncommand = {command}'))
    result = evaluate(task, prepare_workspace(task, tmp_path / "exec"))
    assert result.validity is Validity.FAILED and result.score == 0.0
    assert detail in result.detail


def test_failed_attempt_is_retried_on_the_same_state(tmp_path: Path) -> None:
    # attempt 1 fails (the evaluator crashed), attempt 2 on the same preserved state is valid
    flaky = (
        "import pathlib, sys\n"
        f"flag = pathlib.Path({str(tmp_path / 'flag')!r})\n"
        "if not flag.exists():\n    flag.touch()\n    sys.exit(1)\n"
        "print('3/4')\n"
    )
    evaluator = 'kind = "command"\ncommand = "{python} {hidden}/flaky.py"\nscore = "fraction"'
    task = load_task(make_task(tmp_path, evaluator, hidden={"flaky.py": flaky}))
    ws = prepare_workspace(task, tmp_path / "exec")
    outcomes = ExecutionOutcomes("e", deadline=100.0)
    outcomes.close(CloseKind.COMPLETED, now=1.0, final_state=evaluated_state("e", ws))
    first = evaluate(task, ws)
    outcomes.record(to_evaluation(first, execution="e", attempt=1, created_at=2.0))
    assert first.validity is Validity.FAILED
    assert outcomes.status is Status.AWAITING and outcomes.retry_allowed(3.0)
    second = evaluate(task, ws)
    assert second.artifact == first.artifact
    outcomes.record(
        to_evaluation(second, execution="e", attempt=outcomes.next_attempt(outcomes.final_state), created_at=3.0)
    )
    assert outcomes.reward == 0.75


def test_pending_past_budget_is_excluded_not_zero(tmp_path: Path) -> None:
    task = load_task(
        make_task(tmp_path, 'kind = "command"\ncommand = "{python} -c \'raise SystemExit(1)\'"\nscore = "float"')
    )
    ws = prepare_workspace(task, tmp_path / "exec")
    outcomes = ExecutionOutcomes(1, deadline=10.0)
    outcomes.close(CloseKind.COMPLETED, now=1.0, final_state=evaluated_state(1, ws))
    outcomes.record(to_evaluation(evaluate(task, ws), execution=1, attempt=1, created_at=2.0))
    assert outcomes.expire(10.0)
    assert outcomes.status is Status.EXCLUDED and outcomes.reward is None


SCORER = """\
from pathlib import Path

def score(workspace, hidden_dir):
    return (Path(workspace) / "out.txt").read_text().count("ok") / int((Path(hidden_dir) / "n").read_text())

def crash(workspace, hidden_dir):
    raise RuntimeError("checker bug")

def hang(workspace, hidden_dir):
    import time
    time.sleep(60)

def out_of_range(workspace, hidden_dir):
    return 1.5

def touch(workspace, hidden_dir):
    (Path(workspace) / "out.txt").write_text("evaluator was here")
    return 1.0
"""


def make_python_task(tmp_path: Path, function: str, extra: str = "") -> Path:
    task_dir = make_task(
        tmp_path,
        f'kind = "python"\nfunction = "checker_{tmp_path.name[-8:].replace("-", "_")}:{function}"\n' + extra,
        hidden={"n": "4"},
    )
    (task_dir / f"checker_{tmp_path.name[-8:].replace('-', '_')}.py").write_text(SCORER)  # beside task.toml
    return task_dir


@pytest.mark.parametrize("isolation", ["subprocess", "inline"])
def test_python_evaluator_scores_and_fails(tmp_path: Path, isolation: str) -> None:
    extra = f'isolation = "{isolation}"\n'
    task = load_task(make_python_task(tmp_path / "ok", "score", extra))
    ws = prepare_workspace(task, tmp_path / "exec")
    (ws / "out.txt").write_text("ok ok ok")
    result = evaluate(task, ws)
    assert (result.validity, result.score) == (Validity.VALID, 0.75)
    assert result.evaluator.startswith("python:checker_")

    for name, words in (("crash", "checker bug"), ("out_of_range", "1.5")):
        task = load_task(make_python_task(tmp_path / name, name, extra))
        result = evaluate(task, ws)
        assert result.validity is Validity.FAILED and result.score == 0.0
        assert words in result.detail + result.log

    task = load_task(make_python_task(tmp_path / "touch", "touch", extra))
    evaluate(task, ws)
    assert (ws / "out.txt").read_text() == "ok ok ok"  # the evaluator worked on a copy


def test_python_evaluator_timeout_is_pending(tmp_path: Path) -> None:
    task = load_task(make_python_task(tmp_path, "hang", "timeout_s = 1.5\n"))
    result = evaluate(task, prepare_workspace(task, tmp_path / "exec"))
    assert result.validity is Validity.PENDING and "timed out" in result.detail


def test_missing_workspace_is_not_evaluated(pytest_task, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to evaluate"):
        evaluate(pytest_task, tmp_path / "gone")


@pytest.mark.parametrize(
    ("kind", "stdout", "score"),
    [
        ("pytest", "..F.\n1 failed, 3 passed in 0.05s\n", 0.75),
        ("pytest", "===== 2 passed, 1 error, 1 skipped in 1.20s =====", 2 / 3),
        ("pytest", "E\n1 error in 0.10s", 0.0),
        ("fraction", "running\nscore: 3 / 8\n", 0.375),
        ("float", "log line\n0.25\n", 0.25),
    ],
)
def test_parse_score(kind: str, stdout: str, score: float) -> None:
    assert parse_score(kind, stdout)[0] == pytest.approx(score)


@pytest.mark.parametrize(
    ("kind", "stdout"),
    [
        ("pytest", "no tests ran in 0.01s"),
        ("pytest", "5 skipped in 0.1s"),
        ("fraction", "5/4"),
        ("fraction", "1/0"),
        ("float", "1.5"),
        ("float", "nan"),
        ("float", ""),
    ],
)
def test_parse_score_refuses(kind: str, stdout: str) -> None:
    with pytest.raises(ValueError):
        parse_score(kind, stdout)


def test_evaluator_version_tracks_hidden_files(pytest_task, tmp_path: Path) -> None:
    ws = prepare_workspace(pytest_task, tmp_path / "exec")
    from gyre.tasks.evaluate import evaluator_version

    before = evaluator_version(pytest_task)
    (pytest_task.hidden_dir / "test_calc.py").write_text(HIDDEN_TESTS + "\n# changed\n")
    assert evaluator_version(pytest_task) != before
    assert workspace_digest(ws) == workspace_digest(ws)


def test_special_files_and_symlinks_in_the_workspace(pytest_task, tmp_path: Path) -> None:
    import os

    ws = prepare_workspace(pytest_task, tmp_path / "exec")
    os.mkfifo(ws / "pipe")  # an agent may leave one; copying or hashing it must not block
    (ws / "link").symlink_to("calc.py")
    result = evaluate(pytest_task, ws)
    assert result.valid and result.artifact == workspace_digest(ws) == evaluated_state(0, ws).artifact_version
    (ws / "link").unlink()
    (ws / "link").symlink_to("other.py")
    assert workspace_digest(ws) != result.artifact


def test_agent_cannot_shadow_the_checker_module(tmp_path: Path) -> None:
    task = load_task(make_python_task(tmp_path, "score"))
    ws = prepare_workspace(task, tmp_path / "exec")
    (ws / "out.txt").write_text("ok")
    module = task.evaluator.function.split(":")[0]
    (ws / f"{module}.py").write_text("def score(workspace, hidden_dir):\n    return 1.0\n")  # planted by the agent
    result = evaluate(task, ws)
    assert (result.validity, result.score) == (Validity.VALID, 0.25)


def test_collection_error_from_the_agents_code_is_a_valid_zero(pytest_task, tmp_path: Path) -> None:
    ws = prepare_workspace(pytest_task, tmp_path / "exec")
    (ws / "calc.py").unlink()  # the agent deleted the module the hidden tests import: pytest exits 2
    result = evaluate(pytest_task, ws)
    assert (result.validity, result.score, result.detail) == (Validity.VALID, 0.0, "0/1 passed")


def test_a_daemon_left_by_the_code_under_test_neither_stretches_nor_spoils_the_evaluation(tmp_path: Path) -> None:
    # The command finishes at once but leaves a process in a session of its own holding stdout: the result comes
    # back at once (not after the daemon), and the daemon is gone or orphaned without blocking us.
    evaluator = 'kind = "command"\ncommand = ["sh", "-c", "setsid sleep 30 & echo 1/1"]\nscore = "fraction"\n'
    task = load_task(make_task(tmp_path, evaluator + "timeout_s = 20"))
    started = time.monotonic()
    result = evaluate(task, prepare_workspace(task, tmp_path / "exec"))
    assert result.valid and result.score == 1.0
    assert time.monotonic() - started < 10


def test_the_controllers_secrets_do_not_reach_the_evaluator(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("GYRE_TEST_SECRET", "hunter2")
    script = 'import os; print("1/1" if "GYRE_TEST_SECRET" not in os.environ else "0/1")'
    task = load_task(
        make_task(tmp_path, f'kind = "command"\ncommand = ["{{python}}", "-c", {script!r}]\nscore = "fraction"')
    )
    assert evaluate(task, prepare_workspace(task, tmp_path / "exec")).score == 1.0


def test_a_symlink_planted_at_hidden_dest_scores_zero_and_writes_nothing_outside(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    evaluator = 'kind = "command"\ncommand = ["sh", "-c", "echo 1/1"]\nscore = "fraction"\nhidden_dest = "tests/hidden"'
    task = load_task(make_task(tmp_path, evaluator))
    ws = prepare_workspace(task, tmp_path / "exec")
    (ws / "tests").symlink_to(outside)
    result = evaluate(task, ws)
    assert result.valid and result.score == 0.0 and "symbolic link" in result.detail
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("planted", ["tests/hidden/test_calc.py", "tests/hidden"])
def test_a_symlink_planted_inside_hidden_dest_scores_zero_and_overwrites_nothing(tmp_path: Path, planted: str) -> None:
    """A link where a hidden file (or the destination itself) will be copied: the copy would write through it."""
    victim = tmp_path / "victim.txt"
    victim.write_text("ROOT-ONLY")
    evaluator = 'kind = "command"\ncommand = ["sh", "-c", "echo 1/1"]\nscore = "fraction"\nhidden_dest = "tests/hidden"'
    task = load_task(make_task(tmp_path, evaluator))
    ws = prepare_workspace(task, tmp_path / "exec")
    (ws / planted).parent.mkdir(parents=True, exist_ok=True)
    (ws / planted).symlink_to(victim if planted.endswith(".py") else tmp_path)
    result = evaluate(task, ws)
    assert result.valid and result.score == 0.0 and "symbolic link" in result.detail
    assert victim.read_text() == "ROOT-ONLY" and not (tmp_path / "test_calc.py").exists()
