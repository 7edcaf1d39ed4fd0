"""The builtin harness's Anthropic backend counts the whole prompt: input + cache read + cache creation tokens.

gyre's Anthropic dialect reports the reused prefix as `cache_read_input_tokens`, outside `input_tokens` (the
API's convention, docs/proxy.md "Usage in each dialect"); a proactive compaction that read `input_tokens` alone
compacted late or never. The real `anthropic` SDK talks to a stdlib HTTP server on 127.0.0.1 that answers one
canned Messages response.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gyre.harness.builtin.agent import AnthropicBackend, UserTurn

USAGE = {"input_tokens": 70, "cache_read_input_tokens": 54, "cache_creation_input_tokens": 6, "output_tokens": 3}


class MessagesHandler(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = json.dumps(
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": "gyre",
                "content": [{"type": "text", "text": "ok"}],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": USAGE,
            }
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def messages_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), MessagesHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_the_anthropic_backend_reports_the_whole_prompt(messages_url):
    backend = AnthropicBackend(model="gyre", max_tokens=8, timeout_s=30.0, base_url=messages_url, api_key="k")
    reply = backend.complete("system", [UserTurn("hi")], [], {})
    assert reply.text == "ok"
    assert reply.input_tokens == 70 + 54 + 6 and reply.output_tokens == 3
