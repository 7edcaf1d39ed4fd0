"""The serving stack (proxy + embedded native engine) on a background event loop, for tests that talk HTTP to it.

Imported by the integration tests as `proxy_stack` (pytest puts this directory on sys.path). What
`python -m gyre.serve` runs, in process, so a test can also reach the registry and the records; every wait is
bounded.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from urllib.parse import urlparse

from gyre.config import ServeConfig
from gyre.serve.stack import build_stack


class StackThread:
    """The serving stack on a background event loop (what `python -m gyre.serve` runs, in process)."""

    def __init__(self, cfg: ServeConfig, records_dir):
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
