"""Server-sent events as all three dialects frame them: `event: <type>` (when named), `data: <json>`, a blank line."""

from __future__ import annotations

import json
from typing import Any

import orjson

# An SSE comment: SSE parsers skip it (the OpenAI SDKs' included) while its bytes reset a client's idle-connection
# timers; a client that times events instead (Codex) needs an event (openai_responses's keepalive).
KEEPALIVE_COMMENT = b": keepalive\n\n"


def sse_event(payload: Any, event: str | None = None) -> bytes:
    """One SSE record; orjson, or ASCII-escaped JSON for text orjson refuses (a lone surrogate)."""
    try:
        data = orjson.dumps(payload)
    except orjson.JSONEncodeError:
        data = json.dumps(payload, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + data + b"\n\n"
