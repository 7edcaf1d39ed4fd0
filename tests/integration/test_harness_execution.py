"""`run_harness` with real processes: how executions close, what they leave, and runners against `gyre.serve`.

Checked: exit codes and logs (COMPLETED), a `sleep 1000` harness and its background child both gone at its
budget (HARNESS_TIMEOUT, SIGTERM), a harness that ignores SIGTERM killed after the grace period (SIGKILL), cancel
before and during a run (CANCELLED), a missing binary (FAILED, naming the harness), the controller's secrets
absent from the harness's environment, stdin fed from the spec; the `command` runner end to end (a Python agent
on the `openai` SDK makes one call through the proxy and writes a file: the record file holds the call); and,
marked `harness`, Claude Code and Codex through `run_harness` against `gyre.serve` (the CLIs installed as in
test_harness_clis.py). The lifecycle tests run in every sandbox that works here (LocalSandbox with and without an
own uid, BubblewrapSandbox); leftovers are found by a unique `sleep` argument in /proc, whatever pid namespace.
Every process is stopped by PID or process group; every wait is bounded.

Time on 2 cores: ~21 s for the lifecycle tests (3 sandboxes), ~4 s for the served command runner; the `harness`
tests ~50 s (Claude Code ~35 s, Codex ~10 s, model build ~4 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
import test_harness_clis as clis
from serve_process import start_serve

from gyre import eventloop
from gyre.harness.execution import run_harness
from gyre.harness.protocol import ExecutionContext
from gyre.harness.runners import ClaudeCodeRunner, CodexRunner, CommandRunner
from gyre.harness.sandbox import BubblewrapSandbox, LocalSandbox
from gyre.traj.outcomes import CloseKind

# The real CLIs' fixtures (npm install into the shared cache, the long-context tiny model, one gyre.serve).
claude_bin = clis.claude_bin
codex_bin = clis.codex_bin
long_context_model = clis.long_context_model
served = clis.served

GRACE_S = 0.5
SLACK_S = 5.0  # scheduling slack on a loaded 2-core machine


@pytest.fixture
def base(tmp_path: Path):
    """A root every uid can traverse (pytest's own tmp root is 0700, closed to an execution's own uid)."""
    path = Path(tempfile.mkdtemp(prefix="gyre-exec-test-", dir="/tmp"))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_context(sandbox: LocalSandbox, execution_id: str, **overrides) -> ExecutionContext:
    dirs = sandbox.prepare(execution_id)
    fields = {
        "execution_id": execution_id,
        "task_prompt": "say hi",
        "workspace": dirs.workspace,
        "home": dirs.home,
        "log_dir": dirs.log_dir,
        "anthropic_base_url": "http://127.0.0.1:9",
        "openai_base_url": "http://127.0.0.1:9/v1",
        "api_key": f"key-{execution_id}",
        "model": "gyre",
    }
    fields.update(overrides)
    return ExecutionContext(**fields)


def run(runner, sandbox, context, *, timeout_s: float = 30.0, cancel_event=None):
    """On the controller's loop (uvloop where installed; test_harness_sandbox.py runs on asyncio's own)."""
    return eventloop.run(
        run_harness(
            runner, sandbox, context, harness_timeout_s=timeout_s, cancel_event=cancel_event, grace_period_s=GRACE_S
        )
    )


SANDBOXES = ("local", "local-own-uid", "bubblewrap")


@pytest.fixture(params=SANDBOXES)
def sandbox(request, base: Path) -> LocalSandbox:
    """The lifecycle holds in every sandbox (a contract suite over the implementations that run here)."""
    if request.param == "local-own-uid":
        if os.geteuid() != 0:
            pytest.skip("an own uid per execution needs root")
        return LocalSandbox(root=base / "executions", isolate_user=True)
    if request.param == "bubblewrap":
        if shutil.which("bwrap") is None:
            pytest.skip("bwrap not installed (apt-get install bubblewrap)")
        return BubblewrapSandbox(root=base / "executions")
    return LocalSandbox(root=base / "executions", isolate_user=False)


def marker() -> str:
    """A unique `sleep` argument: finds the process on the host whatever pid namespace it runs in."""
    return f"{1000 + random.randrange(10**6)}.{os.getpid()}"


def running(token: str) -> list[int]:
    """Host pids whose command line holds `token` (zombies have an empty command line: they count as gone)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if token.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
    return found


def test_exit_codes_and_logs_are_reported_and_the_workspace_is_preserved(sandbox):
    context = make_context(sandbox, "e-exit")
    runner = CommandRunner(argv=["sh", "-c", "echo out; echo err >&2; echo {prompt} > note.txt; exit 3"])
    result = run(runner, sandbox, context)
    assert result.close_kind is CloseKind.COMPLETED and result.exit_code == 3 and result.reason is None
    assert result.stdout_path.read_text() == "out\n" and result.stderr_path.read_text() == "err\n"
    assert (result.workspace / "note.txt").read_text() == "say hi\n"
    assert os.stat(result.workspace).st_uid == os.geteuid()  # handed back to the controller after the run
    ok = run(CommandRunner(argv=["true"]), sandbox, make_context(sandbox, "e-ok"))
    assert ok.close_kind is CloseKind.COMPLETED and ok.exit_code == 0


def test_harness_timeout_kills_the_whole_process_group(sandbox):
    context = make_context(sandbox, "e-timeout")
    token = marker()
    script = f"sleep {token} & sleep {token}"
    started = time.monotonic()
    result = run(CommandRunner(argv=["sh", "-c", script]), sandbox, context, timeout_s=1.0)
    assert result.close_kind is CloseKind.HARNESS_TIMEOUT, result
    assert result.exit_code == -15 and "timeout" in result.reason
    assert 1.0 <= time.monotonic() - started < 1.0 + GRACE_S + SLACK_S
    assert not running(token), "the harness or its background child outlived the timeout"


def test_a_harness_that_ignores_sigterm_is_killed_after_the_grace_period(sandbox):
    context = make_context(sandbox, "e-stubborn")
    token = marker()
    script = f"trap '' TERM; sleep {token} & sleep {token}; sleep {token}"
    started = time.monotonic()
    result = run(CommandRunner(argv=["sh", "-c", script]), sandbox, context, timeout_s=1.0)
    assert result.close_kind is CloseKind.HARNESS_TIMEOUT, result
    # the leader's own code: sh gets SIGKILL; under bwrap the leader is bwrap, which SIGTERM ends at once
    assert result.exit_code == (-15 if sandbox.name == "bubblewrap" else -9), result
    assert 1.0 + GRACE_S <= time.monotonic() - started < 1.0 + GRACE_S + SLACK_S  # the grace period was given
    assert not running(token)


def test_cancel_before_and_during_a_run(sandbox):
    token = marker()

    async def cancel_after(delay_s: float) -> object:
        event = asyncio.Event()
        context = make_context(sandbox, "e-cancel")
        task = asyncio.ensure_future(
            run_harness(
                CommandRunner(argv=["sleep", token]), sandbox, context, harness_timeout_s=60, cancel_event=event
            )
        )
        await asyncio.sleep(delay_s)
        event.set()
        return await asyncio.wait_for(task, timeout=GRACE_S + SLACK_S)

    result = eventloop.run(cancel_after(0.5))
    assert result.close_kind is CloseKind.CANCELLED and result.exit_code == -15, result
    assert not running(token)
    event = asyncio.Event()
    event.set()
    early = run(CommandRunner(argv=["sleep", "1000"]), sandbox, make_context(sandbox, "e-early"), cancel_event=event)
    assert early.close_kind is CloseKind.CANCELLED and early.exit_code is None


def test_a_missing_binary_fails_with_a_reason_naming_the_harness(sandbox):
    result = run(CommandRunner(argv=["/nonexistent/agent"], name="my_agent"), sandbox, make_context(sandbox, "e-miss"))
    assert result.close_kind is CloseKind.FAILED and result.exit_code is None
    assert "my_agent" in result.reason and "/nonexistent/agent" in result.reason
    assert "my_agent" in result.stderr_path.read_text()
    claude = ClaudeCodeRunner(binary="/nonexistent/claude")
    result = run(claude, sandbox, make_context(sandbox, "e-miss-claude"))
    assert result.close_kind is CloseKind.FAILED and "Claude Code" in result.reason and "npm install" in result.reason


def test_the_controllers_environment_does_not_reach_the_harness(sandbox, monkeypatch):
    monkeypatch.setenv("GYRE_TEST_CONTROLLER_SECRET", "s3cr3t-value")
    result = run(
        CommandRunner(argv=["sh", "-c", "env; cat /proc/self/environ"]), sandbox, make_context(sandbox, "e-env")
    )
    assert result.close_kind is CloseKind.COMPLETED
    output = result.stdout_path.read_text()
    assert "s3cr3t-value" not in output and "GYRE_TEST_CONTROLLER_SECRET" not in output
    assert "OPENAI_API_KEY=key-e-env" in output and f"TMPDIR={result.workspace.parent / 'home' / 'tmp'}" in output


def test_stdin_is_fed_from_the_spec(sandbox):
    runner = CommandRunner(argv=["sh", "-c", "cat > got.txt"], stdin="task: {prompt}\n")
    result = run(runner, sandbox, make_context(sandbox, "e-stdin"))
    assert result.close_kind is CloseKind.COMPLETED
    assert (result.workspace / "got.txt").read_text() == "task: say hi\n"


AGENT = """
import os
from openai import OpenAI

client = OpenAI(max_retries=0, timeout=60)  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
answer = client.chat.completions.create(
    model=os.environ["GYRE_MODEL"], messages=[{"role": "user", "content": "Write one word."}], max_tokens=8
)
with open("answer.txt", "w") as f:
    f.write(answer.choices[0].message.content or "")
print("finish_reason", answer.choices[0].finish_reason)
"""


def python_sandbox(base: Path, *ro_binds: Path, protected_paths=()) -> LocalSandbox:
    """A sandbox that can run this venv's Python: the interpreter may live in a private directory (/root/.pyenv
    here), which an execution's own uid cannot reach, so bwrap binds it read-only where installed; else plain
    processes as the controller."""
    binds = [Path(sys.prefix), Path(sys.base_prefix), *ro_binds]
    if shutil.which("bwrap"):
        return BubblewrapSandbox(root=base / "executions", ro_binds=binds, protected_paths=protected_paths)
    return LocalSandbox(root=base / "executions", isolate_user=False, protected_paths=protected_paths)


@pytest.mark.slow
def test_the_command_runner_drives_a_python_sdk_agent_through_gyre_serve(base, tmp_path_factory):
    server = start_serve(tmp_path_factory.mktemp("serve") / "run", "executions=1", "proxy.sampling.max_new_tokens=8")
    try:
        agent_dir = base / "agent"
        agent_dir.mkdir()
        (agent_dir / "agent.py").write_text(AGENT)
        os.chmod(agent_dir, 0o755)
        os.chmod(agent_dir / "agent.py", 0o644)
        sandbox = python_sandbox(base, agent_dir, protected_paths=[server.run_dir])
        execution = "exec-00000"
        context = make_context(
            sandbox,
            execution,
            anthropic_base_url=server.anthropic_url,
            openai_base_url=server.openai_url,
            api_key=server.keys[execution],
        )
        runner = CommandRunner(argv=[sys.executable, str(agent_dir / "agent.py")])
        result = run(runner, sandbox, context, timeout_s=120)
        assert result.close_kind is CloseKind.COMPLETED and result.exit_code == 0, result.stderr_path.read_text()
        assert (result.workspace / "answer.txt").exists()
        assert "finish_reason" in result.stdout_path.read_text()
    finally:
        server.stop()
    calls = [json.loads(line) for line in (server.records / f"{execution}.jsonl").read_text().splitlines()]
    calls = [call for call in calls if call.get("kind") == "call"]
    assert len(calls) == 1, calls


# -- the real CLIs ----------------------------------------------------------------------------------------------


def cli_sandbox(base: Path) -> LocalSandbox:
    """bwrap where installed (it binds the CLI's npm prefix read-only); else plain processes as the controller
    (the CLIs live under /root/.cache, which an execution's own uid cannot reach)."""
    if shutil.which("bwrap"):
        return BubblewrapSandbox(root=base / "executions")
    return LocalSandbox(root=base / "executions", isolate_user=False)


def _run_cli(runner, served, execution: str, base: Path):
    sandbox = cli_sandbox(base)
    context = make_context(
        sandbox,
        execution,
        task_prompt=clis.TASK,
        anthropic_base_url=served.anthropic_url,
        openai_base_url=served.openai_url,
        api_key=served.keys[execution],
        model=clis.MODEL_NAME,
    )
    started = time.monotonic()
    result = run(runner, sandbox, context, timeout_s=clis.CLI_TIMEOUT_S)
    elapsed = time.monotonic() - started
    print(f"{runner.name} in {sandbox.name}: {result.close_kind.name} exit {result.exit_code} in {elapsed:.1f} s")
    assert result.close_kind is CloseKind.COMPLETED and result.exit_code == 0, (
        f"{result}\nstdout: {result.stdout_path.read_text()[-3000:]}\nstderr: {result.stderr_path.read_text()[-3000:]}"
        f"\nserve.log: {clis.log_tail(served)}"
    )
    record_file = served.records / f"{execution}.jsonl"
    calls = [json.loads(line) for line in record_file.read_text().splitlines()]
    assert any(call.get("kind") == "call" for call in calls), "no call recorded"
    return calls


@pytest.mark.harness
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GYRE_SKIP_HARNESS_TESTS") == "1", reason="GYRE_SKIP_HARNESS_TESTS=1")
def test_claude_code_through_run_harness(claude_bin, served, base, long_context_model):
    runner = ClaudeCodeRunner(binary=str(claude_bin), instructions=f"{INSTRUCTIONS}\n")
    calls = _run_cli(runner, served, "exec-00000", base)
    assert any(c.get("role_signals", {}).get("user-agent", "").startswith("claude-cli/") for c in calls)
    assert_provisioned(calls, long_context_model)


@pytest.mark.harness
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GYRE_SKIP_HARNESS_TESTS") == "1", reason="GYRE_SKIP_HARNESS_TESTS=1")
def test_codex_through_run_harness(codex_bin, served, base, long_context_model):
    runner = CodexRunner(binary=str(codex_bin), instructions=f"{INSTRUCTIONS}\n")
    calls = _run_cli(runner, served, "exec-00001", base)
    assert any(c.get("role_signals", {}).get("request_kind") == "turn" for c in calls)
    assert_provisioned(calls, long_context_model)


INSTRUCTIONS = "Project rule 7: name every new file in lower case."  # docs/harness.md, "Provisioning"


def assert_provisioned(calls: list[dict], model_dir: Path) -> None:
    """The first call's prompt holds the task (it came on stdin) and the instructions file written into the
    execution's private HOME (~/.claude/CLAUDE.md, $CODEX_HOME/AGENTS.md)."""
    from gyre.models.tokenizer import load_tokenizer

    first = next(c for c in calls if c.get("kind") == "call")
    ids = [i for segment in first["segments"] for i in segment["ids"]]
    prompt = load_tokenizer(model_dir).decode(ids, skip_special_tokens=False)
    assert clis.TASK in prompt and INSTRUCTIONS in prompt, prompt[-2000:]
