"""The routing table when an engine dies (in process; over real HTTP: tests/integration/test_proxy_failover.py).

`Dying` stands for a `RemoteEngine` whose endpoint dies after a number of tokens: its streams break with
`EngineUnreachable` and its probe (`refresh_load`) fails, unless the endpoint is still up (a connection that broke,
not the engine). The engines behind are `ScriptedEngine`s whose token i is a function of its position in the
context, so a call continued anywhere goes on the same sequence; their log-probs name the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from gyre.engine.errors import EngineUnreachable
from gyre.engine.protocol import EngineUnavailableError, GenerateRequest, SamplingParams
from gyre.engine.scripted import ScriptedEngine
from gyre.proxy.routing import EngineLost, NoEngineError, RoutedFinish, RoutedTokens, RoutingTable, generate_routed

TIMEOUT_S = 30.0
BUDGET = 30
PROMPT = (1, 2, 3, 4, 5)


def counting(request):
    return ((len(request.input_ids) + i) % 40 + 5 for i in itertools.count())


def scripted(logprob: float) -> ScriptedEngine:
    return ScriptedEngine(counting, logprob=logprob)


class Dying:
    """An engine whose endpoint dies once it has streamed `after` tokens (None: never)."""

    def __init__(self, engine: ScriptedEngine, after: int | None, *, endpoint_survives: bool = False):
        self.engine, self.after, self.endpoint_survives = engine, after, endpoint_survives
        self.dead = False
        self.probes = 0

    def load(self):
        return self.engine.load()

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    async def refresh_load(self):
        self.probes += 1
        if self.dead and not self.endpoint_survives:
            raise EngineUnreachable("connect call failed")
        return self.engine.load()

    async def generate_stream(self, request):
        if self.dead and not self.endpoint_survives:
            raise EngineUnreachable("connect call failed")
        streamed = 0
        stream = self.engine.generate_stream(request)
        try:
            async for chunk in stream:
                yield chunk
                streamed += len(chunk.token_ids)
                if self.after is not None and streamed >= self.after and not self.dead:
                    self.dead = True
                    raise EngineUnreachable("response payload is not completed")
        finally:
            await stream.aclose()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def request(rid: str, execution: str = "exec") -> GenerateRequest:
    params = SamplingParams(max_new_tokens=BUDGET)
    return GenerateRequest(request_id=rid, execution_id=execution, input_ids=PROMPT, params=params)


async def collect(stream):
    tokens, logprobs, finish = [], [], None
    async for item in stream:
        if isinstance(item, RoutedTokens):
            tokens.extend(item.token_ids)
            logprobs.extend(item.logprobs)
        else:
            assert isinstance(item, RoutedFinish) and finish is None
            finish = item
    return tokens, logprobs, finish


EXPECTED = [(len(PROMPT) + i) % 40 + 5 for i in range(BUDGET)]


@pytest.mark.parametrize("placement", ["scheduler", "least_loaded"])
def test_a_call_whose_engine_dies_goes_on_on_a_live_engine_and_the_engine_is_lost(placement):
    async def main():
        lost: list[EngineLost] = []
        a = Dying(scripted(-1.0), after=8)
        table = RoutingTable({"a": a, "b": scripted(-2.0)}, placement=placement, on_engine_lost=lost.append)
        for execution in ("exec", "idle"):
            table.assign(execution, "a")
        result = await collect(generate_routed(table, request("r")))
        return table, lost, a, result

    table, lost, a, (tokens, logprobs, finish) = run(main())
    assert tokens == EXPECTED  # no token twice, none missing
    assert logprobs == [-1.0] * 8 + [-2.0] * (BUDGET - 8)  # each token's own engine's log-prob
    assert finish.engines == ("a", "b") and finish.failed_over == 1 and finish.finish_reason == "length"
    assert a.probes == 1 and list(table.engines) == ["b"] and list(table.lost_engines) == ["a"]
    (event,) = lost
    assert event.engine == "a" and dict(event.moved) == {"exec": "b", "idle": "b"} and event.unplaced == ()
    assert "payload is not completed" in event.reason and "probe: connect call failed" in event.reason
    assert table.route_of("exec") == table.route_of("idle") == "b"


def test_an_engine_whose_probe_answers_is_not_lost_and_the_call_goes_on():
    """A connection that broke while the endpoint is up (a reset keep-alive connection): one retry, no loss."""

    async def main():
        a = Dying(scripted(-1.0), after=8, endpoint_survives=True)
        table = RoutingTable({"a": a, "b": scripted(-2.0)}, placement="scheduler")
        table.assign("exec", "a")
        return table, a, await collect(generate_routed(table, request("r")))

    table, a, (tokens, _, finish) = run(main())
    assert tokens == EXPECTED and finish.failed_over == 1
    assert a.probes == 1 and table.lost_engines == {} and set(table.engines) == {"a", "b"}
    assert table.route_of("exec") == "a"  # the scheduler's placement stands; the call went on on a


def test_lost_executions_spread_over_the_least_loaded_live_engines_and_assign_never_names_a_lost_one():
    async def main():
        table = RoutingTable({n: scripted(-1.0) for n in ("a", "b", "c")}, placement="scheduler")
        for index in range(4):
            table.assign(f"e{index}", "a")
        event = table.mark_lost("a", "test")
        table.assign("late", "a")  # the owner's ledger still names the dead engine: the table does not
        late = table.route_of("late")
        again = table.mark_lost("a", "again")
        table.add_engine("a", scripted(-1.0))  # the engine is back (a new endpoint under the old name)
        return table, event, late, again

    table, event, late, again = run(main())
    assert dict(event.moved) == {"e0": "b", "e1": "c", "e2": "b", "e3": "c"}  # ties by name, then alternating
    assert late in {"b", "c"} and again is None  # lost once
    assert table.lost_engines == {} and "a" in table.engines


def test_the_owner_places_the_lost_executions_from_its_callback_and_the_call_follows():
    async def main():
        table = RoutingTable(placement="scheduler")

        def owner_places(event: EngineLost) -> None:  # the controller: its scheduler picks c, not the least loaded
            for execution in event.moved:
                table.assign(execution, "c")

        table.on_engine_lost = owner_places
        table.add_engine("a", Dying(scripted(-1.0), after=5))
        table.add_engine("b", scripted(-2.0))
        table.add_engine("c", scripted(-3.0))
        table.assign("exec", "a")
        tokens, logprobs, finish = await collect(generate_routed(table, request("r")))
        return table, tokens, logprobs, finish

    table, tokens, logprobs, finish = run(main())
    assert tokens == EXPECTED and finish.engines == ("a", "c")
    assert logprobs == [-1.0] * 5 + [-3.0] * (BUDGET - 5) and table.route_of("exec") == "c"


@pytest.mark.parametrize("placement", ["scheduler", "least_loaded"])
def test_with_every_engine_lost_a_call_fails_at_once_not_after_the_wait(placement):
    async def main():
        table = RoutingTable({"a": Dying(scripted(-1.0), after=5)}, placement=placement)
        table.assign("exec", "a")
        started = time.monotonic()
        with pytest.raises(NoEngineError, match="every engine of the table is lost"):
            await collect(generate_routed(table, request("r"), wait_s=600.0))
        with pytest.raises(NoEngineError, match=r"lost \(unreachable: a\)"):
            await collect(generate_routed(table, request("r2"), wait_s=600.0))
        return time.monotonic() - started

    assert run(main()) < 5.0


def test_engine_unreachable_is_an_engine_unavailable_error():
    """Whoever routes around a refusal (reroute_execution's export, older callers) routes around a dead engine."""
    assert issubclass(EngineUnreachable, EngineUnavailableError)


def test_a_call_to_an_engine_that_died_while_idle_is_served_elsewhere_from_its_start():
    """Nobody noticed the death (no call was in flight): the next call's connection is refused, the probe fails."""

    async def main():
        a = Dying(scripted(-1.0), after=None)
        a.dead = True
        table = RoutingTable({"a": a, "b": scripted(-2.0)}, placement="scheduler")
        table.assign("exec", "a")
        return table, await collect(generate_routed(table, request("r")))

    table, (tokens, logprobs, finish) = run(main())
    assert tokens == EXPECTED and logprobs == [-2.0] * BUDGET
    assert finish.engines == ("b",) and finish.failed_over == 1 and list(table.lost_engines) == ["a"]
