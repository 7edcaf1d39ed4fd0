"""A role transition under the scheduler's placement, over real HTTP: calls in flight move where the controller says.

The routing table of the training runtime (`RoutingTable(placement="scheduler")`) routes only where the controller
assigned. At a transition the controller stops the source, moves each execution with `reroute_execution` (KV
exported on the source and imported on the destination, or, for an engine without KV export, aborted there), and
assigns it last; the calls continue on the destination from the tokens produced so far. Engines run behind real
endpoints (threads, 127.0.0.1): native engines on the tiny model, and `ScriptedEngine`s (no KV export, as SGLang)
for the re-prefill path. The source engine holds its calls in flight until they are moved (`NativeEngine.hold` and
`release(steps=k)`: exactly k steps; `ScriptedEngine.hold`), so what is moved does not depend on how fast the
machine is. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools

import anthropic
import pytest

from gyre.config import EngineConfig, ServeConfig
from gyre.config.proxy import ProxyConfig, SamplingConfig
from gyre.engine.endpoint import ServerThread
from gyre.engine.native import NativeEngine
from gyre.engine.protocol import GenerateRequest, SamplingParams
from gyre.engine.remote import RemoteEngine
from gyre.engine.scripted import ScriptedEngine
from gyre.models.hf_weights import load_pretrained
from gyre.models.tiny import tiny_model_dir
from gyre.proxy.reroute import reroute_execution
from gyre.proxy.routing import RoutedFinish, RoutedTokens, RoutingTable, generate_routed
from gyre.serve.stack import build_stack
from gyre.traj.store import load_tree

CLIENTS = 8
MAX_NEW = 96
TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def model():
    return load_pretrained(tiny_model_dir())


@contextlib.contextmanager
def endpoints(factories):
    """Engines behind their own endpoints (each on a thread and loop of its own); their urls and threads (to hold
    and release an engine on its loop), stopped at the end."""
    threads = [ServerThread(factory) for factory in factories]
    try:
        yield [thread.start() for thread in threads], threads
    finally:
        for thread in threads:
            thread.stop()


async def wait_until(condition, timeout_s=60.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def hold_then_step(thread: ServerThread, queued: int, steps: int) -> None:
    """With the engine held: once `queued` calls wait on it, run exactly `steps` steps (every call admitted at the
    first has steps + 1 tokens, or ended), and wait until it holds again."""
    await wait_until(lambda: _queued_at_least(thread, queued))
    await thread.call_async(lambda engine: engine.release(steps=steps), 60)
    await thread.call_async(lambda engine: engine.until_held(), 60)


async def _queued_at_least(thread: ServerThread, count: int) -> bool:
    return (await thread.call_async(lambda engine: engine.load(), 60)).queued >= count


async def collect(stream, on_tokens=None):
    tokens, engines, finish = [], [], None
    async for item in stream:
        if isinstance(item, RoutedTokens):
            tokens.extend(item.token_ids)
            engines.extend([item.engine] * len(item.token_ids))
            if on_tokens is not None:
                on_tokens(len(tokens))
        else:
            assert isinstance(item, RoutedFinish)
            finish = item
    return tokens, engines, finish


def test_streaming_clients_follow_the_controllers_reroute_with_their_kv_and_never_a_third_engine(model, tmp_path):
    """8 SDK clients stream from engine 0; the controller moves every execution to engine 2. Engine 1 accepts and
    is idle the whole time: a least-loaded table would send the dropped calls there before the KV import."""
    factories = [lambda: NativeEngine(copy.deepcopy(model), max_running=16) for _ in range(3)]

    async def main(urls, threads):
        await threads[0].call_async(lambda engine: engine.hold(), 60)  # the calls wait there until moved
        cfg = ServeConfig(
            engine=EngineConfig(enabled=False),
            engine_urls=list(urls),
            proxy=ProxyConfig(sampling=SamplingConfig(max_new_tokens=MAX_NEW)),
            executions=0,
        )
        stack = await build_stack(cfg, records_dir=tmp_path / "records")
        # the training runtime's table: the same engines, routed only where the controller assigns
        table = stack.proxy.table = RoutingTable(stack.table.engines, placement="scheduler")
        source = table.engines["external-0"]
        try:
            sessions = [stack.registry.issue() for _ in range(CLIENTS)]
            for session in sessions:
                table.assign(session.execution, "external-0")  # the scheduler's Start

            ready, go = asyncio.Semaphore(0), asyncio.Event()

            async def client(session, index):
                sdk = anthropic.AsyncAnthropic(base_url=stack.proxy.url, api_key=session.key, max_retries=0)
                prompt = [{"role": "user", "content": f"Client {index}: count to twenty."}]
                ready.release()
                await go.wait()  # every client set up first: on a loaded machine setting up took longer than a call
                async with sdk.messages.stream(model="gyre", max_tokens=MAX_NEW, messages=prompt) as stream:
                    deltas = [event.text async for event in stream if event.type == "text"]
                    final = await stream.get_final_message()
                await sdk.close()
                return "".join(deltas), final

            calls = [asyncio.ensure_future(client(session, i)) for i, session in enumerate(sessions)]
            for _ in calls:
                await ready.acquire()
            go.set()

            await hold_then_step(threads[0], CLIENTS, steps=2)  # all admitted together: 3 tokens each, held
            source.stop_accepting()  # BeginTransition: the cell leaves rollout
            moves = [await reroute_execution(table, s.execution, "external-2") for s in sessions]  # Reroute
            await source.drain(abort_after_s=0.0)  # the backstop: nothing is left on the source
            await source.release_memory()  # every export was released
            results = await asyncio.gather(*calls)
        finally:
            await stack.close()
        return sessions, moves, results

    with endpoints(factories) as (urls, threads):
        sessions, moves, results = asyncio.run(asyncio.wait_for(main(urls, threads), TIMEOUT_S))
    migrated = sum(len(move.migrated) for move in moves)
    moved_mid_stream = 0
    for session, (streamed, final) in zip(sessions, results, strict=True):
        text = "".join(block.text for block in final.content if block.type == "text")
        assert streamed == text  # no delta twice, none missing
        tree = load_tree(tmp_path / "records" / f"{session.execution}.jsonl")
        assert len(tree.calls) == 1  # recorded once
        call = tree.calls[0]
        assert len(call.response.ids) == final.usage.output_tokens
        assert call.meta.engine in {"external-0", "external-0,external-2", "external-2"}  # never external-1
        moved_mid_stream += call.meta.engine == "external-0,external-2"
    print(f"KV migrated: {migrated} of {CLIENTS}; calls continued on the destination: {moved_mid_stream}")
    # Held in flight on the source, every call still running there (all, unless one sampled its end within its
    # first 3 tokens) was migrated with its KV and continued on the destination; none was restarted.
    ended_on_source = sum(
        load_tree(tmp_path / "records" / f"{s.execution}.jsonl").calls[0].meta.engine == "external-0" for s in sessions
    )
    assert migrated == moved_mid_stream == CLIENTS - ended_on_source
    assert not any(move.restarted for move in moves)
    assert migrated >= CLIENTS // 2 and moved_mid_stream >= CLIENTS // 2


def test_a_kv_migration_over_http_continues_the_greedy_call_exactly_and_prefills_one_token(model):
    prompt = (3, 1, 4, 1, 5, 9, 2, 6)
    params = SamplingParams(temperature=0.0, max_new_tokens=120)

    def greedy(rid, execution):
        return GenerateRequest(request_id=rid, execution_id=execution, input_ids=prompt, params=params)

    async def main(urls, threads):
        a, b = [await RemoteEngine.connect(url) for url in urls]
        try:
            expected = await b.generate(greedy("ref", "reference"))  # alone, never moved
            table = RoutingTable({"a": a, "b": b}, placement="scheduler")
            table.assign("exec", "a")
            ten = asyncio.Event()
            await threads[0].call_async(lambda engine: engine.hold(), 60)
            call = asyncio.ensure_future(
                collect(generate_routed(table, greedy("r", "exec")), lambda n: n >= 10 and ten.set())
            )
            await hold_then_step(threads[0], 1, steps=9)  # exactly 10 tokens on a, held there
            await asyncio.wait_for(ten.wait(), 60)
            a.stop_accepting()
            moved = await reroute_execution(table, "exec", "b")
            tokens, engines, finish = await call
        finally:
            await a.close()
            await b.close()
        return expected, moved, tokens, engines, finish

    factories = [lambda: NativeEngine(copy.deepcopy(model)) for _ in range(2)]
    with endpoints(factories) as (urls, threads):
        expected, moved, tokens, engines, finish = asyncio.run(asyncio.wait_for(main(urls, threads), TIMEOUT_S))
    assert moved.migrated == ("r",) and moved.restarted == ()
    assert tuple(tokens) == expected.output_ids  # no token twice, none missing
    assert finish.engines == ("a", "b") and finish.finish_reason == expected.finish_reason
    on_a = engines.count("a")
    assert on_a == 10  # held after exactly 10 tokens
    assert finish.continuation_cached_tokens == len(prompt) + on_a - 1  # only the last token was prefilled on b


def counting_reply(request: GenerateRequest):
    """Token i of a call is a function of its position in the context: a continuation from any point goes on the
    same sequence, whichever engine runs it (re-prefill, no KV)."""
    return ((len(request.input_ids) + i) % 40 + 5 for i in itertools.count())


@pytest.mark.parametrize("move", ["reroute_execution", "drain_then_assign"])
def test_without_kv_export_the_call_is_aborted_on_the_source_and_re_prefilled_on_the_destination(move):
    prompt = (1, 2, 3, 4, 5)
    budget = 60
    request = GenerateRequest(
        request_id="r", execution_id="exec", input_ids=prompt, params=SamplingParams(max_new_tokens=budget)
    )

    async def main(urls, threads):
        a, b = [await RemoteEngine.connect(url) for url in urls]
        try:
            table = RoutingTable({"a": a, "b": b}, placement="scheduler")
            table.assign("exec", "a")
            ten = asyncio.Event()
            await threads[0].call_async(lambda engine: engine.hold(after_tokens=10), 60)  # in flight until moved
            call = asyncio.ensure_future(collect(generate_routed(table, request), lambda n: n >= 10 and ten.set()))
            await asyncio.wait_for(ten.wait(), 60)
            a.stop_accepting()
            moved = None
            if move == "reroute_execution":
                moved = await reroute_execution(table, "exec", "b")  # export_kv: NotImplementedError -> abort
            else:
                await a.drain(abort_after_s=0.0)  # the call is dropped; it waits for the controller

                async def dropped():
                    (waiting,) = table.calls_in_flight(execution="exec")
                    return waiting.engine is None

                await wait_until(dropped)
                assert not call.done()
                table.assign("exec", "b")
            tokens, engines, finish = await call
        finally:
            await a.close()
            await b.close()
        return moved, tokens, engines, finish

    factories = [lambda: ScriptedEngine(counting_reply) for _ in range(2)]
    with endpoints(factories) as (urls, threads):
        moved, tokens, engines, finish = asyncio.run(asyncio.wait_for(main(urls, threads), TIMEOUT_S))
    if moved is not None:
        assert moved.migrated == () and moved.restarted == ("r",)
    assert tokens == [(len(prompt) + i) % 40 + 5 for i in range(budget)]  # no token twice, none missing
    assert finish.engines == ("a", "b") and finish.finish_reason == "length"
    assert finish.continuation_cached_tokens == 0 and engines.count("a") == 10  # held after 10 tokens on a
