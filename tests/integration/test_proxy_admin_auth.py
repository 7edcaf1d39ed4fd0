"""The proxy's admin routes over real HTTP (docs/proxy.md, routes): the engine endpoint's rule (docs/endpoint.md,
"The job's secret"): without a key 401 `authentication_error`, with another key (an execution's among them) 403
`permission_error`, whichever header carries it; nothing is issued, closed or read for a refused call; the admin
key is random per proxy.
"""

from __future__ import annotations

import http.client
import json

import pytest
from proxy_stack import StackThread

from gyre.config import EngineConfig, ServeConfig

MISSING = {"error": {"type": "authentication_error", "message": "admin key required"}}
WRONG = {"error": {"type": "permission_error", "message": "this key is not the admin key"}}
ROUTES = [
    ("POST", "/gyre/executions", b'{"execution": "admin-test"}'),
    ("POST", "/gyre/executions/fuzz/close", b""),
    ("GET", "/gyre/stats", b""),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    stack = StackThread(ServeConfig(engine=EngineConfig(max_running=2), executions=0), tmp_path_factory.mktemp("rec"))
    yield stack
    stack.stop()


def request(stack: StackThread, method: str, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(stack.host, stack.port, timeout=30)
    try:
        connection.request(method, path, body=body or None, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_admin_routes_refuse_a_missing_key_with_401_and_another_key_with_403(served):
    admin, execution_key = served.stack.proxy.admin_key, served.session.key
    missing = ({}, {"authorization": "Basic " + admin}, {"authorization": "Bearer "})
    wrong = (
        {"authorization": "Bearer gyre-admin-wrong"},
        {"x-api-key": "gyre-admin-wrong"},
        {"authorization": f"Bearer {execution_key}"},  # a harness's own key is not the admin key
        {"x-api-key": execution_key},
        {"authorization": f"Bearer {admin}x"},
    )
    for method, path, body in ROUTES:
        for headers in missing:
            assert request(served, method, path, body, headers) == (401, MISSING), (path, headers)
        for headers in wrong:
            assert request(served, method, path, body, headers) == (403, WRONG), (path, headers)
    # nothing happened: no execution issued, the test's execution still open
    registry = served.stack.registry
    assert registry.by_execution("admin-test") is None and registry.by_execution("fuzz") is not None

    # with the admin key, in either header, each route does its work
    for headers in ({"authorization": f"Bearer {admin}"}, {"x-api-key": admin}):
        assert request(served, "GET", "/gyre/stats", b"", headers)[0] == 200
    code, issued = request(served, "POST", "/gyre/executions", ROUTES[0][2], {"authorization": f"Bearer {admin}"})
    assert code == 200 and issued["execution"] == "admin-test" and issued["key"] != admin
    code, closed = request(served, "POST", "/gyre/executions/admin-test/close", b"", {"x-api-key": admin})
    assert (code, closed["closed"]) == (200, "admin-test")


def test_the_admin_key_is_random_per_proxy(served):
    from gyre.proxy.server import ProxyServer

    keys = {served.stack.proxy.admin_key}
    for _ in range(2):
        proxy = ProxyServer(
            served.stack.proxy.config,
            template=served.stack.proxy.template,
            registry=served.stack.registry,
            table=served.stack.table,
            context_limit=1024,
        )
        keys.add(proxy.admin_key)
    assert len(keys) == 3 and all(key.startswith("gyre-admin-") and len(key) >= 40 for key in keys)
