"""Runners, the registry, configs and the container argv: what each builds, without starting a process.

Checked: every runner satisfies `HarnessRunner`; the environment is exactly the documented keys (nothing of the
controller's environment, e.g. a secret, leaks in); Claude Code and Codex get the docs/harness.md switches and files;
`runner_for` names the known runners; a missing binary raises `HarnessNotFoundError` saying what to install;
`ExecutionLimits` and `ResourceLimits`; the container engine's exec and run argv, and apptainer's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from gyre.config import ExecutionLimits, ResourceLimits
from gyre.harness.protocol import ExecutionContext, HarnessNotFoundError, HarnessRunner
from gyre.harness.runners import ClaudeCodeRunner, CodexRunner, CommandRunner, runner_for
from gyre.harness.sandbox import ApptainerSandbox
from gyre.traj.roles import classifier_for

BASE_KEYS = {
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "NO_PROXY",
    "no_proxy",
    "OPENAI_BASE_URL",
    "OPENAI_API_KEY",
    "ANTHROPIC_BASE_URL",
    "ANTHROPIC_API_KEY",
    "GYRE_MODEL",
    "GYRE_EXECUTION_ID",
}


def make_context(tmp_path: Path, **overrides) -> ExecutionContext:
    fields = {
        "execution_id": "exec-00007",
        "task_prompt": "Fix the bug; don't touch tests.",
        "workspace": tmp_path / "workspace",
        "home": tmp_path / "home",
        "log_dir": tmp_path / "logs",
        "anthropic_base_url": "http://127.0.0.1:8080",
        "openai_base_url": "http://127.0.0.1:8080/v1",
        "api_key": "sk-exec-7",
        "model": "gyre",
    }
    fields.update(overrides)
    return ExecutionContext(**fields)


@pytest.fixture
def fake_cli(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "fake-cli"
    path.parent.mkdir()
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_registry_builds_each_runner_and_names_the_known_ones_on_a_typo():
    assert isinstance(runner_for("command", argv=["true"]), CommandRunner)
    assert isinstance(runner_for("claude_code"), ClaudeCodeRunner)
    assert isinstance(runner_for("codex"), CodexRunner)
    for runner in (runner_for("command", argv=["true"]), runner_for("claude_code"), runner_for("codex")):
        assert isinstance(runner, HarnessRunner)
        classifier_for(runner.name)  # every runner's name selects a role classifier
    with pytest.raises(ValueError, match="known runners: builtin, claude_code, codex, command"):
        runner_for("claud_code")
    with pytest.raises(ValueError, match="bad options"):
        runner_for("codex", no_such_option=1)


def test_command_runner_fills_the_template_and_builds_only_the_documented_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_TEST_CONTROLLER_SECRET", "do-not-leak")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "do-not-leak")
    context = make_context(tmp_path, extra_env={"MY_AGENT_MODE": "fast"})
    runner = CommandRunner(argv=["sh", "agent.sh", "{prompt}", "--ws={workspace}", "--model", "{model}"])
    spec = runner.launch_spec(context)
    assert os.path.isabs(spec.argv[0]) and spec.argv[0].endswith("/sh")
    assert spec.argv[1:] == ("agent.sh", context.task_prompt, f"--ws={context.workspace}", "--model", "gyre")
    assert set(spec.env) == BASE_KEYS | {"MY_AGENT_MODE"}
    assert "do-not-leak" not in spec.env.values()
    assert spec.env["HOME"] == str(context.home)
    assert spec.env["OPENAI_BASE_URL"] == context.openai_base_url
    assert spec.env["ANTHROPIC_BASE_URL"] == context.anthropic_base_url
    assert spec.env["OPENAI_API_KEY"] == spec.env["ANTHROPIC_API_KEY"] == "sk-exec-7"
    assert all("sk-exec-7" not in arg for arg in spec.argv)  # the key never goes on the command line
    assert spec.stdin is None and not spec.files


def test_command_runner_rejects_unknown_placeholders_and_reports_a_missing_program(tmp_path):
    with pytest.raises(ValueError, match=r"unknown placeholder \{api_key\}"):
        CommandRunner(argv=["agent", "{api_key}"])
    with pytest.raises(ValueError, match="non-empty"):
        CommandRunner(argv=[])
    runner = CommandRunner(argv=["gyre-no-such-agent-xyz"], name="my_agent")
    with pytest.raises(HarnessNotFoundError, match="my_agent runner: program 'gyre-no-such-agent-xyz' not found"):
        runner.check()


def test_claude_code_runner_uses_the_offline_switches_and_the_served_model(tmp_path, fake_cli):
    context = make_context(tmp_path)
    spec = ClaudeCodeRunner(binary=str(fake_cli), extra_args=["--max-turns", "3"]).launch_spec(context)
    assert spec.argv == (str(fake_cli), "-p", "--dangerously-skip-permissions", "--max-turns", "3")
    assert spec.stdin == context.task_prompt and not spec.files  # the task on stdin: never on argv (ps, ARG_MAX)
    assert spec.env["IS_SANDBOX"] == "1"
    assert spec.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    for key in ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
        assert spec.env[key] == "gyre"
    assert spec.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8080"
    assert spec.env["ANTHROPIC_API_KEY"] == "sk-exec-7"
    assert spec.env["PATH"].split(":")[0] == str(fake_cli.parent)


def test_codex_runner_writes_its_provider_config_under_the_private_home(tmp_path, fake_cli):
    context = make_context(tmp_path)
    spec = CodexRunner(binary=str(fake_cli)).launch_spec(context)
    assert spec.argv[1:] == (
        "exec",
        "--skip-git-repo-check",
        "-c",
        "analytics.enabled=false",
        "-c",
        "check_for_update_on_startup=false",
        "--disable",
        "plugins",
        "--dangerously-bypass-approvals-and-sandbox",  # gyre sandboxes the execution; Codex's own is read-only
        "-",
    )
    codex_home = context.home / ".codex"
    assert spec.env["CODEX_HOME"] == str(codex_home)
    assert spec.stdin == context.task_prompt  # `-`: the task on stdin, never on argv (ps, ARG_MAX)
    assert set(spec.files) == {codex_home / "config.toml"}
    tomllib = pytest.importorskip("tomllib", reason="tomllib is stdlib from Python 3.11")
    config = tomllib.loads(spec.files[codex_home / "config.toml"])
    provider = config["model_providers"][config["model_provider"]]
    assert config["model"] == "gyre"
    assert provider["base_url"] == "http://127.0.0.1:8080/v1" and provider["wire_api"] == "responses"
    assert spec.env[provider["env_key"]] == "sk-exec-7"


def test_provisioning_writes_instructions_and_settings_into_the_private_home(tmp_path, fake_cli):
    context = make_context(tmp_path, model="Qwen3-8B")
    claude = ClaudeCodeRunner(binary=str(fake_cli), instructions="Run the tests.\n", settings='{"x": 1}')
    spec = claude.launch_spec(context)
    assert spec.files == {
        context.home / ".claude" / "CLAUDE.md": "Run the tests.\n",
        context.home / ".claude" / "settings.json": '{"x": 1}',
    }
    assert spec.env["ANTHROPIC_MODEL"] == "Qwen3-8B"
    codex = CodexRunner(binary=str(fake_cli), instructions="Run the tests.\n", settings='approval_policy = "never"\n')
    spec = codex.launch_spec(context)
    home = context.home / ".codex"
    assert spec.files[home / "AGENTS.md"] == "Run the tests.\n"
    tomllib = pytest.importorskip("tomllib", reason="tomllib is stdlib from Python 3.11")
    config = tomllib.loads(spec.files[home / "config.toml"])
    assert config["approval_policy"] == "never" and config["model"] == "Qwen3-8B"
    assert config["model_providers"]["gyre"]["wire_api"] == "responses"


def test_missing_cli_binaries_say_what_to_install(tmp_path):
    missing = str(tmp_path / "nope" / "claude")
    with pytest.raises(HarnessNotFoundError, match=r"npm install -g @anthropic-ai/claude-code@2\.1\.197"):
        ClaudeCodeRunner(binary=missing).check()
    with pytest.raises(HarnessNotFoundError, match=r"npm install -g @openai/codex@0\.171\.0"):
        CodexRunner(binary=missing).check()


def test_limits_validate_and_overall_timeout_applies_only_to_evaluable_work():
    limits = ExecutionLimits(harness_timeout_s=60, overall_timeout_s=90)
    assert limits.grace_period_s > 0 and limits.resources.max_processes is not None
    with pytest.raises(ValueError, match="overall_timeout_s"):
        ExecutionLimits(harness_timeout_s=60, overall_timeout_s=30)
    with pytest.raises(ValueError, match="grace_period_s"):
        ExecutionLimits(grace_period_s=0)
    with pytest.raises(ValueError, match="cpu_seconds"):
        ResourceLimits(cpu_seconds=-1)


def test_container_exec_argv_passes_the_environment_in_a_private_file_only(tmp_path):
    from gyre.harness.container.engine import ContainerEngine
    from gyre.harness.container.sandbox import write_env_file
    from gyre.harness.sandbox import SandboxError

    context = make_context(tmp_path)
    spec = CommandRunner(argv=["sh", "-c", "echo {prompt}"]).launch_spec(context)
    engine = ContainerEngine(kind="podman", binary="/usr/bin/podman")
    env_file = write_env_file(tmp_path / "logs" / ".env-harness", spec.env)
    argv = engine.exec_argv("gyre-x-exec-00007", spec.argv, workdir="/workspace", env_file=env_file, stdin=True)
    assert argv[:7] == ["/usr/bin/podman", "exec", "-i", "--workdir", "/workspace", "--env-file", str(env_file)]
    assert not any("sk-exec-7" in a for a in argv)  # the key is in the file, not on the command line
    assert argv[argv.index("gyre-x-exec-00007") + 1 :] == list(spec.argv)
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"
    assert dict(line.split("=", 1) for line in env_file.read_text().splitlines()) == dict(spec.env)
    for bad in ({"A": "two\nlines"}, {"A=B": "x"}, {"": "x"}):
        with pytest.raises(SandboxError, match=r"newline|'='"):
            write_env_file(tmp_path / "bad", bad)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        write_env_file(link, {"A": "1"})  # never written through a link


def test_container_run_argv_labels_binds_and_limits(tmp_path):
    from gyre.config.harness import ContainerConfig
    from gyre.harness.container.engine import ContainerEngine
    from gyre.harness.container.images import ImageSet
    from gyre.harness.container.sandbox import ContainerSandbox, ExecutionDirs, container_name
    from gyre.tasks.spec import TaskEnvironment

    engine = ContainerEngine(kind="podman", binary="/usr/bin/podman")
    sandbox = ContainerSandbox(
        root=tmp_path,
        engine=engine,
        images=ImageSet(engine),
        settings=ContainerConfig(cpus=2, labels={"a": "b"}),
        limits=ResourceLimits(max_processes=256),
        run_label="r" * 16,
        ro_binds=(Path("/opt/python"),),
    )
    dirs = ExecutionDirs(
        root=tmp_path / "e", workspace=tmp_path / "e/workspace", home=tmp_path / "e/home", log_dir=tmp_path / "e/logs"
    )
    sandbox._catatonit = lambda: "/usr/bin/catatonit"  # the host's keeper binary (not needed to build argv)
    name = container_name("r" * 16, "exec/7")
    assert name.startswith("gyre-rrrrrrrrrrrr-exec_7-") and "/" not in name
    args = sandbox._run_args(name, "exec/7", TaskEnvironment(memory_mb=512), "img:1", dirs, "/workspace")
    labels = [args[i + 1] for i, a in enumerate(args) if a == "--label"]
    assert labels == ["gyre.run=" + "r" * 16, "gyre.execution=exec/7", "a=b"]
    assert args[args.index("--network") + 1] == "none"
    assert (args[args.index("--pids-limit") + 1], args[args.index("--cpus") + 1]) == ("256", "2")
    assert args[args.index("--memory") + 1] == "512m"
    mounts = [args[i + 1] for i, a in enumerate(args) if a == "-v"]
    assert mounts[0].endswith(":/run/gyre/keeper:ro")  # the host's catatonit, the keeper: nothing of the image
    assert args[args.index("--entrypoint") + 1] == "/run/gyre/keeper" and args[-1] == "-P"
    assert mounts[1] == f"{dirs.workspace}:/workspace" and "/opt/python:/opt/python:ro" in mounts
    assert not any(m.startswith(str(dirs.log_dir)) for m in mounts)  # the logs are the controller's
    with_internet = sandbox._run_args(name, "x", TaskEnvironment(allow_internet=True), "img:1", dirs, "/w")
    assert with_internet[with_internet.index("--network") + 1] == "slirp4netns"


def test_apptainer_argv_uses_cleanenv_and_prefixed_variables(tmp_path):
    context = make_context(tmp_path)
    spec = CommandRunner(argv=["sh"]).launch_spec(context)
    sandbox = ApptainerSandbox(root=tmp_path, image="/images/agent.sif")
    argv = sandbox.command(spec, context)
    assert argv[:5] == ["apptainer", "exec", "--containall", "--cleanenv", "--no-home"]
    assert argv[argv.index("--pwd") + 1] == str(context.workspace)
    assert argv[-2:] == ["/images/agent.sif", spec.argv[0]]
    env = sandbox._environment(spec, context)
    assert env["APPTAINERENV_OPENAI_API_KEY"] == "sk-exec-7" and "OPENAI_API_KEY" not in env
    with pytest.raises(ValueError, match="image is required"):
        ApptainerSandbox(root=tmp_path)


def test_the_builtin_runner_takes_its_tools_and_prompts_from_the_task(tmp_path):
    from gyre.harness.builtin.runner import BuiltinRunner
    from gyre.tasks.demo import generate_demo_tasks

    (task,) = generate_demo_tasks(1, seed=3, out_dir=tmp_path / "tasks")
    runner = BuiltinRunner.for_task(task, max_turns=4)
    context = ExecutionContext(
        execution_id="x1",
        task_prompt=task.prompt,
        workspace=tmp_path / "ws",
        home=tmp_path / "home",
        log_dir=tmp_path / "logs",
        anthropic_base_url="http://127.0.0.1:9",
        openai_base_url="http://127.0.0.1:9/v1",
        api_key="k",
        model="gyre",
    )
    spec = runner.launch_spec(context)
    argv = list(spec.argv)
    tools_file = Path(argv[argv.index("--tools") + 1])
    assert json.loads(spec.files[tools_file]) == list(task.metadata["tools"])
    assert argv[argv.index("--tools-impl") + 1] == task.metadata["tools_impl"]
    assert "--only-task-tools" in argv
    assert spec.files[Path(argv[argv.index("--system-prompt-file") + 1])] == task.metadata["system_prompt"]
    assert argv[argv.index("--final-answer-file") + 1] == "answer.txt"
    assert spec.files[tmp_path / "home" / "task.md"] == task.prompt


def test_container_argv_mounts_the_specs_read_only_paths_read_only(tmp_path):
    context = make_context(tmp_path)
    spec = dataclasses.replace(CommandRunner(argv=["sh"]).launch_spec(context), ro_paths=(Path("/opt/python"),))
    apptainer = ApptainerSandbox(root=tmp_path, image="/i.sif").command(spec, context)
    assert [apptainer[i + 1] for i, a in enumerate(apptainer) if a == "--bind"][-1] == "/opt/python:/opt/python:ro"
