"""The harness's program and the evaluators' interpreter are run once, as the sandbox runs them, before any
execution (`gyre.runtime.job.harness_setup.check_harness`; docs/runtime.md, "What the program checks before it runs").

With real processes: a CLI under a 0700 directory (a home directory) stops the check with one line naming the path,
the own uid and the fixes, and so does the evaluators' interpreter there (an own uid per execution: needs root); a
CLI whose interpreter is not bound inside bubblewrap (needs bwrap) and an interpreter bubblewrap does not bind
likewise; the same program in an open directory passes. Through `python -m gyre.train`: a run whose harness binary
cannot run exits 2 with that one line and dispatches nothing.

Time on 2 cores: ~6 s.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from test_train_program import finish, train

from gyre.harness.runners import ClaudeCodeRunner, CommandRunner
from gyre.harness.sandbox import BubblewrapSandbox, LocalSandbox
from gyre.runtime.job.harness_setup import HarnessSetupError, check_harness
from gyre.tasks.spec import PythonEvaluatorSpec, Task

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="an own uid per execution needs root")
needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bwrap not installed (apt-get install bubblewrap)"
)


@pytest.fixture
def base():
    """A directory under /tmp (private inside bwrap) that the executions' own uids may traverse (0711)."""
    path = Path(tempfile.mkdtemp(prefix="gyre-preflight-test-", dir="/tmp"))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def script(directory: Path, name: str, text: str, mode: int = 0o755) -> Path:
    directory.mkdir(mode=mode, exist_ok=True)
    path = directory / name
    path.write_text(text)
    path.chmod(0o755)
    return path


CLI = "#!/bin/sh\necho 2.0.0 '(Claude Code)'\n"
PYTHON = "#!/bin/sh\nexit 0\n"  # answers `-c "import sys"` like an interpreter


def evaluated_task(base: Path) -> Task:
    return Task(
        id="t",
        prompt="p",
        task_dir=base,
        workspace_dir=base,
        hidden_dir=None,
        evaluator=PythonEvaluatorSpec(function="check:score"),
    )


@needs_root
def test_a_cli_the_own_uid_cannot_run_stops_the_check_with_one_line(base):
    sandbox = LocalSandbox(root=base / "executions", isolate_user=True)
    private = script(base / "home", "claude", CLI, mode=0o700)
    with pytest.raises(HarnessSetupError) as error:
        check_harness(ClaudeCodeRunner(binary=str(private)), sandbox)
    line = str(error.value)
    assert "\n" not in line and str(private) in line and str(base / "home") in line, line
    assert "own uid" in line and "harness.isolate_user=false" in line and "outside a home directory" in line, line
    with pytest.raises(HarnessSetupError, match="own uid"):  # a user's agent: no --version, only read and execute
        check_harness(CommandRunner(argv=[str(private)]), sandbox)

    check_harness(ClaudeCodeRunner(binary=str(script(base / "opt", "claude", CLI))), sandbox)  # the control
    assert not (base / "executions" / "preflight.evaluate").exists()  # the probe leaves nothing behind


@needs_root
def test_a_cli_that_fails_as_the_own_uid_names_why(base):
    """Readable, but its interpreter is not (as `#!/usr/bin/env node` with node under a home directory)."""
    node = script(base / "home", "node", "#!/bin/sh\necho 2.0.0\n", mode=0o700)
    cli = script(base / "opt", "claude", f"#!{node}\n")
    with pytest.raises(HarnessSetupError) as error:
        check_harness(ClaudeCodeRunner(binary=str(cli)), LocalSandbox(root=base / "executions", isolate_user=True))
    line = str(error.value)
    assert "\n" not in line and str(cli) in line and "own uid" in line and "isolate_user=false" in line, line


@needs_root
def test_an_evaluator_interpreter_the_own_uid_cannot_run_stops_the_check(base, monkeypatch):
    sandbox = LocalSandbox(root=base / "executions", isolate_user=True)
    runner = ClaudeCodeRunner(binary=str(script(base / "opt", "claude", CLI)))
    python = script(base / "home", "python3", PYTHON, mode=0o700)
    monkeypatch.setattr(sys, "executable", str(python))
    check_harness(runner, sandbox)  # no task with an evaluator in a child process: nothing to probe
    with pytest.raises(HarnessSetupError) as error:
        check_harness(runner, sandbox, [evaluated_task(base)])
    line = str(error.value)
    assert line.startswith("the evaluators' interpreter: ") and str(python) in line and "own uid" in line, line

    monkeypatch.setattr(sys, "executable", str(script(base / "opt", "python3", PYTHON)))
    check_harness(runner, sandbox, [evaluated_task(base)])  # the control


@needs_bwrap
def test_a_cli_whose_interpreter_bubblewrap_does_not_bind_stops_the_check(base):
    node = script(base / "home", "node", "#!/bin/sh\necho 2.0.0\n")  # /tmp is private inside: not there
    cli = script(base / "opt", "claude", f"#!{node}\n")
    sandbox = BubblewrapSandbox(root=base / "executions")
    with pytest.raises(HarnessSetupError) as error:
        check_harness(ClaudeCodeRunner(binary=str(cli)), sandbox)
    line = str(error.value)
    assert "\n" not in line and str(cli) in line and "harness.sandbox=bubblewrap" in line, line
    check_harness(ClaudeCodeRunner(binary=str(node)), sandbox)  # its own directory is bound: the control


@needs_bwrap
def test_an_evaluator_interpreter_bubblewrap_does_not_bind_stops_the_check(base, monkeypatch):
    sandbox = BubblewrapSandbox(root=base / "executions")
    runner = ClaudeCodeRunner(binary=str(script(base / "opt", "claude", CLI)))
    sh = script(base / "lib", "sh", PYTHON)  # what the interpreter loads, outside the binds (as a venv's base Python)
    monkeypatch.setattr(sys, "executable", str(script(base / "venv", "python3", f"#!{sh}\n")))
    with pytest.raises(HarnessSetupError) as error:
        check_harness(runner, sandbox, [evaluated_task(base / "opt")])
    line = str(error.value)
    assert line.startswith("the evaluators' interpreter: ") and "harness.sandbox=bubblewrap" in line, line


@needs_root
def test_a_run_whose_harness_cannot_run_exits_2_before_any_dispatch(base):
    private = script(base / "home", "claude", CLI, mode=0o700)
    args = ["harness.name=claude_code", f"harness.binary={private}", "harness.isolate_user=true"]
    code, _, err = finish(train([*args, "logging.wandb=disabled"], base / "run"), 120)
    lines = [line for line in err.splitlines() if line.startswith("gyre.train:")]
    assert code == 2, err[-2000:]
    assert len(lines) == 1 and str(private) in lines[0] and "isolate_user=false" in lines[0], err[-2000:]
    assert "Traceback" not in err
    executions = base / "run" / "executions.jsonl"
    assert not executions.exists() or not executions.read_text().strip()
    assert not list((base / "run").glob("executions/*"))  # no execution prepared, the probe's removed
