"""The engine endpoint over real HTTP on 127.0.0.1: error shapes, abort races, disconnects, the serve command.

The protocol behaviour through the endpoint is proven by test_engine_contract.py (kind `remote`); here are the
things only a network adds.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import signal
import subprocess
import sys

import aiohttp
import pytest
from engine_fixtures import sharp_tiny_model

from gyre.engine import wire
from gyre.engine.endpoint import ServerThread
from gyre.engine.native import NativeEngine
from gyre.engine.protocol import EngineUnavailableError, GenerateRequest, SamplingParams
from gyre.engine.remote import RemoteEngine
from gyre.models.hf_weights import save_pretrained

TIMEOUT_S = 60.0
LONG = {"temperature": 0.0, "max_new_tokens": 110}
HELD = {"temperature": 0.0, "max_new_tokens": 40}  # more than a held request gets: it cannot end by its budget


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_model()


class RecordingEngine(NativeEngine):
    """The native engine, noting which requests were aborted (to tell an abort from a run to the end)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return super().abort(request_id)


@pytest.fixture
def server(model):
    thread = ServerThread(lambda: RecordingEngine(copy.deepcopy(model), max_running=2))
    thread.start()
    yield thread
    thread.stop()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def generate_body(rid: str, prompt, params=None, **extra) -> dict:
    request = {"request_id": rid, "execution_id": f"exec-{rid}", "input_ids": prompt, "params": params or {}}
    return {"request": request, **extra}


async def post(session, url: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else wire.dumps(body)
    async with session.post(url, data=data) as response:
        return response.status, wire.loads(await response.read())


async def engine_load(session, url: str) -> dict:
    async with session.get(url + "/load") as response:
        return wire.loads(await response.read())


async def until_load(session, url: str, reached, what: str) -> dict:
    """Wait (bounded) until the endpoint's load satisfies `reached`; returns that load."""
    for _ in range(1000):
        load = await engine_load(session, url)
        if reached(load):
            return load
        await asyncio.sleep(0.005)
    raise AssertionError(f"the engine never {what}: {load}")


async def until_idle(session, url: str) -> dict:
    return await until_load(session, url, lambda load: load["running"] == load["queued"] == 0, "became idle")


def test_bad_requests_get_the_engines_error_shape_and_the_server_keeps_serving(server):
    url = server.server.url

    async def main():
        async with aiohttp.ClientSession() as session:
            cases = [
                ("/generate", b"{not json", 400, "not JSON"),
                ("/generate", {"request": {"request_id": "r"}}, 400, "input_ids"),
                ("/generate", generate_body("r", [1], {"top_p": 1.5}), 400, "top_p=1.5"),
                ("/generate", generate_body("r", [1, 97]), 400, "out of vocabulary"),
                ("/generate", generate_body("r", [1] * 100, {"max_new_tokens": 100}), 400, "context limit"),
                ("/export_kv", {"request_id": "nobody"}, 404, "nobody"),
                ("/update_weights", b"garbage", 400, "magic"),
                ("/update_bucket", b"garbage", 400, "magic"),
                ("/update_begin", {"versions": 1}, 400, "version"),
                ("/update_begin", {"version": -1}, 400, "version=-1 is not allowed"),
                ("/import_kv", b"GYRF" + bytes(8), 400, ""),
                ("/release_memory", {"weights": True, "everything": 1}, 400, "unknown fields"),
                ("/abort", {}, 400, "request_id"),
            ]
            for path, body, status, match in cases:
                code, reply = await post(session, url + path, body)
                assert code == status, (path, reply)
                assert reply["error"]["type"] in {"invalid_request", "not_found"}
                assert match in reply["error"]["message"]
            code, reply = await post(session, url + "/update_end", {"version": 0})  # no session open
            assert code == 409 and reply["error"]["type"] == "update_session"
            code, reply = await post(session, url + "/generate", generate_body("ok", [1, 2], {"max_new_tokens": 3}))
            assert code == 200 and reply["finish_reason"] == "length" and len(reply["output_ids"]) == 3

    run(main())


def test_an_abort_that_overtakes_its_request_still_ends_it(server):
    url = server.server.url

    async def main():
        async with aiohttp.ClientSession() as session:
            code, reply = await post(session, url + "/abort", {"request_id": "r1", "submission_id": "s1"})
            assert code == 200 and reply == {"aborted": False}
            code, reply = await post(session, url + "/generate", generate_body("r1", [1, 2], LONG, submission_id="s1"))
            assert code == 200 and reply["finish_reason"] == "abort" and reply["output_ids"] == []
            # the same for a stream
            await post(session, url + "/abort", {"request_id": "r2", "submission_id": "s2"})
            body = generate_body("r2", [1, 2], LONG, submission_id="s2", stream=True)
            async with session.post(url + "/generate", data=wire.dumps(body)) as response:
                lines = [wire.loads(line) async for line in response.content if line.strip()]
            assert [(c["finish_reason"], c["token_ids"]) for c in lines] == [("abort", [])]
            # the tombstone is spent: the request id can run normally afterwards
            code, reply = await post(session, url + "/generate", generate_body("r1", [1, 2], {"max_new_tokens": 2}))
            assert reply["finish_reason"] == "length"

    run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_aborts_its_request(server, stream, caplog):
    """The engine behind the endpoint holds the request running (its first 2 tokens out) when its client hangs up,
    so it can only leave by the abort. A stream's client reads a chunk and hangs up while the endpoint writes a few
    more steps' chunks (the engine released for 8 steps, then held again: it cannot reach its budget either)."""
    url = server.server.url
    caplog.set_level(logging.INFO, logger="gyre.engine.endpoint")

    async def main():
        async with aiohttp.ClientSession() as session:
            body = wire.dumps(generate_body("gone", [1, 2, 3], HELD, stream=stream))
            await server.call_async(lambda engine: engine.hold())
            sent = asyncio.ensure_future(session.post(url + "/generate", data=body))
            await until_load(session, url, lambda load: load["queued"] == 1, "queued the request")
            await server.call_async(lambda engine: engine.release(steps=1))  # admitted: 2 tokens, then held
            await server.call_async(lambda engine: engine.until_held())
            if stream:  # read a chunk, then hang up
                response = await sent
                assert wire.loads(await response.content.readline())["token_ids"]
                await server.call_async(lambda engine: engine.release(steps=8))
                response.close()
            else:  # the reply comes at the end: hang up while waiting for it
                sent.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await sent
            load = await until_idle(session, url)  # held, or held again: the abort ended it
            assert load["accepting"] and server.call(lambda engine: engine.aborted) == ["gone"]
            await server.call_async(lambda engine: engine.release())
        # the engine dropped it: a new request with the same id is accepted at once
        engine = await RemoteEngine.connect(url)
        params = SamplingParams(max_new_tokens=2)
        again = GenerateRequest(request_id="gone", execution_id="x", input_ids=[1], params=params)
        result = await engine.generate(again)
        assert result.finish_reason == "length"
        await engine.close()

    run(main())
    # a hang-up is the client's business, not an endpoint error: no ERROR record, no traceback
    noisy = ("gyre.engine.endpoint", "aiohttp.server", "aiohttp.web")
    errors = [r for r in caplog.records if r.name in noisy and r.levelno >= logging.WARNING]
    assert errors == [], [r.getMessage() for r in errors]


def test_an_unreachable_endpoint_is_unavailable(model):
    thread = ServerThread(lambda: NativeEngine(copy.deepcopy(model)))
    url = thread.start()

    async def main():
        engine = await RemoteEngine.connect(url)
        await asyncio.to_thread(thread.stop)
        request = GenerateRequest(request_id="r", execution_id="e", input_ids=[1])
        with pytest.raises(EngineUnavailableError):
            await engine.generate(request)
        with pytest.raises(EngineUnavailableError):
            await engine.refresh_load()
        await engine.close()
        with pytest.raises(EngineUnavailableError):
            await RemoteEngine.connect(url)

    run(main())


def test_serve_command_serves_a_model_directory_and_stops_on_sigterm(model, tmp_path):
    save_pretrained(model, tmp_path / "model")
    command = [sys.executable, "-m", "gyre.engine", "serve", f"model_dir={tmp_path / 'model'}", "port=0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        while not line.startswith("engine endpoint: "):  # bounded: the process exits (EOF) or the test times out
            line = process.stdout.readline()
            assert line, "the serve command exited before serving"
        url = line.split(": ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:")

        async def main():
            remote = await RemoteEngine.connect(url)
            local = NativeEngine(copy.deepcopy(model))
            params = SamplingParams(seed=1, max_new_tokens=40)
            request = GenerateRequest(request_id="r", execution_id="e", input_ids=[3, 1, 4], params=params)
            got, want = await remote.generate(request), await local.generate(request)
            assert (got.output_ids, got.output_logprobs) == (want.output_ids, want.output_logprobs)
            await remote.close()
            await local.close()

        run(main())
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def test_serve_command_refuses_an_unusable_model_directory(tmp_path):
    command = [sys.executable, "-m", "gyre.engine", "serve", f"model_dir={tmp_path / 'missing'}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "config.json not found" in done.stderr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["port=70000"], "port=70000 is not allowed: expected an integer in [0, 65535]"),
        (["engine.dtype=int8"], "engine.dtype='int8' is not allowed: expected one of float32, bfloat16, float16"),
        (["engine.enabled=false"], "engine.enabled=False is not allowed"),
        (["+max_running=2"], "max_running=2 is not allowed: expected one of the EngineServeConfig fields"),
    ],
)
def test_serve_command_refuses_a_bad_config_with_one_line(overrides, message):
    command = [sys.executable, "-m", "gyre.engine", "serve", *overrides]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gyre.engine serve: config error: ") and message in lines[0]


def test_a_call_extending_the_executions_last_prompt_sends_only_what_it_adds(server, model, monkeypatch):
    sizes = []
    decode = wire.generate_from_frame

    def spy(body, **kwargs):
        sizes.append(len(body))
        return decode(body, **kwargs)

    monkeypatch.setattr(wire, "generate_from_frame", spy)

    async def main():
        engine = await RemoteEngine.connect(server.server.url)
        params = SamplingParams(temperature=0.0, max_new_tokens=4)
        prompt = list(range(1, 90))
        first = await engine.generate(
            GenerateRequest(request_id="a", execution_id="x", input_ids=prompt, params=params)
        )
        longer = [*prompt, *first.output_ids, 5]
        second = await engine.generate(
            GenerateRequest(request_id="b", execution_id="x", input_ids=longer, params=params)
        )

        def forget_every_base(_engine):  # on the endpoint's loop, which owns its prompt store
            server.server._prompts.max_bytes = 0
            server.server._prompts.remember(GenerateRequest(request_id="z", execution_id="y", input_ids=[1]))

        await server.call_async(forget_every_base)  # the client then falls back to whole prompts
        third_prompt = [*longer, *second.output_ids, 6]
        third = GenerateRequest(request_id="c", execution_id="x", input_ids=third_prompt, params=params)
        stream = [c async for c in engine.generate_stream(third)]
        local = NativeEngine(copy.deepcopy(model))
        expected = await local.generate(
            GenerateRequest(request_id="c", execution_id="q", input_ids=third_prompt, params=params)
        )
        assert tuple(t for c in stream for t in c.token_ids) == expected.output_ids
        await engine.close()
        await local.close()

    run(main())
    whole, delta = sizes[0], sizes[1]
    assert whole - delta > 4 * 60  # the second call carried its 5 new ids, not all 94
    assert len(sizes) == 4 and sizes[3] > sizes[2]  # third: base refused (409), then the whole prompt


def test_a_load_read_after_accepting_changes_sees_them(server):
    """`stop_accepting` / `resume_accepting` are sent in the background; `refresh_load` right after must read the
    state they set, never the endpoint's state from before they arrived (it waits for them)."""

    async def main():
        engine = await RemoteEngine.connect(server.server.url)
        try:
            for _ in range(30):
                engine.stop_accepting()
                assert not (await engine.refresh_load()).accepting
                engine.resume_accepting()
                assert (await engine.refresh_load()).accepting
        finally:
            await engine.close()

    run(main())
