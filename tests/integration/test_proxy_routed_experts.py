"""The proxy records each call's routed experts (`proxy.record_routed_experts`, docs/moe.md "From the engine to the
trainer"): it asks from the first position the execution's tree has none for, and a call whose engine routing it
cannot keep (another layout than the execution's earlier calls, an id out of range) is still answered and recorded,
without routing and with a warning (found in review: it was a 500 and went unrecorded).

The engine is `ScriptedEngine` (a stand-in named as such: no MoE model behind it) whose final chunk carries routing
of the shape the protocol prescribes; the proxy, HTTP and the record files are real.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import itertools
import json
import logging
from urllib.parse import urlparse

import numpy as np
import pytest

from gyre.config.proxy import ProxyConfig, SamplingConfig
from gyre.engine.scripted import ScriptedEngine
from gyre.models.tiny import tiny_model_dir
from gyre.proxy.routing import RoutingTable
from gyre.proxy.start import start_proxy
from gyre.traj.store import load_tree

TIMEOUT_S = 60.0


class RoutingScript(ScriptedEngine):
    """Answers "XXX" (3 tokens); the final chunk carries routing `[rows, layers, 2]` filled with `fill`."""

    def __init__(self, shapes):
        super().__init__(lambda request: itertools.repeat(65, 3))
        self.shapes, self.starts = shapes, []

    def _chunk(self, request, index, token_ids, finish, flight, admitted, first_token_at):
        chunk = super()._chunk(request, index, token_ids, finish, flight, admitted, first_token_at)
        if finish is None or not request.return_routed_experts:
            return chunk
        self.starts.append(request.routed_experts_start)
        layers, fill = self.shapes[len(self.starts) - 1]
        rows = len(request.input_ids) + index + len(token_ids) - 1 - request.routed_experts_start
        return dataclasses.replace(chunk, routed_experts=np.full((rows, layers, 2), fill, np.int16))


def post(url: str, body: dict, key: str) -> int:
    address = urlparse(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=TIMEOUT_S)
    connection.request("POST", "/v1/messages", body=json.dumps(body), headers={"x-api-key": key})
    status = connection.getresponse().status
    connection.close()
    return status


@pytest.mark.parametrize(
    ("second", "kept"),
    [((2, 5), True), ((3, 5), False), ((2, -2), False)],
    ids=["same_layout", "other_layout", "bad_id"],
)
def test_each_call_is_recorded_with_the_routing_it_can_keep(tmp_path, caplog, second, kept):
    engine = RoutingScript([(2, 5), second])
    config = ProxyConfig(sampling=SamplingConfig(max_new_tokens=3), record_routed_experts=True)

    async def main():
        proxy, registry = await start_proxy(
            config, model_dir=tiny_model_dir(), table=RoutingTable({"e": engine}), records_dir=tmp_path
        )
        try:
            session = registry.issue("ex")
            messages = [{"role": "user", "content": "hi"}]
            statuses = []
            for _ in range(2):
                body = {"model": "gyre", "max_tokens": 3, "messages": messages}
                statuses.append(await asyncio.to_thread(post, proxy.url, body, session.key))
                messages = [*messages, {"role": "assistant", "content": "XXX"}, {"role": "user", "content": "more"}]
            return statuses
        finally:
            await proxy.stop()
            registry.close_all()

    caplog.set_level(logging.WARNING, logger="gyre.proxy.server")
    assert asyncio.run(asyncio.wait_for(main(), TIMEOUT_S)) == [200, 200]
    tree = load_tree(tmp_path / "ex.jsonl")
    assert len(tree.calls) == 2
    first_context, first_output = tree.call_tokens(0)
    # the second call asks from the first call's last output token: the one position it never fed
    assert engine.starts == [0, len(first_context) + len(first_output) - 1]
    (leaf,) = tree.leaves()
    routed = ~(tree.path_routing(leaf) == -1).all(axis=(1, 2))
    assert routed[: engine.starts[1]].all() and bool(routed[engine.starts[1] :].any()) is kept
    assert ("the engine's routing is not recorded" in caplog.text) is not kept
