"""The serving stack (proxy + embedded native engine) on a background event loop, for tests that talk HTTP to it.

Imported by the integration tests as `proxy_stack` (pytest puts this directory on sys.path). What
`python -m gyre.serve` runs, in process, so a test can also reach the registry and the records; every wait is
bounded. `held_stack` serves a `ScriptedEngine` (the stand-in) instead, for tests of the proxy that need a call
to stay in flight until they say so (`hang_up_mid_call`); see docs/testing.md, "Deterministic in-flight tests".
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import itertools
import json
import threading
from urllib.parse import urlparse

from gyre.config import EngineConfig, ServeConfig
from gyre.engine.endpoint import ServerThread
from gyre.engine.scripted import ScriptedEngine
from gyre.models.tiny import tiny_model_dir
from gyre.proxy.render import ChatTemplate
from gyre.serve.stack import build_stack


class StackThread:
    """The serving stack on a background event loop (what `python -m gyre.serve` runs, in process)."""

    def __init__(self, cfg: ServeConfig, records_dir, engine_thread: ServerThread | None = None):
        self.engine_thread = engine_thread  # an engine behind its own endpoint (cfg.engine_urls), stopped with us
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stack = self.call(build_stack(cfg, records_dir=records_dir))
        self.session = self.stack.registry.issue("fuzz")
        self.last_headers: dict[str, str] = {}  # of the last `post`'s answer, names lower-cased
        address = urlparse(self.stack.proxy.url)
        self.host, self.port = address.hostname, address.port

    def call(self, coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def post(self, path: str, body: bytes, *, key: str | None = None, headers: dict | None = None) -> tuple[int, dict]:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=60)
        headers = {"content-type": "application/json", "x-api-key": key or self.session.key, **(headers or {})}
        if path.startswith("/v1/chat") or path.startswith("/v1/responses"):
            headers["authorization"] = f"Bearer {key or self.session.key}"
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
        connection.close()
        self.last_headers = {name.lower(): value for name, value in response.getheaders()}
        if response.getheader("content-type", "").startswith("text/event-stream"):
            assert data.endswith(b"\n\n")  # a (fuzzed) streaming request that was valid: a complete SSE stream
            return response.status, {}
        return response.status, json.loads(data) if data else {}

    def stop(self) -> None:
        self.call(self.stack.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        if self.engine_thread is not None:
            self.engine_thread.stop()


def held_stack(cfg: ServeConfig, records_dir) -> StackThread:
    """The stack of `cfg` over one `ScriptedEngine` (the stand-in, not a model) in place of the native engine: every
    call is answered with the letter "a" until its `max_tokens`, and `stack.engine_thread.call(lambda e: e.hold(n))`
    keeps calls in flight after n tokens until `release()` or their abort."""
    letter = ChatTemplate.from_pretrained(tiny_model_dir()).tokenizer.encode("a").ids
    engine_thread = ServerThread(lambda: ScriptedEngine(lambda request: itertools.cycle(letter)))
    url = engine_thread.start()
    try:
        cfg = dataclasses.replace(cfg, engine=EngineConfig(enabled=False), engine_urls=[url])
        return StackThread(cfg, records_dir, engine_thread)
    except BaseException:
        engine_thread.stop()
        raise


def hang_up_mid_call(stack: StackThread, body: dict, stream: bool) -> None:
    """Send a call on a `held_stack`, wait until its engine holds it (tokens produced, the call in flight whatever
    the time), then hang up: for a stream after its first event, for a whole answer before it. Returns once the
    engine has aborted the call, with the hold released."""
    stack.engine_thread.call(lambda engine: engine.hold(after_tokens=1))
    connection = http.client.HTTPConnection(stack.host, stack.port, timeout=60)
    try:
        headers = {"content-type": "application/json", "x-api-key": stack.session.key}
        connection.request("POST", "/v1/messages", body=json.dumps(body), headers=headers)
        if stream:
            response = connection.getresponse()
            assert response.readline() == b"event: message_start\n"
        stack.engine_thread.call(lambda engine: engine.until_held(1), timeout_s=60)
    finally:
        connection.close()  # the hang-up: the proxy aborts the held call, which ends "abort" with its tokens
    for _ in range(600):  # bounded: the abort reaches the engine (a held call ends no other way)
        load = stack.engine_thread.call(lambda engine: engine.load())
        if load.running == load.queued == 0:
            break
        threading.Event().wait(0.05)
    else:
        raise AssertionError("the held call was not aborted after the client hung up")
    stack.engine_thread.call(lambda engine: engine.release())  # later calls are not held
