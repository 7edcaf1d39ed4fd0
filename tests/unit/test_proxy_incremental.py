"""Incremental dialect parsing gives exactly what a full parse gives, request after request."""

from __future__ import annotations

import copy

import pytest

from gyre.proxy.conversation import ApiError
from gyre.proxy.dialects import anthropic, openai_chat
from gyre.proxy.dialects.incremental import MessageCache


def anthropic_history(steps: int) -> list[list[dict]]:
    """Requests of a Claude Code-like thread: each the previous one + our answer + a tool result; the last block
    of the newest user message carries cache_control (it moves every turn)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "fix the bug"}]}]
    requests = []
    for step in range(steps):
        current = copy.deepcopy(messages)
        current[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        requests.append(current)
        call = {"type": "tool_use", "id": f"toolu_{step}", "name": "read", "input": {"path": f"f{step}.py"}}
        messages.append({"role": "assistant", "content": [{"type": "text", "text": f"step {step}"}, call]})
        if step % 3 == 2:
            messages.append({"role": "system", "content": "reminder"})
        result = {"type": "tool_result", "tool_use_id": f"toolu_{step}", "content": f"contents {step}"}
        messages.append({"role": "user", "content": [result, {"type": "text", "text": "go on"}]})
    return requests


def body(messages: list[dict]) -> dict:
    return {"model": "gyre", "max_tokens": 8, "messages": messages}


def test_anthropic_incremental_parse_equals_full_parse_and_reuses_the_prefix():
    cache = MessageCache()
    for messages in anthropic_history(12):
        before = list(cache.parsed)
        unchanged = cache.reusable(messages)
        incremental = anthropic.parse_request(body(messages), {}, {}, cache=cache)
        assert incremental == anthropic.parse_request(body(messages), {}, {})
        assert all(cache.parsed[i] is before[i] for i in range(unchanged))  # reused, not parsed again
        assert not before or unchanged == len(before) - 1  # all but the message cache_control moved off
    assert cache.reusable(messages) == len(messages)  # an identical retry reuses everything


def test_a_bad_request_leaves_the_cache_as_it_was_and_tool_results_are_still_checked():
    cache = MessageCache()
    good = anthropic_history(4)[-1]
    anthropic.parse_request(body(good), {}, {}, cache=cache)
    stored = list(cache.raw)
    unanswerable = {"type": "tool_result", "tool_use_id": "toolu_nobody", "content": "x"}
    bad = [*good, {"role": "assistant", "content": "ok"}, {"role": "user", "content": [unanswerable]}]
    with pytest.raises(ApiError, match="toolu_nobody"):
        anthropic.parse_request(body(bad), {}, {}, cache=cache)
    assert cache.raw == stored
    answering_a_cached_call = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "again"}
    later = [*good, {"role": "assistant", "content": "ok"}, {"role": "user", "content": [answering_a_cached_call]}]
    assert anthropic.parse_request(body(later), {}, {}, cache=cache) == anthropic.parse_request(body(later), {}, {})


def test_an_edited_middle_message_is_parsed_again():
    cache = MessageCache()
    messages = anthropic_history(6)[-1]
    anthropic.parse_request(body(messages), {}, {}, cache=cache)
    edited = copy.deepcopy(messages)
    edited[3]["content"][0]["text"] = "edited by the harness"
    assert cache.reusable(edited) == 3
    assert anthropic.parse_request(body(edited), {}, {}, cache=cache) == anthropic.parse_request(body(edited), {}, {})


def test_openai_chat_incremental_parse_equals_full_parse():
    cache = MessageCache()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for step in range(8):
        request = {"model": "gyre", "messages": copy.deepcopy(messages)}
        before, unchanged = list(cache.parsed), cache.reusable(request["messages"])
        assert openai_chat.parse_request(request, {}, {}, cache=cache) == openai_chat.parse_request(request, {}, {})
        assert unchanged == len(before) and all(cache.parsed[i] is before[i] for i in range(unchanged))
        call = {"id": f"call_{step}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{step}", "content": "done"},
        ]
        if step == 4:
            messages.append({"role": "developer", "content": "mid-conversation note"})


def test_tools_are_parsed_once_per_change():
    cache = MessageCache()
    tool = {"name": "read", "description": "Read a file", "input_schema": {"type": "object"}}
    first = anthropic.parse_request({**body([{"role": "user", "content": "hi"}]), "tools": [tool]}, {}, {}, cache=cache)
    calls = []
    again = cache.parse_tools([dict(tool)], lambda raw: calls.append(raw))  # equal raw tools: no parse
    assert calls == [] and tuple(again) == first.tools
    changed = {**tool, "description": "Read a file, carefully"}
    second = anthropic.parse_request(
        {**body([{"role": "user", "content": "hi"}]), "tools": [changed]}, {}, {}, cache=cache
    )
    assert second.tools[0].description == "Read a file, carefully"
    with pytest.raises(ApiError, match="input_schema"):
        anthropic.parse_request(
            {**body([{"role": "user", "content": "hi"}]), "tools": [{"name": "x"}]}, {}, {}, cache=cache
        )
