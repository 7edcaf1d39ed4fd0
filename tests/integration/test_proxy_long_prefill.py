"""Long prefills behind the proxy (docs/proxy.md, "Long prefills"), over real HTTP on 127.0.0.1; and the prefix cache.

A streamed call whose first token takes longer than `proxy.stream_keepalive_s` gets its stream started and the
dialect's keep-alive until the tokens come (Anthropic `ping` events, an SSE comment for OpenAI chat,
`response.in_progress` for the Responses API, whose Codex times idle streams by events); the SDKs read such a
stream as any other. With keep-alive off, nothing is sent before the first token. A harness that hangs up during
the prefill has its engine call aborted, is counted as a hang-up and is named in the log with the prefill it
waited for; the proxy's `in_flight` shows the call as waiting for its first token meanwhile. An engine lost during
the prefill of a started stream ends it with the dialect's in-stream error event.

The engine is `ScriptedEngine` (a stand-in, named as such) behind a real endpoint, its first token
`first_token_delay_s` late. The CLIs themselves against a slow first token were measured by hand (docs/proxy.md).
Last, the embedded native engine (the tiny model): a session's second call prefills only its new tokens, and the
answer's usage and the record's `usage` say how many were served from the prefix cache.
Every wait is bounded; every server is stopped.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import time

import anthropic
import openai
import pytest
from proxy_stack import StackThread

from gyre.config import EngineConfig, ServeConfig
from gyre.config.proxy import ProxyConfig, SamplingConfig
from gyre.engine.endpoint import ServerThread
from gyre.engine.scripted import ScriptedEngine, chat_reply
from gyre.models.tiny import tiny_model_dir
from gyre.proxy.render import ChatTemplate

KEEPALIVE_S = 0.15
PREFILL_S = 1.0  # the first token's delay: about 6 keep-alives
ANSWER = "All done."

ROUTES = {
    "anthropic": ("/v1/messages", {"model": "gyre", "max_tokens": 32, "stream": True}),
    "chat": ("/v1/chat/completions", {"model": "gyre", "stream": True}),
    "responses": ("/v1/responses", {"model": "gyre", "stream": True, "input": "say hi"}),
}
KEEPALIVES = {
    "anthropic": b'event: ping\ndata: {"type":"ping"}\n\n',
    "chat": b": keepalive\n\n",
    "responses": b"event: response.in_progress\n",
}


@pytest.fixture(scope="module")
def engine():
    """(the endpoint's thread, its URL): a scripted engine whose first token comes PREFILL_S late."""
    template = ChatTemplate.from_pretrained(tiny_model_dir())
    thread = ServerThread(
        lambda: ScriptedEngine(chat_reply(template, lambda r, p: ANSWER), first_token_delay_s=PREFILL_S)
    )
    url = thread.start()
    yield thread, url
    thread.stop()


def stack_for(engine_url: str, tmp_path, keepalive_s: float = KEEPALIVE_S, **proxy) -> StackThread:
    cfg = ServeConfig(
        engine=EngineConfig(enabled=False),
        engine_urls=[engine_url],
        proxy=ProxyConfig(sampling=SamplingConfig(max_new_tokens=32), stream_keepalive_s=keepalive_s, **proxy),
        executions=0,
    )
    return StackThread(cfg, tmp_path / "records")


def body_for(dialect: str) -> dict:
    body = ROUTES[dialect][1]
    if dialect != "responses":
        body = {**body, "messages": [{"role": "user", "content": "say hi"}]}
    return body


def open_stream(stack: StackThread, dialect: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, float]:
    """POST the dialect's streamed call; the connection, the response (headers read) and when the headers came."""
    path, _ = ROUTES[dialect]
    connection = http.client.HTTPConnection(stack.host, stack.port, timeout=30)
    key = stack.session.key
    headers = {"content-type": "application/json", "x-api-key": key, "authorization": f"Bearer {key}"}
    start = time.monotonic()
    connection.request("POST", path, body=json.dumps(body_for(dialect)), headers=headers)
    response = connection.getresponse()
    return connection, response, time.monotonic() - start


@pytest.mark.parametrize("dialect", sorted(ROUTES))
def test_a_long_prefill_starts_the_stream_and_keeps_it_alive_until_the_first_token(engine, tmp_path, dialect):
    stack = stack_for(engine[1], tmp_path)
    try:
        connection, response, headers_after = open_stream(stack, dialect)
        data = response.read()
        connection.close()
    finally:
        stack.stop()
    assert response.status == 200, data[:500]
    assert headers_after < PREFILL_S * 0.8, headers_after  # the stream started while the prefill ran
    first_content = {"anthropic": rb"content_block_start", "chat": rb'"content":"[^"]', "responses": rb"output_item"}
    before = data[: re.search(first_content[dialect], data).start()]
    assert before.count(KEEPALIVES[dialect]) >= 3, before.decode()
    assert data.rstrip().endswith({"anthropic": b'{"type":"message_stop"}', "chat": b"[DONE]"}.get(dialect, b"}"))
    assert b"event: error" not in data and b'"error":{' not in data


def test_the_sdks_read_a_kept_alive_stream_as_any_other(engine, tmp_path):
    stack = stack_for(engine[1], tmp_path)
    url = f"http://{stack.host}:{stack.port}"
    key = stack.session.key
    try:
        claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=30)
        with claude.messages.stream(
            model="gyre", max_tokens=32, messages=[{"role": "user", "content": "say hi"}]
        ) as stream:
            message = stream.get_final_message()
        assert [block.text for block in message.content] == [ANSWER]
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
        with client.chat.completions.stream(model="gyre", messages=[{"role": "user", "content": "say hi"}]) as stream:
            completion = stream.get_final_completion()
        assert completion.choices[0].message.content == ANSWER
        with client.responses.stream(model="gyre", input="say hi") as stream:
            response = stream.get_final_response()
        assert response.output_text == ANSWER and response.status == "completed"
    finally:
        stack.stop()


def test_with_keepalive_off_nothing_is_sent_before_the_first_token(engine, tmp_path):
    stack = stack_for(engine[1], tmp_path, keepalive_s=0)
    try:
        connection, response, headers_after = open_stream(stack, "anthropic")
        data = response.read()
        connection.close()
    finally:
        stack.stop()
    assert response.status == 200 and headers_after >= PREFILL_S * 0.9, headers_after
    assert data.count(KEEPALIVES["anthropic"]) == 1  # the one message_start always carries


def test_a_hang_up_during_the_prefill_aborts_the_engine_call_and_is_named_in_the_log(engine, tmp_path, caplog):
    thread, url = engine
    stack = stack_for(url, tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="gyre.proxy.server"):
            connection, response, _ = open_stream(stack, "anthropic")
            assert response.status == 200
            response.read1(4096)  # message_start and a ping: the call is in its prefill
            summary = stack.call(_in_flight(stack))
            connection.close()  # the harness gives up
            deadline = time.monotonic() + 10
            while thread.call(lambda e: e.load().running) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert thread.call(lambda e: e.load().running) == 0  # aborted on the engine, before its first token
            while stack.call(_total(stack))["hung_up"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            total = stack.call(_total(stack))
    finally:
        stack.stop()
    assert summary.waiting == 1 and summary.decoding == 0, summary
    assert summary.longest_wait_prompt_tokens > 0 and summary.longest_wait_execution == "fuzz"
    assert total["hung_up"] == 1 and total["recorded"] == 0 and total["answered"] == 0, total
    lines = [r.getMessage() for r in caplog.records if "without a first token" in r.getMessage()]
    assert len(lines) == 1 and "in prefill" in lines[0], [r.getMessage() for r in caplog.records]


async def _in_flight(stack: StackThread):
    """The proxy's calls in flight, read on its loop."""
    return stack.stack.proxy.in_flight.summary(time.monotonic())


async def _total(stack: StackThread):
    return stack.stack.proxy.stats()["total"]


def test_an_engine_lost_during_a_started_prefill_ends_the_stream_with_an_error_event(tmp_path):
    template = ChatTemplate.from_pretrained(tiny_model_dir())
    thread = ServerThread(lambda: ScriptedEngine(chat_reply(template, lambda r, p: ANSWER), first_token_delay_s=30))
    url = thread.start()
    stack = stack_for(url, tmp_path, engine_wait_s=0.5)
    try:
        connection, response, _ = open_stream(stack, "anthropic")
        assert response.status == 200
        response.read1(4096)  # the stream started
        thread.kill()  # the engine's endpoint dies mid-prefill, no other engine to go on with
        data = response.read()
        connection.close()
        total = stack.call(_total(stack))
    finally:
        stack.stop()
        thread.stop()
    assert b"event: error" in data, data[-800:]
    assert total["failed"] and total["answered"] == 0, total


def test_a_later_call_of_a_session_prefills_only_its_new_tokens_and_its_record_says_so(tmp_path):
    """The embedded native engine (the tiny model): the second call extends the first call's prompt and answer, the
    engine reuses their KV, the answer's usage and the record's `usage` report it."""
    from gyre.traj.store import load_tree

    cfg = ServeConfig(proxy=ProxyConfig(sampling=SamplingConfig(max_new_tokens=8, seed=0)), executions=0)
    stack = StackThread(cfg, tmp_path / "records")
    url, key = f"http://{stack.host}:{stack.port}", stack.session.key
    try:
        claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)
        history = [{"role": "user", "content": "What is 2 + 3? Use the calculator."}]
        first = claude.messages.create(model="gyre", max_tokens=8, messages=history)
        history += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "Go on."}]
        second = claude.messages.create(model="gyre", max_tokens=8, messages=history)
    finally:
        stack.stop()
    tree = load_tree(tmp_path / "records" / f"{stack.session.execution}.jsonl")
    usage = [call.meta.usage for call in tree.calls]
    assert usage[0]["cached_tokens"] == 0 and usage[0]["prompt_tokens"] == first.usage.input_tokens
    assert usage[1]["cached_tokens"] >= usage[0]["prompt_tokens"], usage  # the first prompt's KV, at least
    assert usage[1]["prompt_tokens"] - usage[1]["cached_tokens"] < 40, usage  # the answer and the new turn only
    assert second.usage.cache_read_input_tokens == usage[1]["cached_tokens"]
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == usage[1]["prompt_tokens"]
