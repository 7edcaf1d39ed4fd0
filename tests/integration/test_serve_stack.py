"""`start_proxy`: the proxy half alone, over a routing table its caller owns (what the training runtime runs).

Real HTTP on 127.0.0.1; the engine is `ScriptedEngine` (a stand-in, named as such) behind the real endpoint. Under
the scheduler's placement a call waits until the caller assigns its execution, then is served there and recorded.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
from urllib.parse import urlparse

from gyre.config.proxy import ProxyConfig, SamplingConfig
from gyre.engine.endpoint import ServerThread
from gyre.engine.remote import RemoteEngine
from gyre.engine.scripted import ScriptedEngine
from gyre.models.tiny import tiny_model_dir
from gyre.proxy.routing import RoutingTable
from gyre.proxy.start import start_proxy
from gyre.traj.store import load_tree

TIMEOUT_S = 120.0


def post(url: str, body: dict, key: str) -> tuple[int, dict]:
    address = urlparse(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
    try:
        connection.request("POST", "/v1/messages", body=json.dumps(body), headers={"x-api-key": key})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_start_proxy_serves_over_the_callers_table_and_waits_for_its_assignment(tmp_path):
    engine = ServerThread(lambda: ScriptedEngine(lambda request: itertools.repeat(65, 3)))
    url = engine.start()

    async def main():
        remote = await RemoteEngine.connect(url)
        table = RoutingTable(placement="scheduler")
        table.add_engine("cell-0", remote)
        config = ProxyConfig(sampling=SamplingConfig(max_new_tokens=3), engine_wait_s=30.0)
        proxy, registry = await start_proxy(config, model_dir=tiny_model_dir(), table=table, records_dir=tmp_path)
        try:
            session = registry.issue("g00000-e0")
            body = {"model": "gyre", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
            call = asyncio.create_task(asyncio.to_thread(post, proxy.url, body, session.key))
            await asyncio.sleep(0.5)
            waiting = not call.done()  # nobody assigned the execution: the call waits, it is not placed
            table.assign("g00000-e0", "cell-0")
            status, reply = await call
            return waiting, status, reply
        finally:
            await proxy.stop()
            registry.close_all()
            await remote.close()

    try:
        waiting, status, reply = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    finally:
        engine.stop()
    assert waiting
    assert status == 200 and reply["usage"]["output_tokens"] == 3, reply
    assert len(load_tree(tmp_path / "g00000-e0.jsonl").calls) == 1
