"""Routing, its two placements and transparent retry over real native engines in process (behind HTTP:
tests/integration/test_proxy_reroute.py, test_proxy_migration.py)."""

from __future__ import annotations

import asyncio
import copy

import pytest
from engine_fixtures import sharp_tiny_model

from gyre.engine.native import NativeEngine
from gyre.engine.protocol import GenerateRequest, SamplingParams
from gyre.proxy.reroute import reroute_execution
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


# ------------------------------------------------------------------ placement="scheduler" (the training runtime)


async def wait_until(condition, timeout_s=10.0):
    """Poll `condition` (bounded): the tests' waits for a state another task reaches."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def test_a_placement_that_is_not_known_is_refused():
    with pytest.raises(ValueError, match=r"placement='nearest' is not allowed: expected one of \['least_loaded', "):
        RoutingTable(placement="nearest")


def test_the_scheduler_placement_never_picks_an_engine_and_a_call_waits_for_the_assignment(model):
    async def main():
        a, b = NativeEngine(copy.deepcopy(model)), NativeEngine(copy.deepcopy(model))
        table = RoutingTable({"a": a, "b": b}, placement="scheduler")
        assert table.engine_for("exec") is None and table.route_of("exec") is None  # both accept; none is picked
        call = asyncio.ensure_future(collect(generate_routed(table, request("r"), wait_s=30)))
        await asyncio.sleep(0.2)
        assert not call.done()
        (waiting,) = table.calls_in_flight(execution="exec")
        assert (waiting.call_id, waiting.engine, waiting.engine_request_id) == ("r", None, None)
        table.assign("exec", "b")
        tokens, _, engines, finish = await call
        assert len(tokens) == 100 and set(engines) == {"b"} and finish.engines == ("b",)
        assert table.calls_in_flight() == ()

        # the assigned engine refuses (a role transition drains it): the call waits, the accepting "b" is not used
        a.stop_accepting()
        table.assign("exec", "a")
        call = asyncio.ensure_future(collect(generate_routed(table, request("r2"), wait_s=30)))
        await asyncio.sleep(0.2)
        assert not call.done() and b.load().running == 0 and table.route_of("exec") == "a"
        a.resume_accepting()  # back (or a reassignment): it continues there
        tokens, _, engines, finish = await call
        assert len(tokens) == 100 and finish.engines == ("a",) and table.route_of("exec") == "a"
        await a.close()
        await b.close()

    run(main())


def test_under_the_scheduler_placement_a_call_fails_clearly_when_no_assigned_engine_accepts_in_time(model):
    async def main():
        a = NativeEngine(copy.deepcopy(model))
        table = RoutingTable({"a": a}, placement="scheduler")
        short = request("r", params=SamplingParams(max_new_tokens=3))
        with pytest.raises(NoEngineError, match=r"within 0\.2 s \(placement 'scheduler'.*assigned: none\)"):
            await collect(generate_routed(table, short, wait_s=0.2))
        a.stop_accepting()
        table.assign("exec", "a")
        with pytest.raises(NoEngineError, match=r"within 0\.2 s .*assigned: a\)"):
            await collect(generate_routed(table, short, wait_s=0.2))
        assert table.calls_in_flight() == ()
        await a.close()

    run(main())


def test_a_call_its_engine_dropped_waits_for_the_reassignment_even_while_that_engine_accepts(model):
    """An unrequested abort (here the controller's own `abort`, the source still accepting) is not a licence to pick:
    the call waits until the controller assigns it again, then continues there from the tokens it has."""

    async def main():
        reference = NativeEngine(copy.deepcopy(model))
        expected = await reference.generate(request("ref"))
        a, b, c = (NativeEngine(copy.deepcopy(model)) for _ in range(3))
        table = RoutingTable({"a": a, "b": b, "c": c}, placement="scheduler")
        table.assign("exec", "a")
        ten = asyncio.Event()

        async def on_tokens(count):
            if count >= 10:
                ten.set()

        call = asyncio.ensure_future(collect(generate_routed(table, request("r")), on_tokens))
        await asyncio.wait_for(ten.wait(), 20)
        (running,) = table.calls_in_flight(engine="a")
        assert running.engine_request_id == "r" and running.attempt == 0
        assert a.abort(running.engine_request_id)
        await wait_until(lambda: table.calls_in_flight(execution="exec")[0].engine is None)
        await asyncio.sleep(0.2)  # "a" still accepts and "b" is idle: neither is taken
        (waiting,) = table.calls_in_flight(execution="exec")
        assert waiting.engine is None and waiting.produced >= 10 and not call.done()
        table.assign("exec", "c")
        tokens, logprobs, engines, finish = await call
        assert tuple(tokens) == expected.output_ids  # no token twice, none missing
        assert logprobs == pytest.approx(list(expected.output_logprobs), abs=1e-5)
        assert finish.engines == ("a", "c") and engines[0] == "a" and engines[-1] == "c"
        for engine in (reference, a, b, c):
            await engine.close()

    run(main())


@pytest.mark.parametrize("migrate_kv", [True, False], ids=["kv-migrated", "re-prefilled"])
def test_a_reroute_at_a_transition_moves_the_call_to_the_destination_without_a_gap_or_a_repeat(model, migrate_kv):
    """The documented order: the source stops accepting, `export_kv` there, `import_kv` on the destination,
    `release_export`, then `assign`; with `migrate_kv=False` (an engine without KV export) an abort instead."""

    async def main():
        reference = NativeEngine(copy.deepcopy(model))
        expected = await reference.generate(request("ref"))
        a, b = NativeEngine(copy.deepcopy(model)), NativeEngine(copy.deepcopy(model))
        table = RoutingTable({"a": a, "b": b}, placement="scheduler")
        table.assign("exec", "a")
        ten = asyncio.Event()

        async def on_tokens(count):
            if count >= 10:
                ten.set()

        call = asyncio.ensure_future(collect(generate_routed(table, request("r")), on_tokens))
        await asyncio.wait_for(ten.wait(), 20)
        a.stop_accepting()  # the cell leaves rollout
        moved = await reroute_execution(table, "exec", "b", migrate_kv=migrate_kv)
        assert (moved.migrated, moved.restarted) == ((("r",), ()) if migrate_kv else ((), ("r",)))
        assert table.route_of("exec") == "b"
        tokens, logprobs, engines, finish = await call
        assert tuple(tokens) == expected.output_ids
        assert logprobs == pytest.approx(list(expected.output_logprobs), abs=1e-5)
        assert finish.engines == ("a", "b") and finish.finish_reason == "length"
        on_a = engines.index("b")  # chunks are one token each: tokens produced on the source
        # with the KV imported the destination prefilled only the last token; without, the whole context
        assert finish.continuation_cached_tokens == (5 + on_a - 1 if migrate_kv else 0)
        await a.release_memory()  # nothing pinned or running is left on the source
        for engine in (reference, a, b):
            await engine.close()

    run(main())


def test_reroute_execution_needs_the_scheduler_placement_and_a_known_destination(model):
    async def main():
        a = NativeEngine(copy.deepcopy(model))
        with pytest.raises(ValueError, match="needs placement='scheduler'"):
            await reroute_execution(RoutingTable({"a": a}), "exec", "a")
        table = RoutingTable({"a": a}, placement="scheduler")
        with pytest.raises(KeyError, match="unknown engine 'z'"):
            await reroute_execution(table, "exec", "z")
        assert table.route_of("exec") is None
        moved = await reroute_execution(table, "exec", "a")  # nothing in flight: just the assignment
        assert moved.calls == 0 and table.route_of("exec") == "a"
        await a.close()

    run(main())
