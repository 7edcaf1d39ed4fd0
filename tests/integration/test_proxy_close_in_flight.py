"""Closing an execution while its calls are in flight (issue 13 finding 6), over real HTTP on 127.0.0.1.

Before: generation went on, the non-streaming call got a 500, the stream an "execution ... is closed" error, and
nothing was recorded. The contract now (docs/proxy.md, routes): the key stops working at once; calls in flight
finish as usual, each is recorded once, and the tree and file close when the last one ends. The engine is
`ScriptedEngine` (a stand-in, named as such) holding both calls after their first token until the test releases
them, so the calls are in flight when the close comes, however slow the machine.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import threading
from urllib.parse import urlparse

from gyre.config import EngineConfig, ProxyConfig, ServeConfig
from gyre.config.proxy import SamplingConfig
from gyre.engine.endpoint import ServerThread
from gyre.engine.scripted import ScriptedEngine
from gyre.models.tiny import tiny_model_dir
from gyre.proxy.render import ChatTemplate
from gyre.serve.stack import build_stack
from gyre.traj.store import load_tree

TIMEOUT_S = 120.0
TOKENS = 60


def post(url: str, path: str, body: dict, headers: dict) -> tuple[int, bytes]:
    address = urlparse(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
    try:
        connection.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json", **headers})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_a_close_lets_the_calls_in_flight_finish_and_records_each_once(tmp_path):
    template = ChatTemplate.from_pretrained(tiny_model_dir())
    letter = template.tokenizer.encode("a").ids
    engine = ServerThread(lambda: ScriptedEngine(lambda request: itertools.cycle(letter)))
    engine_url = engine.start()
    engine.call(lambda scripted: scripted.hold(after_tokens=1))
    sampling = SamplingConfig(max_new_tokens=TOKENS)
    cfg = ServeConfig(
        engine=EngineConfig(enabled=False), engine_urls=[engine_url], proxy=ProxyConfig(sampling=sampling), executions=0
    )
    answers: dict[str, tuple[int, bytes]] = {}

    async def main():
        stack = await build_stack(cfg, records_dir=tmp_path)
        try:
            session = stack.registry.issue("closing")
            key = {"x-api-key": session.key, "authorization": f"Bearer {session.key}"}
            user = [{"role": "user", "content": "hi"}]
            calls = {
                "stream": ("/v1/messages", {"model": "gyre", "max_tokens": TOKENS, "stream": True, "messages": user}),
                "whole": ("/v1/chat/completions", {"model": "gyre", "max_tokens": TOKENS, "messages": user}),
            }

            def client(name: str) -> None:
                path, body = calls[name]
                answers[name] = post(stack.proxy.url, path, body, key)

            threads = [threading.Thread(target=client, args=(name,), daemon=True) for name in calls]
            for thread in threads:
                thread.start()
            await engine.call_async(lambda scripted: scripted.until_held(2), 30)
            assert session.calls_in_flight == 2
            admin = {"authorization": f"Bearer {stack.proxy.admin_key}"}
            closed = await asyncio.to_thread(post, stack.proxy.url, "/gyre/executions/closing/close", {}, admin)
            assert closed[0] == 200 and json.loads(closed[1]) == {"closed": "closing", "calls_in_flight": 2}
            later = await asyncio.to_thread(post, stack.proxy.url, *calls["whole"], key)
            assert later[0] == 401  # the key stopped working at once
            assert not session.tree.closed  # ... while the calls in flight go on
            await engine.call_async(lambda scripted: scripted.release())
            for thread in threads:
                await asyncio.to_thread(thread.join, 60)
            assert session.tree.closed and session.calls_in_flight == 0
        finally:
            await stack.close()

    try:
        asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    finally:
        engine.stop()
    stream_status, stream_body = answers["stream"]
    assert stream_status == 200 and b"event: message_stop" in stream_body and b"event: error" not in stream_body
    whole_status, whole_body = answers["whole"]
    assert whole_status == 200, whole_body
    assert json.loads(whole_body)["choices"][0]["finish_reason"] == "length"
    tree = load_tree(tmp_path / "closing.jsonl")
    assert len(tree.calls) == 2 and len({call.meta.request_id for call in tree.calls}) == 2
    assert all(len(call.response.ids) == TOKENS for call in tree.calls)
