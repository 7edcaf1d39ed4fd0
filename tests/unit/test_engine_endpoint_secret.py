"""The engine endpoint with the job's secret, over real HTTP on 127.0.0.1 (docs/endpoint.md, "The job's secret").

Every route but `GET /health` refuses a call without `Authorization: Bearer <secret>` (401 `unauthorized`) or with
another token (403 `forbidden`) before the engine sees it; a `RemoteEngine` given the secret works as without one;
one given none or another raises `EngineAuthError` at `connect`. An endpoint without a secret stays open. The engine
is the scripted stand-in: what is tested is the endpoint, not a model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import aiohttp
import pytest
import torch

from gyre.engine import wire
from gyre.engine.endpoint import EngineServer, ServerThread, bearer_token
from gyre.engine.errors import EngineAuthError
from gyre.engine.protocol import GenerateRequest, KVExport, SamplingParams
from gyre.engine.remote import RemoteEngine
from gyre.engine.scripted import ScriptedEngine

TIMEOUT_S = 30.0
SECRET = "job-secret-for-the-test"
KV = KVExport(
    request_id="r",
    execution_id="e",
    token_ids=(1, 2),
    policy_version=0,
    keys=(torch.zeros(1, 2, 2),),
    values=(torch.zeros(1, 2, 2),),
)
# every route but /health, each with a body the route would accept
ROUTES = [
    ("GET", "/load", b""),
    ("POST", "/generate", wire.dumps({"request": {"request_id": "g", "execution_id": "e", "input_ids": [1, 2]}})),
    ("POST", "/abort", wire.dumps({"request_id": "g"})),
    ("POST", "/stop_accepting", b"{}"),
    ("POST", "/resume_accepting", b"{}"),
    ("POST", "/drain", wire.dumps({"abort_after_s": None})),
    ("POST", "/release_memory", wire.dumps({"weights": True, "kv": True})),
    ("POST", "/resume_memory", wire.dumps({"weights": True, "kv": True})),
    ("POST", "/update_weights", wire.weights_to_frame({"w": torch.ones(4)}, version=7)),
    ("POST", "/update_begin", wire.dumps({"version": 8})),
    ("POST", "/update_bucket", wire.weights_to_frame({"w": torch.ones(4)}, version=None)),
    ("POST", "/update_end", wire.dumps({"version": 8})),
    ("POST", "/update_abort", b"{}"),
    ("POST", "/export_kv", wire.dumps({"request_id": "g"})),
    ("POST", "/import_kv", wire.kv_export_to_frame(KV)),
    ("POST", "/release_export", wire.dumps({"request_id": "g"})),
]
UNAUTHORIZED = {
    "error": {
        "type": "unauthorized",
        "message": "this endpoint requires the job's secret: Authorization: Bearer <secret>",
    }
}
FORBIDDEN = {"error": {"type": "forbidden", "message": "the bearer token is not the job's secret"}}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def scripted() -> ScriptedEngine:
    return ScriptedEngine(lambda request: itertools.repeat(65, 3), record_requests=True)


@pytest.fixture
def guarded():
    thread = ServerThread(scripted, secret=SECRET)
    thread.start()
    yield thread
    thread.stop()


async def call(url: str, method: str, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.request(method, url + path, data=body or None, headers=headers) as response,
    ):
        return response.status, wire.loads(await response.read())


def test_without_the_secret_every_route_but_health_is_refused_before_the_engine_sees_it(guarded):
    url, engine = guarded.server.url, guarded.engine
    no_secret = ({}, {"Authorization": "Basic " + SECRET}, {"Authorization": "Bearer "}, {"x-api-key": SECRET})
    wrong = ({"Authorization": "Bearer not-the-secret"}, {"Authorization": "Bearer " + SECRET + "x"})
    for method, path, body in ROUTES:
        for headers in no_secret:
            assert run(call(url, method, path, body, headers)) == (401, UNAUTHORIZED), (path, headers)
        for headers in wrong:
            assert run(call(url, method, path, body, headers)) == (403, FORBIDDEN), (path, headers)
    # nothing reached the engine: no request ran, it still accepts, its memory and weights are as they were
    load = guarded.call(lambda e: e.load())
    assert engine.requests == [] and engine.calls == 0
    assert load.accepting and not load.memory_released and load.policy_version == 0, load
    assert run(call(url, "GET", "/health", b"", {})) == (200, {"ok": True})  # liveness stays open


def test_with_the_secret_every_route_reaches_the_engine(guarded):
    url, auth = guarded.server.url, {"Authorization": f"Bearer {SECRET}"}
    answers = {path: run(call(url, method, path, body, auth)) for method, path, body in ROUTES}
    assert answers["/generate"][0] == 200 and answers["/generate"][1]["output_ids"] == [65, 65, 65]
    assert answers["/update_weights"] == (200, {"ok": True})
    assert answers["/update_begin"] == answers["/update_bucket"] == answers["/update_end"] == (200, {"ok": True})
    assert answers["/update_abort"] == (200, {"ok": True}) and guarded.engine.load().policy_version == 8
    assert answers["/abort"] == (200, {"aborted": False})
    # the scripted engine holds no KV: its own NotImplementedError comes back, so the call got past the secret
    assert answers["/export_kv"][0] == answers["/import_kv"][0] == 501
    assert all(status not in (401, 403) for status, _ in answers.values()), answers


def test_a_remote_engine_with_the_secret_generates_and_one_without_is_refused_at_connect(guarded):
    url = guarded.server.url
    request = GenerateRequest(
        request_id="r1", execution_id="e1", input_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=3)
    )

    async def with_secret():
        remote = await RemoteEngine.connect(url, secret=SECRET)
        try:
            result = await remote.generate(request)
            streamed = dataclasses.replace(request, request_id="r2")
            chunks = [chunk async for chunk in remote.generate_stream(streamed)]
            await remote.update_weights({"w": torch.ones(2)}, version=3)
            assert remote.abort("r-unknown") is False
            await remote.drain()
            remote.resume_accepting()
            await remote.resume_memory()  # waits for the queued resume_accepting, then refreshes the load
            return result, chunks, remote.load()
        finally:
            await remote.close()

    result, chunks, load = run(with_secret())
    assert list(result.output_ids) == [65, 65, 65] and result.finish_reason == "length"
    assert [t for chunk in chunks for t in chunk.token_ids] == [65, 65, 65] and chunks[-1].finish_reason == "length"
    assert load.policy_version == 3 and load.accepting

    for secret, message in ((None, UNAUTHORIZED), ("another", FORBIDDEN)):
        with pytest.raises(EngineAuthError) as refused:
            run(RemoteEngine.connect(url, secret=secret))
        assert str(refused.value) == message["error"]["message"]


def test_an_endpoint_without_a_secret_stays_open_and_ignores_a_token():
    thread = ServerThread(scripted)
    thread.start()
    try:
        url = thread.server.url
        assert run(call(url, "GET", "/load", b"", {}))[0] == 200
        assert run(call(url, "GET", "/load", b"", {"Authorization": "Bearer anything"}))[0] == 200

        async def generate():
            remote = await RemoteEngine.connect(url, secret="unused")
            try:
                request = GenerateRequest(request_id="r", execution_id="e", input_ids=[1], params=SamplingParams())
                return await remote.generate(request)
            finally:
                await remote.close()

        assert list(run(generate()).output_ids) == [65, 65, 65]
    finally:
        thread.stop()


def test_an_empty_secret_is_refused_at_construction():
    for secret in ("", "  "):
        with pytest.raises(ValueError, match="secret=''"):
            EngineServer(scripted(), secret=secret)


def test_bearer_token_reads_only_the_bearer_scheme():
    assert bearer_token("Bearer abc") == bearer_token("bearer  abc ") == "abc"
    assert bearer_token("") is bearer_token("Basic abc") is bearer_token("Bearer") is bearer_token("abc") is None
