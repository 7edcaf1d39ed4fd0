"""The proxy's own counters over real HTTP (`gyre.proxy.stats`, `GET /gyre/stats`): exact after a mix of calls.

The serving stack (the proxy over `ScriptedEngine`, the stand-in: the counters are the proxy's, not the model's)
runs on its own thread and loop (`proxy_stack.held_stack`); the test talks to it with plain `http.client`. Valid
calls of every dialect (streamed and not), refusals of each kind, a token count and a client that hangs up
mid-stream (the engine holds that call in flight until the hang-up, so it cannot end first): each route's counters
must be exactly those calls,
every request must have exactly one outcome, and the calls recorded must equal the record files' calls, per route
and per execution. A reroute and a KV migration (two native engines behind real endpoints, the controller's
`reroute_execution`; the source's step loop held with the call in flight, `NativeEngine.hold`) are counted as such.
"""

from __future__ import annotations

import asyncio
import copy
import http.client
import json
import threading

import pytest
from proxy_stack import StackThread, hang_up_mid_call, held_stack

from gyre.config import EngineConfig, ServeConfig
from gyre.config.proxy import ProxyConfig, SamplingConfig
from gyre.engine.endpoint import ServerThread
from gyre.engine.native import NativeEngine
from gyre.models.hf_weights import load_pretrained
from gyre.models.tiny import tiny_model_dir
from gyre.proxy.reroute import reroute_execution
from gyre.proxy.routing import RoutingTable
from gyre.proxy.stats import COUNTS, outcomes
from gyre.serve.stack import build_stack
from gyre.traj.store import load_tree

BODY_CAP = 64 * 1024
SHORT = {"model": "gyre", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
COUNT_TOKENS = "/v1/messages/count_tokens"


def get(stack: StackThread, path: str, key: str | None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(stack.host, stack.port, timeout=30)
    connection.request("GET", path, headers={"authorization": f"Bearer {key}"} if key else {})
    response = connection.getresponse()
    reply = json.loads(response.read())
    connection.close()
    return response.status, reply


def recorded_in_file(stack: StackThread, execution: str) -> int:
    return len(load_tree(stack.stack.registry.records_dir / f"{execution}.jsonl").calls)


@pytest.fixture
def served(tmp_path):
    cfg = ServeConfig(
        engine=EngineConfig(max_running=4),
        proxy=ProxyConfig(max_body_bytes=BODY_CAP, sampling=SamplingConfig(max_new_tokens=3000)),
        executions=0,
    )
    stack = held_stack(cfg, tmp_path / "records")
    yield stack
    stack.stop()


def test_after_valid_refused_and_hung_up_calls_the_counters_are_exact_and_match_the_records(served):
    admin = served.stack.proxy.admin_key
    post = served.post
    # a second execution, issued over the admin route
    code, issued = post("/gyre/executions", b'{"execution": "second"}', key=admin)
    assert code == 200, issued
    for body in (SHORT, SHORT, {**SHORT, "stream": True}):
        assert post(MESSAGES, json.dumps(body).encode())[0] == 200
    assert post(MESSAGES, json.dumps(SHORT).encode(), key="gyre-wrong")[0] == 401
    assert post(MESSAGES, b"{not json")[0] == 400
    assert post(MESSAGES, json.dumps({**SHORT, "model": "gpt-9"}).encode())[0] == 404
    assert post(MESSAGES, json.dumps({**SHORT, "pad": "x" * BODY_CAP}).encode())[0] == 413
    for body in (SHORT, {**SHORT, "stream": True}):
        assert post(CHAT, json.dumps(body).encode(), key=issued["key"])[0] == 200
    assert post(CHAT, json.dumps({**SHORT, "max_tokens": 0}).encode())[0] == 400
    assert post(RESPONSES, json.dumps({"model": "gyre", "max_output_tokens": 4, "input": "hi"}).encode())[0] == 200
    count_body = json.dumps({"model": "gyre", "messages": SHORT["messages"]}).encode()
    assert post(COUNT_TOKENS, count_body)[0] == 200
    assert post(COUNT_TOKENS, count_body, key="gyre-wrong")[0] == 401

    long_call = {"model": "gyre", "max_tokens": 3000, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    hang_up_mid_call(served, long_call, stream=True)  # held in flight by the engine until the client hangs up
    for _ in range(200):  # bounded: the proxy notices the hang-up, aborts, records
        messages = served.stack.proxy.stats()["routes"][MESSAGES]
        if outcomes(messages) == messages["requests"]:
            break
        threading.Event().wait(0.05)
    assert load_tree(served.stack.registry.records_dir / "fuzz.jsonl").calls[-1].response.finish_reason == "abort"

    stats = served.stack.proxy.stats()
    empty = {"rerouted": 0, "kv_migrated": 0, "failed_over": 0, "refused": {}, "failed": {}}
    assert stats["routes"][MESSAGES] == {
        **empty,
        "requests": 8,
        "admitted": 4,
        "answered": 3,
        "hung_up": 1,
        "recorded": 4,  # the hung-up call too, with what was sampled
        "refused": {"authentication": 1, "invalid_request": 1, "not_found": 1, "request_too_large": 1},
    }
    chat = {"requests": 3, "admitted": 2, "answered": 2, "hung_up": 0, "recorded": 2}
    assert stats["routes"][CHAT] == {**empty, **chat, "refused": {"invalid_request": 1}}
    responses = {"requests": 1, "admitted": 1, "answered": 1, "hung_up": 0, "recorded": 1}
    assert stats["routes"][RESPONSES] == {**empty, **responses}
    count = {"requests": 2, "admitted": 0, "answered": 1, "hung_up": 0, "recorded": 0}
    assert stats["routes"][COUNT_TOKENS] == {**empty, **count, "refused": {"authentication": 1}}

    # per dialect: its routes added; in total: every route added; every request has exactly one outcome
    anthropic = stats["dialects"]["anthropic"]
    for name in COUNTS:
        assert anthropic[name] == stats["routes"][MESSAGES][name] + stats["routes"][COUNT_TOKENS][name]
        assert stats["total"][name] == sum(route[name] for route in stats["routes"].values())
    assert anthropic["refused"]["authentication"] == 2 and stats["total"]["refused"]["invalid_request"] == 2
    assert outcomes(stats["total"]) == stats["total"]["requests"]
    # recorded: the proxy's count = the sessions' = the record files' calls
    assert stats["executions"] == {
        "fuzz": {"recorded": recorded_in_file(served, "fuzz")},
        "second": {"recorded": recorded_in_file(served, "second")},
    }
    assert stats["executions"]["second"]["recorded"] == 2
    assert stats["total"]["recorded"] == sum(execution["recorded"] for execution in stats["executions"].values())

    # the admin route: the same counters, only with the admin key; a closed execution keeps its count
    code, closed = post("/gyre/executions/second/close", b"", key=admin)
    assert code == 200, closed
    code, reply = get(served, "/gyre/stats", None)
    assert code == 401 and reply == {"error": {"type": "authentication_error", "message": "admin key required"}}
    wrong_key = {"error": {"type": "permission_error", "message": "this key is not the admin key"}}
    for key in ("gyre-wrong", served.session.key):  # another key, an execution's among them
        assert get(served, "/gyre/stats", key) == (403, wrong_key)
    code, reply = get(served, "/gyre/stats", admin)
    assert code == 200 and reply == served.stack.proxy.stats() == stats


def test_a_reroute_with_kv_is_counted_as_rerouted_and_kv_migrated(tmp_path):
    """One streamed call moved by the controller mid-call from engine a to b with its KV; one call never moved."""
    model = load_pretrained(tiny_model_dir())
    threads = [ServerThread(lambda: NativeEngine(copy.deepcopy(model))) for _ in range(2)]
    urls = [thread.start() for thread in threads]

    async def main():
        cfg = ServeConfig(
            engine=EngineConfig(enabled=False),
            engine_urls=urls,
            proxy=ProxyConfig(sampling=SamplingConfig(max_new_tokens=200, temperature=0.0)),
            executions=0,
        )
        stack = await build_stack(cfg, records_dir=tmp_path / "records")
        table = stack.proxy.table = RoutingTable(stack.table.engines, placement="scheduler")
        try:
            moved, stays = stack.registry.issue("moved"), stack.registry.issue("stays")
            table.assign("moved", "external-0")
            table.assign("stays", "external-1")
            body = {"model": "gyre", "max_tokens": 200, "stream": True, "messages": SHORT["messages"]}
            source = threads[0]
            await source.call_async(lambda engine: engine.hold())  # the call cannot end on a
            reader, writer = await asyncio.open_connection(stack.proxy.config.host, stack.proxy.port)
            payload = json.dumps(body).encode()
            head = (
                f"POST {MESSAGES} HTTP/1.1\r\nhost: x\r\nx-api-key: {moved.key}\r\ncontent-type: application/json\r\n"
            )
            writer.write(f"{head}content-length: {len(payload)}\r\nconnection: close\r\n\r\n".encode() + payload)
            await writer.drain()
            async with asyncio.timeout(60):  # queued on a, then exactly 3 steps: 4 tokens, held in flight
                while (await source.call_async(lambda engine: engine.load())).queued < 1:
                    await asyncio.sleep(0.01)
            await source.call_async(lambda engine: engine.release(steps=3))
            await source.call_async(lambda engine: engine.until_held(), 60)
            first = await asyncio.wait_for(reader.readuntil(b"content_block_delta"), 60)  # tokens are flowing
            assert b"200 OK" in first
            table.engines["external-0"].stop_accepting()
            migration = await reroute_execution(table, "moved", "external-1")
            rest = await asyncio.wait_for(reader.read(), 120)
            writer.close()
            short = stack.proxy.config.model_names[0]
            async with asyncio.timeout(60):
                await _post_short(stack, stays.key, short)
            return migration, first + rest, stack.proxy.stats()
        finally:
            await stack.close()

    try:
        migration, stream, stats = asyncio.run(asyncio.wait_for(main(), 240))
    finally:
        for thread in threads:
            thread.stop()
    assert b"message_stop" in stream
    calls = load_tree(tmp_path / "records" / "moved.jsonl").calls
    messages = stats["routes"][MESSAGES]
    assert (messages["admitted"], messages["answered"], messages["recorded"]) == (2, 2, 2)
    # The call was held in flight on a (4 tokens) when the controller moved it: moved with its KV, counted once each.
    assert migration.calls == 1 and len(migration.migrated) == 1, migration
    assert [call.meta.engine for call in calls] == ["external-0,external-1"]
    assert (messages["rerouted"], messages["kv_migrated"]) == (1, 1)


async def _post_short(stack, key: str, model: str) -> None:
    """A short non-streamed call on a fresh connection (over HTTP: the proxy's own route)."""
    reader, writer = await asyncio.open_connection(stack.proxy.config.host, stack.proxy.port)
    payload = json.dumps({**SHORT, "model": model}).encode()
    head = f"POST {MESSAGES} HTTP/1.1\r\nhost: x\r\nx-api-key: {key}\r\ncontent-type: application/json\r\n"
    writer.write(f"{head}content-length: {len(payload)}\r\nconnection: close\r\n\r\n".encode() + payload)
    await writer.drain()
    reply = await reader.read()
    writer.close()
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
