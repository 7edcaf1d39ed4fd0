"""The builtin harness's tools: `shell`, `read_file`, `write_file`, confined to one workspace, plus task tools.

Contract:
- A tool call never raises into the agent loop: bad arguments (unparseable JSON, not an object, missing or
  wrongly typed fields), an unknown tool, a path that escapes the workspace, a timeout, a missing file, and an
  exception inside a task's own tool all come back as a `ToolResult` with `is_error=True` and a message the
  model can act on.
- Paths are resolved against the workspace (symlinks followed); a result outside it is an error.
- `shell` runs `/bin/sh -c <command>` in the workspace in its own process group, killed as a group at the
  timeout; stdout and stderr (merged) go through a temporary file, so a command that prints gigabytes costs
  disk, not memory, and the model sees at most `output_cap` bytes of it.
- Task tools: a JSON file with a list of `{"name", "description", "input_schema"}` and an implementation
  `module:function` called as `function(name, arguments, workspace) -> str` (see docs/builtin-harness.md).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_OUTPUT_CAP = 16_000  # bytes of tool output the model sees (~4-8K tokens)
DEFAULT_SHELL_TIMEOUT_S = 60.0
MAX_SHELL_TIMEOUT_S = 600.0  # what a model may ask for with `timeout_s`


class ToolError(Exception):
    """A tool could not do what was asked; the message goes to the model as an error result."""


@dataclass(frozen=True)
class ToolResult:
    text: str
    is_error: bool = False


# arguments -> result text; raise ToolError for an error the model should see.
ToolFunction = Callable[[Mapping[str, Any]], str]


@dataclass(frozen=True)
class Tool:
    """One tool as the model sees it (name, description, JSON schema) and its implementation."""

    name: str
    description: str
    input_schema: Mapping[str, Any]
    function: ToolFunction = field(compare=False)


def parse_arguments(arguments: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """A tool call's arguments as a dict: JSON text (OpenAI) or an already-parsed object (Anthropic)."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise ToolError(f"the arguments are not valid JSON ({err}); send a JSON object") from None
    if not isinstance(arguments, Mapping):
        raise ToolError(f"the arguments must be a JSON object, got {type(arguments).__name__}")
    return dict(arguments)


def _field(arguments: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if name not in arguments:
        if default is ...:
            raise ToolError(f"missing argument {name!r}")
        return default
    value = arguments[name]
    if (isinstance(value, bool) and kind in (int, float, (int, float))) or not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ToolError(f"argument {name!r} must be {expected}, got {type(value).__name__}")
    return value


class Workspace:
    """The directory the agent works in; every path a tool touches must resolve inside it."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ValueError(f"workspace {str(root)!r} is not a directory")

    def resolve(self, path: str) -> Path:
        if not path:
            raise ToolError("path is empty")
        candidate = (self.root / path).resolve()  # an absolute `path` replaces the root: checked below
        if candidate != self.root and self.root not in candidate.parents:
            raise ToolError(f"path {path!r} is outside the workspace; use a path relative to {self.root}")
        return candidate


def shell_tool(workspace: Workspace, *, timeout_s: float, output_cap: int) -> Tool:
    def run(arguments: Mapping[str, Any]) -> str:
        command = _field(arguments, "command", str)
        timeout = float(_field(arguments, "timeout_s", (int, float), timeout_s))
        if not 0 < timeout <= MAX_SHELL_TIMEOUT_S:
            raise ToolError(f"timeout_s must be in (0, {MAX_SHELL_TIMEOUT_S:g}], got {timeout:g}")
        return run_shell(command, workspace.root, timeout_s=timeout, output_cap=output_cap)

    schema = {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "a /bin/sh command line, run in the workspace"},
            "timeout_s": {"type": "number", "description": f"seconds before it is killed (default {timeout_s:g})"},
        },
        "required": ["command"],
    }
    return Tool("shell", "Run a shell command in the workspace; returns its exit code and output.", schema, run)


# Process groups of the shell commands started: a command gets its own group (so its timeout kills its children
# too), which takes it and what it leaves in the background out of the harness's group; `kill_running_commands`
# ends them when the harness is stopped (SIGTERM from its sandbox) or exits, so nothing keeps writing into the
# workspace being scored.
_RUNNING_GROUPS: set[int] = set()


def kill_running_commands() -> None:
    """SIGKILL every shell command group that may still have members (the harness is stopping)."""
    for pgid in list(_RUNNING_GROUPS):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        _RUNNING_GROUPS.discard(pgid)


def run_shell(command: str, cwd: Path, *, timeout_s: float, output_cap: int) -> str:
    """Run `command`; its exit code and (capped) merged output. A timeout kills its whole process group; what a
    finished command left in the background runs on until the harness ends (`kill_running_commands`)."""
    with tempfile.TemporaryFile() as out:
        process = subprocess.Popen(
            ["/bin/sh", "-c", command],
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the timeout kills children too
        )
        _RUNNING_GROUPS.add(process.pid)
        try:
            code = process.wait(timeout=timeout_s)
            status = f"exit code {code}"
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # the group we created for this command, by its id
            process.wait()
            _RUNNING_GROUPS.discard(process.pid)
            status = f"timed out after {timeout_s:g} s (killed)"
        out.seek(0)
        output = out.read(output_cap + 1)
        size = out.seek(0, os.SEEK_END)
    text = output[:output_cap].decode(errors="ignore")
    if size > output_cap:
        text += f"\n[... output truncated: {size - output_cap} more bytes]"
    return f"{status}\n{text}"


def read_file_tool(workspace: Workspace, *, output_cap: int) -> Tool:
    def run(arguments: Mapping[str, Any]) -> str:
        path = workspace.resolve(_field(arguments, "path", str))
        if not path.is_file():
            raise ToolError(f"{arguments['path']!r} is not a file")
        with path.open("rb") as f:
            data = f.read(output_cap + 1)
        size = path.stat().st_size
        text = data[:output_cap].decode(errors="replace")
        if size > output_cap:
            text += f"\n[... file truncated: {size - output_cap} more bytes]"
        return text

    schema = {
        "type": "object",
        "properties": {"path": {"type": "string", "description": "relative to the workspace"}},
        "required": ["path"],
    }
    return Tool("read_file", "Read a text file of the workspace.", schema, run)


def write_file_tool(workspace: Workspace) -> Tool:
    def run(arguments: Mapping[str, Any]) -> str:
        path = workspace.resolve(_field(arguments, "path", str))
        content = _field(arguments, "content", str)
        if path.is_dir():
            raise ToolError(f"{arguments['path']!r} is a directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        return f"wrote {len(content.encode())} bytes to {path.relative_to(workspace.root)}"

    schema = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "relative to the workspace; parents are created"},
            "content": {"type": "string"},
        },
        "required": ["path", "content"],
    }
    return Tool("write_file", "Write (create or replace) a text file in the workspace.", schema, run)


def builtin_tools(workspace: Workspace, *, shell_timeout_s: float, output_cap: int) -> list[Tool]:
    return [
        shell_tool(workspace, timeout_s=shell_timeout_s, output_cap=output_cap),
        read_file_tool(workspace, output_cap=output_cap),
        write_file_tool(workspace),
    ]


def _schema(entry: Any, source: str) -> tuple[str, str, Mapping[str, Any]]:
    """(name, description, input schema) of an Anthropic-shaped or OpenAI-shaped tool schema."""
    if isinstance(entry, dict) and entry.get("type") == "function" and isinstance(entry.get("function"), dict):
        entry = {**entry["function"], "input_schema": entry["function"].get("parameters")}
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
        raise ValueError(f"{source}: each tool needs a non-empty string 'name', got {entry!r:.200}")
    schema = entry.get("input_schema") or {"type": "object", "properties": {}}
    return entry["name"], str(entry.get("description", "")), schema


def _import(target: str, source: str) -> Callable[..., Any]:
    module_name, _, function_name = target.partition(":")
    if not module_name or not function_name:
        raise ValueError(f"{source} {target!r}: expected 'module:function'")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{source} {target!r}: {err}") from None
    if not callable(function):
        raise ValueError(f"{source} {target!r} is not callable")
    return function


def load_task_tools(schema_file: str | Path, implementations: Iterable[str], workspace: Workspace) -> list[Tool]:
    """Task tools: schemas from `schema_file` (a JSON list, Anthropic `{name, description, input_schema}` or OpenAI
    `{"type": "function", "function": {name, description, parameters}}` entries), implemented by `implementations`:
    - `module:function`: one dispatcher for every tool, called as `function(name, arguments, workspace_path)`;
    - `name=module:function`: that tool alone, called with the arguments as keywords (`function(**arguments)`).
    A per-tool implementation wins over the dispatcher. ValueError naming what is wrong (a user error)."""
    source = f"--tools {schema_file}"
    try:
        entries = json.loads(Path(schema_file).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{source}: cannot read a JSON list of tool schemas: {err}") from None
    if not isinstance(entries, list):
        raise ValueError(f"{source}: expected a JSON list of tool schemas, got {type(entries).__name__}")
    dispatcher: Callable[..., Any] | None = None
    per_tool: dict[str, Callable[..., Any]] = {}
    for target in implementations:
        name, equals, rest = target.partition("=")
        if equals:
            per_tool[name] = _import(rest, "--tools-impl")
        elif dispatcher is None:
            dispatcher = _import(target, "--tools-impl")
        else:
            raise ValueError(f"--tools-impl {target!r}: only one dispatcher 'module:function' may be given")

    def bind(name: str) -> ToolFunction:
        if name in per_tool:
            return lambda arguments: str(per_tool[name](**arguments))
        if dispatcher is not None:
            return lambda arguments: str(dispatcher(name, arguments, workspace.root))
        raise ValueError(f"{source}: no --tools-impl implements tool {name!r}")

    tools = []
    for entry in entries:
        name, description, schema = _schema(entry, source)
        tools.append(Tool(name, description, schema, bind(name)))
    unknown = set(per_tool) - {t.name for t in tools}
    if unknown:
        raise ValueError(f"--tools-impl names tools that {schema_file} does not declare: {sorted(unknown)}")
    return tools


class ToolBox:
    """Tools by name; `call` turns every failure into an error result."""

    def __init__(self, tools: Iterable[Tool]):
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool

    def without(self, *names: str) -> ToolBox:
        return ToolBox(t for n, t in self.tools.items() if n not in names)

    def call(self, name: str, arguments: str | Mapping[str, Any] | None) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(f"error: unknown tool {name!r}; available: {', '.join(self.tools)}", is_error=True)
        try:
            return ToolResult(tool.function(parse_arguments(arguments)))
        except ToolError as err:
            return ToolResult(f"error: {err}", is_error=True)
        except OSError as err:  # a file the tool could not read or write: the model can pick another
            return ToolResult(f"error: {err}", is_error=True)
        except Exception as err:  # a task's tool raised: the model sees it and the run goes on; logged in full
            log.exception("tool %r raised", name)
            return ToolResult(f"error: tool {name!r} failed: {type(err).__name__}: {err}", is_error=True)
