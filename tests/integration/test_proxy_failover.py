"""An engine endpoint that dies mid-stream: its calls finish on another engine, and the harness sees no error.

Engines run behind real endpoints on 127.0.0.1 (threads), the real proxy in front, the routing table of the
training runtime (`placement="scheduler"`), real `anthropic` and `openai` SDK clients with retries off (a client
retry would hide an error). Engine A dies mid-call (`ServerThread.kill`: it stops listening and resets every open
connection, as a crashed process's sockets are; one test SIGKILLs A's own process, `held_engine_process`).
The engines are `ScriptedEngine`s whose token i of a call is a function of its position in the context, so a call
continued anywhere goes on the same sequence, and whose log-probs name the engine (A -1.0, B -2.0): the record
shows exactly which engine sampled each token. Engine A holds its calls after their first tokens (`hold`), so they
are in flight when it dies, however slow the machine. Every wait is bounded; every endpoint is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time

import anthropic
import openai
import pytest
from held_engine_process import HeldEngineProcess, counting_reply

from gyre.config import EngineConfig, ServeConfig
from gyre.config.proxy import ProxyConfig, SamplingConfig
from gyre.engine.endpoint import ServerThread
from gyre.engine.scripted import ScriptedEngine
from gyre.proxy.output import OutputDecoder
from gyre.proxy.routing import EngineLost, RoutingTable
from gyre.serve.stack import build_stack

MAX_NEW = 60
HELD_AT = 10  # engine A holds its calls after this many tokens: it dies with them in flight
VERSION = 7  # both engines hold the same weights, as the rollout engines of one step do
TIMEOUT_S = 120.0
A, B = "external-0", "external-1"


def held_engine(at: int = HELD_AT, **options) -> ScriptedEngine:
    """Engine A: every call stays in flight after its first `at` tokens (until A dies)."""
    engine = ScriptedEngine(counting_reply, logprob=-1.0, **options)
    engine.hold(after_tokens=at)
    return engine


async def until_held(thread: ServerThread, count: int = 1) -> None:
    await thread.call_async(lambda engine: engine.until_held(count), 60)


def expected_ids(prompt_tokens: int) -> list[int]:
    return [(prompt_tokens + i) % 40 + 5 for i in range(MAX_NEW)]


@contextlib.contextmanager
def endpoints(*factories):
    threads = [ServerThread(factory) for factory in factories]
    try:
        for thread in threads:
            thread.start()
        yield threads
    finally:
        for thread in threads:
            thread.stop()


async def scheduler_stack(urls, records_dir, *, max_new: int = MAX_NEW, **table_options):
    """`gyre.serve`'s stack over `urls`, with the training runtime's table (routes only where `assign` says)."""
    cfg = ServeConfig(
        engine=EngineConfig(enabled=False),
        engine_urls=list(urls),
        proxy=ProxyConfig(sampling=SamplingConfig(max_new_tokens=max_new), engine_wait_s=30.0),
        executions=0,
    )
    stack = await build_stack(cfg, records_dir=records_dir)
    stack.proxy.table = RoutingTable(stack.table.engines, placement="scheduler", **table_options)
    return stack


async def ask(api: str, stream: bool, stack, key: str, content: str) -> tuple[str | None, str, int]:
    """One call as a harness makes it: (the streamed deltas joined, or None; the final text; prompt tokens)."""
    messages = [{"role": "user", "content": content}]
    if api == "anthropic":
        sdk = anthropic.AsyncAnthropic(base_url=stack.proxy.url, api_key=key, max_retries=0, timeout=60)
        try:
            if stream:
                async with sdk.messages.stream(model="gyre", max_tokens=MAX_NEW, messages=messages) as events:
                    deltas = [event.text async for event in events if event.type == "text"]
                    final = await events.get_final_message()
                streamed = "".join(deltas)
            else:
                final, streamed = await sdk.messages.create(model="gyre", max_tokens=MAX_NEW, messages=messages), None
        finally:
            await sdk.close()
        text = "".join(block.text for block in final.content if block.type == "text")
        assert final.stop_reason == "max_tokens" and final.usage.output_tokens == MAX_NEW
        return streamed, text, final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    sdk = openai.AsyncOpenAI(base_url=stack.proxy.openai_url, api_key=key, max_retries=0, timeout=60)
    try:
        if stream:
            chunks = await sdk.chat.completions.create(
                model="gyre", max_tokens=MAX_NEW, messages=messages, stream=True, stream_options={"include_usage": True}
            )
            deltas, usage, finish = [], None, None
            async for chunk in chunks:
                for choice in chunk.choices:
                    deltas.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
                usage = chunk.usage or usage
            streamed = text = "".join(deltas)
        else:
            completion = await sdk.chat.completions.create(model="gyre", max_tokens=MAX_NEW, messages=messages)
            choice, usage, streamed = completion.choices[0], completion.usage, None
            text, finish = choice.message.content, choice.finish_reason
    finally:
        await sdk.close()
    assert finish == "length" and usage.completion_tokens == MAX_NEW
    return streamed, text, usage.prompt_tokens


def call_lines(records_dir, execution: str) -> list[dict]:
    lines = (records_dir / f"{execution}.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["kind"] == "call"]


def decoded(stack, ids: list[int]) -> str:
    template = stack.proxy.template
    decoder = OutputDecoder(template.tokenizer, skip_ids=template.end_of_turn_ids, new_call_id=lambda: "x")
    decoder.feed(ids)
    return decoder.finish("length")[1].text


CASES = [("anthropic", True), ("anthropic", False), ("openai", True), ("openai", False)]


@pytest.mark.parametrize(("api", "stream"), CASES)
def test_a_call_whose_engine_dies_mid_stream_finishes_on_the_live_engine_with_no_error(api, stream, tmp_path):
    records = tmp_path / "records"
    factories = (
        lambda: held_engine(policy_version=VERSION),
        lambda: ScriptedEngine(counting_reply, logprob=-2.0, policy_version=VERSION),
    )

    async def main(threads):
        lost: list[EngineLost] = []
        stack = await scheduler_stack([thread.server.url for thread in threads], records, on_engine_lost=lost.append)
        table = stack.proxy.table
        try:
            mover, idle, other = (stack.registry.issue(name) for name in ("mover", "idle", "other"))
            table.assign(mover.execution, A)  # the scheduler's Start
            table.assign(idle.execution, A)  # placed on A, no call in flight when A dies
            table.assign(other.execution, B)
            call = asyncio.ensure_future(ask(api, stream, stack, mover.key, "Count to sixty."))
            await until_held(threads[0])  # A sampled its first HELD_AT tokens; the call is in flight
            started = time.monotonic()
            await asyncio.to_thread(threads[0].kill)  # A's endpoint dies with the call in flight
            first = await call
            failover_s = time.monotonic() - started
            routes = {name: table.route_of(name) for name in ("mover", "idle", "other")}
            second = await ask(api, stream, stack, mover.key, "Again.")  # a new call of the moved execution
            return first, second, failover_s, routes, lost, table.engines.keys(), stack.proxy.stats(), stack
        finally:
            await stack.close()

    with endpoints(*factories) as threads:
        first, second, failover_s, routes, lost, live, stats, stack = asyncio.run(
            asyncio.wait_for(main(threads), TIMEOUT_S)
        )
    records_of_mover = call_lines(records, "mover")
    assert len(records_of_mover) == 2  # exactly one record per call

    (streamed, text, prompt_tokens), record = first, records_of_mover[0]
    if stream:
        assert streamed == text  # no delta twice, none missing, although the stream changed engines mid-way
    assert record["response"]["ids"] == expected_ids(prompt_tokens)  # the sequence went on exactly where A stopped
    assert decoded(stack, record["response"]["ids"]) == text  # what the client saw is exactly what was recorded
    on_a = record["response"]["logprobs"].count(-1.0)
    assert 1 <= on_a <= HELD_AT  # A sampled the first tokens (before it died), B the rest, each with its log-prob
    assert record["response"]["logprobs"] == [-1.0] * on_a + [-2.0] * (MAX_NEW - on_a)
    assert record["engine"] == f"{A},{B}" and record["policy_version"] == VERSION
    assert record["response"]["finish"] == "length"
    print(f"{api} stream={stream}: {on_a} tokens from A, the rest from B; the client waited {failover_s:.2f} s")

    (_, second_text, second_prompt), second_record = second, records_of_mover[1]
    assert second_record["engine"] == B and set(second_record["response"]["logprobs"]) == {-2.0}
    assert second_record["response"]["ids"] == expected_ids(second_prompt)
    assert decoded(stack, second_record["response"]["ids"]) == second_text

    assert routes == {"mover": B, "idle": B, "other": B}  # A's executions moved to the live engine
    assert list(live) == [B]  # A is out of the table: no new call goes there
    (event,) = lost
    assert event.engine == A and dict(event.moved) == {"mover": B, "idle": B} and event.unplaced == ()
    route = stats["routes"]["/v1/messages" if api == "anthropic" else "/v1/chat/completions"]
    assert route["answered"] == 2 and route["failed"] == {} and route["refused"] == {} and route["hung_up"] == 0
    assert route["failed_over"] == 1 and route["rerouted"] == 1 and route["recorded"] == 2
    assert stats["engines_lost"][A]["moved"] == 2 and stats["engines_lost"][A]["unplaced"] == 0


CLIENTS = 16


def test_sixteen_streaming_clients_on_an_engine_that_dies_all_finish_on_the_live_engine(tmp_path):
    """Every call in flight on A breaks at once: one loss, every execution moved, every call recorded once."""
    records = tmp_path / "records"
    factories = (lambda: held_engine(at=20), lambda: ScriptedEngine(counting_reply, logprob=-2.0))

    async def main(threads):
        stack = await scheduler_stack([thread.server.url for thread in threads], records)
        engine_a = stack.proxy.table.engines[A]
        try:
            sessions = [stack.registry.issue(f"client-{index}") for index in range(CLIENTS)]
            for session in sessions:
                stack.proxy.table.assign(session.execution, A)
            calls = [
                asyncio.ensure_future(ask("anthropic", True, stack, s.key, f"Client {i}: count."))
                for i, s in enumerate(sessions)
            ]
            await until_held(threads[0], CLIENTS)
            assert (await engine_a.refresh_load()).running == CLIENTS  # all of them in flight on A
            await asyncio.to_thread(threads[0].kill)
            results = await asyncio.gather(*calls)
            return sessions, results, stack.proxy.stats(), stack
        finally:
            await stack.close()

    with endpoints(*factories) as threads:
        sessions, results, stats, stack = asyncio.run(asyncio.wait_for(main(threads), TIMEOUT_S))
    for session, (streamed, text, prompt_tokens) in zip(sessions, results, strict=True):
        (record,) = call_lines(records, session.execution)
        assert streamed == text == decoded(stack, record["response"]["ids"])
        assert record["response"]["ids"] == expected_ids(prompt_tokens)
        on_a = record["response"]["logprobs"].count(-1.0)
        assert 1 <= on_a <= 20 and record["response"]["logprobs"] == [-1.0] * on_a + [-2.0] * (MAX_NEW - on_a)
        assert record["engine"] == f"{A},{B}"
    total = stats["total"]
    assert total["answered"] == total["failed_over"] == total["recorded"] == CLIENTS and total["failed"] == {}
    assert stats["engines_lost"][A]["moved"] == CLIENTS


def test_with_no_live_engine_left_the_call_fails_with_an_overloaded_error_at_once(tmp_path):
    records = tmp_path / "records"

    async def main(threads):
        stack = await scheduler_stack([threads[0].server.url], records)
        try:
            session = stack.registry.issue("alone")
            stack.proxy.table.assign(session.execution, A)
            sdk = anthropic.AsyncAnthropic(base_url=stack.proxy.url, api_key=session.key, max_retries=0, timeout=60)
            messages = [{"role": "user", "content": "Count."}]

            async def streamed():
                async with sdk.messages.stream(model="gyre", max_tokens=MAX_NEW, messages=messages) as events:
                    async for _ in events:
                        pass

            call = asyncio.ensure_future(streamed())
            await until_held(threads[0])
            started = time.monotonic()
            await asyncio.to_thread(threads[0].kill)
            with pytest.raises(anthropic.APIError) as in_stream:
                await call  # the stream had started: the dialect's error event, not a hang
            in_stream_s = time.monotonic() - started
            started = time.monotonic()
            with pytest.raises(anthropic.APIStatusError) as next_call:
                await sdk.messages.create(model="gyre", max_tokens=MAX_NEW, messages=messages)
            next_call_s = time.monotonic() - started
            await sdk.close()
            return in_stream.value, in_stream_s, next_call.value, next_call_s, stack.proxy.stats()
        finally:
            await stack.close()

    with endpoints(held_engine) as threads:
        in_stream, in_stream_s, next_call, next_call_s, stats = asyncio.run(asyncio.wait_for(main(threads), TIMEOUT_S))
    assert "overloaded" in str(in_stream) and "every engine of the table is lost" in str(in_stream)
    assert next_call.status_code == 503 and "every engine of the table is lost" in str(next_call)
    assert in_stream_s < 10.0 and next_call_s < 5.0  # bounded by the probe, not by engine_wait_s (30 s)
    route = stats["routes"]["/v1/messages"]
    assert route["failed"] == {"overloaded": 2} and route["answered"] == 0
    assert stats["engines_lost"][A]["unplaced"] == 1


def test_a_sigkilled_engine_process_mid_stream_is_invisible_to_a_streaming_sdk_client(tmp_path):
    """The real thing: engine A is a process of its own (`held_engine_process`: the stand-in on the real endpoint),
    SIGKILLed while it holds the call in flight after its first HELD_AT tokens; the call goes on on engine B."""
    records = tmp_path / "records"
    engine_a = HeldEngineProcess(HELD_AT, logprob=-1.0)
    try:

        async def main(threads):
            stack = await scheduler_stack([engine_a.url, threads[0].server.url], records)
            try:
                session = stack.registry.issue("killed")
                stack.proxy.table.assign(session.execution, A)
                sdk = anthropic.AsyncAnthropic(base_url=stack.proxy.url, api_key=session.key, max_retries=0)
                messages = [{"role": "user", "content": "Count to sixty."}]
                deltas, killed = [], False
                async with sdk.messages.stream(model="gyre", max_tokens=MAX_NEW, messages=messages) as events:
                    async for event in events:
                        if event.type == "text" and event.text:
                            deltas.append(event.text)
                            if not killed:  # at its first text, with A holding the call: it dies mid-stream
                                await asyncio.to_thread(engine_a.until_held)
                                os.kill(engine_a.process.pid, signal.SIGKILL)
                                killed = True
                    final = await events.get_final_message()
                await sdk.close()
                return "".join(deltas), final, stack.proxy.stats(), stack
            finally:
                await stack.close()

        factory = lambda: ScriptedEngine(counting_reply, logprob=-2.0)  # noqa: E731
        with endpoints(factory) as threads:
            streamed, final, stats, stack = asyncio.run(asyncio.wait_for(main(threads), TIMEOUT_S))
    finally:
        engine_a.stop()
    assert engine_a.process.returncode == -signal.SIGKILL  # it died of the kill, not of its own accord
    text = "".join(block.text for block in final.content if block.type == "text")
    assert streamed == text and final.stop_reason == "max_tokens" and final.usage.output_tokens == MAX_NEW
    (record,) = call_lines(records, "killed")
    prompt_tokens = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert record["response"]["ids"] == expected_ids(prompt_tokens)  # B went on exactly where A stopped
    assert decoded(stack, record["response"]["ids"]) == text
    logprobs = record["response"]["logprobs"]
    on_a = logprobs.count(-1.0)
    print(f"engines {record['engine']}: {len(logprobs)} tokens, {on_a} of them from A")
    assert 1 <= on_a <= HELD_AT and logprobs == [-1.0] * on_a + [-2.0] * (MAX_NEW - on_a)
    assert record["engine"] == f"{A},{B}" and record["response"]["finish"] == "length"
    assert stats["total"]["failed_over"] == 1 and stats["engines_lost"][A]["moved"] == 1
    assert stats["total"]["failed"] == {} and stats["total"]["answered"] == 1
