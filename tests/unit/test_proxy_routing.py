"""Routing and transparent retry over real native engines in process (behind HTTP: tests/integration)."""

from __future__ import annotations

import asyncio
import copy

import pytest
from engine_fixtures import sharp_tiny_model

from gyre.engine.native import NativeEngine
from gyre.engine.protocol import GenerateRequest, SamplingParams
from gyre.proxy.routing import NoEngineError, RoutedFinish, RoutedTokens, RoutingTable, generate_routed

TIMEOUT_S = 60.0
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=100)


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_model()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def request(rid: str, prompt=(3, 1, 4, 1, 5), params=GREEDY, execution="exec") -> GenerateRequest:
    return GenerateRequest(request_id=rid, execution_id=execution, input_ids=prompt, params=params)


async def collect(stream, on_tokens=None):
    tokens, logprobs, engines, finish = [], [], [], None
    async for item in stream:
        if isinstance(item, RoutedTokens):
            tokens.extend(item.token_ids)
            logprobs.extend(item.logprobs)
            engines.append(item.engine)
            if on_tokens is not None:
                await on_tokens(len(tokens))
        else:
            assert isinstance(item, RoutedFinish) and finish is None
            finish = item
    return tokens, logprobs, engines, finish


def test_a_call_dropped_mid_stream_continues_on_another_engine_without_a_gap_or_a_repeat(model):
    async def main():
        reference = NativeEngine(copy.deepcopy(model))
        expected = await reference.generate(request("ref"))
        a, b = NativeEngine(copy.deepcopy(model)), NativeEngine(copy.deepcopy(model))
        table = RoutingTable({"a": a, "b": b})
        table.assign("exec", "a")
        drains = []

        async def drop_a_after_ten(count):
            if count >= 10 and not drains:
                drains.append(asyncio.ensure_future(a.drain(abort_after_s=0.0)))  # the cell leaves rollout

        tokens, logprobs, engines, finish = await collect(generate_routed(table, request("r")), drop_a_after_ten)
        assert tuple(tokens) == expected.output_ids and len(tokens) == 100
        assert logprobs == pytest.approx(list(expected.output_logprobs), abs=1e-5)
        assert engines[0] == "a" and engines[-1] == "b" and finish.attempts == 2 and finish.engines == ("a", "b")
        assert finish.finish_reason == "length" and table.route_of("exec") == "b"
        for engine in (reference, a, b):
            await engine.close()

    run(main())


def test_calls_wait_while_no_engine_accepts_and_fail_clearly_after_the_wait(model):
    async def main():
        a = NativeEngine(copy.deepcopy(model))
        a.stop_accepting()
        table = RoutingTable({"a": a})
        with pytest.raises(NoEngineError, match=r"within 0\.2 s"):
            await collect(generate_routed(table, request("late", params=SamplingParams(max_new_tokens=3)), wait_s=0.2))
        asyncio.get_running_loop().call_later(0.3, a.resume_accepting)
        tokens, _, _, finish = await collect(generate_routed(table, request("r", params=GREEDY), wait_s=10))
        assert len(tokens) == 100 and finish.finish_reason == "length"
        await a.close()

    run(main())


def test_new_executions_go_to_the_least_loaded_engine_and_stay_there(model):
    async def main():
        a, b = NativeEngine(copy.deepcopy(model), max_running=4), NativeEngine(copy.deepcopy(model), max_running=4)
        table = RoutingTable({"a": a, "b": b})
        busy = asyncio.ensure_future(a.generate(request("busy", params=GREEDY, execution="other")))
        await asyncio.sleep(0.01)
        assert table.engine_for("new")[0] == "b"
        assert table.engine_for("new")[0] == "b"  # sticky
        table.assign("new", "a")
        assert table.engine_for("new")[0] == "a"
        table.drop_engine("a")
        assert table.route_of("new") is None and table.engine_for("new")[0] == "b"
        with pytest.raises(KeyError, match="unknown engine"):
            table.assign("new", "a")
        await busy
        await a.close()
        await b.close()

    run(main())


def test_bad_input_fails_at_once_instead_of_being_retried(model):
    async def main():
        engine = NativeEngine(copy.deepcopy(model))
        table = RoutingTable({"a": engine})
        with pytest.raises(ValueError, match="out of vocabulary"):
            await collect(generate_routed(table, request("bad", prompt=(1, 10_000))))
        await engine.close()

    run(main())
