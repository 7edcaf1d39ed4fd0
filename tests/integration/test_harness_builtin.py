"""gyre's builtin harness as a process against a real `python -m gyre.serve`: roles on the wire, compaction,
delegation, tools, and a run with the real tiny model.

The served engine in the scripted tests is `gyre.engine.scripted.ScriptedEngine` (with `chat_reply`, as in
test_proxy_tool_round_trips.py) — a stand-in named as such, served by the real engine endpoint in this process and
given to `gyre.serve engine.enabled=false engine_urls=[...]` — that reads the prompt and answers as a tool-using
model would, in the tiny model's Hermes format:
- a summary request (the prompt holds the harness's summary instruction) -> `<summary>SUMMARY-MARK ...</summary>`,
  carrying `CAT-hi` if the prompt did (a summarizer that keeps the facts);
- a sub-agent (its system prompt) -> `shell echo SUB-$((40+2))`, then, once `SUB-42` is in the prompt, an answer;
- the calculator task (with its system prompt) -> `calculator 6*7`, then (`42` in the prompt) the answer;
- the main agent -> `write_file hello.txt hi`, then (its result in the prompt) `shell echo CAT-$(cat hello.txt)`
  plus a long listing, then (`CAT-hi` or a summary in the prompt) the final answer `DONE`.
Everything else is real: the proxy process, HTTP, the SDKs inside the harness process, the record files.

Time on 2 cores: ~5 s per gyre.serve start, ~1-2 s per harness run; the tiny-model run ~10-20 s.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from serve_process import start_serve

from gyre.engine.endpoint import ServerThread
from gyre.engine.scripted import ScriptedEngine, chat_reply
from gyre.harness.builtin.agent import SUB_AGENT_SYSTEM, SUMMARY_INSTRUCTION
from gyre.harness.builtin.runner import BuiltinRunner
from gyre.harness.protocol import ExecutionContext
from gyre.models.tiny import tiny_model_dir
from gyre.proxy.render import ChatTemplate
from gyre.traj.roles import Role, classifier_for, classify_leaves
from gyre.traj.store import load_tree

pytestmark = pytest.mark.slow

HARNESS_TIMEOUT_S = 120
TASK = "Create hello.txt containing hi, check it, then say DONE."
CALC_TASK = "What is 6*7? Use the calculator."
FORCED = ("--force-delegation", "--sub-agent-max-turns", "2")
# The main agent's first two prompts are ~1,000-1,100 tokens (system prompt and tool schemas in the tiny
# tokenizer); its third carries the ~1,200-token listing and gets 400 "prompt is too long". So does the summary
# request with that listing, until the harness drops it; the history after compaction (task + summary) fits.
TIGHT_CONTEXT_LIMIT = 1600


def _call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def scripted_answer(prompt: str) -> str:
    if SUMMARY_INSTRUCTION in prompt:
        return "<summary>SUMMARY-MARK" + (" CAT-hi" if "CAT-hi" in prompt else "") + "</summary>"
    if SUB_AGENT_SYSTEM in prompt:
        return "SUB-ANSWER 42" if "SUB-42" in prompt else _call("shell", {"command": "echo SUB-$((40+2))"})
    if CALC_TASK in prompt:
        if "careful assistant" not in prompt:  # the task's own system prompt
            return "NO-SYSTEM-PROMPT"
        done = "<tool_response>\n42\n</tool_response>" in prompt
        return "The answer is 42." if done else _call("calculator", {"expression": "6*7"})
    if "CAT-hi" in prompt or "SUMMARY-MARK" in prompt:
        return "DONE"
    if "wrote 2 bytes to hello.txt" in prompt:
        return _call("shell", {"command": "echo CAT-$(cat hello.txt); seq 1000 1250"})
    return _call("write_file", {"path": "hello.txt", "content": "hi"})


@pytest.fixture(scope="module")
def scripted_url():
    template = ChatTemplate.from_pretrained(tiny_model_dir())
    thread = ServerThread(lambda: ScriptedEngine(chat_reply(template, lambda request, prompt: scripted_answer(prompt))))
    yield thread.start()
    thread.stop()


def _serve(tmp_path_factory, name: str, *overrides: str):
    served = start_serve(tmp_path_factory.mktemp(name), "executions=4", *overrides)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def scripted_serve(tmp_path_factory, scripted_url):
    yield from _serve(tmp_path_factory, "scripted", "engine.enabled=false", f"engine_urls=[{scripted_url}]")


@pytest.fixture(scope="module")
def tight_serve(tmp_path_factory, scripted_url):
    yield from _serve(
        tmp_path_factory,
        "tight",
        "engine.enabled=false",
        f"engine_urls=[{scripted_url}]",
        f"proxy.context_limit={TIGHT_CONTEXT_LIMIT}",
    )


# Each backend on its own execution of the served keys: the two SDKs, and the Messages API with no SDK.
BACKENDS = [("anthropic", "exec-00000"), ("openai", "exec-00001"), ("anthropic-http", "exec-00003")]


def run_harness(served, execution: str, tmp_path: Path, *, backend="anthropic", extra_args=(), max_turns=10, task=TASK):
    """Start the harness exactly as an execution would (`BuiltinRunner.launch_spec`); (returncode, transcript)."""
    context = ExecutionContext(
        execution_id=execution,
        task_prompt=task,
        workspace=tmp_path / "workspace",
        home=tmp_path / "home",
        log_dir=tmp_path / "logs",
        anthropic_base_url=served.anthropic_url,
        openai_base_url=served.openai_url,
        api_key=served.keys[execution],
        model="gyre",
    )
    spec = BuiltinRunner(backend=backend, max_turns=max_turns, extra_args=extra_args).launch_spec(context)
    context.workspace.mkdir(parents=True)
    for path, text in spec.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    done = subprocess.run(
        spec.argv,
        env=dict(spec.env),
        cwd=context.workspace,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=HARNESS_TIMEOUT_S,
    )
    transcript_path = context.home / "transcript.jsonl"
    events = [json.loads(line) for line in transcript_path.read_text().splitlines()] if transcript_path.exists() else []
    return done, events


def roles_of(served, execution: str) -> list[Role]:
    tree = load_tree(served.records / f"{execution}.jsonl")
    return sorted(classify_leaves(tree, classifier_for("builtin")).values(), key=lambda role: role.rank)


@pytest.mark.parametrize(("backend", "execution"), BACKENDS)
def test_delegation_forced_compaction_and_tools_record_every_role(scripted_serve, tmp_path, backend, execution):
    flags = ("--force-delegation", "--force-compaction-after", "2")
    done, events = run_harness(scripted_serve, execution, tmp_path, backend=backend, extra_args=flags)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "DONE"
    assert (tmp_path / "workspace/hello.txt").read_text() == "hi"
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end" and events[-1]["status"] == "answered"
    (compaction,) = [e for e in events if e["event"] == "compaction"]
    assert compaction["reason"] == "forced" and compaction["summary"] == "SUMMARY-MARK CAT-hi"
    tools = [(e["agent"] == "main", e["name"], e["is_error"]) for e in events if e["event"] == "tool"]
    assert tools == [
        (False, "shell", False),  # the sub-agent's, written before the delegate call it answers
        (True, "delegate", False),
        (True, "write_file", False),
        (True, "shell", False),
    ]
    assert [e["result"] for e in events if e["event"] == "tool"][1] == "SUB-ANSWER 42"
    # the recorded tree: the sub-agent's thread, the main path up to its summary request, the main path after it
    assert roles_of(scripted_serve, execution) == [Role.MAIN, Role.MAIN_SUMMARY, Role.SUB_AGENT]


def test_task_tools_system_prompt_and_answer_file_as_the_demo_task_declares_them(scripted_serve, tmp_path):
    from gyre.tasks.demo import CALCULATOR_TOOL, SYSTEM_PROMPT

    (tmp_path / "tools.json").write_text(json.dumps([CALCULATOR_TOOL]))  # OpenAI-shaped schema
    (tmp_path / "system.txt").write_text(SYSTEM_PROMPT)
    flags = (
        *("--tools", str(tmp_path / "tools.json"), "--tools-impl", "calculator=gyre.tasks.demo.calculator:calculator"),
        *("--system-prompt-file", str(tmp_path / "system.txt"), "--final-answer-file", "answer.txt"),
    )
    done, events = run_harness(
        scripted_serve, "exec-00002", tmp_path, backend="openai", extra_args=flags, task=CALC_TASK
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "workspace/answer.txt").read_text() == "The answer is 42."
    (tool,) = [e for e in events if e["event"] == "tool"]
    assert (tool["name"], tool["result"], tool["is_error"]) == ("calculator", "42", False)
    assert roles_of(scripted_serve, "exec-00002") == [Role.MAIN]


@pytest.mark.parametrize(("backend", "execution"), BACKENDS)
def test_prompt_too_long_triggers_reactive_compaction(tight_serve, tmp_path, backend, execution):
    done, events = run_harness(tight_serve, execution, tmp_path, backend=backend)
    assert done.returncode == 0, [(e["event"], e.get("input_tokens"), e.get("summary"), e.get("text")) for e in events]
    assert done.stdout.strip() == "DONE"
    compactions = [e for e in events if e["event"] == "compaction"]
    assert [e["reason"] for e in compactions] == ["prompt too long"] * 2
    # the history with the last exchange kept is still too long, so the second compaction keeps no tail
    assert [e["kept_turns"] for e in compactions] == [2, 0]
    roles = roles_of(tight_serve, execution)
    assert Role.MAIN_SUMMARY in roles and Role.MAIN in roles and Role.SUB_AGENT not in roles


@pytest.mark.parametrize("backend", ["anthropic", "anthropic-http"])
def test_a_refused_request_ends_the_run_with_a_clear_message(scripted_serve, tmp_path, backend):
    scripted_serve.keys["bad"] = "gyre-not-a-key"
    done, events = run_harness(scripted_serve, "bad", tmp_path, backend=backend, extra_args=("--max-retries", "0"))
    assert done.returncode == 3
    assert "HTTP 401" in done.stderr and "no execution has this key" in done.stderr
    assert events[-1]["event"] == "end" and events[-1]["status"] == "error"


@pytest.fixture(scope="module")
def tiny_serve(tmp_path_factory):
    yield from _serve(tmp_path_factory, "tiny", "proxy.sampling.max_new_tokens=24")


@pytest.mark.parametrize(("backend", "execution"), BACKENDS[:2])  # the two SDKs on the real model
def test_runs_to_exit_with_the_real_tiny_model(tiny_serve, tmp_path, backend, execution):
    """Random weights write nonsense, almost never a parseable tool call: the run ends on the first answer. The
    forced delegation puts a real sub-agent thread (its own agent id) through the proxy too."""
    done, events = run_harness(tiny_serve, execution, tmp_path, backend=backend, max_turns=3, extra_args=FORCED)
    assert done.returncode in (0, 4), done.stderr[-3000:]  # answered, or --max-turns reached
    assert events[-1]["event"] == "end" and events[-1]["status"] in ("answered", "max_turns")
    assert 1 <= sum(e["event"] == "turn" and e["agent"] == "main" for e in events) <= 3
    assert set(roles_of(tiny_serve, execution)) == {Role.MAIN, Role.SUB_AGENT}
