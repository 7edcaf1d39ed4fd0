"""Rerouting under load: 100 concurrent streaming clients, the serving engine is cancelled mid-stream.

Two native engines behind real endpoints (threads), the real proxy, 100 real `anthropic` SDK clients streaming
at once, every execution placed on engine A. A's step loop is held (`NativeEngine.hold`) until every call waits on
it, then runs exactly two steps (16 calls admitted with 3 tokens each, the rest queued) and holds again; then A
drains with a zero deadline (a cell leaving rollout): everything in flight on it is aborted, however slow the
machine. Every client must still get a complete, well-formed stream whose
text is exactly what the recorded output ids decode to (no delta twice, none missing), and every call must be
recorded once.
"""

from __future__ import annotations

import asyncio
import copy

import anthropic
import pytest

from gyre.config import EngineConfig, ServeConfig
from gyre.config.proxy import ProxyConfig, SamplingConfig
from gyre.engine.endpoint import ServerThread
from gyre.engine.native import NativeEngine
from gyre.engine.protocol import GenerateRequest, SamplingParams
from gyre.engine.remote import RemoteEngine
from gyre.models.hf_weights import load_pretrained
from gyre.models.tiny import tiny_model_dir
from gyre.proxy.output import OutputDecoder
from gyre.proxy.routing import RoutedTokens, RoutingTable, generate_routed
from gyre.serve.stack import build_stack
from gyre.traj.store import load_tree

CLIENTS = 100
MAX_NEW = 48
TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def engines():
    model_dir = tiny_model_dir()
    threads = [ServerThread(lambda: NativeEngine(load_pretrained(model_dir), max_running=16)) for _ in range(2)]
    urls = [thread.start() for thread in threads]
    yield urls, threads
    for thread in threads:
        thread.stop()


def test_cancelling_the_serving_engine_mid_stream_is_invisible_to_100_streaming_clients(engines, tmp_path):
    urls, threads = engines

    def on_a(fn, timeout_s: float = 60.0):
        return threads[0].call_async(fn, timeout_s)

    cfg = ServeConfig(
        engine=EngineConfig(enabled=False),
        engine_urls=list(urls),
        proxy=ProxyConfig(sampling=SamplingConfig(max_new_tokens=MAX_NEW)),
        executions=0,
    )

    async def main():
        stack = await build_stack(cfg, records_dir=tmp_path / "records")
        try:
            sessions = [stack.registry.issue() for _ in range(CLIENTS)]
            for session in sessions:
                stack.table.assign(session.execution, "external-0")
            engine_a = stack.table.engines["external-0"]

            async def client(session, index):
                sdk = anthropic.AsyncAnthropic(base_url=stack.proxy.url, api_key=session.key, max_retries=0)
                prompt = [{"role": "user", "content": f"Client {index}: count to ten."}]
                async with sdk.messages.stream(model="gyre", max_tokens=MAX_NEW, messages=prompt) as stream:
                    deltas = [event.text async for event in stream if event.type == "text"]
                    final = await stream.get_final_message()
                await sdk.close()
                return "".join(deltas), final

            await on_a(lambda engine: engine.hold())
            calls = [asyncio.ensure_future(client(session, i)) for i, session in enumerate(sessions)]
            for _ in range(6000):  # wait (bounded) until every call waits on the held A
                if (await on_a(lambda engine: engine.load())).queued >= CLIENTS:
                    break
                await asyncio.sleep(0.01)
            await on_a(lambda engine: engine.release(steps=2))  # a full batch of 16 admitted: 3 tokens each
            await on_a(lambda engine: engine.until_held())
            await engine_a.drain(abort_after_s=0.0)  # the cell leaves rollout: its in-flight calls are aborted
            results = await asyncio.gather(*calls)
        finally:
            await stack.close()
        return sessions, results, stack

    sessions, results, stack = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    rerouted = 0
    for session, (streamed, final) in zip(sessions, results, strict=True):
        text = "".join(block.text for block in final.content if block.type == "text")
        assert streamed == text
        assert final.stop_reason in {"end_turn", "max_tokens", "tool_use"}
        tree = load_tree(tmp_path / "records" / f"{session.execution}.jsonl")
        assert len(tree.calls) == 1  # recorded once
        call = tree.calls[0]
        assert len(call.response.ids) == final.usage.output_tokens
        rerouted += call.meta.engine == "external-0,external-1"
        decoder = OutputDecoder(
            stack.proxy.template.tokenizer, skip_ids=stack.proxy.template.end_of_turn_ids, new_call_id=lambda: "x"
        )
        decoder.feed(list(call.response.ids))
        _, output = decoder.finish(call.response.finish_reason)
        assert output.text == text  # what the client saw is exactly what was recorded
    print(f"calls moved mid-stream from A to B: {rerouted} of {CLIENTS}")
    assert rerouted >= 8  # A's running batch (16 calls, most with tokens out) moved mid-stream


def test_an_endpoint_that_went_away_is_skipped():
    """A RemoteEngine whose cached load still says "accepting" but whose endpoint is gone: the call goes elsewhere."""
    model = load_pretrained(tiny_model_dir())
    gone = ServerThread(lambda: NativeEngine(copy.deepcopy(model)))
    url = gone.start()
    params = SamplingParams(temperature=0.0, max_new_tokens=100)
    request = GenerateRequest(request_id="r", execution_id="exec", input_ids=(3, 1, 4, 1, 5), params=params)

    async def main():
        remote = await RemoteEngine.connect(url)
        await asyncio.to_thread(gone.stop)
        local = NativeEngine(copy.deepcopy(model))
        table = RoutingTable({"remote": remote, "local": local})
        table.assign("exec", "remote")
        tokens, engines, finish = [], set(), None
        async for item in generate_routed(table, request):
            if isinstance(item, RoutedTokens):
                tokens.extend(item.token_ids)
                engines.add(item.engine)
            else:
                finish = item
        assert len(tokens) == 100 and engines == {"local"} and finish.engines == ("local",)
        await remote.close()
        await local.close()

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
