"""`python -m gyre.harness.builtin [options] (TASK | --task-file FILE)`: run one agent episode.

Exit codes: 0 the model answered without tool calls (its answer is printed to stdout); 2 bad usage (one line on
stderr); 3 the model API refused a request or kept failing (the reason on stderr); 4 `--max-turns` reached
without a final answer. The transcript is `<log dir>/transcript.jsonl`. With `--check-command` the harness runs
that command in the workspace after the agent loop (the final answer already written), whatever its exit code.
See docs/builtin-harness.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_USAGE, EXIT_MODEL_ERROR, EXIT_MAX_TURNS = 0, 2, 3, 4
STARTED_ENV = "GYRE_HARNESS_STARTED"  # the harness's start (Unix time), in the check command's environment
PROG = "gyre.harness.builtin"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m {PROG}", description="gyre's builtin agent harness")
    parser.add_argument("task", nargs="?", help="the task prompt (or use --task-file)")
    parser.add_argument("--task-file", type=Path, help="read the task prompt from this file")
    parser.add_argument(
        "--backend",
        choices=("anthropic", "openai", "anthropic-http"),
        default="anthropic",
        help="anthropic: Messages API on the Anthropic SDK (ANTHROPIC_BASE_URL/ANTHROPIC_API_KEY); openai: Chat "
        "Completions on the OpenAI SDK (OPENAI_BASE_URL/OPENAI_API_KEY); anthropic-http: the Messages API over "
        "Python's own HTTP client, no SDK (ANTHROPIC_*)",
    )
    parser.add_argument("--model", default=os.environ.get("GYRE_MODEL", "gyre"), help="model name ($GYRE_MODEL)")
    parser.add_argument("--workspace", type=Path, default=Path.cwd(), help="directory the tools work in (default .)")
    parser.add_argument("--log-dir", type=Path, default=None, help="where transcript.jsonl goes (default: workspace)")
    parser.add_argument("--max-turns", type=int, default=30, help="model turns of the main agent")
    parser.add_argument("--sub-agent-max-turns", type=int, default=10, help="model turns of each sub-agent")
    parser.add_argument("--max-tokens", type=int, default=4096, help="output tokens asked per call")
    parser.add_argument(
        "--context-limit",
        type=int,
        default=0,
        help="tokens allowed per call, for proactive compaction (0: only on 'prompt is too long')",
    )
    parser.add_argument(
        "--compact-fraction",
        type=float,
        default=0.8,
        help="compact once the last call used this fraction of --context-limit",
    )
    parser.add_argument("--keep-tail", type=int, default=1, help="exchanges kept verbatim after a compaction")
    parser.add_argument("--force-compaction-after", type=int, default=0, help="compact every N main turns (tests)")
    parser.add_argument("--force-delegation", action="store_true", help="first turn delegates the task (tests)")
    parser.add_argument("--tools", type=Path, help="JSON list of extra tool schemas {name, description, input_schema}")
    parser.add_argument(
        "--tools-impl",
        action="append",
        default=[],
        help="implements --tools: 'module:function' called as f(name, arguments, workspace), or (repeatable) "
        "'NAME=module:function' called as f(**arguments)",
    )
    parser.add_argument(
        "--only-task-tools",
        action="store_true",
        help="offer only the --tools (no shell, files or delegate): short prompts for small models",
    )
    parser.add_argument("--system-prompt-file", type=Path, help="replaces the main agent's system prompt")
    parser.add_argument(
        "--final-answer-file", help="also write the final answer to this file (relative to the workspace)"
    )
    parser.add_argument(
        "--check-command",
        help="a shell command run in the workspace after the final answer, as an agent that runs the build or the "
        "test suite before it hands in would (its output goes to check.log in the log directory)",
    )
    parser.add_argument("--check-timeout", type=float, default=3600.0, help="seconds the check command may run")
    parser.add_argument("--shell-timeout", type=float, default=60.0, help="default seconds per shell command")
    parser.add_argument("--output-cap", type=int, default=16_000, help="bytes of tool output the model sees")
    parser.add_argument("--max-retries", type=int, default=4, help="retries of a transient failure per call")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per HTTP request")
    return parser


def _usage_error(message: str) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return EXIT_USAGE


def _stop_on_sigterm(signum: int, frame: object) -> None:
    """The sandbox stops the harness (timeout, cancel): end the shell commands' own process groups, then exit at
    once. Not `sys.exit`: its SystemExit is raised wherever the main thread is, and a bare `except:` there (in a
    library being imported, say) would swallow it and the harness would run on; nor an import here, which may meet
    the same module half-imported. The transcript is flushed line by line, so nothing written is lost."""
    tools = sys.modules.get("gyre.harness.builtin.tools")  # not imported yet: no command can be running
    if tools is not None and hasattr(tools, "kill_running_commands"):
        tools.kill_running_commands()
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault(STARTED_ENV, repr(time.time()))  # the check command may count the harness's time so far
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return _main(argv)
    finally:
        from gyre.harness.builtin.tools import kill_running_commands

        kill_running_commands()


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from gyre.config import AgentConfig
    from gyre.harness.builtin.agent import (
        DELEGATE,
        MAIN_SYSTEM,
        Agent,
        AnthropicBackend,
        AnthropicHTTPBackend,
        ModelCallError,
        OpenAIChatBackend,
        Transcript,
    )
    from gyre.harness.builtin.tools import ToolBox, ToolError, Workspace, builtin_tools, load_task_tools

    if (args.task is None) == (args.task_file is None):
        return _usage_error("give the task either as an argument or with --task-file, not both")
    if (args.tools is None) != (not args.tools_impl):
        return _usage_error("--tools and --tools-impl go together")
    try:
        task = args.task if args.task is not None else args.task_file.read_text()
        workspace = Workspace(args.workspace)
        if args.only_task_tools and args.tools is None:
            raise ValueError("--only-task-tools needs --tools")
        tools = (
            []
            if args.only_task_tools
            else builtin_tools(workspace, shell_timeout_s=args.shell_timeout, output_cap=args.output_cap)
        )
        if args.tools is not None:
            tools += load_task_tools(args.tools, args.tools_impl, workspace)
        toolbox = ToolBox(tools)
        system = args.system_prompt_file.read_text() if args.system_prompt_file else MAIN_SYSTEM
        answer_path = workspace.resolve(args.final_answer_file) if args.final_answer_file else None
        if DELEGATE in toolbox.tools:
            raise ValueError(f"--tools: the name {DELEGATE!r} is taken by the builtin delegation tool")
        config = AgentConfig(
            max_turns=args.max_turns,
            sub_agent_max_turns=args.sub_agent_max_turns,
            context_limit=args.context_limit,
            compact_fraction=args.compact_fraction,
            keep_tail=args.keep_tail,
            force_compaction_after=args.force_compaction_after,
            force_delegation=args.force_delegation,
            delegation=not args.only_task_tools,
            max_retries=args.max_retries,
        )
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens: got {args.max_tokens}, expected an integer >= 1")
        if not args.check_timeout > 0:
            raise ValueError(f"--check-timeout: got {args.check_timeout}, expected a positive number of seconds")
    except (OSError, ValueError, ToolError) as err:
        return _usage_error(str(err))
    env_prefix = "OPENAI" if args.backend == "openai" else "ANTHROPIC"
    base_url, api_key = os.environ.get(f"{env_prefix}_BASE_URL"), os.environ.get(f"{env_prefix}_API_KEY")
    if not api_key:
        return _usage_error(f"{env_prefix}_API_KEY is not set")
    backend_type = {
        "anthropic": AnthropicBackend,
        "openai": OpenAIChatBackend,
        "anthropic-http": AnthropicHTTPBackend,
    }[args.backend]
    backend = backend_type(
        model=args.model, max_tokens=args.max_tokens, timeout_s=args.request_timeout, base_url=base_url, api_key=api_key
    )
    log_dir = args.log_dir or workspace.root
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / "transcript.jsonl").open("a") as stream:
        transcript = Transcript(stream)
        transcript.write("start", backend=args.backend, model=args.model, base_url=base_url, task=task)
        agent = Agent(backend, toolbox, config, transcript, main_system=system)
        try:
            result = agent.run(task)
        except ModelCallError as err:
            transcript.write("end", status="error", error=str(err))
            print(f"{PROG}: {err}", file=sys.stderr)
            return EXIT_MODEL_ERROR
        if result.status != "max_turns" and answer_path is not None:  # before the check: a stop during it keeps it
            answer_path.parent.mkdir(parents=True, exist_ok=True)
            answer_path.write_text(result.text)
        if args.check_command:
            _run_check(args, workspace, log_dir, transcript)
        transcript.write("end", status=result.status, turns=result.turns, compactions=result.compactions)
    if result.status == "max_turns":
        print(f"{PROG}: stopped after --max-turns {args.max_turns} without a final answer", file=sys.stderr)
        return EXIT_MAX_TURNS
    print(result.text)
    print(
        json.dumps({"status": result.status, "turns": result.turns, "compactions": result.compactions}), file=sys.stderr
    )
    return EXIT_OK


def _run_check(args: argparse.Namespace, workspace, log_dir: Path, transcript) -> None:
    """The --check-command, in the workspace, its own process group (killed at its timeout, or with the harness)."""
    from gyre.harness.builtin.tools import run_shell

    started = time.monotonic()
    transcript.write("check", command=args.check_command)
    report = run_shell(args.check_command, workspace.root, timeout_s=args.check_timeout, output_cap=args.output_cap)
    (log_dir / "check.log").write_text(report)
    transcript.write("check_end", status=report.split("\n", 1)[0], seconds=round(time.monotonic() - started, 3))


if __name__ == "__main__":
    sys.exit(main())
