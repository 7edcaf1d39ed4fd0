"""The real `anthropic` and `openai` SDKs against a running `python -m gyre.serve` (tiny model, real HTTP).

What is checked: streaming and non-streaming calls of all three dialects, multi-turn histories that extend a
recorded path (the echoed answer is restored, so stored tokens equal unique tokens), a harness-side tool round
trip, usage counts, 401 on a bad key, the prompt-too-long 400 that makes Claude Code compact, count_tokens, and
that every call is in the execution's record file. The model is random: its text is nonsense.
"""

from __future__ import annotations

import anthropic
import openai
import pytest
from serve_process import start_serve

from gyre.traj.store import load_tree

MAX_NEW = 24


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("serve")
    overrides = ["executions=4", f"proxy.sampling.max_new_tokens={MAX_NEW}", "proxy.context_limit=2048"]
    server = start_serve(run_dir, *overrides)
    yield server
    assert server.stop() == 0


def execution(served, index: int) -> tuple[str, str]:
    name = f"exec-{index:05d}"
    return name, served.keys[name]


def anthropic_client(served, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.anthropic_url, api_key=key, max_retries=0, timeout=60)


def openai_client(served, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.openai_url, api_key=key, max_retries=0, timeout=60)


def test_anthropic_multi_turn_extends_the_recorded_path_streaming_and_not(served):
    name, key = execution(served, 0)
    client = anthropic_client(served, key)
    system = [{"type": "text", "text": "You are a careful assistant.", "cache_control": {"type": "ephemeral"}}]
    history = [{"role": "user", "content": "What is 2+3?"}]
    first = client.messages.create(model="gyre", max_tokens=64, system=system, messages=history)
    assert first.role == "assistant" and first.stop_reason in {"end_turn", "max_tokens"}
    assert 1 <= first.usage.output_tokens <= MAX_NEW and first.usage.input_tokens > 10
    history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}]
    history += [{"role": "user", "content": "And 4+4?"}]
    with client.messages.stream(model="gyre", max_tokens=64, system=system, messages=history) as stream:
        deltas = [event.text for event in stream if event.type == "text"]
        second = stream.get_final_message()
    assert "".join(deltas) == "".join(b.text for b in second.content if b.type == "text")
    assert second.usage.output_tokens >= 1
    assert second.usage.cache_read_input_tokens > 0  # the engine reused the first call's KV (same execution)
    count = client.messages.count_tokens(model="gyre", system=system, messages=history)
    assert count.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens

    tree = load_tree(served.records / f"{name}.jsonl")
    assert len(tree.calls) == 2
    first_call, second_call = tree.calls
    assert second_call.parent == first_call.response_node  # our answer was restored exactly: the path extends
    stats = tree.stats()
    assert stats.leaves == 1 and stats.tokens_stored == stats.tokens_expanded  # stored tokens = unique tokens


def test_a_harness_side_tool_round_trip_is_accepted_and_recorded(served):
    name, key = execution(served, 1)
    client = anthropic_client(served, key)
    tools = [
        {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}},
        }
    ]
    messages = [
        {"role": "user", "content": "Use the calculator for 6*7."},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_h1", "name": "calculator", "input": {"expression": "6*7"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_h1", "content": "42"}]},
    ]
    reply = client.messages.create(model="gyre", max_tokens=32, tools=tools, messages=messages)
    assert reply.stop_reason in {"end_turn", "max_tokens", "tool_use"}
    tree = load_tree(served.records / f"{name}.jsonl")
    labels = [segment.provenance.label for segment in tree.calls[0].segments]
    assert {"system", "user", "harness_assistant", "tool"} <= set(labels)


def test_openai_chat_and_responses_streaming_and_not_with_usage(served):
    name, key = execution(served, 2)
    client = openai_client(served, key)
    chat = client.chat.completions.create(model="gyre", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            model="gyre",
            max_tokens=16,
            messages=[{"role": "user", "content": "hi again"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    response = client.responses.create(model="gyre", max_output_tokens=16, input="hello")
    assert response.status in {"completed", "incomplete"} and response.usage.output_tokens >= 1
    with client.responses.stream(model="gyre", max_output_tokens=16, input="hello there") as stream:
        events = list(stream)
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    # cut by max_output_tokens, a response ends "incomplete", as the real API's does (no response.completed)
    assert events[-1].type in {"response.completed", "response.incomplete"}
    assert text == events[-1].response.output_text and events[-1].response.usage.output_tokens >= 1
    assert len(load_tree(served.records / f"{name}.jsonl").calls) == 4


def test_a_bad_key_gets_401_in_each_dialect(served):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client(served, "gyre-not-a-key").messages.create(
            model="gyre", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.AuthenticationError):
        openai_client(served, "gyre-not-a-key").chat.completions.create(
            model="gyre", messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.AuthenticationError):
        openai_client(served, "gyre-also-wrong").responses.create(model="gyre", input="x")


def test_a_prompt_beyond_the_context_limit_gets_the_400_that_makes_claude_code_compact(served):
    name, key = execution(served, 3)
    long_text = "word " * 4000  # well over the 2048-token limit of this server
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client(served, key).messages.create(
            model="gyre", max_tokens=8, messages=[{"role": "user", "content": long_text}]
        )
    assert caught.value.status_code == 400
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert caught.value.body["error"]["message"].startswith("prompt is too long")
    with pytest.raises(openai.BadRequestError) as caught_openai:
        openai_client(served, key).chat.completions.create(
            model="gyre", messages=[{"role": "user", "content": long_text}]
        )
    assert caught_openai.value.code == "context_length_exceeded"
    assert not (served.records / f"{name}.jsonl").exists() or not load_tree(served.records / f"{name}.jsonl").calls
