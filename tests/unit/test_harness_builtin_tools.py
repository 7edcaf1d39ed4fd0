"""The builtin harness's tools: workspace confinement, shell timeouts and output caps, bad arguments as tool
errors, task tools as a plug-in; plus the agent loop's role headers, retries and compaction on a fake backend."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from gyre.config import AgentConfig
from gyre.harness.builtin.agent import (
    SUMMARY_INSTRUCTION,
    Agent,
    Backend,
    ModelCallError,
    PromptTooLongError,
    Reply,
    ToolCall,
    ToolResults,
    Transcript,
    TransientError,
    UserTurn,
)
from gyre.harness.builtin.runner import BuiltinRunner
from gyre.harness.builtin.tools import ToolBox, ToolResult, Workspace, builtin_tools, load_task_tools
from gyre.harness.protocol import ExecutionContext, HarnessRunner


@pytest.fixture
def box(tmp_path):
    (tmp_path / "ws").mkdir()
    return ToolBox(builtin_tools(Workspace(tmp_path / "ws"), shell_timeout_s=5.0, output_cap=100))


def test_write_then_read_inside_the_workspace(box, tmp_path):
    result = box.call("write_file", {"path": "sub/a.txt", "content": "hello"})
    assert not result.is_error and (tmp_path / "ws/sub/a.txt").read_text() == "hello"
    assert box.call("read_file", '{"path": "sub/a.txt"}').text == "hello"
    assert box.call("read_file", {"path": str(tmp_path / "ws/sub/a.txt")}).text == "hello"  # absolute, inside


@pytest.mark.parametrize("path", ["../outside.txt", "/etc/passwd", "sub/../../x", "link/x"])
def test_paths_escaping_the_workspace_are_tool_errors(box, tmp_path, path):
    (tmp_path / "ws/link").symlink_to(tmp_path)  # a symlink out of the workspace is followed, then refused
    for name, arguments in [("read_file", {"path": path}), ("write_file", {"path": path, "content": "x"})]:
        result = box.call(name, arguments)
        assert result.is_error and "outside the workspace" in result.text
    assert not (tmp_path / "outside.txt").exists() and not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        ("read_file", "{not json", "not valid JSON"),
        ("read_file", "[1, 2]", "must be a JSON object"),
        ("read_file", {}, "missing argument 'path'"),
        ("read_file", {"path": 3}, "must be str"),
        ("read_file", {"path": "missing.txt"}, "is not a file"),
        ("write_file", {"path": "a"}, "missing argument 'content'"),
        ("write_file", {"path": ".", "content": "x"}, "is a directory"),
        ("shell", {"command": "true", "timeout_s": True}, "must be int or float"),
        ("shell", {"command": "true", "timeout_s": 0}, "timeout_s must be in"),
        ("nope", {}, "unknown tool 'nope'"),
    ],
)
def test_bad_arguments_are_tool_errors_not_exceptions(box, name, arguments, message):
    result = box.call(name, arguments)
    assert result.is_error and message in result.text, result.text


def test_shell_runs_in_the_workspace_and_reports_the_exit_code(box, tmp_path):
    result = box.call("shell", {"command": "pwd; exit 3"})
    assert not result.is_error
    assert result.text.splitlines() == ["exit code 3", str((tmp_path / "ws").resolve())]


def test_shell_timeout_kills_the_process_group(box, tmp_path):
    start = time.monotonic()
    # the child's grandchild would write the file after 3 s if the group survived the kill
    result = box.call("shell", {"command": "(sleep 3; touch late) & sleep 30", "timeout_s": 0.5})
    assert time.monotonic() - start < 3.0
    assert result.text.startswith("timed out after 0.5 s")
    time.sleep(3.2)
    assert not (tmp_path / "ws/late").exists()


def test_shell_and_read_file_outputs_are_capped(box, tmp_path):
    result = box.call("shell", {"command": f"{sys.executable} -c \"print('x' * 100000)\""})
    assert "[... output truncated: 99901 more bytes]" in result.text
    assert result.text.splitlines()[1] == "x" * 100
    (tmp_path / "ws/big.txt").write_text("y" * 1000)
    assert box.call("read_file", {"path": "big.txt"}).text == "y" * 100 + "\n[... file truncated: 900 more bytes]"


def echo_tool(name, arguments, workspace):
    """A task tool for the test: `add` sums, `boom` raises."""
    if name == "boom":
        raise RuntimeError("kaput")
    return str(arguments["a"] + arguments["b"]) + f" in {Path(workspace).name}"


def test_task_tools_plug_in_by_schema_file_and_module_function(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    (tmp_path / "ws").mkdir()
    schemas = [{"name": "add", "description": "a+b", "input_schema": {"type": "object"}}, {"name": "boom"}]
    (tmp_path / "tools.json").write_text(json.dumps(schemas))
    tools = load_task_tools(tmp_path / "tools.json", [f"{__name__}:echo_tool"], Workspace(tmp_path / "ws"))
    box = ToolBox(tools)
    assert box.call("add", '{"a": 2, "b": 3}').text == "5 in ws"
    result = box.call("boom", {})
    assert result.is_error and "RuntimeError: kaput" in result.text  # the run goes on
    with pytest.raises(ValueError, match="module:function"):
        load_task_tools(tmp_path / "tools.json", ["no_colon"], Workspace(tmp_path / "ws"))
    with pytest.raises(ValueError, match="JSON list"):
        load_task_tools(tmp_path / "missing.json", ["a:b"], Workspace(tmp_path / "ws"))
    with pytest.raises(ValueError, match="no --tools-impl implements tool 'add'"):
        load_task_tools(tmp_path / "tools.json", [], Workspace(tmp_path / "ws"))


def shout(expression):
    """A per-tool implementation for the test: called with the arguments as keywords."""
    return expression.upper()


def test_task_tools_in_openai_shape_with_per_tool_keyword_implementations(tmp_path, monkeypatch):
    """The shape of `gyre.tasks.demo`'s metadata: OpenAI function schemas, one `module:function` per tool."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    (tmp_path / "ws").mkdir()
    schema = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
    entry = {"type": "function", "function": {"name": "shout", "description": "upper", "parameters": schema}}
    (tmp_path / "tools.json").write_text(json.dumps([entry]))
    (tool,) = load_task_tools(tmp_path / "tools.json", [f"shout={__name__}:shout"], Workspace(tmp_path / "ws"))
    assert (tool.name, tool.description, tool.input_schema) == ("shout", "upper", schema)
    box = ToolBox([tool])
    assert box.call("shout", {"expression": "1+1 ok"}) == ToolResult("1+1 OK")
    wrong = box.call("shout", {"text": "x"})  # a keyword the function does not take: a tool error
    assert wrong.is_error and "TypeError" in wrong.text
    with pytest.raises(ValueError, match="does not declare"):
        load_task_tools(
            tmp_path / "tools.json", [f"shout={__name__}:shout", f"other={__name__}:shout"], Workspace(tmp_path / "ws")
        )


class FakeBackend(Backend):
    """Answers from a list of replies or exceptions; records the headers and histories it was sent."""

    def __init__(self, script):
        self.script = list(script)
        self.calls: list[tuple[dict, list]] = []

    def complete(self, system, history, tools, headers):
        self.calls.append((dict(headers), list(history)))
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    def synthetic_call(self, call):
        return Reply(text="", tool_calls=(call,), raw={})


def reply(text="", *calls, tokens=10):
    return Reply(text=text, tool_calls=tuple(ToolCall(*c) for c in calls), raw={}, input_tokens=tokens)


def make_agent(tmp_path, backend, **config):
    (tmp_path / "ws").mkdir(exist_ok=True)
    box = ToolBox(builtin_tools(Workspace(tmp_path / "ws"), shell_timeout_s=5.0, output_cap=100))
    return Agent(backend, box, AgentConfig(retry_base_s=0.0, **config), Transcript(None), sleep=lambda s: None)


def test_agent_delegates_retries_and_compacts_with_the_right_roles(tmp_path):
    backend = FakeBackend(
        [
            reply("sub answer"),  # the forced delegation's sub-agent
            TransientError("HTTP 503"),  # retried
            reply("", ("c1", "write_file", {"path": "a.txt", "content": "hi"})),
            reply("", ("c2", "read_file", "{bad json")),
            PromptTooLongError("prompt is too long"),
            reply("<summary>wrote a.txt</summary>"),
            reply("done"),
        ]
    )
    result = make_agent(tmp_path, backend, force_delegation=True).run("the task")
    assert (result.status, result.text, result.turns, result.compactions) == ("answered", "done", 3, 1)
    roles = [headers["x-gyre-role"] for headers, _ in backend.calls]
    assert roles == ["sub-agent", "main", "main", "main", "main", "main-summary", "main"]
    assert backend.calls[0][0]["x-gyre-agent-id"].startswith("sub-")
    assert all("x-gyre-agent-id" not in headers for headers, _ in backend.calls[1:])
    summary_history = backend.calls[5][1]
    assert summary_history[-1] == UserTurn(SUMMARY_INSTRUCTION)
    final_history = backend.calls[6][1]  # task + summary, then the last exchange verbatim
    assert final_history[0].text.startswith("the task\n\n") and final_history[0].text.endswith("wrote a.txt")
    assert final_history[1].tool_calls[0].id == "c2" and isinstance(final_history[2], ToolResults)
    ((call_id, bad),) = final_history[2].results
    assert call_id == "c2" and bad.is_error and "not valid JSON" in bad.text
    assert len(final_history) == 3


def test_agent_stops_on_a_refused_request_and_on_exhausted_retries(tmp_path):
    with pytest.raises(ModelCallError, match="HTTP 401"):
        make_agent(tmp_path, FakeBackend([ModelCallError("HTTP 401: bad key")])).run("t")
    with pytest.raises(ModelCallError, match="gave up after 3 attempts"):
        make_agent(tmp_path, FakeBackend([TransientError("x")] * 3), max_retries=2).run("t")


def test_agent_compacts_proactively_near_the_context_limit_and_stops_at_max_turns(tmp_path):
    call = ("c", "shell", {"command": "true"})
    backend = FakeBackend([reply("", call, tokens=90), reply("<summary>s</summary>"), reply("", call, tokens=10)])
    result = make_agent(tmp_path, backend, context_limit=100, compact_fraction=0.8, max_turns=2).run("t")
    assert result.status == "max_turns" and result.turns == 2
    assert [h["x-gyre-role"] for h, _ in backend.calls] == ["main", "main-summary", "main"]


def test_sub_agent_compacts_with_its_own_role_and_agent_id(tmp_path):
    backend = FakeBackend(
        [
            reply("", ("s1", "shell", {"command": "echo hi"})),  # sub-agent
            PromptTooLongError("prompt is too long"),
            reply("<summary>sub summary</summary>"),
            reply("sub done"),
            reply("", ("m1", "delegate", '{"task": "look around"}')),  # main, after the forced delegation
            reply("second sub done"),  # a second sub-agent
            reply("", ("m2", "delegate", '{"task": 3}')),
            reply("main done"),
        ]
    )
    result = make_agent(tmp_path, backend, force_delegation=True).run("t")
    headers = [h for h, _ in backend.calls]
    roles = [h["x-gyre-role"] for h in headers]
    assert roles == ["sub-agent", "sub-agent", "sub-agent-summary", "sub-agent", "main", "sub-agent", "main", "main"]
    assert len({h["x-gyre-agent-id"] for h in headers[:4]}) == 1  # one sub-agent, one thread
    assert headers[5]["x-gyre-agent-id"] != headers[0]["x-gyre-agent-id"]  # each sub-agent its own
    assert backend.calls[5][1] == [UserTurn("look around")]  # an independent context: just its task
    assert result.status == "answered" and result.text == "main done"
    assert backend.calls[6][1][-1].results[0][1].text == "second sub done"
    bad = backend.calls[7][1][-1].results[0][1]
    assert bad.is_error and "'task' must be a non-empty string" in bad.text


def test_runner_launch_spec(tmp_path):
    runner = BuiltinRunner(backend="openai", extra_args=("--force-delegation",))
    assert isinstance(runner, HarnessRunner)
    runner.check()
    context = ExecutionContext(
        execution_id="e1",
        task_prompt="do it",
        workspace=tmp_path / "ws",
        home=tmp_path / "home",
        log_dir=tmp_path / "logs",
        anthropic_base_url="http://127.0.0.1:9",
        openai_base_url="http://127.0.0.1:9/v1",
        api_key="gyre-k",
        model="gyre",
        extra_env={"X": "1"},
    )
    spec = runner.launch_spec(context)
    assert spec.argv[:3] == (sys.executable, "-m", "gyre.harness.builtin") and spec.argv[-1] == "--force-delegation"
    assert spec.files == {tmp_path / "home/task.md": "do it"}
    assert spec.env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1" and spec.env["ANTHROPIC_API_KEY"] == "gyre-k"
    assert spec.env["X"] == "1" and spec.env["HOME"] == str(tmp_path / "home")
    with pytest.raises(ValueError, match="backend"):
        BuiltinRunner(backend="gemini")


def test_background_commands_are_ended_when_the_harness_stops(tmp_path):
    import os
    import time

    from gyre.harness.builtin.tools import kill_running_commands, run_shell

    out = run_shell("sleep 30 >/dev/null 2>&1 & echo $!", tmp_path, timeout_s=10, output_cap=1000)
    pid = int(out.split()[-1])
    os.kill(pid, 0)  # still running after the command returned (it left it in the background)
    kill_running_commands()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(")")[-1].split()[0] == "Z":
                    break  # killed, waiting to be reaped
        except FileNotFoundError:
            break  # gone
        time.sleep(0.05)
    else:
        raise AssertionError(f"background process {pid} survived kill_running_commands")
