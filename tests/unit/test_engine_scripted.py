"""`gyre.engine.scripted.ScriptedEngine`, the stand-in engine, beyond the contract suite (test_engine_contract.py runs
its request lifecycle): how a script ends a request, pacing and timings, holding, recording, `chat_reply`, bad
options, and that the module imports the stdlib and the protocol only (light processes serve it)."""

from __future__ import annotations

import ast
import asyncio
import itertools
import time
from pathlib import Path

import pytest

from gyre.engine import scripted
from gyre.engine.protocol import EngineUnavailableError, GenerateRequest, SamplingParams
from gyre.engine.scripted import ScriptedEngine, chat_reply


def request(rid: str, prompt=(1, 2, 3), **params) -> GenerateRequest:
    return GenerateRequest(request_id=rid, execution_id="e", input_ids=list(prompt), params=SamplingParams(**params))


def test_a_script_ends_with_stop_at_its_end_or_a_stop_id_and_with_length_at_the_budget():
    engine = ScriptedEngine(lambda request: [5, 6, 7], logprob=-0.25)

    async def main():
        ended = await engine.generate(request("a"))
        stopped = await engine.generate(request("b", stop_token_ids=[6]))
        cut = await engine.generate(request("c", max_new_tokens=2))
        empty = await ScriptedEngine(lambda request: ()).generate(request("d"))
        return ended, stopped, cut, empty

    ended, stopped, cut, empty = asyncio.run(main())
    assert (ended.output_ids, ended.finish_reason, ended.output_logprobs) == ((5, 6, 7), "stop", (-0.25,) * 3)
    assert (stopped.output_ids, stopped.finish_reason) == ((5, 6), "stop")
    assert (cut.output_ids, cut.finish_reason) == ((5, 6), "length")
    assert (empty.output_ids, empty.finish_reason) == ((), "stop")
    assert ended.cached_tokens == 0 and ended.prompt_tokens == 3


def test_an_endless_script_streams_one_chunk_per_token_paced_and_timed():
    engine = ScriptedEngine(lambda request: itertools.cycle([4, 9]), token_delay_s=0.01, first_token_delay_s=0.05)

    async def main():
        started = time.monotonic()
        chunks = [c async for c in engine.generate_stream(request("p", max_new_tokens=5))]
        return chunks, time.monotonic() - started

    chunks, wall_s = asyncio.run(main())
    assert [c.token_ids for c in chunks] == [(4,), (9,), (4,), (9,), (4,)] and [c.index for c in chunks] == [*range(5)]
    assert [c.finish_reason for c in chunks] == [None] * 4 + ["length"]
    timings = chunks[-1].timings
    assert wall_s >= 0.05 + 5 * 0.01 and timings.total_s >= 0.1 and timings.first_token_s >= 0.06
    assert all(c.timings is None for c in chunks[:-1]) and chunks[-1].cached_tokens == 0


def test_calls_are_counted_and_recorded_on_request():
    recording = ScriptedEngine(lambda request: [1], record_requests=True)
    counting = ScriptedEngine(lambda request: [1])

    async def main():
        for engine in (recording, counting):
            await engine.generate(request("r1"))
            await engine.generate(request("r2", prompt=[7]))

    asyncio.run(main())
    assert recording.calls == counting.calls == 2 and counting.requests is None
    assert [(r.request_id, list(r.input_ids)) for r in recording.requests] == [("r1", [1, 2, 3]), ("r2", [7])]


def test_released_memory_and_weights_updates_follow_the_protocol():
    engine = ScriptedEngine(lambda request: [3, 3])

    async def main():
        await engine.release_memory(kv=False)
        load = engine.load()
        assert load.memory_released and not load.accepting and load.kv_tokens_total == 1 << 20
        with pytest.raises(EngineUnavailableError):
            await engine.generate(request("x"))
        with pytest.raises(EngineUnavailableError, match="released"):
            await engine.update_weights({}, version=1)
        await engine.resume_memory()
        await engine.update_weights({}, version=4)
        with pytest.raises(ValueError, match=r"^version=3 is not allowed"):
            await engine.update_weights({}, version=3)
        result = await engine.generate(request("y"))
        assert (result.policy_version, result.last_policy_version, engine.load().policy_version) == (4, 4, 4)
        with pytest.raises(NotImplementedError, match="no KV cache"):
            await engine.export_kv("y")

    asyncio.run(main())


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _Template:
    """What `chat_reply` reads of a ChatTemplate: a text is its character codes, end of turn is id 0."""

    tokenizer = _Tokenizer()
    end_of_turn_ids = (0,)

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_chat_reply_answers_the_decoded_prompt_in_the_template_and_ends_the_turn():
    seen = []

    def respond(request, prompt):
        seen.append(prompt)
        return "ok"

    result = asyncio.run(ScriptedEngine(chat_reply(_Template(), respond)).generate(request("c", prompt=[11, 12])))
    assert seen == ["11 12"] and result.output_ids == (ord("o"), ord("k"), 0) and result.finish_reason == "stop"


@pytest.mark.parametrize(
    "options, field",
    [
        ({"token_delay_s": -1}, "token_delay_s"),
        ({"first_token_delay_s": True}, "first_token_delay_s"),
        ({"max_running": 0}, "max_running"),
        ({"logprob": 0.5}, "logprob"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"context_length": 1.5}, "context_length"),
        ({"policy_version": -1}, "policy_version"),
    ],
)
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=rf"^{field}=.* is not allowed: expected"):
        ScriptedEngine(lambda request: (), **options)


def test_module_imports_the_stdlib_and_the_protocol_only():
    """So the proxy's tests and load generators can serve it in processes without torch or numpy."""
    tree = ast.parse(Path(scripted.__file__).read_text())
    modules = set()
    for node in tree.body:  # top level only: the TYPE_CHECKING block is an `if`, not an import
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules.add(node.module or "")
    allowed = {"__future__", "asyncio", "time", "collections", "collections.abc", "typing"}
    assert modules <= allowed | {"gyre.engine.protocol", "gyre.config.checks"}, modules


def test_a_hold_keeps_requests_in_flight_after_their_first_tokens_until_release_or_abort():
    """`hold(after_tokens=n)`: an endless request and one whose script ends right after the hold both wait there, in
    flight, whatever the time; a request ending within its first n tokens ends as usual; abort ends a held one with
    its tokens, release lets the other finish."""
    engine = ScriptedEngine(lambda request: itertools.cycle([4, 9]) if request.request_id != "end" else [5, 6, 7])

    async def main():
        engine.hold(after_tokens=2)
        short = await engine.generate(request("short", max_new_tokens=2))  # ends at the hold: not held
        kept = asyncio.ensure_future(engine.generate(request("kept", max_new_tokens=100)))
        end = asyncio.ensure_future(engine.generate(request("end")))
        await asyncio.wait_for(engine.until_held(2), 5)
        await asyncio.sleep(0.05)  # time passes: nothing moves
        assert not kept.done() and not end.done() and engine.load().running == 2
        assert engine.abort("kept") is True
        aborted = await kept
        assert not end.done()
        engine.release()
        return short, aborted, await end, await engine.generate(request("later", max_new_tokens=5))

    short, aborted, end, later = asyncio.run(asyncio.wait_for(main(), 10))
    assert (short.output_ids, short.finish_reason) == ((4, 9), "length")
    assert (aborted.output_ids, aborted.finish_reason) == ((4, 9), "abort")
    assert (end.output_ids, end.finish_reason) == ((5, 6, 7), "stop")
    assert (later.output_ids, later.finish_reason) == ((4, 9, 4, 9, 4), "length")  # released: no hold any more


def test_a_held_stream_whose_reader_is_cancelled_leaves_the_engine():
    engine = ScriptedEngine(lambda request: itertools.cycle([4]))
    chunks = []

    async def read():
        async for chunk in engine.generate_stream(request("s", max_new_tokens=100)):
            chunks.append(chunk)

    async def main():
        engine.hold(after_tokens=1)
        reader = asyncio.ensure_future(read())
        await asyncio.wait_for(engine.until_held(1), 5)
        reader.cancel()  # a client that hangs up while the request is held
        with pytest.raises(asyncio.CancelledError):
            await reader
        return engine.load()

    load = asyncio.run(asyncio.wait_for(main(), 10))
    assert [chunk.token_ids for chunk in chunks] == [(4,)] and (load.running, load.queued) == (0, 0)
