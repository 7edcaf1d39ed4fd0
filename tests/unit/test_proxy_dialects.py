"""The contract every API dialect keeps with the server (`gyre.proxy.dialects.protocol.Dialect`), one suite for all."""

from __future__ import annotations

import orjson
import pytest

from gyre.proxy.conversation import ApiError, AssistantOutput, ChatRequest, TextDelta, ToolCall, ToolCallDone, Usage
from gyre.proxy.dialects import ANTHROPIC, DIALECTS, DIALECTS_BY_NAME, OPENAI_CHAT
from gyre.proxy.dialects.incremental import MessageCache

HI = [{"role": "user", "content": "hi"}]
BODIES = {
    "anthropic": {"model": "m", "max_tokens": 4, "messages": HI},
    "openai_chat": {"model": "m", "messages": HI},
    "openai_responses": {"model": "m", "input": "hi"},
}
OUTPUT = AssistantOutput(text="hello", tool_calls=(ToolCall(id="call_1", name="ls", arguments="{}"),))
USAGE = Usage(input_tokens=5, output_tokens=3)


def parse(dialect, headers=None) -> ChatRequest:
    cache = MessageCache() if dialect.incremental else None
    return dialect.parse_request(BODIES[dialect.name], headers or {}, {}, cache=cache)


def test_every_dialect_has_its_own_name_and_routes():
    paths = [d.path for d in DIALECTS] + [d.count_tokens_path for d in DIALECTS if d.count_tokens_path]
    assert len(set(paths)) == len(paths) and set(DIALECTS_BY_NAME) == set(BODIES)


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_a_dialect_parses_into_a_chat_request_of_its_name(dialect):
    request = parse(dialect, {"x-gyre-role": "sub-agent"})
    assert request.dialect == dialect.name and request.model == "m" and request.turns[-1].text == "hi"
    assert dialect.role_signals(request)["gyre_role"] == "sub-agent"
    with pytest.raises(ApiError) as caught:
        dialect.parse_request({**BODIES[dialect.name], "model": 7}, {}, {}, cache=None)
    assert caught.value.kind == "invalid_request" and caught.value.param == "model"


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_a_dialect_writes_the_response_the_stream_and_errors(dialect):
    request = parse(dialect)
    body = dialect.response_body(request, OUTPUT, USAGE, response_id=dialect.response_prefix + "1", created=7)
    assert body["id"] == dialect.response_prefix + "1" and orjson.loads(orjson.dumps(body)) == body
    writer = dialect.stream_writer(request, response_id=dialect.response_prefix + "1", created=7, input_tokens=5)
    events = [TextDelta("hel"), TextDelta("lo"), ToolCallDone(OUTPUT.tool_calls[0])]
    data = writer.start() + b"".join(writer.event(event) for event in events) + writer.finish(OUTPUT, USAGE)
    assert data.endswith(b"\n\n") and b"hel" in data and b"call_1" in data
    failed = dialect.stream_writer(request, response_id="x", created=7, input_tokens=5)
    assert b"engine gone" in failed.start() + failed.error(ApiError("overloaded", "engine gone"))
    for kind in ApiError.STATUS:
        assert "went wrong" in orjson.dumps(dialect.error_body(ApiError(kind, "went wrong"))).decode()


@pytest.mark.parametrize("dialect", [d for d in DIALECTS if d.count_tokens_path], ids=lambda d: d.name)
def test_a_dialect_with_token_counting_parses_and_answers_it(dialect):
    body = {k: v for k, v in BODIES[dialect.name].items() if k != "max_tokens"}
    assert dialect.parse_count_tokens(body, {}, {}).turns[-1].text == "hi"
    assert dialect.count_tokens_body(12) == {"input_tokens": 12}


def test_model_listings_go_to_the_first_dialect_that_claims_them():
    def lister(headers):
        return next(d for d in DIALECTS if d.lists_models_for(headers))

    assert lister({"anthropic-version": "2023-06-01"}) is ANTHROPIC and lister({}) is OPENAI_CHAT
    assert ANTHROPIC.models_body(["m"], 7)["data"][0]["id"] == OPENAI_CHAT.models_body(["m"], 7)["data"][0]["id"]
